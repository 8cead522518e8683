"""What every Triton launcher promises, whatever its kernel (issue 29, items 1, 3 and 7).

- The scaling of a gradient by the upstream factor takes a gradient of any shape: the autograd
  node hands it the LM head's [V] bias and [V, H] weight gradients as well as [B, T, V] logits.
- Every launch runs under the device guard, with the device of the tensors it reads.
- At sizes never allocated (N up to 2^24 tokens, V up to 2^18), no grid dimension exceeds what
  CUDA launches, and row offsets past 2^31 elements are computed in int64.

The launchers are found in the sources (every function of kernels/*.py that launches a
`*_kernel[grid](...)`), so that a new one must be added to `_calls` and `_far_launches` below
or these tests fail.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import mmap
import platform
import sys
from pathlib import Path

import pytest
import torch

import fusedrl
import fusedrl.kernels

from .conftest import needs_interpreter

KERNELS_DIR = Path(fusedrl.kernels.__file__).parent


def _launchers() -> dict[str, str]:
    """{"module.function": kernel name} of every function in kernels/*.py that launches a kernel
    (a call `name[grid](...)` with `name` ending in `_kernel`)."""
    found = {}
    for path in sorted(KERNELS_DIR.glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id.endswith("_kernel")
                ):
                    found[f"{path.stem}.{fn.name}"] = node.func.value.id
    return found


LAUNCHERS = _launchers()


def test_the_launchers_are_found():
    """The scan sees the launchers known when it was written (a broken scan would check none)."""
    assert {
        "logprobs.logprobs_forward",
        "logprobs.logits_backward",
        "scale.scale_rows_unless_one",
        "sampling._launch_select",
        "token_loss.fused_token_loss",
        "loss_sums.token_loss_sums",
        "loss_sums.aggregation_weights",
        "sequence_terms.sequence_terms",
        "linear_loss.linear_stats",
        "linear_loss.linear_logits_grad",
        "two_rows.two_rows_forward",
        "two_rows.two_rows_backward",
    } <= set(LAUNCHERS)


def _calls(batch, time, vocab, dtype, device, hidden=24) -> dict:
    """{launcher: call} of every launcher on [batch, time, vocab] logits (and the LM head's
    [batch, time, hidden] states, [vocab, hidden] weight, [vocab] bias) on `device`. Under
    FakeTensorMode nothing is allocated: the tests here look at the launches only."""
    from fusedrl.kernels import (
        linear_loss,
        logprobs,
        loss_sums,
        sampling,
        scale,
        sequence_terms,
        split_rows,
        token_args,
        token_loss,
        two_rows,
    )

    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype, device=device)

    logits = zeros(batch, time, vocab, dtype=dtype)
    labels = zeros(batch, time, dtype=torch.long)
    valid = zeros(batch, time, dtype=torch.bool)
    rows = zeros(batch, time)
    states = zeros(batch, time, hidden, dtype=dtype)
    weight = zeros(vocab, hidden, dtype=dtype)
    bias = zeros(vocab, dtype=dtype)
    factor = zeros(1)

    kl_and_bonus = token_args.LossVariant(kl="k3", beta=0.1, entropy_coef=0.01)
    every_input = token_args.TokenLossArgs(
        labels, valid, rows, kl_and_bonus, rows, None, rows, rows, rows, rows, rows
    )

    def fused():
        token_loss.fused_token_loss(logits, logits, every_input)

    def split(two_launches):
        split_rows.split_row_loss(logits, logits, every_input, two_launches=two_launches)

    def split_both():
        split(True)  # the two launches, and the cooperative one, its grid sized from the
        # compiled kernel's resources (given here: nothing is compiled) and the device's SMs
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(split_rows, "_sm_resources", lambda index: (132, {}))
            patch.setattr(split_rows, "_compiled_resources", lambda compiled: (128, 0))
            patch.setattr(split_rows, "_RESOURCES", {})
            patch.setattr(split_rows, "_NOT_CO_RESIDENT", {})
            split(False)

    def linear_grad():
        linear_loss.linear_logits_grad(
            states,
            weight,
            bias,
            labels,
            rows,
            rows,
            rows,
            rows,
            1.0,
            0,
            zeros(batch * time, vocab, dtype=dtype),
        )

    return {
        "logprobs.logprobs_forward": lambda: logprobs.logprobs_forward(logits, labels, valid, 1.0),
        "logprobs.logits_backward": lambda: logprobs.logits_backward(
            logits, labels, rows, rows, rows, rows, 1.0, logits
        ),
        # Every gradient the autograd node scales: logits, hidden states, weight, bias.
        "scale.scale_rows_unless_one": lambda: [
            scale.scale_rows_unless_one(g, factor) for g in (logits, states, weight, bias)
        ],
        # (the select's one launcher, through both its callers: the masked rows, the floors)
        "sampling._launch_select": lambda: (
            sampling.write_sampled_set(logits, labels, logits, 0.7, 50, 0.9, 0.05),
            sampling.sampled_floors(logits, labels, 0.7, 50, 0.9, 0.05),
        ),
        "token_loss.fused_token_loss": fused,
        "split_rows.split_row_loss": split_both,
        "split_rows.merge_partials_rows": lambda: split_rows.merge_partials_rows(
            zeros(2, split_rows.MAX_SLICES.value, split_rows.PARTIAL.value), 2
        ),
        "loss_sums.token_loss_sums": lambda: loss_sums.token_loss_sums(zeros(5, 16)),
        "loss_sums.aggregation_weights": lambda: loss_sums.aggregation_weights(
            rows, "token-mean", None, None
        ),
        "sequence_terms.sequence_terms": lambda: sequence_terms.sequence_terms(
            rows,
            rows,
            every_input._replace(
                variant=kl_and_bonus._replace(low_bound=0.8, high_bound=1.2),
                mask=rows,
                low=None,
                high=None,
            ),
            sequence_ratio=True,
            vocab=vocab,
        ),
        "linear_loss.linear_stats": lambda: linear_loss.linear_stats(
            states, weight, bias, labels, valid, 1.0
        ),
        "linear_loss.linear_logits_grad": linear_grad,
        "two_rows.two_rows_forward": lambda: two_rows.two_rows_forward(
            logits, logits, labels, valid, 1.0, "jsd", 0.5
        ),
        "two_rows.two_rows_backward": lambda: two_rows.two_rows_backward(
            logits,
            logits,
            rows,
            rows,
            rows,
            rows,
            rows,
            1.0,
            "kl",
            0.5,
            logits,
            labels,
            rows,
            rows,
            rows,
        ),
    }


class _Recorder:
    """Stands in for a kernel: `kernel[grid](...)` records (kernel, grid, device guarded)."""

    def __init__(self, name: str, sink: list, guarded: list):
        self.name, self.sink, self.guarded = name, sink, guarded

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            grid_now = grid(kwargs) if callable(grid) else grid
            self.sink.append((self.name, tuple(grid_now), tuple(self.guarded)))

        return launch

    def warmup(self, *args, grid, **kwargs):  # (compiles, launches nothing)
        return None


@contextlib.contextmanager
def _recording(monkeypatch, sms_and_l2=(132, 50 * 2**20)):
    """Every kernel swapped for a recorder, the device guard watched instead of entered (fake
    CUDA tensors have no device to switch to), and the GPU's SM count and L2 size given.
    Yields (launches, the SM-query device indices)."""
    from fusedrl.kernels import device, launch

    launches, guarded, queried = [], [], []

    @contextlib.contextmanager
    def watched_guard(dev):
        guarded.append(dev)
        try:
            yield
        finally:
            guarded.pop()

    def sms(index):
        queried.append(index)
        return sms_and_l2

    monkeypatch.setattr(device, "device_guard", watched_guard)
    monkeypatch.setattr(launch, "_sms_and_l2", sms)
    for launcher, kernel in LAUNCHERS.items():
        module = importlib.import_module(f"fusedrl.kernels.{launcher.split('.')[0]}")
        monkeypatch.setattr(module, kernel, _Recorder(kernel, launches, guarded))
    yield launches, queried


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _run_every_launcher(calls: dict, launches: list) -> dict[str, list]:
    """Runs each call; {launcher: its launches}, checking that no launcher is left without one."""
    missing = set(LAUNCHERS) - set(calls)
    assert not missing, f"add a call of {sorted(missing)} to tests/test_launchers.py::_calls"
    by_launcher = {}
    for name, call in calls.items():
        start = len(launches)
        call()
        by_launcher[name] = launches[start:]
        assert by_launcher[name], f"{name} launched nothing"
        assert {k for k, _, _ in by_launcher[name]} == {LAUNCHERS[name]}, name
    return by_launcher


# ------------------------------------------------------------------ item 1: any gradient shape
def _spy_scale_kernel(monkeypatch) -> list:
    """The real scaling kernel, its launches recorded: (data_ptr of the rows, number of rows)."""
    from fusedrl.kernels import scale

    kernel = scale._scale_rows_unless_one_kernel
    launches = []

    class Spy:
        def __getitem__(self, grid):
            def launch(rows, *args, **kwargs):
                launches.append((rows.data_ptr(), grid[0]))
                return kernel[grid](rows, *args, **kwargs)

            return launch

    monkeypatch.setattr(scale, "_scale_rows_unless_one_kernel", Spy())
    return launches


def _gradient(layout: str, dtype: torch.dtype) -> torch.Tensor:
    """A gradient of `layout`, in a buffer with elements around it (that must stay untouched)."""
    gen = torch.Generator().manual_seed(29)

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(dtype)

    return {
        "0-D": lambda: randn(),
        "1-D [V] (bias)": lambda: randn(1031),
        "2-D [V, H] (weight)": lambda: randn(101, 24),
        "2-D [N, V]": lambda: randn(7, 1031),
        "3-D [B, T, V]": lambda: randn(2, 3, 1031),
        "4-D": lambda: randn(2, 3, 2, 131),
        "[B, P+T, V] slice": lambda: randn(2, 9, 1031)[:, 3:8],
        "every other row": lambda: randn(9, 1031)[::2],
        "4-D, no two strides": lambda: randn(4, 6, 4, 131)[::2, ::2, ::2],
        "transposed": lambda: randn(1031, 5).t(),
        "1-D strided": lambda: randn(2062)[::2],
    }[layout]()


# Layouts the kernel walks in place, as rows of their last dim; the others are multiplied by torch.
AS_ROWS = {
    "0-D": 1,
    "1-D [V] (bias)": 1,
    "2-D [V, H] (weight)": 101,
    "2-D [N, V]": 7,
    "3-D [B, T, V]": 6,
    "4-D": 12,
    "[B, P+T, V] slice": 10,
    "every other row": 5,
}
NO_VIEW = ["4-D, no two strides", "transposed", "1-D strided"]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [*AS_ROWS, *NO_VIEW])
def test_scale_takes_a_gradient_of_any_shape(layout, dtype, monkeypatch):
    """A factor of 1 leaves the gradient bitwise untouched; 2 doubles it (exact in any dtype),
    in place, and nothing around it. Where a view with a contiguous last dim exists, the kernel
    walks it as rows of that dim on the gradient's own memory (no copy); elsewhere torch
    multiplies in place (issue 29, item 1: a [V] bias gradient crashed the unpacking)."""
    from fusedrl.kernels import scale

    launches = _spy_scale_kernel(monkeypatch)
    grad = _gradient(layout, dtype)
    storage = grad.untyped_storage()
    buffer = torch.empty(0, dtype=dtype).set_(storage)  # the whole buffer, around the view too
    before, before_buffer = grad.clone(), buffer.clone()
    scale.scale_rows_unless_one(grad, torch.tensor(1.0))
    assert torch.equal(buffer.view(torch.uint8), before_buffer.view(torch.uint8))
    scale.scale_rows_unless_one(grad, torch.tensor([2.0]))
    assert torch.equal(grad, before * 2)
    marker = torch.zeros_like(buffer)
    marker.as_strided(grad.shape, grad.stride(), grad.storage_offset()).fill_(1)
    outside = marker == 0
    assert torch.equal(buffer[outside], before_buffer[outside]), "scaled outside the gradient"
    if layout in AS_ROWS:
        assert launches == [(grad.data_ptr(), AS_ROWS[layout])] * 2
    else:
        assert launches == []


@needs_interpreter
@pytest.mark.parametrize(
    "layout, dtype",
    # (the interpreter rounds the kernel's fp32 -> bf16 toward zero: the kernel in fp16 only)
    [("3-D [B, T, V]", torch.float16)]
    + [(layout, dtype) for layout in NO_VIEW for dtype in (torch.float16, torch.bfloat16)],
)
def test_scale_multiplies_half_gradients_in_fp32(layout, dtype):
    """The kernel and its torch fallback (a gradient no view can walk) alike: the product in
    fp32, rounded once. GradScaler's 2**16 cast to fp16 first would be inf (and NaN at a zero
    gradient); 1/3 cast to bf16 first would lose its low bits. (A CPU multiply by a 0-D tensor
    computes in fp32 anyway; a CUDA one casts the factor: tests/test_gpu.py runs this there.)"""
    from fusedrl.kernels import scale

    for factor in (2.0**16, 1.0 / 3.0):
        grad = _gradient(layout, dtype)
        grad.mul_(1e-3)
        truth = (grad.float() * factor).to(dtype)  # (the fp32 product, rounded once)
        scale.scale_rows_unless_one(grad, torch.tensor([factor]))
        assert torch.equal(grad, truth), (factor, (grad.double() - truth.double()).abs().max())


@needs_interpreter
def test_scale_refuses_what_it_cannot_scale_in_place():
    """A broadcast gradient shares its elements between rows: scaling each row would scale them
    again and again, so it raises (torch's in-place check) instead. A scale of several elements,
    or on another device than the gradient, is refused with what is wrong."""
    from fusedrl.kernels import scale

    shared = torch.ones(1, 131).expand(3, 131)
    with pytest.raises(RuntimeError, match="single memory location"):
        scale.scale_rows_unless_one(shared, torch.tensor(2.0))
    assert torch.equal(shared, torch.ones(3, 131))
    with pytest.raises(ValueError, match="scale must have one element"):
        scale.scale_rows_unless_one(torch.ones(3, 131), torch.ones(2))
    with pytest.raises(ValueError, match="scale is on meta"):
        scale.scale_rows_unless_one(torch.ones(3, 131), torch.ones(1, device="meta"))


@needs_interpreter
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
def test_lm_head_gradients_scaled_by_the_kernel(preset, monkeypatch):
    """The LM-head loss with a trainable bias behind an upstream factor of 2, with the autograd
    node's scaling routed to the kernel as on a GPU (on CPU it multiplies on the host): the
    hidden [B, T, H], weight [V, H] and bias [V] gradients match autograd through the
    materialised logits."""
    from fusedrl import _autograd, reference
    from fusedrl.kernels import scale

    def on_the_kernel(grad, grad_loss):
        scale.scale_rows_unless_one(grad, grad_loss)
        return grad

    monkeypatch.setattr(_autograd, "scale_unless_one", on_the_kernel)
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 5, 24, generator=gen), 0.3 * torch.randn(131, 24, generator=gen)
    bias = torch.randn(131, generator=gen)
    rows = dict(
        labels=torch.randint(0, 131, (2, 5), generator=gen),
        advantages=torch.randn(2, generator=gen),
        mask=torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool),
        config=fusedrl.LossConfig.preset(preset),
    )

    def grads(loss_of):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        (2 * loss_of(*leaves)).backward()
        return [t.grad for t in leaves]

    ours = grads(
        lambda h, w, b: fusedrl.linear_policy_loss(h, w, bias=b, backend="triton", **rows).loss
    )
    expected = grads(
        lambda h, w, b: reference.policy_loss(torch.nn.functional.linear(h, w, b), **rows).loss
    )
    for name, g, e in zip(("hidden", "weight", "bias"), ours, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------ item 3: the tensor's device
def test_device_guard_switches_to_a_cuda_tensors_device():
    """What the guard enters (built without a GPU: torch.cuda.device only switches on enter)."""
    from fusedrl.kernels.device import device_guard

    guard = device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(device_guard(torch.device("cpu")), contextlib.nullcontext)


def test_every_launch_runs_under_the_tensors_device(monkeypatch):
    """Tensors on cuda:1 (fake: nothing is allocated): every launcher's kernel is launched
    inside the device guard entered with cuda:1, and the persistent grids are sized from
    cuda:1's SMs (issue 29, item 3: Triton launches on the current device, which is not
    necessarily the tensors')."""
    with _recording(monkeypatch) as (launches, queried), _fake_mode():
        calls = _calls(2, 3, 1031, torch.bfloat16, torch.device("cuda", 1))
        by_launcher = _run_every_launcher(calls, launches)
    for name, found in by_launcher.items():
        for kernel, _, guarded in found:
            assert guarded, f"{name} launched {kernel} outside the device guard"
            assert guarded[-1] == torch.device("cuda", 1), (name, guarded)
    assert queried and set(queried) == {1}


def test_persistent_grid_reads_the_current_device_for_a_bare_cuda(monkeypatch):
    """torch.device("cuda") has no index: it means the current device, not device 0."""
    from fusedrl.kernels import launch

    queried = []
    monkeypatch.setattr(launch, "_sms_and_l2", lambda index: queried.append(index) or (8, 1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert launch.persistent_programs(100, 2, torch.device("cuda")) == 8
    assert launch.persistent_programs(100, 2, torch.device("cuda", 2)) == 8
    assert queried == [3, 2]


# ------------------------------------------------- item 7: grids and offsets at any size
GRID_X_MAX = 2**31 - 1
GRID_YZ_MAX = 65535


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("vocab", [2**18, 151936, 32003])
@pytest.mark.parametrize("batch, time", [(1, 2**24), (2**24, 1), (2**12, 2**12), (1, 65536)])
def test_grids_stay_within_cuda_limits(batch, time, vocab, dtype, monkeypatch):
    """Every launcher at up to N = 2^24 tokens (one sequence, one token a sequence, a square)
    and V up to 2^18, with the grid its own code computes for a CUDA device (fake tensors: not
    a byte is allocated): grid x <= 2^31 - 1, y and z <= 65535, every dimension >= 1. Liger's
    GRPO kernel puts the tokens on a grid dimension and fails at 65,536 of them."""
    hidden = 4096
    for sms_and_l2 in ((132, 50 * 2**20), (148, 126 * 2**20)):  # H100, B200
        with pytest.MonkeyPatch.context() as mp:
            with _recording(mp, sms_and_l2) as (launches, _), _fake_mode():
                calls = _calls(batch, time, vocab, dtype, torch.device("cuda", 0), hidden)
                by_launcher = _run_every_launcher(calls, launches)
        for name, found in by_launcher.items():
            for kernel, grid, _ in found:
                where = (name, kernel, grid, sms_and_l2)
                assert 1 <= len(grid) <= 3, where
                assert all(isinstance(g, int) and g >= 1 for g in grid), where
                assert grid[0] <= GRID_X_MAX, where
                assert all(g <= GRID_YZ_MAX for g in grid[1:]), where


# Row offsets: a stride below 2^31 (so that Triton passes it as an int32) whose multiple by row
# 2 is past 2^31. In int32 that product wraps to itself - 2^32.
FAR = 2**30 + 8
# Where each tensor starts, in elements: from 2^31 on, so that a wrapped row-2 address is still
# inside the mapping (a wrong row of zeros, not a crash), apart by far more than any tensor.
BASES = [2**31 + k * 2**21 for k in range(4)]
SPACE = 2**32 + 2**23  # elements of bf16 address space: every true and every wrapped address


@pytest.fixture
def address_space():
    """SPACE bf16 elements of address space and almost no memory: an anonymous private mapping
    without reserve reads as zeros and gets a page only where it is written (the interpreter
    hands a CPU tensor's storage to the kernel as it is, copying nothing)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("maps 8 GiB of address space without reserve: Linux only")
    no_reserve = getattr(mmap, "MAP_NORESERVE", None)
    if no_reserve is None:  # not exposed before Python 3.13; its Linux value on these CPUs
        no_reserve = 0x4000 if platform.machine() in ("x86_64", "aarch64", "arm64") else 0
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | no_reserve
    try:
        region = mmap.mmap(-1, SPACE * 2, flags=flags)
    except OSError as exc:  # vm.overcommit_memory = 2 accounts for the whole mapping
        pytest.skip(f"cannot map {SPACE * 2} bytes of address space: {exc}")
    return torch.frombuffer(region, dtype=torch.bfloat16)


def _far(space: torch.Tensor, base: int, values: torch.Tensor, dim: int, stride=FAR):
    """`values` copied into `space` at `base`, with leading dim `dim` `stride` elements apart
    (the other dims compact): row 2 of that dim starts past 2^31 elements from the view."""
    strides = list(values.contiguous().stride())
    strides[dim] = stride
    view = space.as_strided(values.shape, strides, base)
    view.copy_(values)
    return view


def _far_launches(space, layout: str):
    """{launcher: (call on far-apart rows, call on compact copies)}: each returns its results.
    `layout`: whether the batch or the time dim of [B, T, ...] tensors holds the far rows."""
    from fusedrl.kernels import (
        linear_loss,
        logprobs,
        sampling,
        scale,
        split_rows,
        token_args,
        token_loss,
        two_rows,
    )

    gen = torch.Generator().manual_seed(7)
    shape, dim = ((3, 1), 0) if layout == "batch" else ((1, 3), 1)
    vocab, hidden = 40, 24
    values = (2 * torch.randn(*shape, vocab, generator=gen)).to(torch.bfloat16)
    states = torch.randn(*shape, hidden, generator=gen).to(torch.bfloat16)
    # Only column 4 of the head is past 2^31 (a [V, H] head holds 2^31 elements at V = 2^18,
    # H = 8192): smaller strides for it.
    head = (0.3 * torch.randn(5, hidden, generator=gen)).to(torch.bfloat16)
    bias = torch.randn(5, generator=gen).to(torch.bfloat16)
    labels = torch.tensor([2, 17, 33]).view(shape)
    head_labels = torch.tensor([0, 4, 3]).view(shape)
    valid = torch.ones(shape, dtype=torch.bool)
    rows = torch.rand(shape, generator=gen) + 0.5

    # The far views are made at each call: some launchers write into their input.
    def logits_pair(fn):
        def far():
            out = _far(space, BASES[1], torch.full_like(values, float("nan")), dim)
            return fn(_far(space, BASES[0], values, dim), out)

        return far, lambda: fn(values.clone(), torch.full_like(values, float("nan")))

    def linear_pair(fn):
        def far():
            far_head = _far(space, BASES[3], head, 0, stride=2**29 + 8)
            out = _far(space, BASES[1], head.new_full((3, 5), float("nan")), 0)
            return fn(_far(space, BASES[2], states, dim), far_head, out)

        return far, lambda: fn(states, head, head.new_full((3, 5), float("nan")))

    def scaled(grad, _):
        scale.scale_rows_unless_one(grad, torch.tensor(2.0))
        return grad

    def backward(logits, out):
        logp, lse, entropy = logprobs.logprobs_forward(logits, labels, None, 1.0)
        logprobs.logits_backward(logits, labels, lse, entropy, rows, rows, 1.0, out)
        return logp, lse, entropy, out

    def sampled(logits, out):
        sampling.write_sampled_set(logits, labels, out, 1.0, 5, None, None)
        return out, sampling.sampled_floors(logits, labels, 1.0, 5, None, None)

    bonus = token_args.TokenLossArgs(
        labels, valid, rows, token_args.LossVariant(entropy_coef=0.01), rows, None, rows
    )

    def fused(logits, grad):
        return (*token_loss.fused_token_loss(logits, grad, bonus), grad)

    def split(logits, grad):  # rows of one slice (one launch), then of three (two launches)
        outputs = []
        for width in (64, 16):
            split_rows.INTERPRETED_SLICE = width
            outputs += split_rows.split_row_loss(logits, grad, bonus)
            outputs.append(grad.clone())
        return tuple(outputs)

    def two_rows_pass(logits, out):
        # The teacher is the student's own far view: a teacher row read from the wrong place
        # makes a divergence where there is none.
        stats = two_rows.two_rows_forward(logits, logits, labels, None, 1.0, "jsd", 0.4)
        two_rows.two_rows_backward(logits, logits, *stats[1:5], rows, 1.0, "jsd", 0.4, out)
        return (*stats, out)

    def stats(hidden_states, weight, _):
        return linear_loss.linear_stats(hidden_states, weight, bias, head_labels, valid, 1.0)

    def linear_grad(hidden_states, weight, out):
        lse = torch.full(shape, 2.0)
        linear_loss.linear_logits_grad(
            hidden_states, weight, bias, head_labels, lse, lse, rows, rows, 1.0, 0, out
        )
        return out

    return {
        "logprobs.logprobs_forward": logits_pair(
            lambda logits, _: logprobs.logprobs_forward(logits, labels, None, 1.0)
        ),
        "logprobs.logits_backward": logits_pair(backward),
        "scale.scale_rows_unless_one": logits_pair(scaled),
        "sampling._launch_select": logits_pair(sampled),
        "token_loss.fused_token_loss": logits_pair(fused),
        "split_rows.split_row_loss": logits_pair(split),
        "linear_loss.linear_stats": linear_pair(stats),
        "linear_loss.linear_logits_grad": linear_pair(linear_grad),
        "two_rows.two_rows_forward": logits_pair(two_rows_pass),
        "two_rows.two_rows_backward": logits_pair(two_rows_pass),
    }


# Launchers that address no [B, T, V] rows: the loss's sums, aggregation weights and the
# two-pass terms ([B, T] scalars).
ROWLESS = {
    "loss_sums.token_loss_sums",
    "loss_sums.aggregation_weights",
    "sequence_terms.sequence_terms",
    "split_rows.merge_partials_rows",  # ([rows, 64, 4] partials: no row of the logits)
}


@needs_interpreter
@pytest.mark.parametrize("layout", ["batch", "time"])
@pytest.mark.parametrize("launcher", sorted(set(LAUNCHERS) - ROWLESS))
def test_row_offsets_past_2_31_elements(address_space, launcher, layout, monkeypatch):
    """Every launcher on rows 2^30 + 8 elements apart (row 2 starts past 2^31 elements: logits,
    gradients, hidden states; and row 4 of the LM head) gives what it gives on compact copies.

    What this proves: a row's offset is its index times a stride. Triton passes a stride below
    2^31 as an int32, so unless the kernel casts the row index to int64 before the multiply,
    the product wraps to itself - 2^32, as it would on a GPU (the interpreter follows the
    compiler's types; its numpy int32 arithmetic wraps the same way). The views here are laid
    out so that the wrapped address is mapped and reads zeros: a kernel without the cast reads
    and writes the wrong rows, and the comparison fails instead of crashing. Offsets >= 2^31
    in one stride come as int64 from Triton and need no test; the within-row offsets stay below
    V <= 2^18. Nothing large is allocated (see `address_space`)."""
    from fusedrl.kernels import launch, split_rows

    monkeypatch.setattr(launch, "MAX_BLOCK_V_INTERPRETED", 16)  # whole tiles and a remainder
    monkeypatch.setattr(split_rows, "INTERPRETED_SLICE", split_rows.INTERPRETED_SLICE)
    pairs = _far_launches(address_space, layout)
    assert launcher in pairs, f"add a call of {launcher} to tests/test_launchers.py::_far_launches"
    far, compact = pairs[launcher]
    got, expected = far(), compact()
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
