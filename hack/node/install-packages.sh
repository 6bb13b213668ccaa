#!/usr/bin/env bash
# Install the node pieces carve takes from Debian rather than building: runc (the OCI runtime
# containerd's shim calls), containernetworking-plugins (the CNI plugins the CRI calls to
# give each pod its network) and busybox-static (the one binary of carve's test image).
#
#   hack/node/install-packages.sh           install what is missing (needs root), then print
#                                           KEY=VALUE lines: RUNC, CNI_BIN_DIR, BUSYBOX
#   hack/node/install-packages.sh --check   exit 0 if all three are installed, 1 otherwise
#
# Nothing is assumed pre-installed; as a non-root user it says what to run instead of
# failing half-way. Progress goes to stderr.
set -euo pipefail

PACKAGES=(runc containernetworking-plugins busybox-static)

log() { printf '[node-packages] %s\n' "$*" >&2; }

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'; }

missing=()
for p in "${PACKAGES[@]}"; do
    installed "$p" || missing+=("$p")
done

if [[ "${1:-}" == "--check" ]]; then
    ((${#missing[@]} == 0))
    exit $?
fi

if ((${#missing[@]} > 0)); then
    if ((EUID != 0)); then
        log "missing Debian packages: ${missing[*]}"
        log "run as root: apt-get install -y --no-install-recommends ${missing[*]}"
        exit 2
    fi
    log "installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends "${missing[@]}" >&2; then
        log "apt-get install failed; refreshing the package lists and trying once more"
        apt-get update >&2
        apt-get install -y --no-install-recommends "${missing[@]}" >&2
    fi
fi

# Where the files really are, from the packages' own file lists, not from assumptions.
runc="$(dpkg -L runc | grep -E '/s?bin/runc$' | head -n1)"
bridge="$(dpkg -L containernetworking-plugins | grep -E '/bridge$' | head -n1)"
busybox="$(dpkg -L busybox-static | grep -E '/s?bin/busybox$' | head -n1)"
for f in "$runc" "$bridge" "$busybox"; do
    if [[ -z "$f" || ! -x "$f" ]]; then
        log "expected executable not found after install (runc=${runc} bridge=${bridge} busybox=${busybox})"
        exit 1
    fi
done
echo "RUNC=${runc}"
echo "CNI_BIN_DIR=$(dirname "$bridge")"
echo "BUSYBOX=${busybox}"
