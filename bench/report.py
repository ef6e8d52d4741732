"""Tables and plots of `splitspec bench`, from the per-answer records (see bench/metrics.py).

The main table has the shape of the seed paper's client-server table (seed 001, Table 3): one row
per method, and per link profile the tokens/s, the accept length tau, the server calls (here per
generated token, since answer lengths differ) and the speed-up over remote autoregressive decoding
under the same profile.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from .metrics import (ALL, BASELINE, REMOTE_AR, BenchRecord, GroupKey, GroupStats, aggregate, feature_bytes, goals,
                      paired_comparisons, speedup, vs_remote_ar, vs_single_device_ar)

PLOTS = ("tokens_per_s.png", "calls_per_token.png", "itl_p99.png")
CALLS_GOAL = 0.4  # server calls per generated token, the issue's MoA goal (metrics.goals, the README)
DEFINITIONS = (
    "Definitions: tokens/s = generated tokens / client wall time (prefill included); tau = tokens per verify "
    "call (accepted + bonus); tau 95% CI = percentile bootstrap over the answers (shared/records.py); "
    "calls/token = server calls (open + verify) per generated token; bytes/token = serialized protobuf bytes "
    "per token in the decoding phase (verify calls), each way; open KiB = the open "
    "call's reply (first token and the prompt's features); ITL = gap between consecutive tokens' arrival at "
    "the client (the tokens of one commit arrive together, so gaps inside a commit are 0 and p99 is the wait "
    "for the next commit); TTFT = time to the first token; server share = server-reported time (queue + "
    "forward) / client wall time (single-device: the in-process target's time); vs remote AR = tokens/s over "
    "split `none` under the same profile; vs single-device AR = over plain generate(). Client and server "
    "share the machine's cores: compare ratios within this run only.")


def render_markdown(records: list[BenchRecord], meta: dict, cfg=None) -> str:
    """The whole report: header, client-server table, per-profile detail, per-category tokens/s,
    goal lines. `cfg` (a BenchConfig) adds the exact command; `meta` holds target, commit, machine,
    seed, max_new_tokens.

    Raises:
        ValueError: no generate() baseline rows among `records`.
    """
    groups = aggregate(records)
    if GroupKey("local", BASELINE, None, ALL) not in groups:
        raise ValueError("the records hold no generate() baseline rows")
    profiles = _profiles(records)
    lossy = inexact_answers(records)
    sections = [_header(records, meta, cfg), lossy, client_server_table(groups, profiles),
                *[detail_table(groups, p) for p in profiles], detail_table(groups, None),
                category_tables(groups, profiles), paired_section(records),
                goal_section(groups, records, cfg.goal if cfg else "4g", meta.get("target", "")), lossy]
    return "\n\n".join(s for s in sections if s)


def inexact_answers(records: list[BenchRecord]) -> str:
    """A WARNING paragraph naming every greedy answer that is not token-equal to generate()'s (arm
    and prompt), or '' when there is none. Sampled answers (`exact` None) are never compared: every
    arm's speed-up then stands for a lossless method only where this is empty."""
    lossy = [r for r in records if r.exact is False]
    if not lossy:
        return ""
    arms = dict.fromkeys(f"{r.mode} {r.method}" + (f" @{r.profile}" if r.profile else "") for r in lossy)
    answers = [f"{r.mode} {r.method}" + (f" @{r.profile}" if r.profile else "") + f" on {r.category}/{r.id}"
               for r in lossy]
    return (f"**WARNING: {len(lossy)} greedy answers differ from generate()'s, so these arms were not lossless "
            f"and their figures (goals included) are not those of speculative decoding: {', '.join(arms)}.** "
            f"Answers: {'; '.join(answers)}.")


def _profiles(records: list[BenchRecord]) -> list[str]:
    return list(dict.fromkeys(r.profile for r in records if r.mode == "split"))


def _methods(groups: dict[GroupKey, GroupStats], mode: str) -> list[str]:
    return list(dict.fromkeys(k.method for k in groups if k.mode == mode))


def _label(method: str, mode: str = "split") -> str:
    if method == REMOTE_AR:
        return f"{method} (remote AR)" if mode == "split" else f"{method} (AR, speculative loop)"
    return method


def _fmt(value: float, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None or math.isnan(value) else f"{value:{spec}}{suffix}"


def _interval(bounds: tuple[float, float], spec: str = ".2f", suffix: str = "") -> str:
    low, high = bounds
    return "-" if math.isnan(low) or math.isnan(high) else f"{low:{spec}}{suffix} to {high:{spec}}{suffix}"


def _header(records: list[BenchRecord], meta: dict, cfg) -> str:
    prompts = list(dict.fromkeys((r.category, r.id) for r in records))
    categories = list(dict.fromkeys(c for c, _ in prompts))
    backends = sorted({r.backend for r in records if r.backend}) or ["none (plain loopback)"]
    lines = [f"target {meta.get('target', '?')}, {meta.get('decoding', 'greedy')}, {len(prompts)} prompt{'s' if len(prompts) != 1 else ''} ({', '.join(categories)}), "
             f"up to {meta.get('max_new_tokens', '?')} new tokens each",
             "", f"- commit: {meta.get('commit', '?')}", f"- machine: {meta.get('machine', '?')}",
             f"- link backend: {', '.join(backends)}; seed {meta.get('seed', '?')}"]
    for name, link in dict.fromkeys((r.profile, _link_text(r.link)) for r in records if r.mode == "split"):
        lines.append(f"- profile {name}: {link}")
    lines += ["", DEFINITIONS]
    if cfg is not None:
        lines += ["", f"- MoA LSA placement {cfg.lsa_placement}, features {cfg.feature_quant} unless a method says "
                  f"otherwise", f"- command: `{cfg.command()}`"]
    return "\n".join(lines)


def _exact(g: GroupStats) -> str:
    """'k/n' answers token-equal to generate()'s; 'sampled' where they were not compared."""
    return "sampled" if g.exact is None else f"{g.exact}/{g.answers}"


def _link_text(link: dict | None) -> str:
    if not link:
        return "no emulation (loopback)"
    rate = f"{link['rate_mbit']:g} Mbit/s" if link.get("rate_mbit") else "unlimited rate"
    return (f"one-way delay {link['delay_ms']:g} ± {link['jitter_ms']:g} ms ({link['distribution']}) in each "
            f"direction (idle RTT ~{2 * link['delay_ms']:g} ms), {link['loss_pct']:g}% loss, {rate}")


def client_server_table(groups: dict[GroupKey, GroupStats], profiles: Sequence[str]) -> str:
    """Rows: split methods; per profile: tokens/s, tau, server calls per token, speed-up vs remote AR."""
    methods = _methods(groups, "split")
    if not methods:
        return ""
    head = "| method | " + " | ".join(f"{p} tokens/s | {p} tau | {p} calls/token | {p} vs remote AR"
                                       for p in profiles) + " |"
    lines = ["### Client-server", "", head, "|---|" + "---|---|---|---|" * len(profiles)]
    for m in methods:
        cells = []
        for p in profiles:
            key = GroupKey("split", m, p, ALL)
            g = groups.get(key)
            cells += ["-"] * 4 if g is None else [_fmt(g.tokens_per_s, ".1f"), _fmt(g.tau), _fmt(g.calls_per_token),
                                                  _fmt(speedup(groups, key, vs_remote_ar(key)), ".2f", "x")]
        lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_table(groups: dict[GroupKey, GroupStats], profile: str | None) -> str:
    """Every metric of every method under one profile (None: the single-device rows)."""
    mode = "local" if profile is None else "split"
    keys = [k for k in groups if k.mode == mode and k.profile == profile and k.category == ALL]
    if not keys:
        return ""
    title = "### Single-device reference" if profile is None else f"### Profile {profile}: all metrics"
    lines = [title, "", "| method | tokens/s | tau | tau 95% CI | calls/token | bytes/token up | bytes/token down | "
             "open KiB down | ITL p50 ms | ITL p99 ms | TTFT p50 ms | server share | vs remote AR | vs single-device AR | "
             "exact |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in keys:
        g = groups[k]
        lines.append(f"| {_label(k.method, mode)} | {_fmt(g.tokens_per_s, '.1f')} | {_fmt(g.tau)} | {_interval(g.tau_ci95)} | "
                     f"{_fmt(g.calls_per_token)} | "
                     f"{_fmt(g.bytes_up_per_token, '.0f')} | {_fmt(g.bytes_down_per_token, '.0f')} | "
                     f"{_fmt(g.open_kib_down, '.1f')} | "
                     f"{_fmt(g.itl_p50_ms, '.1f')} | {_fmt(g.itl_p99_ms, '.1f')} | {_fmt(g.ttft_p50_ms, '.0f')} | "
                     f"{_fmt(g.server_share, '.0%')} | {_fmt(speedup(groups, k, vs_remote_ar(k)), '.2f', 'x')} | "
                     f"{_fmt(speedup(groups, k, vs_single_device_ar(k)), '.2f', 'x')} | {_exact(g)} |")
    return "\n".join(lines)


def paired_section(records: list[BenchRecord]) -> str:
    """Side-by-side arms compared prompt by prompt (bench/metrics.py `paired_comparisons`): what a
    run can tell apart."""
    rows = paired_comparisons(records)
    if not rows:
        return ""
    lines = ["### Paired by prompt: variants against the first of their kind, kinds against the first drafter", "",
             "Differences over the prompts both arms answered; 95% intervals from a bootstrap that keeps "
             "each prompt's two answers together (an interval that excludes 0 for tau, or 1 for tokens/s, "
             "is a difference these prompts resolve).", "",
             "| mode | profile | method | against | prompts | tau difference | 95% CI | tokens/s ratio | 95% CI |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        lines.append(f"| {c.mode} | {c.profile or '-'} | {c.method} | {c.base} | {c.prompts} | "
                     f"{_fmt(c.tau_difference, '+.2f')} | {_interval(c.tau_difference_ci95, '+.2f')} | "
                     f"{_fmt(c.speed_ratio, '.2f', 'x')} | {_interval(c.speed_ratio_ci95, '.2f', 'x')} |")
    return "\n".join(lines)


def category_tables(groups: dict[GroupKey, GroupStats], profiles: Sequence[str]) -> str:
    """Per profile: rows methods, columns categories, cells 'tokens/s (speed-up vs remote AR)'."""
    categories = list(dict.fromkeys(k.category for k in groups if k.category != ALL))
    out = []
    for p in profiles:
        lines = [f"#### {p}: tokens/s by category (speed-up vs remote AR)", "",
                 "| method | " + " | ".join(categories) + " |", "|---|" + "---|" * len(categories)]
        for m in _methods(groups, "split"):
            cells = []
            for c in categories:
                key = GroupKey("split", m, p, c)
                cells.append("-" if key not in groups else
                             f"{groups[key].tokens_per_s:.1f} ({_fmt(speedup(groups, key, vs_remote_ar(key)), '.2f', 'x')})")
            lines.append(f"| {_label(m)} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(["### By category", *out]) if out else ""


def goal_section(groups: dict[GroupKey, GroupStats], records: list[BenchRecord], profile: str, target: str) -> str:
    """The issue's goals under `profile`, each with the measured value and met / missed by how much,
    then the bytes per generated token of each feature quantization. The heading says "sampled" when
    the records are sampled answers (`exact` None: nothing to compare), else "greedy"."""
    decoding = "sampled" if any(r.exact is None for r in records) else "greedy"
    lines = [f"### Goals ({decoding}, {target or 'target'}, profile {profile})", ""]
    run_profiles = _profiles(records)
    if not run_profiles:  # --profiles means nothing without split methods (QA 57: it said to add one given)
        lines += ["This run has no split methods (--methods ''), so no split goal is measured.", ""]
    elif profile not in run_profiles:
        lines += [f"Profile {profile} was not among this run's link profiles ({', '.join(run_profiles)}): its "
                  f"split goals are not measured (run with --profiles {profile}, or pick one with --goal-profile).",
                  ""]
    lines += [f"- {g.line()}" for g in goals(groups, profile, records)]
    rows = feature_bytes(records, profile)
    if rows:
        lines += ["", f"Bytes per generated token by feature quantization ({profile}; decoding phase, and the "
                  "open call that carries the prompt's features):", "",
                  "| method | LSA placement | features | bytes/token up | bytes/token down | open KiB up | open KiB down |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {m} | {lsa} | {quant} | {g.bytes_up_per_token:.0f} | {g.bytes_down_per_token:.0f} | "
                  f"{g.open_kib_up:.1f} | {g.open_kib_down:.1f} |" for m, lsa, quant, g in rows]
    return "\n".join(lines)


def write_plots(records: list[BenchRecord], out: Path, profiles: Sequence[str] | None = None) -> list[Path]:
    """Grouped bar charts (x: link profile, one bar per split method) of tokens/s (with the
    single-device rows as dashed lines), server calls per generated token, and ITL p99.

    Returns:
        The PNG paths written under `out` (PLOTS); none when the run had no split rows.
    """
    from matplotlib.figure import Figure

    groups = aggregate(records)
    profiles = list(profiles) if profiles is not None else _profiles(records)
    methods = _methods(groups, "split")
    if not profiles or not methods:
        return []
    out.mkdir(parents=True, exist_ok=True)
    figures = [("tokens_per_s.png", "tokens/s", lambda g: g.tokens_per_s),
               ("calls_per_token.png", "server calls per generated token", lambda g: g.calls_per_token),
               ("itl_p99.png", "inter-token latency p99, ms", lambda g: g.itl_p99_ms)]
    paths = []
    width = 0.8 / len(methods)
    for name, ylabel, value in figures:
        fig = Figure(figsize=(max(6.0, 1.6 * len(profiles) + 3), 4.2), layout="constrained")
        ax = fig.add_subplot()
        for i, m in enumerate(methods):
            heights = [value(groups[k]) if (k := GroupKey("split", m, p, ALL)) in groups else math.nan for p in profiles]
            ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in range(len(profiles))], heights, width,
                   label=_label(m))
        if name == "calls_per_token.png":
            ax.axhline(CALLS_GOAL, linestyle=":", linewidth=1, color="black", label=f"goal <= {CALLS_GOAL:g} (MoA)")
        if name == "tokens_per_s.png":
            for j, k in enumerate(k for k in groups if k.mode == "local" and k.category == ALL):
                ax.axhline(groups[k].tokens_per_s, linestyle="--", linewidth=1, color=f"C{(len(methods) + j) % 10}",
                           label=f"single-device {k.method}")
        ax.set_title(f"{ylabel} by link profile (one run)", fontsize="medium")
        ax.set_xticks(range(len(profiles)), profiles)
        ax.set_xlabel("link profile")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))
        path = out / name
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths
