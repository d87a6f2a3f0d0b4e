"""Regenerate the Python code of the public API from ``proto/``: ``python -m pdserve.codegen``.

The generated modules (``pdserve/v1/generation_pb2*.py``) are committed, so installing pdserve
needs no protobuf compiler; ``tests/test_proto_sync.py`` regenerates them into a temporary
folder and fails when the committed copies are stale. Run this from a checkout, with the
``dev`` extra installed (it needs ``grpcio-tools``, pinned to the same version as ``grpcio``
because the generated stubs check the runtime's version).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ("pdserve/v1/generation.proto", "pdserve/v1/admin.proto", "pdserve/internal/kv_transfer.proto")


def generated_files(proto_file: str) -> list[str]:
    """Paths (relative to the output root) that protoc writes for one ``.proto`` file."""
    stem = proto_file[: -len(".proto")]
    return [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]


def all_generated_files() -> list[str]:
    return [path for proto in PROTO_FILES for path in generated_files(proto)]


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Run protoc (from grpcio-tools) on every API file, writing under ``out_root``."""
    try:
        from grpc_tools import protoc
        import grpc_tools
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "pdserve.codegen needs grpcio-tools: pip install 'grpcio-tools==<grpcio version>'"
        ) from exc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    for proto in PROTO_FILES:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(PROTO_ROOT / proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    return [out_root / p for p in all_generated_files()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.codegen", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the checkout)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
