#!/usr/bin/env bash
# Build the helm v4 CLI (helm.sh/helm/v4/cmd/helm, named in go.mod's tool block) from the Go
# module proxy into a cache outside the repository, for the chart tests (tests/deploy) and
# hack/render-manifests.sh. The version is stamped as upstream's Makefile does, so
# `helm version` reports it.
#
#   hack/helm/build.sh            build if needed, then print the bin directory on stdout
#   hack/helm/build.sh --check    exit 0 if the cache is complete and current, 1 otherwise
#
# Exit status 2: no Go toolchain. Binary: ~/.cache/carve/helm/<version>/bin/helm. The cache is
# keyed by a hash of this module's inputs, so a second run returns at once. Progress goes to
# stderr.
set -euo pipefail

HELM_VERSION=v4.3.1
HELM_PKG=helm.sh/helm/v4
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${CARVE_CACHE:-${HOME}/.cache/carve}"
BIN_DIR="${CACHE_ROOT}/helm/${HELM_VERSION}/bin"
STAMP="${BIN_DIR}/.inputs"

log() { printf '[helm-build] %s\n' "$*" >&2; }

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
    [[ -x "${BIN_DIR}/helm" ]]
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
    log "up to date: ${BIN_DIR}"
    echo "$BIN_DIR"
    exit 0
fi

# The version pinned in go.mod must be the one this script says it builds.
pinned="$(cd "$HERE" && go list -m -f '{{.Version}}' "$HELM_PKG")"
if [[ "$pinned" != "$HELM_VERSION" ]]; then
    log "go.mod pins ${HELM_PKG} ${pinned}, build.sh says ${HELM_VERSION}: make them agree"
    exit 1
fi

# -mod=mod resolves the graph from go.mod/go.sum without a vendor directory; GOPATH and
# GOCACHE keep their defaults, outside the repository. Static, as upstream builds it.
export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0
vpkg="${HELM_PKG}/internal/version"
ldflags="-s -w -X ${vpkg}.version=${HELM_VERSION} -X ${vpkg}.gitTreeState=clean"

mkdir -p "$BIN_DIR"
staging="$(mktemp -d "${BIN_DIR}/.staging.XXXXXX")"
trap 'rm -rf "$staging"' EXIT

log "building helm ${HELM_VERSION} into ${BIN_DIR}"
log "go: $(go version); GOCACHE=$(go env GOCACHE); cores: $(nproc)"
start=$SECONDS

log "downloading modules"
(cd "$HERE" && go mod download)
log "modules ready after $(fmt_secs $((SECONDS - start)))"

pkglog="${staging}/helm.packages"
: >"$pkglog"
(
    cd "$HERE"
    go build -v -trimpath -ldflags "$ldflags" -o "${staging}/helm" "${HELM_PKG}/cmd/helm" 2>"$pkglog"
) &
builder=$!
next_report=$((start + 30))
while kill -0 "$builder" 2>/dev/null; do
    sleep 1
    if ((SECONDS >= next_report)); then
        next_report=$((SECONDS + 30))
        log "helm: $(fmt_secs $((SECONDS - start))) elapsed, $(wc -l <"$pkglog") packages compiled"
    fi
done
if ! wait "$builder"; then
    log "helm: FAILED after $(fmt_secs $((SECONDS - start))); go said:"
    grep -v '^[a-z0-9.]*[/a-zA-Z0-9._-]*$' "$pkglog" >&2 || cat "$pkglog" >&2
    exit 1
fi
mv -f "${staging}/helm" "${BIN_DIR}/helm"
inputs_hash >"$STAMP"
log "helm built in $(fmt_secs $((SECONDS - start))) ($(wc -l <"$pkglog") packages compiled); $(du -sh "${BIN_DIR}/helm" | cut -f1)"
echo "$BIN_DIR"
