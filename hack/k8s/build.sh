#!/usr/bin/env bash
# Build carve's local control plane (etcd, kube-apiserver, kube-scheduler,
# kube-controller-manager) and the kubelet (for a real node: the real kubelet and
# containerd running carve's plugin, see hack/node/) from the Go module proxy into a cache
# outside the repository, plus dra-allocate (cmd/dra-allocate: kube-scheduler's structured
# DRA allocator as a stdin/stdout tool, the baseline carve's packing is compared with).
#
#   hack/k8s/build.sh            build if needed, then print the bin directory on stdout
#   hack/k8s/build.sh --check    exit 0 if the cache is complete and current, 1 otherwise
#
# The cache is keyed by Kubernetes version and by a hash of this module's inputs, so a
# second run (or another clone on the same machine) returns in well under a second.
# Progress goes to stderr: which binary, elapsed time, packages compiled so far.
set -euo pipefail

K8S_VERSION=v1.37.2
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${CARVE_CACHE:-${HOME}/.cache/carve}"
BIN_DIR="${CACHE_ROOT}/k8s/${K8S_VERSION}/bin"
STAMP="${BIN_DIR}/.inputs"
# etcd first: it is small, and its dependencies (grpc, protobuf, otel) are shared with the
# apiserver, so the later binaries find them compiled.
# dra-allocate right after kube-scheduler: it links the scheduler's DRA plugin and
# k8s.io/dynamic-resource-allocation, all compiled by then, so it costs seconds.
# kubelet last: most of its dependencies (client-go, component-base, the API types) are
# compiled by then; what remains is its own tree (cadvisor, CRI client, volume plugins).
BINARIES=(etcd kube-scheduler dra-allocate kube-controller-manager kube-apiserver kubelet)
# Not Kubernetes binaries: built without the component-base version stamp.
UNSTAMPED=(dra-allocate)

log() { printf '[k8s-build] %s\n' "$*" >&2; }

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
    local b
    for b in "${BINARIES[@]}"; do
        [[ -x "${BIN_DIR}/${b}" ]] || return 1
    done
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

# -mod=mod lets go resolve the graph from go.mod/go.sum without a vendor directory;
# GOPATH and GOCACHE keep their defaults, which lie outside the repository.
export GOFLAGS="-mod=mod -buildvcs=false"
build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
major="${K8S_VERSION#v}"; major="${major%%.*}"
minor="${K8S_VERSION#v*.}"; minor="${minor%%.*}"
pkg=k8s.io/component-base/version
ldflags="-s -w"
ldflags+=" -X ${pkg}.gitVersion=${K8S_VERSION} -X ${pkg}.gitMajor=${major}"
ldflags+=" -X ${pkg}.gitMinor=${minor} -X ${pkg}.gitTreeState=clean"
ldflags+=" -X ${pkg}.buildDate=${build_date}"

mkdir -p "$BIN_DIR"
staging="$(mktemp -d "${BIN_DIR}/.staging.XXXXXX")"
trap 'rm -rf "$staging"' EXIT

log "building Kubernetes ${K8S_VERSION} control plane and kubelet into ${BIN_DIR}"
log "go: $(go version); GOCACHE=$(go env GOCACHE); cores: $(nproc)"
total_start=$SECONDS

log "downloading modules"
(cd "$HERE" && go mod download)
log "modules ready after $(fmt_secs $((SECONDS - total_start)))"

for b in "${BINARIES[@]}"; do
    start=$SECONDS
    log "${b}: compiling"
    pkglog="${staging}/${b}.packages"
    flags="$ldflags"
    if [[ " ${UNSTAMPED[*]} " == *" ${b} "* ]]; then
        flags="-s -w"
    fi
    : >"$pkglog"
    (
        cd "$HERE"
        go build -v -trimpath -ldflags "$flags" -o "${staging}/${b}" "./cmd/${b}" 2>"$pkglog"
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

for b in "${BINARIES[@]}"; do
    mv -f "${staging}/${b}" "${BIN_DIR}/${b}"
done
inputs_hash >"$STAMP"
log "all binaries built in $(fmt_secs $((SECONDS - total_start))); $(du -sh "$BIN_DIR" | cut -f1) in ${BIN_DIR}"
echo "$BIN_DIR"
