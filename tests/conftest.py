"""Shared fixtures.

Without a CUDA device the Triton kernels run on CPU tensors through the interpreter, which must be
switched on before triton is imported anywhere (`import torch` does not import it). With a CUDA
device it stays off: tests/test_gpu.py must run the compiled kernels, never the interpreter.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from . import interpreter_speed

    interpreter_speed.skip_nested_language_patches()
    interpreter_speed.memoize_numpy_dtypes()
    interpreter_speed.skip_equal_shape_broadcasts()
    interpreter_speed.memoize_block_types()
    interpreter_speed.memoize_tensor_shapes()
    interpreter_speed.skip_discarded_overflow_checks()
    interpreter_speed.skip_identity_casts()

import pytest  # noqa: E402

# The trainer's warm-start cache (trainer/warmstart.py): one folder for this run of the suite,
# shared by its xdist workers (they inherit this process's environment), removed at its end; never
# a developer's ~/.cache, whose entries would change what a run prints.
_OWN_CACHE = None
if "FUSEDRL_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_CACHE = os.environ["FUSEDRL_CACHE_DIR"] = tempfile.mkdtemp(prefix="fusedrl-test-cache-")


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# pytest-xdist's scheduler for `make test` (-n auto --dist loadgroup): the heavy files together.
from .xdist_groups import pytest_xdist_make_scheduler  # noqa: E402, F401

# CPU tensors reach a Triton kernel only through the interpreter (on a GPU machine it is off).
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU tensors needs TRITON_INTERPRET=1; tests/test_gpu.py runs it compiled",
)

import fusedrl  # noqa: E402
from fusedrl import reference  # noqa: E402

# The CUDA extension's kernel code on CPU tensors: built for the host and driven through the same
# Python path as backend="cuda" on a GPU (tests/cuda_host_ops.py). A backend matrix that lists
# CUDA_ON_THE_HOST gets it: fusedrl's `backend=CUDA_ON_THE_HOST` is routed there.
CUDA_ON_THE_HOST = "cuda-host"


# The backends of the matrices: torch and Triton (through the interpreter without a GPU); the
# logits entry points (policy_loss, token_logprobs) also the CUDA extension's kernel code.
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]
LOGITS_BACKENDS = [*BACKENDS, CUDA_ON_THE_HOST]


@pytest.fixture(scope="session")
def cuda_host_kernels():
    import tempfile

    from . import cuda_host_ops

    if cuda_host_ops.NVCC is None:
        pytest.skip("nvcc is not installed: the CUDA extension's code cannot be built")
    # one folder for every worker and run, each build keyed by the hash of its sources
    cache = Path(tempfile.gettempdir()) / f"fusedrl-cuda-host-{os.getuid()}"
    return cuda_host_ops.HostKernels(cuda_host_ops.build(cache))


@pytest.fixture
def cuda_on_the_host(cuda_host_kernels, monkeypatch):
    from fusedrl import backends, cuda_backend

    monkeypatch.setattr(cuda_backend, "_OPS", cuda_host_kernels.ops())
    resolve = backends.resolve

    def resolve_host(backend, device):
        return cuda_backend if backend == CUDA_ON_THE_HOST else resolve(backend, device)

    monkeypatch.setattr(backends, "resolve", resolve_host)
    cuda_host_kernels.calls.clear()
    return cuda_host_kernels


@pytest.fixture(autouse=True)
def _seeded_global_rng(request):
    """Each test draws from torch's global generator seeded by its own id: what a test's
    `torch.randn_like` draws must not depend on which tests ran before it on its worker (xdist
    hands them out in another order every run) nor on Python's hash seed. A test whose inputs
    came from the unseeded generator failed one run in four (a CISPO case no sequence clipped)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _fresh_call_plans():
    """Every test decides its calls' kinds anew (`fusedrl.call_plan`): tests replace a backend's
    code (a spy, the CUDA code on the host) that a plan of an earlier test would bypass."""
    from fusedrl import call_plan

    call_plan.clear()


@pytest.fixture(autouse=True)
def _cuda_on_the_host_where_asked(request):
    spec = getattr(request.node, "callspec", None)
    if spec is not None and spec.params.get("backend") == CUDA_ON_THE_HOST:
        request.getfixturevalue("cuda_on_the_host")


def make_batch(
    batch=3,
    time=7,
    vocab=1031,
    dtype=torch.float32,
    seed=0,
    per_token_adv=False,
    empty_rows=(1,),
    old_noise=0.3,
    device="cpu",
    with_nan_padding=False,
):
    """Random inputs for policy_loss: odd sizes, ragged lengths, some empty sequences.

    old/ref/rollout log-probs are the current log-probs plus noise, so ratios straddle the clip
    bounds instead of all sitting at 1 or far outside.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = (2.0 * torch.randn(batch, time, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, (batch, time), generator=gen)
    lengths = torch.randint(1, time + 1, (batch,), generator=gen)
    mask = torch.arange(time)[None, :] < lengths[:, None]
    for row in empty_rows:
        if row < batch:
            mask[row] = False
    if with_nan_padding:
        logits[~mask] = float("nan")
        labels[~mask] = -100
    if per_token_adv:
        advantages = torch.randn(batch, time, generator=gen)
    else:
        advantages = torch.randn(batch, generator=gen)
    with torch.no_grad():
        clean = torch.where(mask[..., None], logits.float(), 0.0)
        logp, _ = reference.token_logprobs(clean, torch.where(mask, labels, 0))
    old = logp + old_noise * torch.randn(batch, time, generator=gen)
    ref = logp + 0.2 * torch.randn(batch, time, generator=gen)
    rollout = old + 0.3 * torch.randn(batch, time, generator=gen)
    return dict(
        logits=logits.to(device),
        labels=labels.to(device),
        advantages=advantages.to(device),
        mask=mask.to(device),
        old_logp=old.to(device),
        ref_logp=ref.to(device),
        rollout_logp=rollout.to(device),
    )


def run_loss(fn, batch, config, *, requires_grad=True, **kwargs):
    """Call a policy_loss implementation on a fresh leaf copy of the logits; return (out, grad)."""
    # detach() keeps the caller's strides (clone() would make a strided view contiguous); the
    # implementations must not write into it unless asked to (inplace=True).
    logits = batch["logits"].detach().requires_grad_(requires_grad)
    args = {k: v for k, v in batch.items() if k != "logits"}
    out = fn(logits, config=config, **args, **kwargs)
    grad = None
    if requires_grad:
        (grad,) = torch.autograd.grad(out.loss, logits)
    return out, grad


def assert_lm_head_form_matches_the_oracle(
    hidden, weight, rows: dict, backend: str, fused_only: dict | None = None, **kwargs
):
    """fusedrl.linear_policy_loss(hidden, weight, **rows, **kwargs, **fused_only) against the
    oracle on the materialised logits hidden @ weight.T: the loss and the gradients to hidden and
    weight. `fused_only`: keywords the oracle has no use for (how the logits are made)."""
    leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    ours = fusedrl.linear_policy_loss(
        *leaves, **rows, **kwargs, **(fused_only or {}), backend=backend
    )
    grads = torch.autograd.grad(ours.loss, leaves)
    oracle = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    want = reference.policy_loss(oracle[0] @ oracle[1].T, **rows, **kwargs)
    want_grads = torch.autograd.grad(want.loss, oracle)
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    return ours, want


@pytest.fixture
def radix_rows(monkeypatch):
    """How many rows took each radix select of kernels/sampling.py (`_count_select`: top_k,
    `_mass_select`: top_p): the interpreter looks a kernel's nested functions up in its module
    at every call."""
    from fusedrl.kernels import sampling

    calls = {"_count_select": 0, "_mass_select": 0}

    def counting(name, select):
        def counted(*args):
            calls[name] += 1
            return select(*args)

        return counted

    for name in calls:
        monkeypatch.setattr(sampling, name, counting(name, getattr(sampling, name)))
    return calls


@pytest.fixture
def batch():
    return make_batch()


ALL_PRESETS = fusedrl.LossConfig.presets()


def numeric_gradient(fn, tensors, eps=1e-6):
    """Central differences of the scalar fn(*tensors), element by element (float64)."""
    grads = []
    for t in tensors:
        g = torch.zeros_like(t)
        flat, gflat = t.view(-1), g.view(-1)
        for i in range(flat.numel()):
            saved = flat[i].item()
            flat[i] = saved + eps
            up = fn(*tensors).item()
            flat[i] = saved - eps
            down = fn(*tensors).item()
            flat[i] = saved
            gflat[i] = (up - down) / (2 * eps)
        grads.append(g)
    return grads
