#!/usr/bin/env bash
# The GPU validation of fusedrl (H100 / H200 / A100), in stages that each fit one 9-minute call:
#
#   bash bench/run_gpu.sh tests   [OUTDIR]  # tests/test_gpu.py: Triton backend, then CUDA backend
#   bash bench/run_gpu.sh bench   [OUTDIR]  # bench/bench_loss.py (BENCH_MATRIX=full|small), plot
#   bash bench/run_gpu.sh profile [OUTDIR]  # ncu DRAM bytes of the fused kernels -> ncu-<gpu>.json
#   bash bench/run_gpu.sh linear  [OUTDIR]  # bench/bench_linear.py: the LM-head loss, both designs
#   bash bench/run_gpu.sh steps   [OUTDIR]  # bench/bench_train_step.py, bench/bench_trl_step.py
#   bash bench/run_gpu.sh sampling [OUTDIR] # bench/bench_sampling.py: sampled-set select costs
#   bash bench/run_gpu.sh distill [OUTDIR]  # bench_distill.py + bench_loss.py's exact KL (2R + 1W)
#   bash bench/run_gpu.sh sweep   [OUTDIR]  # bench/sweep_fused.py: the fused kernel's launch shape
#   bash bench/run_gpu.sh tp      [OUTDIR]  # bench/bench_tp.py: vocab-sharded logits, 2+ GPUs
#   bash bench/run_gpu.sh all     [OUTDIR]  # the nine above (bench on the small matrix)
#   bash bench/run_gpu.sh session [OUTDIR]  # one call for a short lease: tests, then the rest
#
# `all` takes longer than one 9-minute call: on a machine lent call by call, run one stage per
# call. OUTDIR defaults to $OUT (the device tool's output folder), else bench/results.
#
# Each stage runs its steps under `timeout`, within STAGE_BUDGET seconds (default 510: setup
# included, so that a stage ends inside 9 minutes); a step that would start with under 20 s left
# is reported NOT RUN. A failed step does not stop the steps after it; the exit status is non-zero
# if any step failed, timed out or was not run (setup failing stops the stage at once). The last
# thing printed is a summary table: step, status, seconds, output file. Every step's output is
# tee'd into OUTDIR/<date>-<gpu>-<step>.log; the environment (nvidia-smi, torch / triton / CUDA /
# GPU versions, which optional packages import) goes to OUTDIR/<date>-<gpu>-env.txt.
#
# Setup: refuses without a GPU (`nvidia-smi -L` fails, or torch.cuda.is_available() is false);
# installs wheels carried in .whl/ into /tmp/site (PYTHONPATH; torch, triton and nvidia-* wheels
# are never installed over the machine's), then fusedrl itself, editable, without dependencies:
# the machine's torch (2.11) and Triton (3.6) are used as they are; no registry is needed.
# Wheels to carry in .whl/ (git-ignored) when the machine lacks them, downloaded where a registry
# is reachable: `bash bench/gpu_wheels.sh` fetches the peers below at their pins (about 3 MB):
#   - liger-kernel==0.8.5, the peer of bench/bench_loss.py (pure Python):
#       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux2014_x86_64 -d .whl liger-kernel==0.8.5
#   - trl and its dependencies (transformers, accelerate, datasets, ...) for
#     bench/bench_trl_step.py, transformers alone for bench/bench_train_step.py: the command above
#     with trl==1.16.0 (the version pyproject's dev extra pins) in place of liger-kernel and
#     without --no-deps, plus --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
#     for the compiled dependencies; then delete the torch, triton and nvidia-* wheels it pulls
#     (the script would not install them anyway: the machine keeps its own);
#   - matplotlib (+ deps) for the plot, pytest (+ pluggy, iniconfig) for `tests`, ninja for the
#     CUDA extension's JIT build, setuptools for the editable install, if the machine lacks them.
#     The env file says what imports and which of nvcc / ninja / ncu are on PATH.
#
# Environment: PYTHON (default python3), STAGE_BUDGET (seconds per stage), TEST_WORKERS (pytest
# processes of `tests`, default 4, with pytest-xdist), BENCH_MATRIX (full |
# small; `bench` defaults to full, `all` to small), BENCH_ARGS (extra bench_loss.py arguments,
# e.g. "--N 4096" to run the full matrix in slices), NCU (path of ncu), TP_ARGS (extra
# bench_tp.py arguments, e.g. "--tp 2").
#
# The full matrix may not fit in one stage: bench_loss.py rewrites its JSON after every case, so a
# run cut short by the budget keeps what it measured ("complete": false in the JSON).
set -euo pipefail

usage() {
  sed -n '4,14p' "$0" | sed 's/^# \{0,1\}//'
  echo "  (OUTDIR defaults to \$OUT, else bench/results; see the header of $0)"
}

STAGE=${1:-}
case "$STAGE" in
  tests | bench | profile | linear | steps | sampling | distill | sweep | tp | all | session) ;;
  -h | --help) usage; exit 0 ;;
  "") echo "run_gpu.sh: missing the stage" >&2; usage >&2; exit 2 ;;
  *) echo "run_gpu.sh: unknown stage '$STAGE'" >&2; usage >&2; exit 2 ;;
esac
if (($# > 2)); then
  echo "run_gpu.sh: too many arguments: $*" >&2
  usage >&2
  exit 2
fi
OUTDIR=${2:-${OUT:-bench/results}}
[[ $OUTDIR == /* ]] || OUTDIR=$PWD/$OUTDIR # relative to the caller, not to the repo root
PY=${PYTHON:-python3}
STAGE_BUDGET=${STAGE_BUDGET:-510}
cd "$(dirname "$0")/.."

# ------------------------------------------------------------------------------ no GPU: refuse
refuse() {
  echo "run_gpu.sh: refusing to run: $1" >&2
  echo "run_gpu.sh: this is the GPU validation (H100 / H200 / A100). Without a GPU, run" \
    "\`make test\` (the kernels through the Triton interpreter) or \`make bench-cpu\`" \
    "(a smoke run, not a measurement)." >&2
  exit 3
}
if ! smi=$(nvidia-smi -L 2>&1) || ! grep -q "^GPU " <<<"$smi"; then
  refuse "no GPU visible (nvidia-smi -L failed: $(head -c 300 <<<"${smi:-no output}"))"
fi
if ! cuda_check=$("$PY" -c 'import torch, sys
ok = torch.cuda.is_available()
print(f"torch {torch.__version__}, torch.cuda.is_available() is {ok}")
print("gpu:", torch.cuda.get_device_name()) if ok else None
sys.exit(0 if ok else 1)' 2>&1); then
  refuse "no GPU visible to torch ($PY: $(tail -n 1 <<<"$cuda_check"))"
fi
GPU_NAME=$(sed -n 's/^gpu: //p' <<<"$cuda_check" | tail -n 1)
SLUG=$(tr 'A-Z' 'a-z' <<<"$GPU_NAME" | sed 's/[^a-z0-9]\{1,\}/-/g; s/^-//; s/-$//')
PREFIX=$OUTDIR/$(date +%F)-$SLUG # every file this run writes starts so

# ------------------------------------------------------------------------------ steps, summary
SUMMARY=()  # "name<TAB>status<TAB>seconds<TAB>file"
FAILED=0
DEADLINE=0  # $SECONDS by which the current stage must end

record() {  # record NAME STATUS SECONDS FILE [failed]
  SUMMARY+=("$1"$'\t'"$2"$'\t'"$3"$'\t'"$4")
  if [[ ${5:-} == failed ]]; then FAILED=1; fi
}

summary() {
  local rc=$?
  if ((${#SUMMARY[@]})); then
    echo
    echo "==== run_gpu.sh $STAGE: summary (${GPU_NAME:-GPU ?}; outputs in $OUTDIR) ===="
    printf '%-26s %-34s %7s  %s\n' step status seconds output
    local row name status secs file
    for row in "${SUMMARY[@]}"; do
      IFS=$'\t' read -r name status secs file <<<"$row"
      printf '%-26s %-34s %7s  %s\n' "$name" "$status" "$secs" "${file#"$OUTDIR"/}"
    done
    if ((rc == 0 && FAILED)); then rc=1; fi
    if ((rc == 0)); then echo "run_gpu.sh $STAGE: all steps passed"; fi
    if ((rc != 0)); then echo "run_gpu.sh $STAGE: FAILED (exit status $rc)"; fi
  fi
  exit "$rc"
}
trap summary EXIT

# step NAME LIMIT_S LOG CMD...: run CMD under `timeout`, its stdout + stderr tee'd into LOG.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((DEADLINE - SECONDS - 10))
  if ((limit > left)); then limit=$left; fi
  if ((limit < 20)); then
    echo "=== $name: NOT RUN, the stage budget (${STAGE_BUDGET}s) is spent"
    record "$name" "NOT RUN (stage budget spent)" 0 "-" failed
    return 0
  fi
  echo "=== $name (limit ${limit}s): $* -> $log"
  local t0=$SECONDS rc
  set +e
  timeout -k 15 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  local secs=$((SECONDS - t0))
  case $rc in
    0) record "$name" ok "$secs" "$log" ;;
    124 | 137) record "$name" "TIMEOUT (limit ${limit}s)" "$secs" "$log" failed ;;
    *) record "$name" "FAILED (exit $rc)" "$secs" "$log" failed ;;
  esac
  return 0
}

last_ok() { [[ ${SUMMARY[-1]} == *$'\t'ok$'\t'* ]]; }

# skip_unless NAME MODULE...: record NAME as skipped (not a failure) unless every MODULE imports.
skip_unless() {
  local name=$1 missing=()
  shift
  local m
  for m in "$@"; do
    "$PY" -c "import $m" >/dev/null 2>&1 || missing+=("$m")
  done
  if ((${#missing[@]})); then
    echo "=== $name: SKIPPED, not importable: ${missing[*]} (carry the wheels in .whl/)"
    record "$name" "SKIPPED (no ${missing[*]})" 0 "-"
    return 1
  fi
}

start_stage() { DEADLINE=$((SECONDS + STAGE_BUDGET)); }

# ------------------------------------------------------------------------------ setup
start_stage
mkdir -p "$OUTDIR"
mapfile -t WHEELS < <(compgen -G ".whl/*.whl" || true)
if ((${#WHEELS[@]})); then
  KEEP=()
  for w in "${WHEELS[@]}"; do
    case ${w##*/} in
      torch-* | triton-* | nvidia_*) echo "run_gpu.sh: not installing $w over the machine's" ;;
      *) KEEP+=("$w") ;;
    esac
  done
  if ((${#KEEP[@]})); then
    step setup:wheels 180 "$PREFIX-setup_wheels.log" \
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "${KEEP[@]}"
    last_ok || exit 1
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/site/bin:$PATH # console scripts of the wheels (ninja)
fi
step setup:install 180 "$PREFIX-setup_install.log" \
  "$PY" -m pip install --no-deps --no-build-isolation -e .
last_ok || exit 1

nvidia-smi >"$PREFIX-nvidia-smi.txt" 2>&1 || true
step setup:env 60 "$PREFIX-env.txt" "$PY" - <<'EOF'
import datetime, importlib, os, platform, shutil, subprocess, sys
import torch

failed = False

print("date", datetime.datetime.now().isoformat(timespec="seconds"), "host", platform.node())
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn",
      torch.backends.cudnn.version())
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:
    print("triton: not importable:", exc)
try:
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"sm_{p.major}{p.minor}", "SMs", p.multi_processor_count,
          f"memory {p.total_memory / 2**30:.1f} GiB", "devices", torch.cuda.device_count())
except Exception as exc:
    failed = print("gpu: properties failed:", exc) or True
import importlib.metadata
for m, dist in (("fusedrl", "fusedrl"), ("liger_kernel", "liger-kernel"),
                ("transformers", "transformers"), ("trl", "trl"), ("datasets", "datasets"),
                ("accelerate", "accelerate"), ("matplotlib", "matplotlib"),
                ("pytest", "pytest"), ("numpy", "numpy")):
    try:
        mod = importlib.import_module(m)
        # the version from the package's metadata: liger_kernel has no __version__
        print(f"{m} {importlib.metadata.version(dist)} ({os.path.dirname(mod.__file__)})")
    except Exception as exc:
        print(f"{m}: not importable ({type(exc).__name__})")
for tool in ("nvcc", "ninja", "ncu"):
    print(tool, shutil.which(tool) or "not on PATH")
for cmd in (["git", "rev-parse", "HEAD"], ["git", "status", "--short"],
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
             "clocks.max.memory,power.limit", "--format=csv"]):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        print("$", " ".join(cmd), "\n" + (out.stdout or out.stderr).strip())
    except Exception as exc:
        print("$", " ".join(cmd), "failed:", exc)
sys.exit(1 if failed else 0)
EOF

# ------------------------------------------------------------------------------ stages
stage_tests() {
  # The Triton backend first (the CUDA extension's JIT build must not eat its time), then the
  # CUDA backend; no -x: every failure is reported, in one junit file per backend. With
  # pytest-xdist, TEST_WORKERS processes share the GPU (default 4), and a test that crashes its
  # process is reported as failed instead of ending the run.
  local workers=()
  if "$PY" -c "import xdist" >/dev/null 2>&1; then workers=(-n "${TEST_WORKERS:-4}"); fi
  step tests:triton 330 "$PREFIX-test_gpu-triton.log" \
    "$PY" -m pytest tests/test_gpu.py -k "not cuda" -q --durations=10 "${workers[@]}" \
    --junitxml "$PREFIX-test_gpu-triton.xml"
  step tests:cuda-build 240 "$PREFIX-cuda_build.log" \
    "$PY" -c "from fusedrl.kernels import cuda; cuda.load(verbose=True)"
  step tests:cuda 500 "$PREFIX-test_gpu-cuda.log" \
    "$PY" -m pytest tests/test_gpu.py -k cuda -q --durations=10 "${workers[@]}" \
    --junitxml "$PREFIX-test_gpu-cuda.xml"
}

stage_bench() {
  local matrix=${BENCH_MATRIX:-$1} left=$((DEADLINE - SECONDS - 60))
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
  step "bench:loss($matrix)" "$left" "$PREFIX-bench_loss.log" \
    "$PY" bench/bench_loss.py --matrix "$matrix" --out "$OUTDIR" ${BENCH_ARGS:-}
  skip_unless bench:plot matplotlib || return 0
  local results=()
  mapfile -t results < <(ls -t "$OUTDIR"/policy_loss_fwd_bwd-"$SLUG"-*.json 2>/dev/null || true)
  if ((${#results[@]} == 0)); then
    record bench:plot "NOT RUN (no results to plot)" 0 "-" failed
    return 0
  fi
  step bench:plot 60 "$PREFIX-plot.log" \
    "$PY" bench/plot_loss.py "${results[0]}" --out "$PREFIX-policy_loss_fwd_bwd.png"
}

stage_profile() {
  # $1: the calls to profile (default: all four of bench/profile_fused.py). Beside the DRAM
  # bytes, the warps' stall reasons and the achieved occupancy (the H200 run of 2026-11-28 put
  # the fused kernel's bytes at the floor and its DRAM throughput at 46 %: why it waits is the
  # next question); they stay in the .csv, the JSON keeps the bytes.
  local calls=${1:-"dapo dapo_split logprobs gspo"}
  local kernels="_fused_token_loss_kernel|_split_row_loss_kernel|_logprobs_fwd_kernel"
  kernels+="|_logits_grad_kernel"
  local metrics="dram__bytes_read.sum,dram__bytes_write.sum"
  metrics+=",dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum"
  local shape=(--N 16384 --V 151936 --dtype bfloat16 --manifest "$PREFIX-ncu-manifest.json")
  local ncu=${NCU:-$(command -v ncu || true)}
  if [[ -z $ncu ]]; then
    ncu=$(compgen -G "/usr/local/cuda*/bin/ncu" | head -n 1 || true)
  fi
  if [[ -z $ncu ]]; then
    ncu=$(compgen -G "/opt/nvidia/nsight-compute/*/ncu" | sort | tail -n 1 || true)
  fi
  if [[ -z $ncu || ! -x $ncu ]]; then
    echo "=== profile:ncu: FAILED, ncu (Nsight Compute) not found: set NCU=/path/to/ncu"
    record profile:ncu "FAILED (ncu not found)" 0 "-" failed
    # The driver still runs once on the GPU, so that it is checked there.
    step profile:driver 240 "$PREFIX-profile_driver.log" \
      "$PY" bench/profile_fused.py "${shape[@]}"
    return 0
  fi
  local csvs=() call
  for call in $calls; do
    step "profile:ncu-$call" 200 "$PREFIX-ncu-$call.log" \
      "$ncu" --target-processes all --profile-from-start off --kernel-name "regex:$kernels" \
      --launch-count 4 --metrics "$metrics" --section WarpStateStats --section Occupancy \
      -f -o "$PREFIX-ncu-$call" \
      "$PY" bench/profile_fused.py --calls "$call" "${shape[@]}"
    step "profile:csv-$call" 60 "$PREFIX-ncu-$call.csv" \
      "$ncu" -i "$PREFIX-ncu-$call.ncu-rep" --csv --page details --print-units base
    csvs+=("$call=$PREFIX-ncu-$call.csv")
  done
  step profile:parse 60 "$PREFIX-ncu-parse.log" \
    "$PY" bench/profile_fused.py parse --manifest "$PREFIX-ncu-manifest.json" \
    --csv "${csvs[@]}" --out "$OUTDIR/ncu-$SLUG.json"
}

stage_linear() {
  # The issue's grid (N x H x V, 8 shapes) against materialised logits and Liger's chunked loss,
  # then what skipping the masked rows saves at one shape with 40 % padding (fused+skip).
  step linear:bench "$((DEADLINE - SECONDS - 90))" "$PREFIX-bench_linear.log" \
    "$PY" bench/bench_linear.py --out "$OUTDIR"
  step linear:skip "$((DEADLINE - SECONDS - 10))" "$PREFIX-bench_linear-skip.log" \
    "$PY" bench/bench_linear.py --N 16384 --H 4096 --V 151936 --live-fraction 0.6 --out "$OUTDIR"
}

stage_sampling() {
  # The on-chip select of the sampled sets against the torch route and the plain fused loss.
  step sampling:bench "$((DEADLINE - SECONDS - 10))" "$PREFIX-bench_sampling.log" \
    "$PY" bench/bench_sampling.py --out "$OUTDIR"
}

stage_distill() {
  # distill_loss (the two-row kernels, the torch backend) against TRL's GKD loss, eager and
  # compiled, at the 2R + 1W floor.
  step distill:bench "$((DEADLINE - SECONDS - 130))" "$PREFIX-bench_distill.log" \
    "$PY" bench/bench_distill.py --out "$OUTDIR"
  # The exact KL to the reference in the policy loss (kl="full"), at its 2R + 1W floor, against
  # eager (both log-softmaxes in fp32) and torch.compile of the oracle.
  step distill:full_kl "$((DEADLINE - SECONDS - 70))" "$PREFIX-bench_loss-full_kl.log" \
    "$PY" bench/bench_loss.py --presets full_kl --N 16384 --V 151936 \
    --ops policy_loss_fwd_bwd --tag full_kl --out "$OUTDIR"
  # The soft cap inside the row kernels (policy_loss(softcap=30), Gemma's) beside plain DAPO in
  # one run: what its tanh per element costs against the 1R + 1W floor.
  step distill:softcap "$((DEADLINE - SECONDS - 10))" "$PREFIX-bench_loss-softcap.log" \
    "$PY" bench/bench_loss.py --presets dapo softcap --N 16384 --V 151936 \
    --impls fusedrl-triton fusedrl-triton-inplace torch-eager --ops policy_loss_fwd_bwd \
    --tag softcap --out "$OUTDIR"
}

stage_sweep() {
  # The fused token-level kernel, unchanged, under other launch shapes (programs per SM x warps):
  # which one closes the gap to the 1R + 1W floor (docs/benchmarks.md).
  step sweep:fused "$((DEADLINE - SECONDS - 10))" "$PREFIX-sweep_fused.log" \
    "$PY" bench/sweep_fused.py --out "$OUTDIR"
}

stage_steps() {
  if skip_unless steps:train_step transformers; then
    step steps:train_step 270 "$PREFIX-bench_train_step.log" \
      "$PY" bench/bench_train_step.py --out "$OUTDIR"
  fi
  if skip_unless steps:trl_step trl datasets transformers; then
    step steps:trl_step 400 "$PREFIX-bench_trl_step.log" \
      "$PY" bench/bench_trl_step.py --out "$OUTDIR"
  fi
  # The trainer itself on the GPU: the default job in bf16 with the Triton loss, rollouts by vLLM
  # where it is installed, else transformers' generate (--rollout auto). The run directory (model
  # weights, checkpoints) stays out of OUTDIR: only its metrics come back.
  if skip_unless steps:trainer transformers; then
    rm -rf /tmp/fusedrl-trainer-run
    step steps:trainer 240 "$PREFIX-trainer.log" \
      "$PY" -m fusedrl.trainer --out /tmp/fusedrl-trainer-run --max-steps 8 --save-every 4 \
      --dtype bfloat16 --backend triton --rollout auto --progress false --tensorboard false
    cp /tmp/fusedrl-trainer-run/metrics.jsonl "$PREFIX-trainer-metrics.jsonl" 2>/dev/null || true
  fi
}

stage_tp() {
  # The loss on vocab-sharded logits, one process per GPU over NCCL (tp = 2, 4, 8 up to the GPUs
  # there are), against Megatron's / verl's eager all-reduces and against tp = 1. One GPU: the
  # stage says so and is skipped (not a failure); bench_tp.py would say the same.
  local gpus
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if ((gpus < 2)); then
    echo "=== tp:bench: SKIPPED, tensor parallelism needs 2 or more GPUs; this machine has $gpus"
    record tp:bench "SKIPPED (needs 2+ GPUs, found $gpus)" 0 "-"
    return 0
  fi
  # shellcheck disable=SC2086  # TP_ARGS is a list of arguments
  step tp:bench "$((DEADLINE - SECONDS - 10))" "$PREFIX-bench_tp.log" \
    "$PY" bench/bench_tp.py --out "$OUTDIR" ${TP_ARGS:-}
}

stage_session() {
  # A lease of 15 device-minutes, 1-2 of them to start the machine, affords one full call: the
  # GPU tests first (both backends, ~3 minutes), then what the time left allows, the most
  # telling first: the loss at host-bound and memory-bound shapes against its peers (the
  # H200 run of 2026-11-28 cut this matrix at V = 262144: the split-row kernel, slower at every
  # shape there, is left out of it), the fused kernel's launch shapes (two rounds, with the
  # wider per-thread tiles), the host-bound shape's GPU time (CUDA-graph replays), the fused
  # kernel's DRAM bytes (ncu), the loss over a sampled set (top_k 50 + top_p 0.9, read through
  # the select's floors), the gradient-accumulation row. (Measured on 2026-11-28 and left
  # to their stages: the split-row kernel's bytes, the exact KL: `profile`, `distill`.)
  stage_tests
  step session:bench "$((DEADLINE - SECONDS - 170))" "$PREFIX-bench_loss-session.log" \
    "$PY" bench/bench_loss.py --N 4096 16384 --V 32000 151936 262144 --presets dapo \
    --impls fusedrl-triton fusedrl-cuda liger torch-compile \
    --ops policy_loss_fwd_bwd --warmup-ms 50 --rep-ms 200 --tag session --out "$OUTDIR"
  step session:sweep "$((DEADLINE - SECONDS - 80))" "$PREFIX-sweep_fused.log" \
    "$PY" bench/sweep_fused.py --out "$OUTDIR"
  step session:graph "$((DEADLINE - SECONDS - 50))" "$PREFIX-bench_loss-graph.log" \
    "$PY" bench/bench_loss.py --N 4096 --V 32000 --presets dapo \
    --impls fusedrl-triton fusedrl-cuda liger torch-compile --ops policy_loss_fwd_bwd \
    --cuda-graph --warmup-ms 50 --rep-ms 200 --tag graph --out "$OUTDIR"
  stage_profile "dapo"
  step session:sampling "$((DEADLINE - SECONDS - 40))" "$PREFIX-bench_sampling-session.log" \
    "$PY" bench/bench_sampling.py --V 151936 --filters top_k=50,top_p=0.9 top_p=0.9 \
    --impls loss:sampled select:kernel select:radix --warmup-ms 50 --rep-ms 200 --out "$OUTDIR"
  step session:grad_scale "$((DEADLINE - SECONDS - 10))" "$PREFIX-bench_loss-grad_scale.log" \
    "$PY" bench/bench_loss.py --N 16384 --V 151936 --presets accum4 accum4_rescaled \
    --impls fusedrl-triton fusedrl-cuda liger --ops policy_loss_fwd_bwd \
    --warmup-ms 50 --rep-ms 200 --tag grad_scale --out "$OUTDIR"
}

case "$STAGE" in
  session) stage_session ;;
  tests) stage_tests ;;
  bench) stage_bench full ;;
  profile) stage_profile ;;
  linear) stage_linear ;;
  steps) stage_steps ;;
  sampling) stage_sampling ;;
  distill) stage_distill ;;
  sweep) stage_sweep ;;
  tp) stage_tp ;;
  all)
    stage_tests
    start_stage
    stage_bench small
    start_stage
    stage_profile
    start_stage
    stage_linear
    start_stage
    stage_steps
    start_stage
    stage_sampling
    start_stage
    stage_distill
    start_stage
    stage_sweep
    start_stage
    stage_tp
    ;;
esac
