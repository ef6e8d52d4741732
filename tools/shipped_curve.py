"""Measure every checkpoint ever shipped, from git history, on today's held-out prompts.

The learning-curve records under docs/curves/ were written by each run as it went, so they use the
held-out prompts and tau setting of their day (16 prompts until session 30 found that 3 of them
start training conversations; 13 clean ones since). This tool takes each shipped version of the
named drafters out of git (one per distinct `model.safetensors` blob, oldest first), measures it
with `splitspec train --eval-only` on one fixed setting, and appends one record per checkpoint to
OUT/<drafter>/history.jsonl, which `splitspec train-curve` reads like any run's. Resumable: a
checkpoint (blob) already in OUT is skipped.

    python tools/shipped_curve.py --out docs/curves/shipped-clean13 --eval-prompts 16

Run from the repository root with the project's environment active. Each checkpoint costs one
`--eval-only` (target load, held-out loss/top-1/memory gain, tau over the prompts).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from splitspec.train.trainer import DrafterJob

CHECKPOINTS = "client/checkpoints/smollm2-135m"


def git(*args: str, repo: str = ".") -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def shipped_versions(name: str, repo: str = ".") -> list[tuple[str, str]]:
    """[(commit, blob)] oldest first: the commits that changed NAME's weights, one per distinct blob
    (a commit that restores earlier weights, or that only touched the card, adds nothing)."""
    path = f"{CHECKPOINTS}/{name}/model.safetensors"
    seen, out = set(), []
    for rev in reversed(git("log", "--format=%H", "--", path, repo=repo).split()):
        try:
            blob = git("rev-parse", f"{rev}:{path}", repo=repo).strip()
        except subprocess.CalledProcessError:  # the commit removed it
            continue
        if blob not in seen:
            seen.add(blob)
            out.append((rev, blob))
    return out


def extract(rev: str, name: str, meta_text: str, dest: Path) -> None:
    """Write the checkpoint NAME of commit REV into `dest` (its drafter.json already read as `meta_text`)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "drafter.json").write_text(meta_text)
    weights = subprocess.run(["git", "show", f"{rev}:{CHECKPOINTS}/{name}/model.safetensors"], check=True,
                             capture_output=True).stdout
    (dest / "model.safetensors").write_bytes(weights)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default="moa-tli0,eagle2", help="checkpoint folder names under " + CHECKPOINTS)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--heldout", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=1_000_000,
                   help="skip checkpoints whose card records fewer training tokens (older recipes)")
    p.add_argument("--work", type=Path, default=Path("out/shipped-curve"))
    p.add_argument("--limit", type=int, default=0, help="measure at most this many checkpoints this call (0 = all)")
    args = p.parse_args()

    done = 0
    for name in args.drafters.split(","):
        history = args.out / name / "history.jsonl"
        measured = {json.loads(line)["blob"] for line in history.read_text().splitlines()} if history.exists() else set()
        for rev, blob in shipped_versions(name):
            if blob in measured or (args.limit and done >= args.limit):
                continue
            meta_text = git("show", f"{rev}:{CHECKPOINTS}/{name}/drafter.json")
            meta = json.loads(meta_text)
            training = meta.get("training", {})
            tokens = training.get("tokens_total", training.get("tokens", 0))
            if tokens < args.min_tokens:
                continue
            dest = args.work / rev[:10] / name
            extract(rev, name, meta_text, dest)
            cmd = ["splitspec", "train", "--drafter", DrafterJob.of_checkpoint(meta).spec, "--target", "smollm2-135m",
                   "--init", str(dest), "--eval-only", "--eval-prompts", str(args.eval_prompts),
                   "--heldout", str(args.heldout)]
            print(f"{rev[:10]} {name} ({tokens:,} tokens): {' '.join(cmd)}", file=sys.stderr, flush=True)
            result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            record = {"rev": rev[:10], "blob": blob, "tokens_total": tokens,
                      **{k: v for k, v in result[name].items() if k not in ("init", "tokens_total")}}
            history.parent.mkdir(parents=True, exist_ok=True)
            with history.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps({k: record[k] for k in ("rev", "tokens_total", "tau", "heldout_top1")}), flush=True)
            shutil.rmtree(dest.parent)
            done += 1


if __name__ == "__main__":
    main()
