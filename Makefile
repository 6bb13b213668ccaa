# carve developer entry points. `make test` and `make demo` are the two commands a newcomer needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
PRODUCT := driver process kubeletplugin controller carvecli

.PHONY: test lint typecheck demo demo-down venv clean k8s-bin node-bin cluster-up cluster-down
.PHONY: test-lanes test-serial test-unit test-cluster test-e2e test-realnode

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache --no-logo

typecheck: venv
	$(BIN)/mypy $(PRODUCT)

# The tests as lanes (tests/support/lanes.py: what each holds, and its time budget). Each
# target runs one lane with what it needs built; `make test` runs all four side by side.
# Extra pytest arguments: `make test-e2e PYTEST_ARGS='-x -k churn'`.
LANES = $(BIN)/python -m tests.support.lanes
test-unit: venv k8s-bin helm-bin
	$(LANES) unit -- $(PYTEST_ARGS)

test-cluster: venv k8s-bin helm-bin kueue-bin image-prerequisites
	$(LANES) cluster -- $(PYTEST_ARGS)

test-e2e: venv k8s-bin
	$(LANES) e2e -- $(PYTEST_ARGS)

test-realnode: venv k8s-bin node-bin helm-bin image-prerequisites
	$(LANES) realnode -- $(PYTEST_ARGS)

test-lanes: venv
	$(LANES) -- $(PYTEST_ARGS)

# Every test, one after the other in one pytest (what `make test` ran before the lanes).
test-serial: venv
	$(BIN)/pytest -q $(PYTEST_ARGS)

# Kubernetes v1.37.2 control plane (etcd, kube-apiserver, kube-scheduler,
# kube-controller-manager) built from the Go module proxy into ~/.cache/carve (cold: ~6 min
# on 2 cores; then instant). Without Go, the suites that need it are skipped, and say so.
k8s-bin:
	@if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then \
		PATH="$$PATH:/usr/local/go/bin" bash hack/k8s/build.sh >/dev/null; \
	else \
		echo "k8s-bin: no Go toolchain - tests that need the control plane will be SKIPPED"; \
	fi

# A real node's containerd v2.4.2 (+ runc shim, ctr) and carve's pause program, built into
# ~/.cache/carve/node (cold: ~1.5 min on 2 cores; then instant), plus runc, the CNI plugins
# and busybox from Debian (installed when missing; needs root). Exit status 2 from the script
# means a prerequisite is missing: the real-node tests will be SKIPPED, and it says so.
node-bin:
	@if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then \
		rc=0; PATH="$$PATH:/usr/local/go/bin" bash hack/node/build.sh >/dev/null || rc=$$?; \
		if [ $$rc -eq 2 ]; then \
			echo "node-bin: prerequisites missing (see above) - real-node tests will be SKIPPED"; \
		elif [ $$rc -ne 0 ]; then exit $$rc; fi; \
	else \
		echo "node-bin: no Go toolchain - real-node tests will be SKIPPED"; \
	fi

# helm v4.3.1 built from the Go module proxy into ~/.cache/carve/helm (cold: ~6 min on 2 cores;
# then instant), for the chart tests (tests/deploy) and hack/render_manifests.py. Without Go,
# the chart tests are skipped, and say so.
.PHONY: helm-bin
helm-bin:
	@if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then \
		PATH="$$PATH:/usr/local/go/bin" bash hack/helm/build.sh >/dev/null; \
	else \
		echo "helm-bin: no Go toolchain - the Helm chart tests will be SKIPPED"; \
	fi

# Kueue v0.17.0's controller manager built from the Go module proxy into ~/.cache/carve/kueue
# (with the CRDs and webhook manifests of the same module version), for the Kueue suite
# (tests/controller/cluster/test_kueue_cluster.py). Without Go that suite is skipped, and says so.
.PHONY: kueue-bin
kueue-bin:
	@if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then \
		PATH="$$PATH:/usr/local/go/bin" bash hack/kueue/build.sh >/dev/null; \
	else \
		echo "kueue-bin: no Go toolchain - the Kueue tests will be SKIPPED"; \
	fi

# carve's image as an OCI archive, built without a registry (deploy/image/build.py; the
# Debian base layer is cached in ~/.cache/carve/image: cold ~1.5 min, then ~35 s).
# image-prerequisites installs mmdebstrap when missing (root); without it the in-cluster test
# is SKIPPED, and says so.
.PHONY: image image-prerequisites
image-prerequisites:
	@rc=0; bash hack/image/prerequisites.sh || rc=$$?; \
	if [ $$rc -eq 2 ]; then echo "image-prerequisites: no mmdebstrap - the in-cluster test will be SKIPPED"; \
	elif [ $$rc -ne 0 ]; then exit $$rc; fi

image: venv image-prerequisites
	$(BIN)/python deploy/image/build.py

# A detached local cluster for manual work: `eval "$$(.venv/bin/python -m devcluster env)"`.
cluster-up: venv k8s-bin
	$(BIN)/python -m devcluster up

cluster-down: venv
	$(BIN)/python -m devcluster down

# The one test command: lint, strict typing of the product packages, then every test suite
# (the four lanes, side by side).
test: lint typecheck k8s-bin node-bin helm-bin kueue-bin image-prerequisites test-lanes

# carve on a local v1.37 cluster with three GPU nodes, running deploy/examples/; it keeps
# running for kubectl until `make demo-down`. NODES=auto runs real nodes (containerd + kubelet)
# where this machine can (Linux, root, node-bin), else simulated ones; NODES=real|sim forces.
# (`carve demo`: one node, NVML only.)
NODES ?= auto
demo: venv k8s-bin node-bin
	$(BIN)/python -m nodesim demo --nodes $(NODES)

demo-down: venv
	$(BIN)/python -m nodesim down

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
