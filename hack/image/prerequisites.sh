#!/usr/bin/env bash
# Install what building carve's image without a registry needs: mmdebstrap (Debian's own
# tool that makes the image's root file system from packages; deploy/image/build.py).
#
#   hack/image/prerequisites.sh   install mmdebstrap if it is missing (needs root)
#
# Exit status 2 when it is missing and this is not root: the in-cluster test then fails
# under CARVE_REQUIRE_CLUSTER (CI) and is skipped, with this reason, elsewhere.
set -euo pipefail

log() { printf '[image-prerequisites] %s\n' "$*" >&2; }

if command -v mmdebstrap >/dev/null 2>&1; then
    exit 0
fi
if ((EUID != 0)); then
    log "mmdebstrap is missing; run as root: apt-get install -y --no-install-recommends mmdebstrap"
    exit 2
fi
log "installing mmdebstrap with apt-get"
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends mmdebstrap >&2; then
    log "apt-get install failed; refreshing the package lists and trying once more"
    apt-get update >&2
    apt-get install -y --no-install-recommends mmdebstrap >&2
fi
