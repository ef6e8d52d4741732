"""The bench command end to end on stories260K: a real server process, every row exact."""
from __future__ import annotations

import json

from splitspec.client.cli import main


def test_bench_small(stories_path, tmp_path, capsys):
    code = main(["bench", "--target", str(stories_path), "--methods", "none,ngram", "--modes", "local,split",
                 "--datasets", "humaneval", "--limit", "1", "--max-new-tokens", "12", "--out", str(tmp_path)])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {(r["mode"], r["method"]) for r in rows} == {("local", "generate()"), ("local", "none"), ("local", "ngram"),
                                                        ("split", "none"), ("split", "ngram")}
    assert all(r["exact"] for r in rows)
    table = (tmp_path / "table.md").read_text()
    assert "| split | ngram |" in table and "speed-up vs generate()" in table
    split_rows = [r for r in rows if r["mode"] == "split"]
    assert all(r["bytes_sent"] > 0 and r["bytes_received"] > 0 for r in split_rows)
