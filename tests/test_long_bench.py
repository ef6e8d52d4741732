"""`splitspec long-bench` (bench/long_bench.py): side-by-side rows per length and penalty, checked
exact, and a results file kept up to date while the run goes on."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from splitspec.bench.long_bench import cmd_long_bench, distinct_n


def test_distinct_n_counts_repeated_ngrams():
    assert distinct_n([1, 2, 1, 2, 1, 2], 2) == pytest.approx(2 / 5)
    assert distinct_n([1, 2, 3, 4], 2) == 1.0
    assert distinct_n([7], 2) == 1.0


def test_long_bench_rows_are_exact_and_written(stories_path, tmp_path, capsys):
    out = tmp_path / "long.md"
    args = SimpleNamespace(target=str(stories_path), drafter="ngram", lengths=[24, 40], penalty=1.2, penalty_window=16,
                           threads=0, prompt="Tom had a big red ball.", out=str(out))
    cmd_long_bench(args)
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 8  # 2 lengths x 2 penalties x (generate(), drafter)
    drafter_rows = [r.split(" | ") for r in rows if "| ngram |" in r]
    assert [(r[0], r[1]) for r in drafter_rows] == [("| 24", "1"), ("| 24", "1.2"), ("| 40", "1"), ("| 40", "1.2")]
    assert all(r[-1].strip(" |") == "True" for r in drafter_rows)  # every answer equals its own baseline
    assert capsys.readouterr().out.count("| ngram |") == 4


def test_long_bench_refuses_lengths_past_the_context(stories_path):
    args = SimpleNamespace(target=str(stories_path), drafter="ngram", lengths=[100000], penalty=1.0, penalty_window=16,
                           threads=0, prompt="Tom", out="")
    with pytest.raises(SystemExit, match="at most"):
        cmd_long_bench(args)


def test_long_bench_cut_short_keeps_the_pairs_it_measured(stories_path, tmp_path, monkeypatch):
    """A run that dies in its second pair leaves the first pair's rows in --out (after an untimed
    warm-up answer)."""
    from splitspec.bench.long_bench import WARMUP_TOKENS
    from splitspec.shared import reference

    calls = []
    original = reference.target_greedy

    def dies_on_the_second_pair(*args, **kwargs):
        calls.append(args[2])  # new tokens
        if len(calls) == 3:  # the warm-up, the first pair, the second pair
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(reference, "target_greedy", dies_on_the_second_pair)
    out = tmp_path / "long.md"
    args = SimpleNamespace(target=str(stories_path), drafter="ngram", lengths=[24, 40], penalty=1.2, penalty_window=16,
                           threads=0, prompt="Tom had a big red ball.", out=str(out))
    with pytest.raises(KeyboardInterrupt):
        cmd_long_bench(args)
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 24 | 1 |")]
    assert [r.split(" | ")[2] for r in rows] == ["generate()", "ngram"]
    assert calls[:2] == [WARMUP_TOKENS, 24]


def test_long_bench_fails_loudly_on_an_answer_that_is_not_its_baseline(stories_path, tmp_path, monkeypatch, capsys):
    """A speculative answer unequal to its generate() baseline gets a WARNING line in the table and
    --out, and the command fails (here the baseline is made wrong by hand)."""
    from splitspec.shared import reference

    original = reference.target_greedy
    monkeypatch.setattr(reference, "target_greedy", lambda *a, **k: list(reversed(original(*a, **k))))
    out = tmp_path / "long.md"
    args = SimpleNamespace(target=str(stories_path), drafter="ngram", lengths=[24], penalty=1.0, penalty_window=16,
                           threads=0, prompt="Tom had a big red ball.", out=str(out))
    with pytest.raises(RuntimeError, match="1 speculative answers differ"):
        cmd_long_bench(args)
    assert "WARNING: ngram's answer differs from generate()'s at 24 tokens, penalty 1" in out.read_text()
    assert "WARNING" in capsys.readouterr().out
