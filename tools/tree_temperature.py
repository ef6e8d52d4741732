"""Held-out tau of drafters when the EAGLE-2 tree scores their logits divided by a temperature T.

An experiment, not a feature (docs/training.md, "Session 40"): greedy verification accepts a node
when its token is the target's argmax, while the drafters are trained to match the target's
distribution, so their probabilities need not rank tree nodes by acceptance. Dividing the logits by
T before `client/drafters/dynamic_tree` scores them keeps every node's top-B children and changes
which frontier nodes are expanded and which `max_nodes` are kept. This measures the tau of
`splitspec train --eval-only` (the goal's 5x4x24 tree, greedy, the held-out prompts) per T, and
writes each answer's counts so two temperatures can be compared paired by prompt
(shared/records.py `paired_interval`).

    python tools/tree_temperature.py --drafter moa,eagle2 --temperatures 0.5,0.7,1.0,1.5 \\
        --eval-prompts 16 --out out/tree-temperature.json

Run from the repository root with the project's environment active (~30 s per drafter and T on a
2-core CPU at 16 prompts x 48 tokens).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from splitspec.client.drafters import dynamic_tree
from splitspec.shared.models import load_model
from splitspec.train import trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default="moa,eagle2")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--init", default="client/checkpoints/smollm2-135m")
    p.add_argument("--temperatures", default="0.5,0.7,1.0,1.5")
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--heldout", type=int, default=16)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]

    add_children = dynamic_tree._add_children
    current = {"t": 1.0}

    def scaled(pool, rows, parent, parent_score, depth, logits, *rest):
        return add_children(pool, rows, parent, parent_score, depth, logits / current["t"], *rest)

    dynamic_tree._add_children = scaled  # build_tree looks the helper up in its module at each call

    cfg = trainer.TrainConfig(drafter=args.drafter, target=args.target, init=args.init, out=args.out.parent,
                              eval_only=True, heldout=args.heldout, eval_prompts=args.eval_prompts)
    model, tokenizer, model_id = load_model(cfg.target, device="cpu")
    identity = trainer.TargetIdentity.of(model, tokenizer, model_id)
    held = trainer.sharegpt_split(cfg.heldout, cfg.split_seed, cfg.conversations)[1][: cfg.eval_prompts]
    results = {}
    for job in cfg.jobs():
        drafter = trainer._init_drafter(cfg, job, model.config, identity)[0]
        drafter = trainer._on_cpu(drafter, cfg).eval()
        parts = trainer.TargetParts(model, job.tli)
        for t in temperatures:
            current["t"] = t
            answers = trainer.measure_tau(cfg, drafter, parts, model, tokenizer, held, job)
            results[f"{job.name} T={t}"] = {"tau": trainer.accept_length(answers),
                                            "answers": [[a.new_tokens, a.target_calls] for a in answers]}
            print(f"{job.name} T={t}: tau {results[f'{job.name} T={t}']['tau']:.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
