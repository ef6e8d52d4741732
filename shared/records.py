"""`AnswerRecord`: one answer's counts, `accept_length`, the one tau estimator,
`accept_length_interval`, how far that estimate moves with the answers it was measured on, and
`paired_interval`, the same for a comparison of two arms that answered the same prompts.

The loop (client/loop.py `GenerationStats.record`), the benchmarks (bench/metrics.py) and the
trainer's held-out evaluation report tau through `accept_length`, so that every table and card
states the same figure.

tau, the accept length, is what the papers report (MoA seed 001 §4, EAGLE / EAGLE-2, Spec-Bench):
the mean number of tokens one verify call (one drafting-verification cycle) produces, accepted
draft tokens plus the target's bonus token, so tau >= 1. Averaged over verify calls, not over
answers: Spec-Bench (hemingkx/Spec-Bench, evaluation/speed.py) extends one list with every
answer's per-step accept lengths and reports its mean ("#Mean accepted tokens"), which is the
ratio of sums sum(tokens from verify calls) / sum(verify calls). Long answers weigh more
than short ones; a mean of per-answer ratios would weigh every answer alike and differ. The open
call (prefill) yields the first token without verifying anything, so it counts on neither side;
nor do tokens no verify call produced (written by the drafter alone while the link was down and
never verified, kept against the target's choice, or written from private text on the device).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, TypeVar

R = TypeVar("R")  # one prompt's record in a paired comparison


@dataclass(frozen=True)
class AnswerRecord:
    """One answer's counts.

    new_tokens: tokens generated (EOS included). target_calls: target forward passes, the open call
    plus every verify call (plain generate(): one per token). elapsed_s: client wall time, s.
    bytes_*: serialized protobuf bytes over all calls, each way (0 single-device); open_bytes_*:
    the open call's alone. server_ms: the server-reported time summed over calls, ms (None when
    not reported). unverified_tokens: tokens of the answer no verify call produced (offline and
    never verified, kept, private; client/answer.py `Provenance`); 0 for an answer made online.
    """

    new_tokens: int
    target_calls: int
    elapsed_s: float
    bytes_sent: int = 0
    bytes_received: int = 0
    open_bytes_sent: int = 0
    open_bytes_received: int = 0
    server_ms: float | None = None
    unverified_tokens: int = 0

    @property
    def tau(self) -> float:
        return accept_length([self])

    @property
    def verify_tokens(self) -> int:
        """Tokens the verify calls produced: all but the open call's first and the unverified ones."""
        return self.new_tokens - 1 - self.unverified_tokens


def accept_length(records: Iterable[AnswerRecord]) -> float:
    """tau pooled over `records` (see the module docstring):
    sum(new_tokens - 1 - unverified_tokens) / sum(target_calls - 1).

    Returns:
        Tokens per verify call; NaN when no verify call was made.
    """
    tokens = calls = 0
    for r in records:
        tokens += r.verify_tokens
        calls += r.target_calls - 1
    return tokens / calls if calls > 0 else math.nan


def calls_per_token(records: Iterable[AnswerRecord]) -> float:
    """Server calls (open + verify) per generated token pooled over `records`:
    sum(target_calls) / sum(new_tokens); NaN when no token was generated."""
    tokens = calls = 0
    for r in records:
        tokens += r.new_tokens
        calls += r.target_calls
    return calls / tokens if tokens > 0 else math.nan


def accept_length_interval(records: Iterable[AnswerRecord], level: float = 0.95, resamples: int = 2000,
                           seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `accept_length` over answers (Efron and Tibshirani, "An
    Introduction to the Bootstrap", 1993, ch. 13): the answers are drawn again with replacement
    `resamples` times, the pooled ratio recomputed each time, and the central `level` share of those
    ratios kept. Answers, not verify calls, are the unit drawn: calls within an answer share its
    prompt and are not independent. Deterministic for a given `seed`.

    Returns:
        (low, high), tokens per verify call; (NaN, NaN) with fewer than two answers that made a
        verify call, where an interval says nothing.
    Raises:
        ValueError: `level` outside (0, 1) or `resamples` < 1.
    """
    import numpy as np

    _check_bootstrap(level, resamples)
    records = list(records)
    tokens = np.array([r.verify_tokens for r in records], dtype=np.float64)  # as accept_length counts them
    calls = np.array([r.target_calls - 1 for r in records], dtype=np.float64)
    if int((calls > 0).sum()) < 2:
        return math.nan, math.nan
    draws = _draws(len(records), resamples, seed)
    with np.errstate(invalid="ignore", divide="ignore"):  # a resample without verify calls: NaN, left out
        ratios = tokens[draws].sum(axis=1) / calls[draws].sum(axis=1)
    return _central(ratios, level)


def bootstrap_interval(records: Sequence[R], statistic: Callable[[list[R]], float], level: float = 0.95,
                       resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic(records)` over one arm's per-prompt records (the
    one-sample counterpart of `paired_interval`; e.g. server calls per generated token pooled over
    answers). Deterministic for a given `seed`.

    Returns:
        (low, high); (NaN, NaN) with fewer than two records or where no resample gives a finite value.
    Raises:
        ValueError: `level` outside (0, 1) or `resamples` < 1.
    """
    _check_bootstrap(level, resamples)
    if len(records) < 2:
        return math.nan, math.nan
    draws = _draws(len(records), resamples, seed).tolist()
    return _central([statistic([records[i] for i in row]) for row in draws], level)


def paired_interval(base: Sequence[R], other: Sequence[R], statistic: Callable[[list[R], list[R]], float],
                    level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic(base, other)` with the prompts drawn jointly:
    base[i] and other[i] answer the same prompt, and each resample keeps those pairs together.
    The records are anything per prompt the statistic reads (`AnswerRecord`s for tau; the trainer's
    per-conversation held-out counts for top-1 and loss).
    Two arms run side by side on the same prompts share each prompt's difficulty, so the interval of
    their difference (e.g. `tau_difference`) is far narrower than the two arms' own intervals
    suggest; this is the interval that says whether one arm beats the other on these prompts.

    Returns:
        (low, high); (NaN, NaN) with fewer than two pairs or where no resample gives a finite value.
    Raises:
        ValueError: `base` and `other` of different lengths, `level` outside (0, 1), `resamples` < 1.
    """
    if len(base) != len(other):
        raise ValueError(f"paired answers: {len(base)} against {len(other)}")
    return bootstrap_interval(list(zip(base, other)),
                              lambda pairs: statistic([b for b, _ in pairs], [o for _, o in pairs]), level, resamples, seed)


def _check_bootstrap(level: float, resamples: int) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")


def _draws(n: int, resamples: int, seed: int):
    """[resamples, n] indices drawn with replacement (numpy), seeded."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _central(values, level: float) -> tuple[float, float]:
    """The central `level` share of the finite `values` (percentiles); (NaN, NaN) if none is finite."""
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if not len(values):
        return math.nan, math.nan
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def tau_difference(base: Sequence[AnswerRecord], other: Sequence[AnswerRecord]) -> float:
    """accept_length(other) - accept_length(base)."""
    return accept_length(other) - accept_length(base)


def speed_ratio(base: Sequence[AnswerRecord], other: Sequence[AnswerRecord]) -> float:
    """Pooled tokens/s of `other` over that of `base` (tokens and wall time summed over answers)."""
    base_s, other_s = sum(r.elapsed_s for r in base), sum(r.elapsed_s for r in other)
    if base_s <= 0 or other_s <= 0:
        return math.nan
    return (sum(r.new_tokens for r in other) / other_s) / (sum(r.new_tokens for r in base) / base_s)
