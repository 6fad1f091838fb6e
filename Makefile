# The two commands a user needs (see README.md):
#   make pretrain   set up .venv if missing, then run the main job (small BLOOM-style model on CPU)
#   make test       set up .venv if missing, then run the whole test suite
# Everything is installed by this file; nothing by hand.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

# Pinned where it matters: deepspeed 0.17.x / 0.18.0 break bf16 + ZeRO-1.
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

# transformers' own converter for Megatron-DeepSpeed BLOOM checkpoints ships in transformers 4.x wheels only
# (dropped in 5.x); the tests run it on our checkpoints. Only that one file is taken out of the 4.46.3
# wheel (from PyPI, no install); where it cannot be fetched, its test skips and says why.
BLOOM_CONVERTER := $(VENV)/external/convert_bloom_original_checkpoint_to_pytorch.py
$(BLOOM_CONVERTER): $(STAMP)
	mkdir -p $(VENV)/external/wheel
	$(PIP) download --quiet --no-deps -d $(VENV)/external/wheel transformers==4.46.3 && \
	  $(PY) -c "import glob, sys, zipfile; z = zipfile.ZipFile(glob.glob(sys.argv[1])[0]); \
	    open(sys.argv[2], 'wb').write(z.read('transformers/models/bloom/' + sys.argv[2].rsplit('/', 1)[1]))" \
	    '$(VENV)/external/wheel/transformers-4.46.3-*.whl' $@ \
	  || echo "could not fetch transformers 4.46.3's BLOOM converter: tests/inference/test_trained_parity.py skips it"

pretrain: $(STAMP) $(EXT)
	PYTHON=$(PY) examples/pretrain_tiny_bloom_cpu.sh

# The linter first (a second, pyproject.toml's settings), then the suite; its 25 slowest tests are listed last.
# Two pytest-xdist workers, each taking a whole test module at a time (--dist loadfile: a module's fixtures
# are built once): on 2 cores one worker's multi-process run leaves the other core idle much of the time (a
# pipeline stage waits for its neighbour, a launcher starts its ranks), and the other worker's tests use it.
# The modules go out longest first (tests/conftest.py, from tests/module_seconds.json), not in xdist's order.
# TEST_ARGS: more pytest arguments (.ci/run's second pass leaves out the modules that test processes, not numbers).
TEST_WORKERS ?= 2
TEST_ARGS ?=
test: $(STAMP) $(EXT) $(BLOOM_CONVERTER)
	$(PY) -m ruff check .
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(TEST_ARGS)

test-quick: $(STAMP) $(EXT)
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not multiprocess"

clean-venv:
	rm -rf $(VENV)
