"""Quiet output by default: the libraries' own start-up logs and warnings hidden unless --verbose.

A CPU run of the built-in job otherwise prints some forty lines that are not about the run: vLLM's
engine warnings (eager mode, tcmalloc, thread binding, once per step), torch's NUMA binding
notice, FutureWarnings from inside vLLM, and transformers' weight-loading progress bars. Errors
still print. The C++ log level is read when torch is imported, so the environment is set first
thing in `fusedrl-train`, from the command line alone (`--verbose` there, or FUSEDRL_VERBOSE=1);
`verbose: true` in a YAML file restores the Python-side logs only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings

# Read once, at import, by the libraries: defaults only, the user's own environment wins.
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
NOISY_MODULES = r"(vllm|transformers|torch|triton)(\.|$)"


def wants_verbose(argv: list[str]) -> bool:
    return "--verbose" in argv or os.environ.get("FUSEDRL_VERBOSE", "") not in ("", "0")


def quiet_environment() -> None:
    """Before torch, vLLM or transformers is imported."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore", module=NOISY_MODULES)


def quiet_libraries(verbose: bool) -> None:
    """After parsing the config: the Python-side switches, either way."""
    if verbose:
        warnings.filters[:] = [f for f in warnings.filters if _module_pattern(f) != NOISY_MODULES]
        return
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("vllm", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _module_pattern(warning_filter: tuple) -> str | None:
    """A warnings filter's module regex as text: `warnings.filterwarnings` compiles it, but the
    filters made from -W options and PYTHONWARNINGS, and some libraries', hold a plain str."""
    module = warning_filter[3]
    return getattr(module, "pattern", module)


@contextlib.contextmanager
def native_stderr_hidden(verbose: bool):
    """Hide what native code writes to stderr (file descriptor 2) inside the block, such as
    torch's "NUMA binding" notice when vLLM's CPU worker binds its threads; replay it if the block
    fails, so an error is never hidden with its context."""
    if verbose:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
