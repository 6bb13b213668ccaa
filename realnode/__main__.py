"""``python -m realnode down``: clean up every real node this machine still has.

Real nodes live under /tmp/carve-rn-*; each root holds a node.json per node. A root whose owner
is gone (a killed test run, a demo host that died) is normally cleaned by its reaper; this
command is the manual way, for a reaper that was itself killed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from realnode.reaper import clean_root, owner_alive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m realnode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    down = sub.add_parser("down", help="stop and remove every real node under /tmp/carve-rn-*")
    down.add_argument("roots", nargs="*", type=Path, help="only these node roots")
    down.add_argument(
        "--all", action="store_true", help="also the nodes of owners that are still running"
    )
    args = parser.parse_args(argv)
    roots = args.roots or [
        r for r in sorted(Path("/tmp").glob("carve-rn-*")) if args.all or not owner_alive(r)
    ]
    for root in roots:
        for line in clean_root(root):
            print(f"{root}: {line}")
    if not roots:
        print("no real nodes on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
