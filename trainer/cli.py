"""`fusedrl-train` (also `python -m fusedrl.trainer`): parse the config, run the loop."""

from __future__ import annotations

import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    from .quiet import quiet_environment, wants_verbose

    if hasattr(sys.stdout, "reconfigure"):  # a log file sees each line when it is printed
        sys.stdout.reconfigure(line_buffering=True)

    if not wants_verbose(sys.argv[1:] if argv is None else argv):
        quiet_environment()  # before torch / vLLM / transformers are imported
    previous = _stop_on_sigterm()
    try:
        return _main(argv)
    except KeyboardInterrupt as exc:  # before the training loop's own handlers are installed
        # (the start cleans up as for Ctrl-C: a scheduler's SIGTERM during the warm start or
        # the engine's start, then the same command requeued, finds --out as it was)
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        print(f"\nfusedrl-train: {what} before training started", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
    finally:  # (an in-process caller's own SIGTERM handling, as it was)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM before the training loop's own handlers (which finish the step, checkpoint it
    and stop) are installed: unwinds the start as Ctrl-C does."""


def _stop_on_sigterm():
    """SIGTERM raises Terminated from here on; the handler it replaces (None off the main
    thread, whose signals these are)."""

    def terminate(signum, frame):
        raise Terminated

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, terminate)


# What `pip install fusedrl` leaves out and `fusedrl[train]` brings (pyproject.toml), by module.
TRAIN_EXTRA_MODULES = {"yaml", "tqdm", "transformers", "math_verify", "tensorboard", "matplotlib"}


def _missing_train_extra(exc: ModuleNotFoundError) -> int:
    """One line for a trainer dependency that a plain `pip install fusedrl` does not bring."""
    if (exc.name or "").split(".")[0] not in TRAIN_EXTRA_MODULES:
        raise exc
    print(
        f"fusedrl-train: error: {exc.name} is not installed; the trainer's dependencies come "
        "with `pip install 'fusedrl[train]'`",
        file=sys.stderr,
    )
    return 2


def _main(argv: list[str] | None) -> int:
    try:
        from .config import parse_config
    except ModuleNotFoundError as exc:
        return _missing_train_extra(exc)

    try:
        cfg = parse_config(argv)
    except (ValueError, FileNotFoundError) as exc:
        print(f"fusedrl-train: error: {exc}", file=sys.stderr)
        return 2
    try:
        from .loop import Trainer
    except ModuleNotFoundError as exc:
        return _missing_train_extra(exc)
    from .quiet import quiet_libraries

    quiet_libraries(cfg.verbose)

    try:
        trainer = Trainer(cfg)  # checks the model, data and rewards against the config
    except (ValueError, FileNotFoundError) as exc:
        print(f"fusedrl-train: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the machine's (a read-only or full --out, an I/O error): no traceback
        print(f"fusedrl-train: error: {exc}", file=sys.stderr)
        return 1
    from .checkpoint import WriteError
    from .loop import NonFiniteError, Stopped
    from .rewards import RewardError

    finished = False
    try:
        run_dir = trainer.train()
        finished = True
    except (NonFiniteError, WriteError, RewardError) as exc:
        print(f"fusedrl-train: error: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:
        print(f"fusedrl-train: {exc}", file=sys.stderr)
        return 128 + exc.signum
    finally:
        trainer.close(finished)
    if trainer.env.is_main:
        print(
            f"fusedrl-train: done; metrics in {run_dir}/metrics.jsonl, plots in "
            f"{run_dir}/plots.png, model in {run_dir}/final_model"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
