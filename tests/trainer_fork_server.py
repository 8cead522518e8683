"""`python -m fusedrl.trainer` runs forked from one process that imported the trainer once.

Started by tests/trainer_cli.py, which talks to it over stdin / stdout: one JSON request per line
(the run's arguments, working directory and output files), answered by two JSON lines (the run's
pid, then its exit status). A fresh interpreter spends ~10 s of a short CPU run importing torch,
transformers and vLLM; here they are imported once and every run is a `fork()` of this process
that then executes `python -m fusedrl.trainer` as a new interpreter would (runpy, argv, the
interpreter's own exit: atexit handlers, exit code, an uncaught exception's traceback and 1).

Faithful where it matters to the tests: the environment is the one this server was started with
(the client sends a run here only when its environment is that one, and only a non-verbose run:
the imports follow a non-verbose run's order and quiet switches); whatever the imports printed (to
file descriptor 1 or 2) starts every run's output, as it would in a fresh process. A
`fork()` is safe only while this process has a single thread: it checks that after the imports
and refuses to serve otherwise (the client then runs plain subprocesses). numpy's OpenBLAS starts
its thread pool when numpy is imported; here it is imported with one BLAS thread (the variable is
removed again before any run, whose environment is the server's own), which leaves only numpy's
own matrix products, not torch's (MKL), on one core.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc: cannot tell, so do not fork
        return -1


def _import_the_trainer(with_vllm: bool) -> None:
    """What a non-verbose run imports before its first step, in the order `fusedrl-train` does
    (trainer/cli.py: the quiet environment, the config and loop modules, the libraries' quiet
    switches), then the lazy imports of its model, rollout and plot code."""
    from fusedrl.trainer.quiet import quiet_environment

    quiet_environment()
    import fusedrl.trainer.config  # noqa: F401
    import fusedrl.trainer.loop  # noqa: F401
    from fusedrl.trainer.quiet import quiet_libraries

    quiet_libraries(verbose=False)
    import matplotlib
    import torch.utils.tensorboard  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import fusedrl.tiny  # noqa: F401
    import fusedrl.trainer.cli  # noqa: F401
    import fusedrl.trainer.warmstart  # noqa: F401

    matplotlib.use("Agg")  # as trainer/logger.py's plot() does
    import matplotlib.pyplot  # noqa: F401

    if with_vllm:
        from vllm import LLM, SamplingParams  # noqa: F401


def _become_the_run(request: dict, printed: tuple[bytes, bytes]) -> None:
    """In the child: the run's output files, directory and argv; never returns (the run's
    SystemExit, or an exception's traceback, ends the interpreter as `python -m` would)."""
    for fd, path, head in ((1, request["stdout"], printed[0]), (2, request["stderr"], printed[1])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(out, head)
        os.dup2(out, fd)
        os.close(out)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(request["cwd"])
    sys.argv = ["-m", *request["args"]]  # runpy puts the module's path first, as `-m` does
    runpy.run_module("fusedrl.trainer", run_name="__main__", alter_sys=True)
    sys.exit(0)


def _exit_status(status: int) -> int:
    """As subprocess reports it: the exit code, or -N for a run ended by signal N."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main() -> None:
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    # The imports' output, caught at the descriptors: what a fresh run would print first.
    caught = [tempfile.TemporaryFile() for _ in range(2)]
    for fd, sink in zip((1, 2), caught):
        os.dup2(sink.fileno(), fd)
    blas_threads = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    _import_the_trainer(with_vllm="--with-vllm" in sys.argv)
    if blas_threads is None:
        del os.environ["OPENBLAS_NUM_THREADS"]
    else:
        os.environ["OPENBLAS_NUM_THREADS"] = blas_threads
    sys.stdout.flush()
    sys.stderr.flush()
    printed = []
    for sink in caught:
        sink.seek(0)
        printed.append(sink.read())
    threads = _threads()
    replies.write(json.dumps({"ready": threads == 1, "threads": threads}) + "\n")
    if threads != 1:
        return
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _become_the_run(request, (printed[0], printed[1]))
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": _exit_status(status)}) + "\n")


if __name__ == "__main__":
    main()
