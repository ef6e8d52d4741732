"""`AnswerRecord`: one answer's counts, and `accept_length`, the one tau estimator.

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
call (prefill) yields the first token without verifying anything, so it counts on neither side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class AnswerRecord:
    """One answer's counts.

    new_tokens: tokens generated (EOS included). target_calls: target forward passes, the open call
    plus every verify call (plain generate(): one per token). elapsed_s: client wall time, s.
    bytes_*: serialized protobuf bytes over all calls, each way (0 single-device); open_bytes_*:
    the open call's alone. server_ms: the server-reported time summed over calls, ms (None when
    not reported).
    """

    new_tokens: int
    target_calls: int
    elapsed_s: float
    bytes_sent: int = 0
    bytes_received: int = 0
    open_bytes_sent: int = 0
    open_bytes_received: int = 0
    server_ms: float | None = None

    @property
    def tau(self) -> float:
        return accept_length([self])

    @property
    def verify_tokens(self) -> int:
        """Tokens the verify calls produced: all but the open call's first."""
        return self.new_tokens - 1


def accept_length(records: Iterable[AnswerRecord]) -> float:
    """tau pooled over `records` (see the module docstring): sum(new_tokens - 1) / sum(target_calls - 1).

    Returns:
        Tokens per verify call; NaN when no verify call was made.
    """
    tokens = calls = 0
    for r in records:
        tokens += r.new_tokens - 1
        calls += r.target_calls - 1
    return tokens / calls if calls > 0 else math.nan
