"""tools/shipped_curve.py: which versions of a shipped checkpoint it measures (one per distinct
weights blob, oldest first, a deletion skipped), and as which trainer variant."""
from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

from splitspec.train.trainer import DrafterJob

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("shipped_curve", ROOT / "tools" / "shipped_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commit(repo: Path, weights: bytes | None, message: str) -> str:
    f = repo / "client/checkpoints/smollm2-135m/eagle2/model.safetensors"
    f.parent.mkdir(parents=True, exist_ok=True)
    if weights is None:
        f.unlink()
    else:
        f.write_bytes(weights)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message],
                   check=True)
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_one_version_per_distinct_blob_oldest_first(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    first = _commit(tmp_path, b"weights 1", "ship 1")
    second = _commit(tmp_path, b"weights 2", "ship 2")
    _commit(tmp_path, b"weights 1", "revert to 1")  # the same blob as the first: measured once
    _commit(tmp_path, None, "remove")
    third = _commit(tmp_path, b"weights 3", "ship 3")
    versions = _tool().shipped_versions("eagle2", repo=str(tmp_path))
    assert [rev for rev, _ in versions] == [first, second, third]
    assert len({blob for _, blob in versions}) == 3


def test_drafter_spec_names_the_checkpoints_own_variant():
    """The --drafter entry the tool passes (DrafterJob.of_checkpoint(...).spec) makes the trainer's
    job name the checkpoint's folder name (the key the tool reads the result under), for every shipped
    checkpoint and a learned-pool MoA."""
    tool = _tool()
    folders = sorted((ROOT / tool.CHECKPOINTS).glob("*/drafter.json"))
    assert {f.parent.name for f in folders} >= {"moa-tli0", "moa-tli1", "eagle2"}
    for f in folders:
        assert DrafterJob.parse(DrafterJob.of_checkpoint(json.loads(f.read_text())).spec).name == f.parent.name
    learned = {"kind": "moa", "config": {"tli": 1, "lsa_pool": "learned"}}
    assert DrafterJob.parse(DrafterJob.of_checkpoint(learned).spec).name == "moa-tli1-learned"
