# The two commands a user needs (see README.md):
#   make pretrain   set up .venv if missing, then run the main job (small BLOOM-style model on CPU)
#   make test       set up .venv if missing, then run the whole test suite
# Everything is installed by this file; nothing by hand.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

# Pinned where it matters (see ../shared/ARCHITECTURE.md: deepspeed 0.17.x / 0.18.0 break bf16 + ZeRO-1).
TORCH_VERSION     := 2.13.0
DEEPSPEED_VERSION := 0.19.8

.PHONY: venv pretrain test test-quick clean-venv

venv: $(STAMP)

# torch first (so nothing pulls a multi-GB CUDA build), then deepspeed without build isolation
# (its setup.py imports torch) and with no ops prebuilt, then the project with its test extras.
$(STAMP): setup.py requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet "pybind11>=2.12" numpy
	DS_BUILD_OPS=0 $(PIP) install --quiet --no-build-isolation deepspeed==$(DEEPSPEED_VERSION)
	$(PIP) install --quiet --no-build-isolation -e ".[test]"
	touch $(STAMP)

# The C++ data helpers are rebuilt in place whenever their source changes.
EXT := megatron/data/.helpers.built
$(EXT): megatron/data/helpers.cpp $(STAMP)
	$(PY) setup.py -q build_ext --inplace
	touch $(EXT)

pretrain: $(STAMP) $(EXT)
	PYTHON=$(PY) examples/pretrain_tiny_bloom_cpu.sh

test: $(STAMP) $(EXT)
	$(PY) -m pytest tests

test-quick: $(STAMP) $(EXT)
	$(PY) -m pytest tests -m "not multiprocess"

clean-venv:
	rm -rf $(VENV)
