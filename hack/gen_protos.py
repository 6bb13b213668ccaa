#!/usr/bin/env python3
"""Generate carve's Python gRPC stubs from proto/*.proto with grpcio-tools.

The stubs are committed (kubeletplugin/_generated/) so that installing carve never needs protoc.
tests/kubeletplugin/test_proto_stubs.py regenerates them into a temporary directory and fails when
the committed copy is stale, so edit the .proto files and rerun this script; never edit the stubs.

Usage: python hack/gen_protos.py [--out DIR] [--check]
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "proto"
DEFAULT_OUT = REPO / "kubeletplugin" / "_generated"

_INIT = '''"""Generated gRPC stubs for the kubelet plugin contracts. Do not edit.

Produced by hack/gen_protos.py from proto/*.proto.
"""
'''

# grpc_python_out writes `import dra_v1_pb2 as dra__v1__pb2`, which only works with the output
# directory on sys.path; make it a relative import so the stubs live inside the package.
_BARE_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def generate(out: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Write the stubs for every proto file into `out`; return the files written, sorted."""
    from grpc_tools import protoc  # dev dependency only: the product never generates code

    out.mkdir(parents=True, exist_ok=True)
    protos = sorted(proto_dir.glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files in {proto_dir}")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(p.name for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    for grpc_file in out.glob("*_pb2_grpc.py"):
        text = grpc_file.read_text()
        grpc_file.write_text(_BARE_IMPORT.sub(r"from . import \1 as \2", text))
    (out / "__init__.py").write_text(_INIT)
    return sorted(p for p in out.iterdir() if p.is_file() and p.suffix in {".py", ".pyi"})


def diff_trees(expected: Path, actual: Path) -> list[str]:
    """Unified diffs between two generated trees; empty when they are identical."""
    names = {p.name for p in expected.glob("*.py*")} | {p.name for p in actual.glob("*.py*")}
    problems: list[str] = []
    for name in sorted(names):
        want, have = expected / name, actual / name
        if not have.exists():
            problems.append(f"missing: {have}")
            continue
        if not want.exists():
            problems.append(f"not produced by the generator (delete it): {have}")
            continue
        a, b = want.read_text().splitlines(), have.read_text().splitlines()
        if a != b:
            problems.extend(
                difflib.unified_diff(b, a, str(have), f"regenerated {name}", lineterm="")
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument(
        "--check", action="store_true", help="only report whether --out is up to date"
    )
    args = parser.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            problems = diff_trees(Path(tmp), args.out)
        for line in problems:
            print(line)
        return 1 if problems else 0
    for path in generate(args.out):
        print(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
