#!/usr/bin/env bash
# TRL's own tests/test_grpo_trainer.py with GRPOTrainer, then with FusedGRPOTrainer, offline on
# the CPU, and the tests whose outcomes differ (README.md). Usage: run.sh TRL_CHECKOUT [pytest args]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
TRL_CHECKOUT="$(cd "${1:?usage: run.sh TRL_CHECKOUT [pytest args]}" && pwd)"
shift
PY="${PY:-$ROOT/.venv/bin/python}"
WORK="$(mktemp -d)"
export HF_HOME="${HF_HOME:-/tmp/fusedrl-trl-hub}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TRL_EXPERIMENTAL_SILENCE=1 PYTHONPATH="$WORK:$HERE"
"$PY" "$HERE/build_hub.py" "$HF_HOME"
# The test package (tests/__init__.py, testing_utils.py, conftest.py) as the checkout has it.
cp -r "$TRL_CHECKOUT/tests" "$WORK/tests"
cd "$WORK"
for fused in 0 1; do
  FUSED=$fused "$PY" -m pytest tests/test_grpo_trainer.py -p plugin -p no:cacheprovider -q \
    -n "${WORKERS:-2}" -k "${SELECT:-not VLM and not vlm}" --junitxml="$WORK/fused$fused.xml" "$@" \
    > "$WORK/fused$fused.log" 2>&1 || true
  tail -n 1 "$WORK/fused$fused.log"
done
"$PY" "$HERE/compare.py" "$WORK/fused0.xml" "$WORK/fused1.xml"
