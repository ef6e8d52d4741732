"""tau's estimator and its bootstrap interval over answers (shared/records.py)."""
from __future__ import annotations

import math

import pytest

from splitspec.shared.records import AnswerRecord, accept_length, accept_length_interval


def answer(verify_tokens: int, verify_calls: int) -> AnswerRecord:
    """An answer whose verify calls produced `verify_tokens` tokens (the open call adds one of each)."""
    return AnswerRecord(new_tokens=verify_tokens + 1, target_calls=verify_calls + 1, elapsed_s=1.0)


def test_interval_of_two_answers_spans_their_own_ratios():
    """Two answers at tau 2 and 4: a resample holds both (pooled 50/15), or one twice (2 or 4), each
    with a quarter of the draws, so the central 95% runs from exactly 2 to exactly 4."""
    records = [answer(10, 5), answer(40, 10)]
    assert accept_length(records) == pytest.approx(50 / 15)
    assert accept_length_interval(records) == (2.0, 4.0)


def test_interval_collapses_when_every_answer_agrees_and_narrows_with_more_answers():
    same = [answer(30, 10)] * 5
    assert accept_length_interval(same) == (pytest.approx(3.0), pytest.approx(3.0))
    few = [answer(t, 10) for t in (15, 20, 25, 30, 35, 40, 45, 50)]
    low, high = accept_length_interval(few)
    assert low < accept_length(few) < high
    many_low, many_high = accept_length_interval(few * 16)  # same spread, 16x the answers: ~1/4 the width
    assert many_low < accept_length(few) < many_high
    assert 0.15 < (many_high - many_low) / (high - low) < 0.4


def test_interval_is_seeded_and_weighs_answers_by_their_calls():
    records = [answer(t, c) for t, c in ((5, 5), (60, 20), (9, 3), (30, 15), (2, 1), (44, 11))]
    assert accept_length_interval(records, seed=3) == accept_length_interval(records, seed=3)
    assert accept_length_interval(records, seed=3) != accept_length_interval(records, seed=4)
    low, high = accept_length_interval(records, level=0.5)
    wide_low, wide_high = accept_length_interval(records, level=0.99)
    assert wide_low <= low < high <= wide_high


def test_interval_needs_two_answers_with_verify_calls():
    assert all(math.isnan(x) for x in accept_length_interval([answer(12, 4)]))
    assert all(math.isnan(x) for x in accept_length_interval([answer(12, 4), answer(0, 0)]))
    assert all(math.isnan(x) for x in accept_length_interval([]))
    with pytest.raises(ValueError, match="level"):
        accept_length_interval([answer(12, 4)] * 3, level=1.0)
    with pytest.raises(ValueError, match="resamples"):
        accept_length_interval([answer(12, 4)] * 3, resamples=0)
