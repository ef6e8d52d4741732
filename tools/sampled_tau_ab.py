"""Sampled tau with the dynamic tree's slot scores (since 1f2ede1) against the drawn-token scores
before it, side by side in one process, the same seed per prompt for both arms.

    python tools/sampled_tau_ab.py [DRAFTER] [PER_CATEGORY] [NEW_TOKENS]    # default: moa 1 48

Single-device, SmolLM2-135M (fp32), Spec-Bench prompts (PER_CATEGORY of each category), T = 0.7,
top-p 0.9, the default tree. The old rule is rebuilt around the current `_add_children` (the same
draws): each sampled child's score becomes its parent's plus the log of its own token's probability,
capped by the previous sibling's. docs/benchmarks.md "Session 52" has the figures.
"""
import argparse
import math

import torch

from splitspec.bench.prompts import load_prompts
from splitspec.cli.main import load_local_verifier
from splitspec.client import build
from splitspec.client.drafters import dynamic_tree
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.models import encode_chat
from splitspec.shared.records import accept_length
from splitspec.shared.sampling import SamplingParams

slot_scores = dynamic_tree._add_children


def drawn_scores(pool, rows, parent, parent_score, depth, logits, top_b, sampling, generator, max_support):
    kids = slot_scores(pool, rows, parent, parent_score, depth, logits, top_b, sampling, generator, max_support)
    if not sampling.greedy:
        row = dict(zip(rows[parent].token_ids.tolist(), rows[parent].probs.tolist()))
        cap = parent_score
        for k in kids:
            cap = min(cap, parent_score + math.log(row[pool[k].token]))
            pool[k].score = cap
    return kids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", nargs="?", default="moa")
    parser.add_argument("per_category", nargs="?", type=int, default=1, help="Spec-Bench prompts of each category")
    parser.add_argument("new_tokens", nargs="?", type=int, default=48)
    args = parser.parse_args()
    drafter, per_category, new_tokens = args.drafter, args.per_category, args.new_tokens
    torch.set_num_threads(2)
    setup = build.build_client(build.ClientConfig(target="smollm2-135m", drafter=DrafterSpec.parse(drafter),
                                                  server=None, sampling=SamplingParams(0.7, 0.9)),
                               load_local_verifier)
    arms = {"slot scores (now)": slot_scores, "drawn-token scores (before)": drawn_scores}
    records = {arm: [] for arm in arms}
    for k, prompt in enumerate(load_prompts(["spec_bench"], per_category)):
        ids = encode_chat(setup.tokenizer, [{"role": "user", "content": prompt["text"]}])
        for arm, add_children in arms.items():
            dynamic_tree._add_children = add_children
            gen = setup.decoder.generate(ids, new_tokens, SamplingParams(temperature=0.7, top_p=0.9, seed=1000 + k))
            records[arm].append(gen.stats.record())
    for arm, recs in records.items():
        print(f"{drafter} {arm}: tau {accept_length(recs):.3f} over {len(recs)} answers, "
              f"{sum(r.new_tokens for r in recs)} tokens, {sum(r.elapsed_s for r in recs):.1f} s")


if __name__ == "__main__":
    main()
