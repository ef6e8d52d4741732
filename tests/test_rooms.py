"""The rooms' import rules (README, "Architecture"): the client runs without the server, and no
room imports one it may not (read from the source by tools/import_graph.py)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room -> the rooms it may import; cli (the composition root) may import every room
MAY_IMPORT = {
    "v1": set(),
    "shared": {"v1"},
    "client": {"shared", "v1"},
    "server": {"shared", "v1"},
    "netsim": set(),
    "train": {"shared", "client", "server"},  # held-out tau runs the client's loop on an in-process target
    "bench": {"shared", "client", "server", "netsim", "v1"},
}

WITHOUT_SERVER = """
import importlib.abc, sys

class NoServer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "splitspec.server" or name.startswith("splitspec.server."):
            raise ImportError(f"{name} is unimportable here")

sys.meta_path.insert(0, NoServer())
import splitspec.client.build, splitspec.client.cli, splitspec.client.drafters.factory
import splitspec.client.loop, splitspec.client.transport
from splitspec.client.drafters import DraftModelDrafter, NgramDrafter
assert not [m for m in sys.modules if m.startswith("splitspec.server")]
"""


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: 1-2 minutes on a loaded 2-core VM
def test_the_client_imports_its_loop_transport_and_drafters_without_the_server():
    proc = subprocess.run([sys.executable, "-c", WITHOUT_SERVER], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_rooms_import_only_what_they_may():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    import_graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(import_graph)
    graph = import_graph.room_graph(ROOT)
    for room, allowed in MAY_IMPORT.items():
        assert set(graph[room]) <= allowed, f"{room} imports {sorted(set(graph[room]) - allowed)}"
    assert import_graph.cycles(graph) == []


def test_a_relative_import_out_of_its_room_is_an_edge(tmp_path):
    """`from ...server import runner` in client/daemon/ reaches the server as surely as the absolute
    form; relative imports inside the room are no edge."""
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    import_graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(import_graph)
    (tmp_path / "client" / "daemon").mkdir(parents=True)
    (tmp_path / "client" / "loop.py").write_text("from .drafters import base\nfrom . import plan\n")
    (tmp_path / "client" / "daemon" / "app.py").write_text(
        "from ..loop import x\n\ndef f():\n    from ...server import runner\n    from ... import shared\n")
    graph = import_graph.room_graph(tmp_path)
    assert dict(graph["client"]) == {"server": [0, 1], "shared": [0, 1]}
