"""What one apiserver request costs the thread that sends it, in CPU time.

Run: python -m bench.request_cost [--requests 400] [--rounds 2]

A private v1.37.2 control plane is started; over one client built as carve's processes build
theirs (`process.kubeconfig.load_api_client`, TLS to 127.0.0.1), one thread sends, in turn:

- client patch: a merge patch of a ConfigMap through the official client, answer read raw and
  parsed once, exactly as carve-controller's writers send a claim's finalizer or a pod's gate
  removal (controller/status.py);
- pool patch: the same request through the client's own urllib3 pool, without the client's
  layer (argument validation, serialisation, header selection);
- pool get: a read of the same object through the pool.

Printed: CPU and wall milliseconds per request for each way. bench.scale's `req/pl` times the
first figure is what a placement's requests cost the controller; docs/scale.md compares that
with bench.scale's CPU per placement. Figures are printed, not asserted
(tests/bench/test_request_cost.py runs the machinery, tests/support/request_cost.py).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tests.support.request_cost import measure, report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.request_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=400, help="per way and round")
    parser.add_argument("--rounds", type=int, default=2, help="the ways in turn, this often")
    args = parser.parse_args(argv)
    if min(args.requests, args.rounds) < 1:
        parser.error("--requests and --rounds must be at least 1")
    from devcluster.binaries import BinariesUnavailableError
    from devcluster.cluster import LocalCluster
    from process.kubeconfig import load_api_client

    root = Path(tempfile.mkdtemp(prefix="carve-request-cost-"))
    cluster = LocalCluster(root / "cluster")
    try:
        try:
            info = cluster.start()
        except BinariesUnavailableError as exc:
            print(f"request_cost: control plane unavailable: {exc}", file=sys.stderr)
            return 2
        api = load_api_client(str(info.kubeconfig))
        print(report(measure(api, args.requests, args.rounds)))
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
