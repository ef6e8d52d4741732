"""`splitspec train-curve`: the learning curve of training runs (held-out tau, top-1 agreement and,
for MoA, memory gain against training tokens), as a Markdown table and a PNG plot."""
from __future__ import annotations

import json
from pathlib import Path

METRICS = (("tau", "held-out tau (depth-5 top-4 24-node tree)"), ("heldout_top1", "held-out top-1 agreement"),
           ("memory_gain", "MoA memory gain (top-1, true - shuffled memory)"))


def read_histories(dirs: list[Path]) -> dict[str, list[dict]]:
    """{"drafter (run)": records} from every `history.jsonl` under `dirs` (a run dir or a drafter dir).

    A record needs `tokens` (or `tokens_total`, which counts the tokens an `--init` checkpoint had
    already seen), `tau` and `heldout_top1`; `memory_gain`, `heldout_loss` and `elapsed_s` are
    shown where present (a curve transcribed from an older run's notes may lack them). The drafter
    is the one its checkpoint's drafter.json names, where there is one (a one-drafter run keeps it
    beside history.jsonl in the run folder), else the history's folder (`<run>/<drafter>/`).

    Raises:
        ValueError: a folder that is missing or holds no history, a line that is no record or
            lacks a needed figure (named by file and line), or two histories of one label.
    """
    out, where = {}, {}
    for d in dirs:
        paths = [p for p in sorted(Path(d).rglob("history.jsonl")) if p.parent.name != "best"]
        if not paths:
            raise ValueError(f"{d}: no history.jsonl there (not a training run folder)")
        for path in paths:
            records = [_record(path, number, line) for number, line in enumerate(path.read_text().splitlines(), 1)
                       if line.strip()]
            drafter = _drafter(path.parent)
            run = path.parent.parent.name if drafter == path.parent.name else path.parent.name
            name = f"{drafter} ({run})"
            if name in out:
                raise ValueError(f"{where[name]} and {path} would both be labelled {name!r}: give the runs "
                                 f"folders of distinct names")
            out[name], where[name] = records, path
    return out


def _record(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} line {number}: not a JSON record ({err})") from None
    if not isinstance(record, dict) or "tau" not in record or "heldout_top1" not in record or not (
            "tokens" in record or "tokens_total" in record):
        raise ValueError(f"{path} line {number}: a record needs tau, heldout_top1 and tokens (or tokens_total)")
    return record


def _drafter(folder: Path) -> str:
    """The drafter name of a checkpoint folder's drafter.json (`DrafterJob.name`), else the folder's name."""
    from .trainer import DrafterJob

    meta = folder / "drafter.json"
    if not meta.exists():
        return folder.name
    return DrafterJob.of_checkpoint(json.loads(meta.read_text())).name


def tokens(record: dict) -> int:
    """The training tokens behind a record: `tokens_total` where written, else the run's `tokens`."""
    return record["tokens_total"] if "tokens_total" in record else record["tokens"]


def table(histories: dict[str, list[dict]]) -> str:
    lines = ["| drafter (run) | tokens | minutes | held-out tau | top-1 | memory gain | held-out loss |",
             "|---|---|---|---|---|---|---|"]
    for name, records in histories.items():
        for r in records:
            gain = f"{r['memory_gain']:+.3f}" if "memory_gain" in r else "-"
            minutes = f"{r['elapsed_s'] / 60:.0f}" if "elapsed_s" in r else "-"
            loss = f"{r['heldout_loss']:.3f}" if "heldout_loss" in r else "-"
            lines.append(f"| {name} | {tokens(r):,} | {minutes} | {r['tau']:.2f} | "
                         f"{r['heldout_top1']:.3f} | {gain} | {loss} |")
    return "\n".join(lines)


def run_styles(runs: list[str]) -> dict[str, tuple[str, str]]:
    """{run: (marker, line style)}, distinct for the first 48 runs."""
    return {r: ("os^Dv<>p*hXP"[i % 12], ("-", "--", ":", "-.")[i // 12 % 4]) for i, r in enumerate(runs)}


def plot(histories: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One colour per drafter in every panel, one marker and line style per run (48 runs before one
    # repeats): a continuation run reads as the same drafter's curve going on.
    drafters = sorted({name.split(" (")[0] for name in histories})
    runs = sorted({name.split(" (")[-1] for name in histories})
    colours = {d: f"C{i}" for i, d in enumerate(drafters)}
    styles = run_styles(runs)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 4))
    for ax, (key, title) in zip(axes, METRICS):
        for name, records in histories.items():
            points = [(tokens(r), r[key]) for r in records if key in r]
            if points:
                marker, line = styles[name.split(" (")[-1]]
                ax.plot(*zip(*points), color=colours[name.split(" (")[0]], marker=marker, linestyle=line, label=name)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # a narrow range labels its minor ticks, overlapping
        ax.set_xlabel("training tokens")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    # Beside the panels, not over them: a dozen runs would hide the curves they name.
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
