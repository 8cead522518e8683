#!/usr/bin/env bash
# `make test-install`: fusedrl built and installed as a user gets it, then used from outside the
# checkout. No GPU needed.
#
# 1. `python -m build`: the sdist, then the wheel built from the sdist (an isolated build, as pip
#    does for a user), into a temporary folder.
# 2. A fresh venv with torch alone (TORCH_SPEC; on a CPU machine `torch==2.13.0` takes the local
#    CPU wheel), then the wheel with its own dependencies: `pip install fusedrl` as a user runs it.
# 3. From a temporary directory, with nothing of the checkout on the path: import fusedrl (from the
#    venv, at the wheel's version), policy_loss (torch backend) and linear_policy_loss against the
#    oracle, the CUDA sources found by the loader inside the installed package (no GPU needed),
#    and `fusedrl-train --help` telling the user which extra it needs.
# 4. Triton: a CPU torch brings none (a Linux CUDA torch does), so the smoke installs TRITON_SPEC
#    (default: the newest supported, the main venv's) and compiles each kernel's base
#    configuration for one arch: `python -m fusedrl.kernels.aot --quick --arch ARCH`.
# 5. `pip install 'fusedrl[train]'` (the wheel's extra): `fusedrl-train --help` runs, and torch is
#    still the one installed first (the extra pulls no torch and no vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}                  # makes the fresh venv
BUILD_PY=${BUILD_PY:-$ROOT/.venv/bin/python}  # has `build` (the dev extra)
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TRITON_SPEC=${TRITON_SPEC:-triton==3.9.0}
ARCH=${ARCH:-90}
# The venv is about 2.3 GB of small files (torch, triton, transformers, ...): in memory (/dev/shm,
# where it has 4 GiB free) it installs and is deleted in seconds; on a busy disk, deleting it alone
# took 81 s here. SMOKE_TMP picks the folder.
if [[ -z "${SMOKE_TMP:-}" ]]; then
    SMOKE_TMP=${TMPDIR:-/tmp}
    if [[ -d /dev/shm && -w /dev/shm ]] \
        && (( $(df -Pk /dev/shm | awk 'NR==2 {print $4}') > 4 * 1024 * 1024 )); then
        SMOKE_TMP=/dev/shm
    fi
fi
WORK=$(mktemp -d "$SMOKE_TMP/fusedrl-install.XXXXXX")
# KEEP=1 keeps the folder (its path is printed) to look at what was built and installed.
if [[ "${KEEP:-0}" == 1 ]]; then echo "test-install: working in $WORK (kept)"; else
    trap 'rm -rf "$WORK"' EXIT; fi
step() { printf '\n== test-install: %s (%ds)\n' "$1" "$SECONDS"; }

step "build the sdist and the wheel"
"$BUILD_PY" -m build --outdir "$WORK/dist" "$ROOT" >"$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log"; exit 1; }
SDIST=$(ls "$WORK"/dist/fusedrl-*.tar.gz)
WHEEL=$(ls "$WORK"/dist/fusedrl-*.whl)
echo "built $(basename "$SDIST") $(basename "$WHEEL")"

step "a fresh venv: $TORCH_SPEC, then the wheel and its own dependencies"
"$PYTHON" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
"$VPY" -m pip install -q "$TORCH_SPEC"
"$VPY" -m pip install -q "$WHEEL"
TORCH_BEFORE=$("$VPY" -c "import torch; print(torch.__version__)")
"$VPY" -m pip list --format=freeze | tr '\n' ' '; echo

mkdir "$WORK/run"
cd "$WORK/run"  # outside the checkout: nothing of it can be imported from here
unset PYTHONPATH TRITON_INTERPRET

step "import fusedrl, the losses, the CUDA sources"
"$VPY" - "$WORK/venv" <<'EOF'
import importlib.metadata
import sys
from pathlib import Path

import torch

import fusedrl
from fusedrl.kernels import cuda

venv = Path(sys.argv[1]).resolve()
package = Path(fusedrl.__file__).resolve().parent
assert venv in package.parents, f"fusedrl imported from {package}, not from the venv {venv}"
assert fusedrl.__version__ == importlib.metadata.version("fusedrl"), fusedrl.__version__

B, T, V, H = 4, 16, 1031, 32
gen = torch.Generator().manual_seed(0)
logits = torch.randn(B, T, V, generator=gen, requires_grad=True)
labels = torch.randint(0, V, (B, T), generator=gen)
mask = torch.ones(B, T, dtype=torch.bool)
adv = fusedrl.advantages.grpo(torch.tensor([1.0, 0.0, 1.0, 0.5]), group_size=4)
old_logp = fusedrl.token_logprobs(logits.detach(), labels)[0]
old_logp = old_logp + 0.1 * torch.randn(B, T, generator=gen)  # ratios off 1: a loss that moves
config = fusedrl.LossConfig.preset("dapo")
out = fusedrl.policy_loss(logits, labels, adv, mask, old_logp, config=config, backend="torch")
out.loss.backward()
ref_logits = logits.detach().clone().requires_grad_(True)
ref = fusedrl.reference.policy_loss(ref_logits, labels, adv, mask, old_logp, config=config)
ref.loss.backward()
torch.testing.assert_close(out.loss, ref.loss)
torch.testing.assert_close(logits.grad, ref_logits.grad)
print(f"policy_loss (torch backend): loss {out.loss.item():.6f}, equal to the oracle's")

hidden = torch.randn(B, T, H, generator=gen, requires_grad=True)
weight = torch.randn(V, H, generator=gen, requires_grad=True)
lin = fusedrl.linear_policy_loss(hidden, weight, labels, adv, mask, old_logp, config=config)
lin.loss.backward()
full = fusedrl.reference.policy_loss(hidden.detach() @ weight.detach().T, labels, adv, mask,
                                     old_logp, config=config)
torch.testing.assert_close(lin.loss.detach(), full.loss, rtol=1e-4, atol=1e-5)
assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
print(f"linear_policy_loss: loss {lin.loss.item():.6f}, equal to the oracle's on the logits")

sources = cuda.sources()
names = sorted(p.name for p in sources)
assert cuda.CSRC == package / "csrc", f"the loader looks in {cuda.CSRC}, not in the package"
assert names == ["bindings.cpp", "fused_loss.cu"], names
assert all(p.is_file() for p in sources) and (cuda.CSRC / "fused_loss.h").is_file()
print(f"CUDA sources found by the loader in {cuda.CSRC}: {names} + fused_loss.h")
EOF

step "fusedrl-train --help without the [train] extra"
set +e
"$WORK/venv/bin/fusedrl-train" --help >"$WORK/train-help.txt" 2>&1
status=$?
set -e
cat "$WORK/train-help.txt"
if [[ $status -ne 2 ]] || ! grep -q "fusedrl\[train\]" "$WORK/train-help.txt"; then
    echo "test-install: expected exit 2 naming fusedrl[train], got $status"; exit 1
fi

step "python -m fusedrl.kernels.aot --quick --arch $ARCH (with $TRITON_SPEC)"
if "$VPY" -c "import triton" 2>/dev/null; then
    echo "triton $("$VPY" -c 'import triton; print(triton.__version__)') came with torch"
else
    "$VPY" -m pip install -q "$TRITON_SPEC"
fi
"$VPY" -m fusedrl.kernels.aot --quick --arch "$ARCH" 2>&1 | grep -v "FP_FUSION"

step "pip install 'fusedrl[train]', fusedrl-train --help"
"$VPY" -m pip install -q "$WHEEL[train]"
"$WORK/venv/bin/fusedrl-train" --help | head -3
TORCH_AFTER=$("$VPY" -c "import torch; print(torch.__version__)")
if [[ "$TORCH_AFTER" != "$TORCH_BEFORE" ]]; then
    echo "test-install: [train] replaced torch $TORCH_BEFORE with $TORCH_AFTER"; exit 1
fi
if "$VPY" -c "import vllm" 2>/dev/null; then
    echo "test-install: [train] installed vLLM"; exit 1
fi

step "passed"
