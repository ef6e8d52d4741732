"""tau's estimator and its bootstrap interval over answers (shared/records.py)."""
from __future__ import annotations

import math

import pytest

from splitspec.shared.records import (AnswerRecord, accept_length, accept_length_interval, bootstrap_interval,
                                      calls_per_token, paired_interval, speed_ratio, tau_difference)


def answer(verify_tokens: int, verify_calls: int) -> AnswerRecord:
    """An answer whose verify calls produced `verify_tokens` tokens (the open call adds one of each)."""
    return AnswerRecord(new_tokens=verify_tokens + 1, target_calls=verify_calls + 1, elapsed_s=1.0)


def test_interval_of_two_answers_spans_their_own_ratios():
    """Two answers at tau 2 and 4: a resample holds both (pooled 50/15), or one twice (2 or 4), each
    with a quarter of the draws, so the central 95% runs from exactly 2 to exactly 4."""
    records = [answer(10, 5), answer(40, 10)]
    assert accept_length(records) == pytest.approx(50 / 15)
    assert accept_length_interval(records) == (2.0, 4.0)


def test_interval_leaves_out_unverified_tokens_as_tau_does():
    """Tokens the client wrote offline (or kept, or private) were verified by no call: tau leaves
    them out, and so must its interval, or it would not bracket tau."""
    offline = [AnswerRecord(new_tokens=41, target_calls=11, elapsed_s=1.0, unverified_tokens=10)] * 3
    assert accept_length(offline) == pytest.approx(3.0)
    assert accept_length_interval(offline) == (pytest.approx(3.0), pytest.approx(3.0))


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


def test_paired_interval_sees_a_steady_gain_that_the_arms_own_intervals_hide():
    """Eight prompts from easy to hard (tau 1.5 to 5): the other arm gains 0.2 on every one. Each
    arm's own interval spans most of that range, yet paired by prompt the difference is 0.2 in every
    resample."""
    base = [answer(10 * k // 2, 10) for k in range(3, 11)]  # tau 1.5, 2, ..., 5
    other = [answer(10 * k // 2 + 2, 10) for k in range(3, 11)]
    assert tau_difference(base, other) == pytest.approx(0.2)
    low, high = paired_interval(base, other, tau_difference)
    assert low == pytest.approx(0.2) and high == pytest.approx(0.2)
    assert accept_length_interval(other)[0] < accept_length_interval(base)[1]  # the arms' own intervals overlap


def test_paired_interval_keeps_pairs_together_and_refuses_unpaired_input():
    base = [answer(20, 10), answer(20, 10), answer(20, 10)]
    other = [answer(40, 10), answer(10, 10), answer(30, 10)]  # +2, -1, +1 tokens per call
    low, high = paired_interval(base, other, tau_difference)
    assert low == pytest.approx(-1.0) and high == pytest.approx(2.0)  # a resample of one prompt thrice
    assert all(math.isnan(x) for x in paired_interval(base[:1], other[:1], tau_difference))
    with pytest.raises(ValueError, match="paired"):
        paired_interval(base, other[:2], tau_difference)


def test_bootstrap_interval_resamples_one_arm():
    """One arm's pooled figure: equal records give a point; unequal ones an interval within their
    extremes that contains the full sample's figure; too few records give NaN, bad settings an error."""
    pooled = calls_per_token
    same = [AnswerRecord(10, 5, 1.0)] * 4
    assert bootstrap_interval(same, pooled) == (pytest.approx(0.5), pytest.approx(0.5))
    mixed = [AnswerRecord(10, 2, 1.0), AnswerRecord(10, 8, 1.0), AnswerRecord(10, 5, 1.0), AnswerRecord(10, 4, 1.0)]
    low, high = bootstrap_interval(mixed, pooled)
    assert 0.2 <= low < pooled(mixed) < high <= 0.8
    assert all(math.isnan(x) for x in bootstrap_interval(mixed[:1], pooled))
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval(mixed, pooled, level=1.5)


def test_speed_ratio_pools_tokens_and_time():
    base = [AnswerRecord(10, 5, 1.0), AnswerRecord(30, 10, 3.0)]  # 10 tokens/s
    other = [AnswerRecord(10, 3, 0.5), AnswerRecord(30, 6, 1.5)]  # 20 tokens/s
    assert speed_ratio(base, other) == pytest.approx(2.0)
    assert paired_interval(base, other, speed_ratio) == (pytest.approx(2.0), pytest.approx(2.0))
    assert math.isnan(speed_ratio(base, [AnswerRecord(10, 3, 0.0)]))


def test_calls_per_token_pools_calls_over_tokens():
    """Pooled, not a mean of ratios: 5 + 10 calls over 10 + 40 tokens is 0.3 (the answers' own 0.5
    and 0.25 average 0.375); no tokens at all is NaN, not zero."""
    records = [AnswerRecord(10, 5, 1.0), AnswerRecord(40, 10, 1.0)]
    assert calls_per_token(records) == pytest.approx(0.3)
    assert math.isnan(calls_per_token([]))
    assert bootstrap_interval(records[:1] * 2, calls_per_token) == (pytest.approx(0.5), pytest.approx(0.5))


def test_unverified_tokens_count_on_neither_side():
    """Tokens no verify call produced (offline, kept, private) leave tau as the verify calls made it."""
    online = AnswerRecord(new_tokens=11, target_calls=5, elapsed_s=1.0)
    with_offline = AnswerRecord(new_tokens=17, target_calls=5, elapsed_s=1.0, unverified_tokens=6)
    assert online.tau == with_offline.tau == 2.5
    assert with_offline.verify_tokens == 10
    assert accept_length([online, with_offline]) == 2.5
