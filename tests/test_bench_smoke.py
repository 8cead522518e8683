"""The benchmark scripts run end to end (tiny shapes, CPU, Triton interpreted): they cannot rot
between GPU sessions. The numbers are meaningless here and are not checked; the outputs must say
so. bench/run_gpu.sh is checked for what it can do without a GPU: refuse, clearly."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusedrl
from fusedrl.tp.header import FIELDS

from .conftest import needs_interpreter

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SMOKE_NOTE = "smoke run, not a measurement"


def _load(name: str):
    """A bench/ script as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_runs_write_outside_the_tracked_results():
    """A smoke run aimed at bench/results/ (every script's default) writes under
    bench/results/smoke/, which git ignores; an explicit --out is kept."""
    bench = _load("bench_loss")
    assert bench.results_dir(bench.RESULTS, smoke=True) == bench.SMOKE_RESULTS
    assert bench.results_dir(bench.RESULTS, smoke=False) == bench.RESULTS
    assert bench.results_dir("/tmp/x", smoke=True) == Path("/tmp/x")
    probe = bench.SMOKE_RESULTS / "policy_loss_fwd_bwd-cpu-smoke.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=BENCH.parent)
    assert ignored.returncode == 0, "bench/results/smoke/ is not git-ignored"
    for script in sorted(BENCH.glob("bench_*.py")):  # each says what a smoke run is
        assert "SMOKE_NOTE" in script.read_text() or "not a measurement" in script.read_text(), (
            script.name
        )


@needs_interpreter
def test_bench_loss_checks_every_impl_against_the_oracle(monkeypatch):
    """Before timing, bench_loss checks each impl's loss and gradient against the oracle on a
    small case of the preset: Liger's adapter (its kernels through the interpreter) included, and
    with the gradient-accumulation factor; an impl that is off is named, not timed silently."""
    pytest.importorskip("liger_kernel")
    bench = _load("bench_loss")
    monkeypatch.setattr(bench, "VERIFY_TOKENS", 64)  # (every row interpreted: a small case)
    impls = [
        "fusedrl-triton",
        "fusedrl-triton-inplace",
        "fusedrl-triton-split-inplace",
        "torch-eager",
        "liger",
    ]
    for preset in ("dapo", "grpo", "accum4"):
        found = bench.verify_impls(impls, torch.device("cpu"), torch.bfloat16, 263, preset, 4)
        assert found == dict.fromkeys(impls, "ok"), (preset, found)
    real = bench._liger_fn()
    monkeypatch.setattr(bench, "_liger_fn", lambda: lambda case, inp: 1.5 * real(case, inp))
    found = bench.verify_impls(["liger"], torch.device("cpu"), torch.bfloat16, 263, "dapo", 4)
    assert found["liger"].startswith("loss "), found


def test_bench_loss_cuda_graph_needs_a_gpu(capsys):
    """--cuda-graph times graph replays: on a machine without CUDA it refuses by name at once
    (tests/test_gpu.py runs it on a GPU)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/test_gpu.py covers the graph mode")
    with pytest.raises(SystemExit) as exit_info:
        _load("bench_loss").main(["--cuda-graph", "--smoke"])
    assert exit_info.value.code == 2
    assert "--cuda-graph needs a CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_loss_smoke_and_plot(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_loss.py"),
            "--smoke",
            "--out",
            str(tmp_path),
            "--presets",
            "dapo",
            "gspo",
        ],
        check=True,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # Said in the table header and again at the end; every JSON file says it too.
    lines = proc.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("op ")))
    assert any(SMOKE_NOTE in line for line in lines[:header])
    assert lines[-1] == SMOKE_NOTE
    files = sorted(tmp_path.glob("*.json"))
    assert {f.name.split("-")[0] for f in files} == {"token_logprobs_fwd", "policy_loss_fwd_bwd"}
    result = json.loads((tmp_path / files[0].name).read_text())
    assert {
        "device",
        "torch",
        "triton",
        "commit",
        "timestamp",
        "copy_bandwidth_gbps",
        "smoke",
        "complete",
        "skipped",
        "rows",
    } <= set(result)
    for f in files:
        data = json.loads(f.read_text())
        assert data["smoke"] is True and data["complete"] is True
    if not torch.cuda.is_available():  # the CUDA extension's impls: skipped, with the reason
        assert "CUDA device" in result["skipped"]["fusedrl-cuda-inplace"]
        assert "# skipped fusedrl-cuda: needs a CUDA device" in proc.stdout
    loss_rows = json.loads(next(tmp_path.glob("policy_loss_fwd_bwd-*.json")).read_text())["rows"]
    measured = {(r["impl"], r["preset"]) for r in loss_rows if r.get("ms") is not None}
    assert ("fusedrl-triton", "gspo") in measured and ("torch-eager", "dapo") in measured
    for row in loss_rows:
        assert {"op", "impl", "preset", "N", "V", "dtype", "ms", "bytes_floor"} <= set(row)
    pytest.importorskip("matplotlib")
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "plot_loss.py"),
            str(next(tmp_path.glob("policy_loss_fwd_bwd-*.json"))),
            "--out",
            str(tmp_path / "plot.png"),
        ],
        check=True,
        timeout=300,
    )
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_bench_train_step_smoke(tmp_path):
    pytest.importorskip("transformers")
    subprocess.run(
        [sys.executable, str(BENCH / "bench_train_step.py"), "--smoke", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(next(tmp_path.glob("train_step-*.json")).read_text())
    assert [r["impl"] for r in result["rows"]] == ["eager", "fusedrl", "fusedrl-packed"]
    assert all(r["step_ms"] > 0 and r["tokens"] > 0 for r in result["rows"])


def test_bench_pack_job_smoke(tmp_path):
    """The default job padded, packed and packed by a token budget: the same seeded updates
    (their losses agree), each timed."""
    pytest.importorskip("transformers")
    from .trainer_cli import TrainerCLI

    sys.path.insert(0, str(BENCH))  # (it imports bench_loss)
    bench_pack_job = _load("bench_pack_job")
    # The three runs forked from one process that imported the trainer (tests/trainer_cli.py)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cli = TrainerCLI(env, with_vllm=False)
    try:
        bench_pack_job.main(["--smoke", "--budgets", "64", "--out", str(tmp_path)], cli.run)
    finally:
        cli.close()
    result = json.loads(next(tmp_path.glob("pack_job-*.json")).read_text())
    rows = result["results"]
    assert list(rows) == ["padded", "packed", "packed-64"] and result["note"] == SMOKE_NOTE
    assert all(row["train_time_s"] > 0 and row["steps"] == 4 for row in rows.values())
    losses = [row["loss"] for row in rows.values()]
    assert max(losses) - min(losses) <= 1e-5 * max(1.0, abs(losses[0]))


def test_bench_loss_impls_match_the_docs():
    """Every impl docs/benchmarks.md lists is a choice of bench_loss.py --impls."""
    bench_loss = _load("bench_loss")
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| impls |"))
    names = re.compile(r"(fusedrl|torch)(-[a-z]+)+|liger")
    listed = {code for code in row.split("`")[1::2] if names.fullmatch(code)}
    assert listed == set(bench_loss.IMPLS)


@needs_interpreter
def test_bench_loss_case_logprobs_per_buffer():
    """Each rotated buffer has old / ref log-probs of its own logits (ratios near 1 for all)."""
    bench_loss = _load("bench_loss")
    case = bench_loss.Case(32, 263, "grpo", torch.bfloat16, torch.device("cpu"), 2, 4)
    logps = [
        fusedrl.token_logprobs(b[:, :-1], case.labels, backend="torch")[0] for b in case.buffers
    ]
    for i, logp in enumerate(logps):
        assert (case.old[i] - logp).abs().max() < 1.0
        assert (case.ref[i] - logp).abs().max() < 1.0
    assert (case.old[1] - logps[0]).abs().max() > 1.0  # not the first buffer's log-probs
    for _ in range(4):
        inp = case.take()
        i = (case._next - 1) % 2
        assert inp.logits.data_ptr() == case.buffers[i].data_ptr() and inp.old is case.old[i]


@pytest.mark.parametrize("preset", ["dapo", "grpo", "full_kl"])
def test_bench_loss_eager_peer_computes_the_same_loss(preset):
    """The eager peer (TRL's recipe; with full_kl the exact KL from both log-softmaxes) is the
    loss fusedrl computes, so that the table compares like with like; the exact-KL preset's
    reference logits rotate with the buffers and its floor is 2R + 1W."""
    bench_loss = _load("bench_loss")
    case = bench_loss.Case(32, 263, preset, torch.float32, torch.device("cpu"), 2, 4)
    for _ in range(2):
        inp = case.take()
        kwargs = dict(old_logp=inp.old, config=case.cfg, backend="torch")
        if case.cfg.full_kl:
            kwargs["ref_logits"] = inp.ref_logits
            assert inp.ref_logits is case.ref_logits[(case._next - 1) % 2]
        elif case.cfg.beta > 0:
            kwargs["ref_logp"] = inp.ref
        ours = fusedrl.policy_loss(inp.logits, case.labels, case.advantages, case.mask, **kwargs)
        eager = bench_loss.trl_style_loss(inp.logits, case, inp.old, inp.ref, inp.ref_logits)
        torch.testing.assert_close(eager, ours.loss, rtol=1e-5, atol=1e-6)
    floor = bench_loss.floor_bytes("policy_loss_fwd_bwd", case)
    assert floor == (3 if preset in ("full_kl",) else 2) * case.bytes_of_logits


@needs_interpreter
def test_bench_loss_inplace_impls_time_fresh_logits(monkeypatch):
    """An in-place impl gets a buffer restored from its pristine copy before every call, and the
    impls after it never see the gradient it wrote."""
    bench_loss = _load("bench_loss")
    cpu = torch.device("cpu")
    seen: dict[str, list[bool]] = {}
    make_step = bench_loss.make_step

    def checked_make_step(op, impl, case):
        step = make_step(op, impl, case)
        if step is None:
            return None

        def checked():
            i = case._next % len(case.buffers)
            seen.setdefault(impl, []).append(torch.equal(case.buffers[i], case.pristine[i]))
            step()

        return checked

    monkeypatch.setattr(bench_loss, "make_step", checked_make_step)
    args = argparse.Namespace(
        ops=["policy_loss_fwd_bwd"],
        presets=["dapo"],
        sequences=4,
        warmup_ms=1,
        rep_ms=5,
        cuda_graph=False,
    )
    impls = ["fusedrl-triton-inplace", "fusedrl-torch", "torch-eager"]
    rows = bench_loss._run_case(args, impls, cpu, torch.bfloat16, 32, 263, "dapo", 100.0)
    assert [r["impl"] for r in rows] == impls and all(r["ms"] is not None for r in rows)
    assert "restored" in rows[0]["timing"] and "restored" not in rows[1]["timing"]
    assert set(seen) == set(impls)
    assert all(all(calls) for calls in seen.values()), seen

    # The in-place step does write into its buffer (else the restore would test nothing).
    case = bench_loss.Case(32, 263, "dapo", torch.bfloat16, cpu, 2, 4, pristine=True)
    make_step("policy_loss_fwd_bwd", "fusedrl-triton-inplace", case)()
    assert not torch.equal(case.buffers[0], case.pristine[0])
    case.restore_all()
    assert all(torch.equal(b, p) for b, p in zip(case.buffers, case.pristine))


def test_profile_fused_smoke(tmp_path):
    """The ncu driver runs its three calls (no ncu, tiny shapes) and says it measured nothing."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "profile_fused.py"),
            "--smoke",
            "--manifest",
            str(tmp_path / "manifest.json"),
        ],
        check=True,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.stdout.splitlines()[-1] == SMOKE_NOTE
    for call in ("dapo", "logprobs", "gspo"):
        assert f"{call}: " in proc.stdout
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["smoke"] is True and manifest["logits_bytes"] == 32 * 263 * 2


# The format of `ncu --csv --page details --print-units base` (made-up values, not a measurement).
NCU_HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
)


def _ncu_csv(kernels: list[tuple[int, str, dict[str, tuple[str, str]]]]) -> str:
    lines = ["==PROF== Connected to process 1", NCU_HEADER]
    for kid, name, metrics in kernels:
        for metric, (unit, value) in metrics.items():
            lines.append(
                f'"{kid}","1","python3","host","{name}","1","7","(256, 1, 1)","(32, 1, 1)","0",'
                f'"9.0","Command line profiler metrics","{metric}","{unit}","{value}"'
            )
    return "\n".join(lines) + "\n"


def test_profile_fused_parses_ncu_csv(tmp_path):
    manifest = {"device": "test", "N": 4, "V": 1000, "dtype": "bfloat16", "logits_bytes": 8000}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "dapo.csv").write_text(
        _ncu_csv(
            [
                (
                    0,
                    "_fused_token_loss_kernel",
                    {
                        "dram__bytes_read.sum": ("byte", "12,000"),
                        "dram__bytes_write.sum": ("Kbyte", "8"),
                        "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("%", "50.5"),
                        "gpu__time_duration.sum": ("usecond", "1.5"),
                    },
                )
            ]
        )
    )
    gspo_metrics = {
        "dram__bytes_read.sum": ("byte", "8,000"),
        "dram__bytes_write.sum": ("byte", "0"),
    }
    (tmp_path / "gspo.csv").write_text(
        _ncu_csv(
            [
                (0, "_logprobs_fwd_kernel", gspo_metrics),
                (
                    1,
                    "_logits_grad_kernel",
                    {**gspo_metrics, "dram__bytes_write.sum": ("byte", "8000")},
                ),
            ]
        )
    )
    out = tmp_path / "ncu.json"
    profile_fused = _load("profile_fused")
    argv = ["parse", "--manifest", str(tmp_path / "manifest.json"), "--out", str(out), "--csv"]
    rc = profile_fused.main(
        argv + [f"dapo={tmp_path / 'dapo.csv'}", f"gspo={tmp_path / 'gspo.csv'}"]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    dapo = result["calls"]["dapo"]
    (kernel,) = dapo["kernels"]
    assert kernel["kernel"] == "_fused_token_loss_kernel"
    assert kernel["dram_bytes_read"] == 12000 and kernel["dram_bytes_write"] == 8000
    assert kernel["read_over_logits"] == 1.5 and kernel["write_over_logits"] == 1.0
    assert kernel["gpu_time_ns"] == 1500 and kernel["dram_throughput_pct_of_peak"] == 50.5
    assert dapo["floor_bytes"] == 2 * 8000 and dapo["bytes_over_floor"] == 1.25
    gspo = result["calls"]["gspo"]
    assert [k["kernel"] for k in gspo["kernels"]] == ["_logprobs_fwd_kernel", "_logits_grad_kernel"]
    assert gspo["floor_bytes"] == 3 * 8000 and gspo["bytes_over_floor"] == 1.0
    # A call whose CSV holds no kernel (ncu failed, e.g. no permission for the counters): exit 1.
    (tmp_path / "empty.csv").write_text("==ERROR== ERR_NVGPUCTRPERM\n")
    assert profile_fused.main(argv + [f"logprobs={tmp_path / 'empty.csv'}"]) == 1


# ------------------------------------------------------------------------------ run_gpu.sh
def _fake_bin(tmp_path: Path, nvidia_smi: str) -> dict[str, str]:
    """An environment whose nvidia-smi is the given script body (the host's is never run)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text("#!/usr/bin/env bash\n" + nvidia_smi + "\n")
    tool.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def _run_gpu(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(BENCH / "run_gpu.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_run_gpu_sh_parses(tmp_path):
    assert subprocess.run(["bash", "-n", str(BENCH / "run_gpu.sh")]).returncode == 0
    env = _fake_bin(tmp_path, "exit 1")
    for args in ([], ["nope"], ["tests", "a", "b"]):
        proc = _run_gpu(args, env)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "bash bench/run_gpu.sh profile [OUTDIR]" in proc.stderr
    proc = _run_gpu(["--help"], env)
    assert proc.returncode == 0 and "bash bench/run_gpu.sh all" in proc.stdout
    assert "bash bench/run_gpu.sh session" in proc.stdout  # the last line of the list too


def test_gpu_wheels_sh_pins_what_the_project_pins():
    """bench/gpu_wheels.sh (the wheels a GPU machine without a registry is carried): it parses,
    refuses an unknown option by name, and fetches the peers at the versions pyproject's extras
    pin (a mismatch would benchmark another TRL or Liger than the parity tests ran)."""
    script = BENCH / "gpu_wheels.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    proc = subprocess.run(["bash", str(script), "--nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown option '--nope'" in proc.stderr
    pyproject = (ROOT / "pyproject.toml").read_text()
    text = script.read_text()
    pins = re.findall(r"(trl==[\d.]+|liger-kernel==[\d.]+)", pyproject)
    assert len(pins) >= 2, pins
    for pin in pins:
        assert pin in text, pin


def test_run_gpu_sh_refuses_without_gpu(tmp_path):
    """`bash bench/run_gpu.sh tests /tmp/x` on a machine without a GPU: a clear refusal, non-zero,
    before it installs or writes anything."""
    env = _fake_bin(tmp_path, 'echo "NVIDIA-SMI has failed: no devices were found" >&2; exit 9')
    out = tmp_path / "x"
    proc = _run_gpu(["tests", str(out)], env)
    assert proc.returncode != 0
    assert "run_gpu.sh: refusing to run: no GPU visible (nvidia-smi -L failed" in proc.stderr
    assert "make bench-cpu" in proc.stderr
    assert not out.exists() and "pip" not in proc.stdout + proc.stderr


def test_run_gpu_sh_refuses_when_torch_sees_no_gpu(tmp_path):
    """nvidia-smi lists a GPU, but torch.cuda.is_available() is false: refused too."""
    env = _fake_bin(tmp_path, 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"')
    env.update(PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "x"
    proc = _run_gpu(["bench", str(out)], env)
    assert proc.returncode != 0
    assert "no GPU visible to torch" in proc.stderr
    assert "torch.cuda.is_available() is False" in proc.stderr
    assert not out.exists()


def test_bench_linear_smoke(tmp_path):
    """bench/bench_linear.py runs on CPU (tiny shapes) and writes its JSON; not a measurement."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_linear

    argv = ["--smoke", "--out", str(tmp_path), "--live-fraction", "0.5"]
    assert bench_linear.main(argv) == 0
    result = json.loads((tmp_path / "linear-smoke.json").read_text())
    assert result["smoke"] is True and result["note"] == "smoke run, not a measurement"
    # the stack and the peers from package metadata, as every one-table JSON records them
    import importlib.metadata

    for key, dist in (("triton", "triton"), ("liger_kernel", "liger-kernel"), ("trl", "trl")):
        try:
            want = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            want = None
        assert result[key] == want, key
    impls = {row["impl"] for row in result["rows"]}
    assert {"fused", "fused+skip", "logits"} <= impls
    assert all(row["ms"] > 0 and row["gemm_tflops"] > 0 for row in result["rows"])


@needs_interpreter
def test_bench_sampling_smoke(tmp_path):
    """bench/bench_sampling.py runs on CPU (the select kernel interpreted) and writes its JSON,
    every filter setting's loss and the three selects timed; not a measurement."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_sampling

    assert bench_sampling.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "sampling-smoke.json").read_text())
    assert result["smoke"] is True and result["note"] == "smoke run, not a measurement"
    timed = {(row.get("filters"), row["impl"]) for row in result["rows"] if row["ms"] > 0}
    for name in bench_sampling.FILTERS:
        impls = ("loss:sampled", "select:kernel", "select:radix", "select:torch")
        assert {(name, impl) for impl in impls} <= timed
    assert (None, "loss:plain") in timed
    passes = {
        row["filters"]: row["kernel_row_reads"]
        for row in result["rows"]
        if row["impl"] == "select:kernel"
    }
    assert passes["min_p=0.05"] == 1  # gathered:
    assert passes["top_k=50,top_p=0.9"] == passes["top_p=0.9"] == 2
    radix = {
        row["filters"]: row["kernel_row_reads"]
        for row in result["rows"]
        if row["impl"] == "select:radix"
    }
    assert radix["top_k=50,top_p=0.9"] == 11 and radix["top_p=0.9"] == 9
    sampled = [row for row in result["rows"] if row["impl"] == "loss:sampled"]
    assert all(row["x_plain_loss"] > 0 for row in sampled)
    # The A/B's two selects give the same floors; the radix one swaps the rule back after.
    from fusedrl.kernels import sampling

    rule = sampling._gathers_candidates
    tensors = bench_sampling._inputs(4, 1031, torch.bfloat16, torch.device("cpu"), seed=0)
    mask = bench_sampling.SamplingMask(50, 0.9, None)
    cfg = fusedrl.LossConfig.preset("dapo")
    seen = []
    sampling._gathers_candidates = lambda *filters: seen.append(filters) or rule(*filters)
    try:
        gathered = bench_sampling.make_select("select:kernel", tensors, mask, cfg)()
        radix = bench_sampling.make_select("select:radix", tensors, mask, cfg)()
    finally:
        sampling._gathers_candidates = rule
    assert len(seen) == 1 and rule(*seen[0])  # the radix call did not ask the rule
    assert torch.equal(gathered, radix)


def test_bench_tp_smoke(tmp_path):
    """bench/bench_tp.py --smoke: 2 gloo processes on CPU, every op and impl at tp = 2 and 1,
    its JSON marked smoke. Not a measurement; what is checked is what the run counts and
    compares: the collectives of one call (fusedrl: the header and one all-gather; Megatron's
    log-probs: 3 all-reduces; verl's log-probs + entropy: 6) and that the eager baselines and
    the tp = 1 call agree with the fused tensor-parallel one."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_tp.py"), "--smoke", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stdout.splitlines()
    assert SMOKE_NOTE in lines[0] and lines[-1] == SMOKE_NOTE
    result = json.loads((tmp_path / "tp-smoke.json").read_text())
    assert result["smoke"] is True and result["note"] == SMOKE_NOTE and result["tp"] == [2]
    rows = {(r["op"], r["impl"], r["preset"], r["tp"]): r for r in result["rows"]}
    ops = [
        ("token_logprobs_fwd", None, "megatron-eager", 3),
        ("logp_entropy_fwd_bwd", None, "verl-eager", 6),
        ("policy_loss_fwd_bwd", "dapo", "megatron-eager", 3),
        ("policy_loss_fwd_bwd", "gspo", "megatron-eager", 3),
    ]
    assert len(rows) == len(result["rows"]) == 4 * len(ops)
    tokens = result["N"]
    for op, preset, eager, reduces in ops:
        fused = rows[(op, "fusedrl", preset, 2)]
        assert sum(fused["collectives"].values()) == 2, fused["collectives"]
        assert fused["comm_bytes_per_token"] == (len(FIELDS) * 8 + 3 * 4 * tokens) / tokens
        assert fused["V_rank"] == result["V"] // 2
        peer = rows[(op, eager, preset, 2)]
        assert peer["collectives"] == {"all_reduce": reduces}
        assert peer["comm_bytes_per_token"] == 4 * reduces
        for row in (peer, rows[(op, "fusedrl", preset, 1)], rows[(op, eager, preset, 1)]):
            diffs = {k: row[k] for k in row if k.endswith("_max_diff") and row[k] is not None}
            assert "logp_max_diff" in diffs, row
            assert all(d < 1e-4 for d in diffs.values()), (op, row["impl"], row["tp"], diffs)
        assert all(r["ms"] > 0 for r in (fused, peer))
    assert "grad_max_diff" in rows[("policy_loss_fwd_bwd", "megatron-eager", "gspo", 1)]


def test_bench_tp_skips_without_two_gpus(monkeypatch, capsys, tmp_path):
    bench_tp = _load("bench_tp")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench_tp.main(["--out", str(tmp_path)]) == 0
    assert "skipped: tensor parallelism needs 2 or more GPUs, found 1" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_run_gpu_sh_knows_the_tp_stage(tmp_path):
    """`tp` is a stage: without a GPU it is refused like the others (not an unknown stage)."""
    env = _fake_bin(tmp_path, 'echo "NVIDIA-SMI has failed" >&2; exit 9')
    proc = _run_gpu(["tp", str(tmp_path / "x")], env)
    assert proc.returncode == 3 and "refusing to run" in proc.stderr, proc.stderr
    assert "bash bench/run_gpu.sh tp" in _run_gpu(["--help"], env).stdout


def test_bench_distill_smoke(tmp_path):
    """bench/bench_distill.py runs on CPU (the two-row kernels interpreted, TRL's eager loss) and
    writes its JSON, every kind timed for each impl that runs here; not a measurement."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_distill

    assert bench_distill.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "distill-smoke.json").read_text())
    assert result["smoke"] is True and result["note"] == "smoke run, not a measurement"
    timed = {(row["kind"], row["impl"]) for row in result["rows"] if row.get("ms", 0) > 0}
    for kind in bench_distill.KINDS:
        assert {(kind, "fusedrl-triton"), (kind, "fusedrl-torch"), (kind, "trl-eager")} <= timed
    skipped = {row["impl"]: row["skipped"] for row in result["rows"] if "skipped" in row}
    assert skipped == {"trl-compile": "torch.compile is timed on the GPU only"}
    assert all(row["bytes_floor"] == 3 * 6 * 1031 * 2 for row in result["rows"] if "ms" in row)


def test_sweep_fused_smoke(tmp_path, monkeypatch):
    """bench/sweep_fused.py runs every launch shape on CPU (interpreted: the shapes only change
    GPU launches) and writes its JSON; and the shape it sets is undone after each one."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import sweep_fused

    from fusedrl.kernels import launch, token_loss

    def sizing():
        return (
            token_loss.persistent_programs,
            launch.MAX_WARPS,
            launch.MIN_CTAS_PER_SM,
            launch.BYTES_PER_THREAD,
        )

    before = sizing()
    assert sweep_fused.main(["--smoke", "--out", str(tmp_path)]) == 0
    assert sizing() == before
    result = json.loads((tmp_path / "sweep_fused-smoke.json").read_text())
    assert result["smoke"] is True and result["note"] == "smoke run, not a measurement"

    def shape(row):
        return row["programs_per_sm"], row["warps"], row["bytes_per_thread"]

    timed = {shape(row) for row in result["rows"] if row["ms"] > 0}
    plain = itertools.product(sweep_fused.PROGRAMS_PER_SM, sweep_fused.WARPS, [None])
    expected = {(None, None, None), *plain, *sweep_fused.WIDE_SHAPES, *sweep_fused.ROW_SHAPES}
    assert timed == expected and len(sweep_fused.WIDE_SHAPES) == 4
    rounds = [(row["round"], *shape(row)) for row in result["rows"]]
    assert sorted(rounds, key=str) == sorted(
        ((r, *shape) for r in range(sweep_fused.ROUNDS) for shape in expected), key=str
    )  # every shape timed once per round
    with sweep_fused.launch_shape(sweep_fused.ONE_ROW_EACH, 16):
        assert launch.MIN_CTAS_PER_SM == before[2]  # one program per row: the default's cap
        monkeypatch.setattr(launch, "_sms_and_l2", lambda index: (132, 50 * 2**20))
        cuda = torch.device("cuda", 0)
        assert token_loss.persistent_programs(16384, 303872, cuda, fit_l2=False) == 16384
    with sweep_fused.launch_shape(3, 8, 32):
        assert (launch.MAX_WARPS, launch.MIN_CTAS_PER_SM, launch.BYTES_PER_THREAD) == (8, 3, 32)
        assert launch.max_registers(8) == 65536 // (3 * 32 * 8)
        assert launch.block_size(151936, torch.device("cuda")) == 8 * 32 * 32 // 2


def test_host_overhead_smoke(tmp_path):
    """bench/host_overhead.py --smoke: fusedrl's presets and Liger's loss in one run, the
    kernels stubbed out; what it counts is exact (the ops tests/test_host_overhead.py budgets,
    no device-to-host sync but the CPU path's own checks), its times marked smoke."""
    host_overhead = _load("host_overhead")
    rows = host_overhead.main(["--smoke", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "host-overhead-cpu-smoke.json").read_text())
    assert result["smoke"] is True and result["note"] == SMOKE_NOTE
    by_impl = {row["impl"]: row for row in rows}
    assert {"fusedrl-triton dapo", "fusedrl-triton gspo", "liger triton_grpo_loss dapo"} <= set(
        by_impl
    )
    for row in rows:
        assert row["ops"]["launching"] > 0 and row["host_ms_min"] > 0, row
    dapo = by_impl["fusedrl-triton dapo"]
    # the fused kernel (it weighs the mask itself: token-mean), the one program that adds up its
    # sums: Triton launches called straight from the driver in eager mode (no custom op's
    # dispatch); grpo's seq-mean weights take one more launch
    assert dapo["ops"].get("custom", 0) == 0 and dapo["triton_launches"] == 2
    assert by_impl["fusedrl-triton grpo"]["triton_launches"] == 3
    assert by_impl["fusedrl-triton gspo"]["triton_launches"] == 5  # + the terms kernel, 2 passes
