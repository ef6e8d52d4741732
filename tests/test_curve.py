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


def test_runs_get_distinct_styles():
    """Each of 48 runs gets its own (marker, line style): a dozen markers alone made the 13th and 1st
    run look alike."""
    runs = [f"session{i}-train{i}" for i in range(48)]
    assert len(set(run_styles(runs).values())) == 48
