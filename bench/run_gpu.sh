#!/usr/bin/env bash
# Everything a GPU session runs, in one command (a lent machine starts bare):
#   bash bench/run_gpu.sh            # results under $OUT (device tool) or bench/results
# 1. installs fusedrl editable without touching the machine's torch/triton, plus liger-kernel
#    from .whl/ when carried (the peer of the benchmark; see docs/benchmarks.md);
# 2. the GPU test suite (real vocab sizes, 131k rows, inplace memory, no host sync,
#    torch.compile with inductor) and the backend suite on CUDA tensors;
# 3. bench/bench_loss.py on the full matrix, bench/bench_trl_step.py (needs trl + datasets:
#    carry their wheels in .whl/ too), bench/bench_train_step.py, then the plot.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest tests/test_gpu.py -q -x 2>&1 | tee "$OUT/gpu-tests.txt" | tail -5
python3 bench/bench_loss.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-loss.txt"
python3 bench/bench_trl_step.py --out "$OUT" 2>&1 | tee "$OUT/bench-trl-step.txt" | tail -3
python3 bench/bench_train_step.py --out "$OUT" 2>&1 | tee "$OUT/bench-train-step.txt" | tail -4
python3 bench/plot_loss.py "$OUT"/policy_loss_fwd_bwd-*.json --out "$OUT/policy_loss_fwd_bwd.png" \
  2>&1 | tail -1
