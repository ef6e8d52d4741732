"""Metrics of `splitspec bench`: from per-answer records to per-group figures, speed-ups and goals.

A record (`BenchRecord`) is one answer (one prompt x method x profile), written to results.jsonl
as one flat JSON object (`to_json`, read back by `from_json`). The fields the metrics use:

    mode         "local" (single-device) or "split" (verify service behind the link)
    method       drafter name with options, or "generate()" (plain transformers decoding)
    profile      link profile name ("loopback" without emulation; None for single-device rows)
    category     Spec-Bench category or "humaneval"
    new_tokens   tokens generated (EOS included)
    target_calls target forward passes the answer needed (open + verify calls; for generate(): one
                 per token)
    elapsed_s    client wall time of the whole answer, s
    bytes_sent / bytes_received   serialized protobuf bytes up / down over all calls (0 single-device)
    open_bytes_sent / open_bytes_received   the same for the open call alone (prompt ids up; first
                 token and the prompt's features down)
    server_ms    sum over calls of the server's own time (queue + forward), ms; None for generate()
    itl_ms       per-token gaps, ms (see `token_gaps_ms`)
    ttft_ms      time to the first token, ms

Definitions (every figure pools an aggregate's answers, so long answers weigh more):

    tokens/s         sum(new_tokens) / sum(elapsed_s)
    tau              accept length, sum(new_tokens - 1) / sum(target_calls - 1): tokens per verify
                     call (the first token comes from the open call, which verifies nothing);
                     shared/records.py `accept_length`, the estimator the loop and the trainer use
    calls/token      sum(target_calls) / sum(new_tokens)
    bytes/token      decoding-phase bytes per token: verify-call bytes (all minus open) divided by the
                     tokens the verify calls produced, sum(new_tokens - 1), each direction
    open KiB         mean bytes of the open call per answer, each direction (grows with the prompt)
    ITL p50/p99      quantiles (linear interpolation) of all per-token gaps
    server share     sum(server_ms) / sum(elapsed_s): the fraction of the client's wall time the
                     target spent computing (in single-device mode: the in-process target)
    paired           `paired_comparisons`, per mode and profile on the prompts both arms answered:
                     each variant of a drafter kind against the first method of that kind, the first
                     of every other kind against the first drafter; bootstrap intervals that keep
                     each prompt's two answers together (shared/records.py `paired_interval`)
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from typing import Iterable, Sequence

import numpy as np

from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.records import (AnswerRecord, accept_length, accept_length_interval, bootstrap_interval,
                                      calls_per_token, paired_interval, speed_ratio, tau_difference)

ALL = "all"  # the category of an aggregate over every category
BASELINE = "generate()"  # single-device autoregressive decoding (transformers generate)
REMOTE_AR = "none"  # split mode without drafting: one server call per token


def token_gaps_ms(start_s: float, arrivals_s: Sequence[float]) -> tuple[float, list[float]]:
    """Time to first token and the per-token inter-token latencies.

    Args:
        start_s: when the client asked for the answer (perf_counter seconds).
        arrivals_s: [N] when each token reached the client, non-decreasing; the tokens of one
            commit share the arrival time of that commit.
    Returns:
        (ttft_ms, gaps_ms) where gaps_ms [N - 1] holds arrival[i] - arrival[i - 1] for i >= 1: a
        token committed together with the one before it has gap 0, so with tau tokens per commit
        about (tau - 1) / tau of the gaps are zero and the p99 is the wait for the next commit.
    Raises:
        ValueError: no arrivals, or arrivals out of order or before the start.
    """
    if not arrivals_s:
        raise ValueError("no token arrived")
    if arrivals_s[0] < start_s or any(b < a for a, b in zip(arrivals_s, arrivals_s[1:])):
        raise ValueError("arrival times must be non-decreasing and not before the start")
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals_s, arrivals_s[1:])]
    return (arrivals_s[0] - start_s) * 1e3, gaps


def quantile(values: Iterable[float], q: float, method: str = "linear") -> float:
    """The q-quantile (0 <= q <= 1); NaN if empty. `method` as numpy's: "linear" interpolates
    between order statistics, "nearest" takes the one at round(q x (n - 1)) (a value that occurred:
    serve-bench's and prefill-bench's step latencies).

    Raises:
        ValueError: q outside [0, 1].
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile q must be in [0, 1], got {q}")
    data = np.fromiter(values, dtype=float)
    return float(np.quantile(data, q, method=method)) if data.size else math.nan


@dataclass(frozen=True)
class BenchRecord:
    """One answer of one arm on one prompt (see the module docstring).

    answer: the counts; itl_ms / ttft_ms: latencies (`token_gaps_ms`); exact: token-equal to
    generate()'s answer (None when sampled: samples need not agree); lsa / quant: MoA LSA placement and feature quantization (split moa and
    eagle2 rows only); link: the LinkProfile's fields; details: every other field of the JSON line
    (run facts, prompt size, the loop's further stats), written back as they came.
    """

    mode: str
    method: str
    profile: str | None
    category: str
    id: str
    answer: AnswerRecord
    itl_ms: tuple[float, ...] = ()
    ttft_ms: float | None = None
    exact: bool | None = True
    backend: str | None = None
    link: dict | None = None
    lsa: str | None = None
    quant: str | None = None
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The flat JSON object of results.jsonl."""
        typed = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("answer", "details")}
        return {**self.details, **typed, **asdict(self.answer), "itl_ms": list(self.itl_ms)}

    @classmethod
    def from_json(cls, row: dict) -> "BenchRecord":
        """Read one results.jsonl object; counts a row does not carry (generate() sends no bytes)
        are 0, a server time it does not carry is None.

        Raises:
            KeyError: a row without mode, method, profile, category, id, new_tokens, target_calls
                or elapsed_s.
        """
        required = {k: row[k] for k in ("mode", "method", "profile", "category", "id")}
        optional = {k: row[k] for k in ("ttft_ms", "exact", "backend", "link", "lsa", "quant") if k in row}
        optional["itl_ms"] = tuple(row.get("itl_ms", ()))
        counts = {f.name: row[f.name] for f in fields(AnswerRecord) if f.name in row}
        known = {f.name for f in fields(cls)} | {f.name for f in fields(AnswerRecord)}
        return cls(**required, answer=AnswerRecord(**counts), **optional,
                   details={k: v for k, v in row.items() if k not in known})


@dataclass(frozen=True)
class GroupKey:
    mode: str
    method: str
    profile: str | None
    category: str


@dataclass(frozen=True)
class GroupStats:
    """Pooled figures of one (mode, method, profile, category) aggregate; see the module docstring."""

    key: GroupKey
    answers: int
    exact: int | None  # answers token-equal to generate()'s; None when any was sampled (not compared)
    new_tokens: int
    target_calls: int
    tau: float  # shared/records.py accept_length over the group's answers
    elapsed_s: float
    bytes_up: int  # all calls
    bytes_down: int
    open_up: int  # open calls only
    open_down: int
    server_ms: float | None  # None when the rows do not report it (generate())
    itl_ms: tuple[float, ...]
    ttft_ms: tuple[float, ...]
    tau_ci95: tuple[float, float] = (math.nan, math.nan)  # records.accept_length_interval over the answers

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else math.nan

    @property
    def calls_per_token(self) -> float:
        return self.target_calls / self.new_tokens if self.new_tokens else math.nan

    @property
    def bytes_up_per_token(self) -> float:
        return self._per_verify_token(self.bytes_up - self.open_up)

    @property
    def bytes_down_per_token(self) -> float:
        return self._per_verify_token(self.bytes_down - self.open_down)

    def _per_verify_token(self, nbytes: int) -> float:
        tokens = self.new_tokens - self.answers  # the first token of each answer comes from the open call
        return nbytes / tokens if tokens > 0 else math.nan

    @property
    def open_kib_up(self) -> float:
        return self.open_up / self.answers / 1024

    @property
    def open_kib_down(self) -> float:
        return self.open_down / self.answers / 1024

    @property
    def itl_p50_ms(self) -> float:
        return quantile(self.itl_ms, 0.5)

    @property
    def itl_p99_ms(self) -> float:
        return quantile(self.itl_ms, 0.99)

    @property
    def ttft_p50_ms(self) -> float:
        return quantile(self.ttft_ms, 0.5)

    @property
    def server_share(self) -> float:
        if self.server_ms is None or self.elapsed_s <= 0:
            return math.nan
        return self.server_ms / (self.elapsed_s * 1e3)


def aggregate(records: Iterable[BenchRecord]) -> dict[GroupKey, GroupStats]:
    """Group answers by (mode, method, profile, category), plus an ALL-category group per
    (mode, method, profile). Keys keep the order in which they first appear."""
    rows: dict[GroupKey, list[BenchRecord]] = defaultdict(list)
    for r in records:
        for category in (ALL, r.category):
            rows[GroupKey(r.mode, r.method, r.profile, category)].append(r)
    return {key: _pool(key, rs) for key, rs in rows.items()}


def _pool(key: GroupKey, rows: list[BenchRecord]) -> GroupStats:
    answers = [r.answer for r in rows]
    server = [a.server_ms for a in answers]
    return GroupStats(
        key=key, answers=len(rows),
        exact=None if any(r.exact is None for r in rows) else sum(r.exact for r in rows),
        new_tokens=sum(a.new_tokens for a in answers), target_calls=sum(a.target_calls for a in answers),
        tau=accept_length(answers), elapsed_s=sum(a.elapsed_s for a in answers),
        bytes_up=sum(a.bytes_sent for a in answers), bytes_down=sum(a.bytes_received for a in answers),
        open_up=sum(a.open_bytes_sent for a in answers), open_down=sum(a.open_bytes_received for a in answers),
        server_ms=None if any(s is None for s in server) else float(sum(server)),
        itl_ms=tuple(g for r in rows for g in r.itl_ms),
        ttft_ms=tuple(r.ttft_ms for r in rows if r.ttft_ms is not None),
        tau_ci95=accept_length_interval(answers))


def speedup(groups: dict[GroupKey, GroupStats], key: GroupKey, reference: GroupKey) -> float:
    """tokens/s of `key` over tokens/s of `reference`; NaN when either is missing."""
    if key not in groups or reference not in groups:
        return math.nan
    return groups[key].tokens_per_s / groups[reference].tokens_per_s


def vs_remote_ar(key: GroupKey) -> GroupKey:
    """Split-mode no-drafting decoding (one call per token) under the same profile and category."""
    return GroupKey("split", REMOTE_AR, key.profile, key.category)


def vs_single_device_ar(key: GroupKey) -> GroupKey:
    """Plain single-device generate() on the same category."""
    return GroupKey("local", BASELINE, None, key.category)


def drafter_kind(method: str) -> str:
    """'moa:tli=1;lsa=server' -> 'moa'; 'draft-model:X' -> 'draft-model'."""
    return DrafterSpec.parse(method).kind


@dataclass(frozen=True)
class Goal:
    """One goal line: `subject` measured against `bound` (`at_least` or at most)."""

    text: str
    measured: float
    bound: float
    at_least: bool
    unit: str = "x"
    # 95% bootstrap interval over the run's prompts (paired where the goal is a ratio of two arms);
    # None where the goal was measured without the answers, or NaNs where too few prompts
    interval: tuple[float, float] | None = None

    @property
    def met(self) -> bool | None:
        if math.isnan(self.measured):
            return None
        return self.measured >= self.bound if self.at_least else self.measured <= self.bound

    def verdict(self) -> str:
        """'met', 'missed by N%' (the shortfall relative to the bound) or 'not measured'."""
        if self.met is None:
            return "not measured"
        if self.met:
            return "met"
        shortfall = (self.bound - self.measured) / self.bound if self.at_least else (self.measured - self.bound) / self.bound
        return f"missed by {100 * shortfall:.0f}%"

    @property
    def resolved(self) -> bool | None:
        """Whether the interval lies wholly on the verdict's side of the bound (the prompts tell met
        from missed); None without an interval."""
        if self.met is None or self.interval is None or any(math.isnan(x) for x in self.interval):
            return None
        low, high = self.interval
        if self.at_least:
            return low >= self.bound if self.met else high < self.bound
        return high <= self.bound if self.met else low > self.bound

    def line(self) -> str:
        sign = ">=" if self.at_least else "<="
        value = "n/a" if math.isnan(self.measured) else f"{self.measured:.2f}{self.unit}"
        text = f"{self.text}: goal {sign} {self.bound:g}{self.unit}, measured {value}"
        if self.resolved is not None:
            low, high = self.interval
            text += f" (95% CI {low:.2f}{self.unit} to {high:.2f}{self.unit})"
        verdict = self.verdict()
        if self.resolved is False:
            verdict += " (not resolved: the interval crosses the bound)"
        return f"{text} -> {verdict}"


def goals(groups: dict[GroupKey, GroupStats], profile: str = "4g",
          records: Iterable[BenchRecord] | None = None) -> list[Goal]:
    """Issue 10's speed goals: under `profile`, for every split MoA variant in the run, tokens/s
    >= 1.5x remote autoregressive and >= 1.2x eagle2 (the plain 'eagle2' method if run, else the
    first eagle2 variant), server calls per generated token <= 0.4; then, for every single-device
    MoA variant, tokens/s >= 1.5x plain generate(). Goals whose rows are missing are returned as not
    measured (NaN). With the run's `records`, each goal carries its 95% bootstrap interval over the
    prompts (`goal_interval`), so a verdict says whether these prompts resolve it.
    """
    split = [k for k in groups if k.mode == "split" and k.profile == profile and k.category == ALL]
    moas = [k for k in split if drafter_kind(k.method) == "moa"] or [GroupKey("split", "moa", profile, ALL)]
    eagles = [k for k in split if drafter_kind(k.method) == "eagle2"]
    eagle = next((k for k in eagles if k.method == "eagle2"), eagles[0] if eagles else GroupKey("split", "eagle2", profile, ALL))
    answers = _answers_by_arm(records) if records is not None else None

    def interval(key: GroupKey, reference: GroupKey | None = None) -> tuple[float, float] | None:
        return None if answers is None else goal_interval(answers, key, reference)

    out = []
    for moa in moas:
        calls = groups[moa].calls_per_token if moa in groups else math.nan
        out += [Goal(f"{moa.method} split tokens/s vs remote AR ({profile})",
                     speedup(groups, moa, vs_remote_ar(moa)), 1.5, True, interval=interval(moa, vs_remote_ar(moa))),
                Goal(f"{moa.method} split tokens/s vs {eagle.method} split ({profile})",
                     speedup(groups, moa, eagle), 1.2, True, interval=interval(moa, eagle)),
                Goal(f"{moa.method} server calls per generated token ({profile})", calls, 0.4, False, unit="",
                     interval=interval(moa))]
    local = [k for k in groups if k.mode == "local" and k.category == ALL and k.method != BASELINE
             and drafter_kind(k.method) == "moa"]
    out += [Goal(f"{moa.method} single-device tokens/s vs generate()", speedup(groups, moa, vs_single_device_ar(moa)),
                 1.5, True, interval=interval(moa, vs_single_device_ar(moa))) for moa in local]
    return out


def _answers_by_arm(records: Iterable[BenchRecord]) -> dict[tuple[str, str, str | None], dict[tuple, AnswerRecord]]:
    """{(mode, method, profile): {(category, id): answer}}: each arm's answers by prompt."""
    arms: dict[tuple[str, str, str | None], dict[tuple, AnswerRecord]] = defaultdict(dict)
    for r in records:
        arms[(r.mode, r.method, r.profile)][(r.category, r.id)] = r.answer
    return arms


def goal_interval(answers: dict, key: GroupKey, reference: GroupKey | None = None) -> tuple[float, float]:
    """95% percentile-bootstrap interval of a goal's figure over prompts (shared/records.py): with a
    `reference` arm, the pooled tokens/s ratio of `key` over it on the prompts both answered, each
    resample keeping a prompt's two answers together (`paired_interval`); without, `key`'s server
    calls per generated token, its answers resampled (`bootstrap_interval`). (NaN, NaN) where an arm
    is missing or fewer than two prompts count."""
    mine = answers.get((key.mode, key.method, key.profile), {})
    if reference is None:
        return bootstrap_interval(list(mine.values()), calls_per_token)
    theirs = answers.get((reference.mode, reference.method, reference.profile), {})
    prompts = [p for p in mine if p in theirs]
    return paired_interval([theirs[p] for p in prompts], [mine[p] for p in prompts], speed_ratio)


def feature_bytes(records: Iterable[BenchRecord], profile: str | None) -> list[tuple[str, str, str, GroupStats]]:
    """[(method, LSA placement, feature quantization, pooled stats)] of the split rows under
    `profile` whose drafter receives target features (records with a `quant` field: moa, eagle2),
    in first-seen order; the stats give bytes/token each way and the open call's KiB.
    """
    chosen = [r for r in records if r.mode == "split" and r.profile == profile and r.quant]
    options = {r.method: (r.lsa or "-", r.quant) for r in chosen}
    groups = aggregate(chosen)
    return [(m, lsa, quant, groups[GroupKey("split", m, profile, ALL)]) for m, (lsa, quant) in options.items()]


@dataclass(frozen=True)
class PairedComparison:
    """`method` against `base` (same mode and profile) on the `prompts` both answered: tau(method) -
    tau(base) and tokens/s(method) / tokens/s(base), each with its paired 95% bootstrap interval."""

    mode: str
    profile: str | None
    base: str
    method: str
    prompts: int
    tau_difference: float
    tau_difference_ci95: tuple[float, float]
    speed_ratio: float
    speed_ratio_ci95: tuple[float, float]


def paired_comparisons(records: Iterable[BenchRecord]) -> list[PairedComparison]:
    """Per (mode, profile), paired by (category, id): each variant of a drafter kind against the
    first method of that kind in the run (`moa;tree=3x2x6` or `moa:DIR` against `moa`: a sweep, or
    a new checkpoint beside the shipped one), and the first of each other kind against the run's
    first drafter. generate() and `none`, which draft nothing, are not compared."""
    arms: dict[tuple[str, str | None], dict[str, dict[tuple[str, str], AnswerRecord]]] = defaultdict(dict)
    for r in records:
        if r.method not in (BASELINE, REMOTE_AR):
            arms[(r.mode, r.profile)].setdefault(r.method, {})[(r.category, r.id)] = r.answer
    out = []
    for (mode, profile), by_method in arms.items():
        first_of_kind: dict[str, str] = {}
        for method in by_method:
            first_of_kind.setdefault(drafter_kind(method), method)
        run_first = next(iter(by_method))
        for method in by_method:
            base = first_of_kind[drafter_kind(method)]
            base = run_first if base == method else base
            if base == method:
                continue
            prompts = [p for p in by_method[base] if p in by_method[method]]
            a = [by_method[base][p] for p in prompts]
            b = [by_method[method][p] for p in prompts]
            out.append(PairedComparison(mode, profile, base, method, len(prompts), tau_difference(a, b),
                                        paired_interval(a, b, tau_difference), speed_ratio(a, b),
                                        paired_interval(a, b, speed_ratio)))
    return out
