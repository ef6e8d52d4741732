"""The scripts under tools/ that docs cite as how a figure was made still start: each answers --help
(tools/sampled_tau_ab.py took its drafter from argv[1] and, given --help, failed on a drafter of
that name after loading the target)."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

TOOLS = sorted(p for p in (Path(__file__).resolve().parents[1] / "tools").glob("*.py") if p.name != "import_graph.py")


@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: p.name)
def test_each_tool_answers_help(tool, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(tool), "--help"])
    with pytest.raises(SystemExit) as end:
        runpy.run_path(str(tool), run_name="__main__")
    assert end.value.code in (0, None)
    assert capsys.readouterr().out.startswith("usage:")


def test_the_tools_are_found():
    assert {"sampled_tau_ab.py", "refingerprint.py", "shipped_curve.py"} <= {p.name for p in TOOLS}
