"""Generates the Python code for proto/kvmesh/v1/*.proto (and the standard proto/grpc/health/v1/health.proto)
into libs/mesh/pb (the one place it lives).

    python -m mesh.protogen           # regenerate
    python -m mesh.protogen --check   # exit 1 if the committed code is stale (make test runs this)

protoc names modules by the proto path (`kvmesh.v1.common_pb2`); we keep the descriptors' canonical paths
but import the modules from `mesh.pb`, so the generated imports are rewritten to that package.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent / "pb"
_IMPORT = re.compile(r"^from (kvmesh|grpc\.health)\.v1 import ", re.MULTILINE)
PACKAGES = (Path("kvmesh") / "v1", Path("grpc") / "health" / "v1")
_HEADER = '"""Generated from proto/kvmesh/v1 by `python -m mesh.protogen`. Do not edit."""\n'


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    protos = sorted(
        str(p.relative_to(PROTO_DIR)) for package in PACKAGES for p in (PROTO_DIR / package).glob("*.proto")
    )
    with tempfile.TemporaryDirectory() as tmp:
        include = Path(protoc.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("*_pb2*"):
            old.unlink()
        for src in sorted(src for package in PACKAGES for src in (Path(tmp) / package).iterdir()):
            (out_dir / src.name).write_text(_IMPORT.sub("from mesh.pb import ", src.read_text()))
        (out_dir / "__init__.py").write_text(_HEADER)


def is_stale() -> list[str]:
    """Names of generated files that differ from what the protos generate now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "pb"
        generate(fresh)
        names = {p.name for p in fresh.iterdir()} | {p.name for p in OUT_DIR.glob("*") if p.suffix in (".py", ".pyi")}
        return sorted(
            n
            for n in names
            if not (OUT_DIR / n).exists()
            or not (fresh / n).exists()
            or not filecmp.cmp(fresh / n, OUT_DIR / n, shallow=False)
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the generated code is stale")
    args = parser.parse_args()
    if args.check:
        stale = is_stale()
        if stale:
            print(
                f"generated protobuf code is stale: {', '.join(stale)}; run `python -m mesh.protogen`", file=sys.stderr
            )
            return 1
        return 0
    generate(OUT_DIR)
    shutil.rmtree(OUT_DIR / "__pycache__", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
