"""Which tests share a pytest-xdist worker under `make test` (`-n auto --dist loadgroup`), and the
scheduler that keeps them together. tests/conftest.py registers the hook; no torch here, so that
tests/test_xdist_groups.py can run it on a stand-in suite quickly."""

from __future__ import annotations

import pytest

# pytest-xdist: `make test` runs the suite on every core (`-n auto --dist loadgroup`). Tests of one
# group run on one worker, one after another; every other test goes to whichever worker is free.
# Groups are assigned here by file (a test added to one of these files joins its group), by the
# scheduler below: xdist 3.8's own loadgroup reads the groups from node ids that it rewrites, which
# pytest 9.2 no longer allows (pytest-dev/pytest-xdist#1386: every test scheduled on its own).
XDIST_GROUPS = {
    # Each of these keeps both cores busy on its own (the Triton compile of every kernel variant
    # runs in parallel subprocesses; vLLM engines; torch.distributed worlds of spawned
    # processes) and holds GBs of memory: never two at a time.
    "exclusive": (
        "test_kernels_compile.py",
        "test_trainer_e2e.py",
        "test_sampling_vllm.py",
        "test_trl_vllm.py",
        "test_trainer_distributed.py",
        "test_tensor_parallel.py",
        # trainer subprocesses with transformers' generate: beside a vLLM engine (whose threads
        # spin) a one-step resume took 342 s instead of 28 s
        "test_trainer_hf.py",
    ),
    # A module-scoped fixture that builds something (a tiny model, a training run, the mutant
    # generator, the wheel) or a GPU at real sizes: the whole file on one worker, built once.
    **{
        name.removesuffix(".py"): (name,)
        for name in (
            # its nvcc builds use both cores for ~45 s, but hold little memory: beside the
            # exclusive group (~9 min on the 2-core machine, the suite's longest path) rather
            # than inside it
            "test_cuda_build.py",
            "test_docs_snippets.py",
            "test_mutation_tool.py",
            "test_packaging.py",
            "test_trl_integration.py",
            "test_trl_distributed.py",
            "test_gpu.py",
        )
    },
}
GROUP_OF_FILE = {name: group for group, names in XDIST_GROUPS.items() for name in names}


def xdist_scope(nodeid: str) -> str:
    """The work unit of a test: its file's group, else the test itself. (A `@group` suffix is an
    `xdist_group` mark, where xdist manages to add it.)"""
    at = nodeid.rfind("@")
    if at > nodeid.rfind("]"):  # after any parametrisation, whose ids may hold an "@"
        return nodeid[at + 1 :]
    group = GROUP_OF_FILE.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1])
    return nodeid if group is None else group


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: unknown where it is not installed
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's loadgroup (LoadScopeScheduling: whole groups, largest first, a worker takes
        the next one when it has 2 tests left) with the groups of `xdist_scope`."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return GroupScheduling(config, log)
