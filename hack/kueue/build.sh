#!/usr/bin/env bash
# Build Kueue's controller manager (sigs.k8s.io/kueue/cmd/kueue, named in go.mod's tool block)
# from the Go module proxy into a cache outside the repository, for the Kueue suite
# (tests/controller/cluster/test_kueue_cluster.py), and copy next to it the manifests that the
# suite installs from the same module version: the CRDs (config/components/crd, bases and the
# conversion-webhook patches) and the webhook configurations (config/components/webhook).
#
#   hack/kueue/build.sh            build if needed, then print the version directory on stdout
#   hack/kueue/build.sh --check    exit 0 if the cache is complete and current, 1 otherwise
#
# Exit status 2: no Go toolchain. Layout: ~/.cache/carve/kueue/<version>/bin/kueue and
# .../config/{crd/bases,crd/patches,webhook}/*.yaml. The cache is keyed by a hash of this
# module's inputs, so a second run returns at once. Progress goes to stderr.
set -euo pipefail

KUEUE_VERSION=v0.17.0
KUEUE_PKG=sigs.k8s.io/kueue
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${CARVE_CACHE:-${HOME}/.cache/carve}"
VERSION_DIR="${CACHE_ROOT}/kueue/${KUEUE_VERSION}"
BIN_DIR="${VERSION_DIR}/bin"
STAMP="${BIN_DIR}/.inputs"

log() { printf '[kueue-build] %s\n' "$*" >&2; }

fmt_secs() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

inputs_hash() {
    # Everything that changes what gets built: module graph, flags, toolchain.
    (
        cd "$HERE"
        cat go.mod go.sum build.sh
        go env GOVERSION GOOS GOARCH
    ) | sha256sum | cut -c1-16
}

cache_is_current() {
    [[ -f "$STAMP" ]] || return 1
    [[ "$(cat "$STAMP")" == "$(inputs_hash)" ]] || return 1
    [[ -x "${BIN_DIR}/kueue" ]] || return 1
    [[ -f "${VERSION_DIR}/config/crd/bases/kueue.x-k8s.io_workloads.yaml" ]] || return 1
    [[ -f "${VERSION_DIR}/config/webhook/manifests.yaml" ]]
}

if ! command -v go >/dev/null 2>&1; then
    if [[ -x /usr/local/go/bin/go ]]; then
        export PATH="/usr/local/go/bin:${PATH}"
    else
        log "Go toolchain not found (need go >= 1.26 on PATH or in /usr/local/go)"
        exit 2
    fi
fi

if [[ "${1:-}" == "--check" ]]; then
    cache_is_current
    exit $?
fi

if cache_is_current; then
    log "up to date: ${VERSION_DIR}"
    echo "$VERSION_DIR"
    exit 0
fi

# The version pinned in go.mod must be the one this script says it builds.
pinned="$(cd "$HERE" && go list -m -f '{{.Version}}' "$KUEUE_PKG")"
if [[ "$pinned" != "$KUEUE_VERSION" ]]; then
    log "go.mod pins ${KUEUE_PKG} ${pinned}, build.sh says ${KUEUE_VERSION}: make them agree"
    exit 1
fi

# -mod=mod resolves the graph from go.mod/go.sum without a vendor directory; GOPATH and
# GOCACHE keep their defaults, outside the repository. Static, with the version stamp that
# upstream's Makefile sets, so the manager logs which Kueue it is.
export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0
vpkg="${KUEUE_PKG}/pkg/version"
ldflags="-s -w -X ${vpkg}.GitVersion=${KUEUE_VERSION} -X ${vpkg}.BuildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"

mkdir -p "$BIN_DIR"
staging="$(mktemp -d "${BIN_DIR}/.staging.XXXXXX")"
trap 'rm -rf "$staging"' EXIT

log "building kueue ${KUEUE_VERSION} into ${VERSION_DIR}"
log "go: $(go version); GOCACHE=$(go env GOCACHE); cores: $(nproc)"
start=$SECONDS

log "downloading modules"
(cd "$HERE" && go mod download)
log "modules ready after $(fmt_secs $((SECONDS - start)))"

# The manifests come from the module source of the very version built, not from the repository.
src="$(cd "$HERE" && go list -m -f '{{.Dir}}' "$KUEUE_PKG")"
mkdir -p "${staging}/config/crd" "${staging}/config/webhook"
cp -r "${src}/config/components/crd/bases" "${src}/config/components/crd/patches" \
    "${staging}/config/crd/"
cp "${src}/config/components/crd/kustomization.yaml" "${staging}/config/crd/"
cp "${src}/config/components/webhook/manifests.yaml" "${staging}/config/webhook/"
chmod -R u+w "${staging}/config"

pkglog="${staging}/kueue.packages"
: >"$pkglog"
(
    cd "$HERE"
    go build -v -trimpath -ldflags "$ldflags" -o "${staging}/kueue" "${KUEUE_PKG}/cmd/kueue" 2>"$pkglog"
) &
builder=$!
next_report=$((start + 30))
while kill -0 "$builder" 2>/dev/null; do
    sleep 1
    if ((SECONDS >= next_report)); then
        next_report=$((SECONDS + 30))
        log "kueue: $(fmt_secs $((SECONDS - start))) elapsed, $(wc -l <"$pkglog") packages compiled"
    fi
done
if ! wait "$builder"; then
    log "kueue: FAILED after $(fmt_secs $((SECONDS - start))); go said:"
    grep -v '^[a-z0-9.]*[/a-zA-Z0-9._-]*$' "$pkglog" >&2 || cat "$pkglog" >&2
    exit 1
fi
rm -rf "${VERSION_DIR}/config"
mv "${staging}/config" "${VERSION_DIR}/config"
mv -f "${staging}/kueue" "${BIN_DIR}/kueue"
inputs_hash >"$STAMP"
log "kueue built in $(fmt_secs $((SECONDS - start))) ($(wc -l <"$pkglog") packages compiled); $(du -sh "${BIN_DIR}/kueue" | cut -f1)"
echo "$VERSION_DIR"
