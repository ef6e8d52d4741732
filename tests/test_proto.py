"""The committed stubs are what proto/generate.py makes from the .proto files today."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    produced = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert produced, "protoc produced nothing"
    for rel in produced:
        committed = ROOT / "proto" / rel
        assert committed.exists(), f"{rel} is not committed; run `make proto`"
        assert committed.read_text() == (tmp_path / rel).read_text(), f"{rel} is stale; run `make proto`"
