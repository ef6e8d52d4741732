"""`splitspec train-curve`: histories of several runs become one table and one PNG, with
continuation runs placed at their total token count and missing optional figures shown as '-'."""
from __future__ import annotations

import json

from splitspec.train.curve import plot, read_histories, run_styles, table


def _write(path, records):
    path.mkdir(parents=True)
    (path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_table_and_plot(tmp_path):
    _write(tmp_path / "run_a" / "moa-tli0", [
        {"step": 10, "tokens": 1000, "elapsed_s": 120.0, "tau": 1.5, "heldout_top1": 0.2, "heldout_loss": 1.1,
         "memory_gain": 0.02}])
    _write(tmp_path / "run_b" / "eagle2", [{"step": 5, "tokens": 500, "tokens_total": 1500, "tau": 1.7,
                                            "heldout_top1": 0.3}])
    # a re-measured shipped checkpoint (tools/shipped_curve.py) has tokens_total and no run tokens
    _write(tmp_path / "shipped" / "moa-tli0", [{"rev": "abc", "tokens_total": 2500, "tau": 1.8, "heldout_top1": 0.25}])
    _write(tmp_path / "run_b" / "eagle2" / "best", [{"step": 5, "tokens": 500, "tau": 9.0, "heldout_top1": 0.9}])
    histories = read_histories([tmp_path])
    assert sorted(histories) == ["eagle2 (run_b)", "moa-tli0 (run_a)", "moa-tli0 (shipped)"]  # best/ is a copy, not a run
    rows = table(histories).splitlines()
    assert "| moa-tli0 (run_a) | 1,000 | 2 | 1.50 | 0.200 | +0.020 | 1.100 |" in rows
    assert "| eagle2 (run_b) | 1,500 | - | 1.70 | 0.300 | - | - |" in rows
    assert "| moa-tli0 (shipped) | 2,500 | - | 1.80 | 0.250 | - | - |" in rows
    png = tmp_path / "curve.png"
    plot(histories, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_prints_the_table_and_plots_only_when_asked(tmp_path, monkeypatch, capsys):
    """`train-curve` has no default PNG: one relative to the working folder overwrote the repo's
    tracked plot from its root and failed elsewhere before printing the table (QA 56)."""
    from splitspec.cli.main import main

    _write(tmp_path / "run_a" / "moa-tli0", [{"step": 1, "tokens": 1000, "tau": 1.5, "heldout_top1": 0.2}])
    monkeypatch.chdir(tmp_path)
    assert main(["train-curve", str(tmp_path / "run_a")]) == 0
    assert "| moa-tli0 (run_a) | 1,000 |" in capsys.readouterr().out and not list(tmp_path.rglob("*.png"))
    assert main(["train-curve", str(tmp_path / "run_a"), "--png", "plot.png"]) == 0
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_get_distinct_styles():
    """Each of 48 runs gets its own (marker, line style): a dozen markers alone made the 13th and 1st
    run look alike."""
    runs = [f"session{i}-train{i}" for i in range(48)]
    assert len(set(run_styles(runs).values())) == 48


def test_bad_folders_and_records_are_named(tmp_path):
    """A missing folder gave an empty table and plot with rc 0, a record without heldout_top1 a
    KeyError traceback, a corrupt line a JSON error without a file name; two runs whose folders end
    alike overwrote each other."""
    import pytest

    with pytest.raises(ValueError, match="no history.jsonl"):
        read_histories([tmp_path / "missing"])
    _write(tmp_path / "partial", [{"tokens": 10, "tau": 1.2}])
    with pytest.raises(ValueError, match="partial/history.jsonl line 1: a record needs tau, heldout_top1"):
        read_histories([tmp_path / "partial"])
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "history.jsonl").write_text('{"tokens": 1, "tau": 1.0, "heldout_top1": 0.1}\n{"tok\n')
    with pytest.raises(ValueError, match="corrupt/history.jsonl line 2: not a JSON record"):
        read_histories([tmp_path / "corrupt"])
    for root in ("a", "b"):
        _write(tmp_path / root / "x" / "moa-tli0", [{"tokens": 1, "tau": 1.0, "heldout_top1": 0.1}])
    with pytest.raises(ValueError, match="both be labelled 'moa-tli0 \\(x\\)'"):
        read_histories([tmp_path / "a", tmp_path / "b"])


def test_a_one_drafter_run_is_labelled_by_its_drafter(tmp_path):
    """A one-drafter run keeps its history in the run folder: the label is "drafter (run)", the
    drafter read from its drafter.json (it read "run1 ()" before)."""
    record = {"tokens": 1, "tau": 1.0, "heldout_top1": 0.1}
    for run, meta in (("run1", {"kind": "eagle2", "config": {}}), ("run2", {"kind": "moa", "config": {"tli": 1}})):
        _write(tmp_path / run, [record])
        (tmp_path / run / "drafter.json").write_text(json.dumps(meta))
    _write(tmp_path / "run3" / "moa-tli0", [record])  # a several-drafter run's drafter folder
    (tmp_path / "run3" / "moa-tli0" / "drafter.json").write_text(json.dumps({"kind": "moa", "config": {"tli": 0}}))
    histories = read_histories([tmp_path / "run1", tmp_path / "run2", tmp_path / "run3"])
    assert sorted(histories) == ["eagle2 (run1)", "moa-tli0 (run3)", "moa-tli1 (run2)"]
