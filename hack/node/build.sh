#!/usr/bin/env bash
# Build what a real node runs besides the kubelet (hack/k8s/build.sh builds that): containerd
# v2.4.2 with its runc shim and ctr, from the Go module proxy (Debian 12's containerd 1.6
# predates CDI, which carve's plugin hands devices over with), plus carve's own pause
# program for the sandbox image. runc, the CNI plugins and busybox come from Debian
# (install-packages.sh, run from here; installing needs root).
#
#   hack/node/build.sh            build/install if needed, then print the bin directory on stdout
#   hack/node/build.sh --check    exit 0 if the cache is complete and current and the Debian
#                                 packages are installed, 1 otherwise
#
# Exit status 2: a prerequisite is missing (no Go toolchain, or Debian packages missing and
# not root); the message says what to do.
#
# Binaries: containerd, containerd-shim-runc-v2, ctr, pause in
# ~/.cache/carve/node/<containerd version>/bin. Where Debian put runc, the CNI plugins and
# busybox is written to ../packages.env next to that bin directory (KEY=VALUE lines).
# The cache is keyed by a hash of this module's inputs, so a second run returns at once.
# Progress goes to stderr.
set -euo pipefail

CONTAINERD_VERSION=v2.4.2
CONTAINERD_PKG=github.com/containerd/containerd/v2
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${CARVE_CACHE:-${HOME}/.cache/carve}"
NODE_DIR="${CACHE_ROOT}/node/${CONTAINERD_VERSION}"
BIN_DIR="${NODE_DIR}/bin"
PACKAGES_ENV="${NODE_DIR}/packages.env"
STAMP="${BIN_DIR}/.inputs"
# name=package: upstream commands by import path (go.mod lists them as tools), ours by path.
TARGETS=(
    "containerd=${CONTAINERD_PKG}/cmd/containerd"
    "containerd-shim-runc-v2=${CONTAINERD_PKG}/cmd/containerd-shim-runc-v2"
    "ctr=${CONTAINERD_PKG}/cmd/ctr"
    "pause=./cmd/pause"
)
# All static (CGO_ENABLED=0), as upstream builds its shim. Without cgo the btrfs snapshotter
# drops out by itself (its file needs cgo); no_btrfs says so anyway, and devmapper and zfs go
# too: the node uses overlayfs only. urfave_cli_no_docs as in upstream's Makefile.
TAGS="urfave_cli_no_docs no_btrfs no_devmapper no_zfs"
# Upstream's Makefile adds no_grpc for the shim: it talks ttrpc to containerd.
SHIM_TAGS="${TAGS} no_grpc"

log() { printf '[node-build] %s\n' "$*" >&2; }

fmt_secs() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

inputs_hash() {
    # Everything that changes what gets built: module graph, sources, flags, toolchain.
    (
        cd "$HERE"
        cat go.mod go.sum build.sh
        find cmd -name '*.go' -print0 | sort -z | xargs -0 cat
        go env GOVERSION GOOS GOARCH
    ) | sha256sum | cut -c1-16
}

cache_is_current() {
    [[ -f "$STAMP" ]] || return 1
    [[ "$(cat "$STAMP")" == "$(inputs_hash)" ]] || return 1
    local t
    for t in "${TARGETS[@]}"; do
        [[ -x "${BIN_DIR}/${t%%=*}" ]] || return 1
    done
}

if ! command -v go >/dev/null 2>&1; then
    if [[ -x /usr/local/go/bin/go ]]; then
        export PATH="/usr/local/go/bin:${PATH}"
    else
        log "Go toolchain not found (need go >= 1.26.6 on PATH or in /usr/local/go)"
        exit 2
    fi
fi

if [[ "${1:-}" == "--check" ]]; then
    cache_is_current && [[ -f "$PACKAGES_ENV" ]] && bash "${HERE}/install-packages.sh" --check
    exit $?
fi

# Debian packages first: quick, and without them (not root) the node cannot run anyway.
rc=0
packages="$(bash "${HERE}/install-packages.sh")" || rc=$?
if ((rc != 0)); then
    log "Debian packages not ready (install-packages.sh exit ${rc}); see above"
    exit "$rc"
fi
mkdir -p "$BIN_DIR"
if [[ "$(cat "$PACKAGES_ENV" 2>/dev/null)" != "$packages" ]]; then
    printf '%s\n' "$packages" >"$PACKAGES_ENV"
fi
log "from Debian: $(tr '\n' ' ' <<<"$packages")(recorded in ${PACKAGES_ENV})"

if cache_is_current; then
    log "up to date: ${BIN_DIR}"
    echo "$BIN_DIR"
    exit 0
fi

# -mod=mod resolves the graph from go.mod/go.sum without a vendor directory; GOPATH and
# GOCACHE keep their defaults, outside the repository.
export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0
vpkg="${CONTAINERD_PKG}/version"
ldflags="-s -w -X ${vpkg}.Version=${CONTAINERD_VERSION} -X ${vpkg}.Revision=carve-hack-node"

staging="$(mktemp -d "${BIN_DIR}/.staging.XXXXXX")"
trap 'rm -rf "$staging"' EXIT

log "building containerd ${CONTAINERD_VERSION}, its runc shim, ctr and pause into ${BIN_DIR}"
log "go: $(go version); GOCACHE=$(go env GOCACHE); cores: $(nproc)"
total_start=$SECONDS

log "downloading modules"
(cd "$HERE" && go mod download)
log "modules ready after $(fmt_secs $((SECONDS - total_start)))"

for t in "${TARGETS[@]}"; do
    b="${t%%=*}"
    pkg="${t#*=}"
    tags="$TAGS"
    [[ "$b" == containerd-shim-runc-v2 ]] && tags="$SHIM_TAGS"
    flags="$ldflags"
    [[ "$b" == pause ]] && flags="-s -w"
    start=$SECONDS
    log "${b}: compiling"
    pkglog="${staging}/${b}.packages"
    : >"$pkglog"
    (
        cd "$HERE"
        go build -v -trimpath -tags "$tags" -ldflags "$flags" -o "${staging}/${b}" "$pkg" 2>"$pkglog"
    ) &
    builder=$!
    next_report=$((start + 30))
    while kill -0 "$builder" 2>/dev/null; do
        sleep 1
        if ((SECONDS >= next_report)); then
            next_report=$((SECONDS + 30))
            log "${b}: $(fmt_secs $((SECONDS - start))) elapsed, $(wc -l <"$pkglog") packages compiled"
        fi
    done
    if ! wait "$builder"; then
        log "${b}: FAILED after $(fmt_secs $((SECONDS - start))); go said:"
        grep -v '^[a-z0-9.]*[/a-zA-Z0-9._-]*$' "$pkglog" >&2 || cat "$pkglog" >&2
        exit 1
    fi
    log "${b}: done in $(fmt_secs $((SECONDS - start))) ($(wc -l <"$pkglog") packages compiled)"
done

for t in "${TARGETS[@]}"; do
    mv -f "${staging}/${t%%=*}" "${BIN_DIR}/${t%%=*}"
done
inputs_hash >"$STAMP"
log "all binaries built in $(fmt_secs $((SECONDS - total_start))); $(du -sh "$BIN_DIR" | cut -f1) in ${BIN_DIR}"
echo "$BIN_DIR"
