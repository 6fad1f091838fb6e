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

pretrain: $(STAMP)
	$(PY) -m megatron.quickstart

test: $(STAMP)
	$(PY) -m pytest tests

test-quick: $(STAMP)
	$(PY) -m pytest tests -m "not multiprocess"

clean-venv:
	rm -rf $(VENV)
