"""The committed gRPC code in pdserve/v1 is exactly what proto/ generates."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from pdserve import codegen

pytest.importorskip("grpc_tools", reason="needs grpcio-tools (the dev extra)")


def test_committed_code_matches_proto(tmp_path: Path) -> None:
    codegen.generate(tmp_path)
    stale = []
    for rel in codegen.all_generated_files():
        fresh = (tmp_path / rel).read_text()
        committed_path = codegen.REPO_ROOT / rel
        if not committed_path.is_file() or committed_path.read_text() != fresh:
            stale.append(rel)
    assert not stale, f"stale generated code {stale}: run `python -m pdserve.codegen` and commit"


def test_generated_stubs_match_installed_grpcio() -> None:
    text = (codegen.REPO_ROOT / "pdserve/v1/generation_pb2_grpc.py").read_text()
    version = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", text).group(1)
    assert version == grpc.__version__, (
        f"stubs generated for grpcio {version} but grpcio {grpc.__version__} is installed; "
        "pin grpcio-tools to the grpcio version and regenerate"
    )


def test_no_top_level_proto_package() -> None:
    assert not (codegen.REPO_ROOT / "proto" / "__init__.py").exists()
    from pdserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: F401
