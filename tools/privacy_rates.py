"""How often the privacy guard acts on public text: the target's own answers, each after a prompt
that holds a private span the answer does not contain (client/privacy.py).

For every answer position i, with path = the answer's next 4 tokens (a drafter that is always
right), counts per 1,000 answer tokens how often `private_run` would write the path's start locally
(unverified: the answer then departs from the target's) and how often `prune` would drop a node (a
smaller tree, still lossless), for the id rule alone (no decode) and for the guard as the CLI and
the daemon build it (the tokenizer's decode: the text rule, and local writing only for runs of
MIN_RUN_CHARS letters or digits). Secrets: 20 synthetic ones (names, addresses, e-mails, numbers,
passwords) or `--kind other`, 4-10 words of another answer (private spans of common words).

    python tools/privacy_rates.py [--answers 300] [--kind synthetic|other]   # ~1 minute each, one thread

Session 55 (SmolLM2's tokenizer, 300 answers of data/smollm2-answers.jsonl, 58,412 positions):
local writes 10.96 -> 0.00 per 1,000 (synthetic) and 8.25 -> 2.29 (other).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from splitspec.client.drafters.base import Proposal
from splitspec.client.privacy import PrivacyGuard, encode_private_chat, placeholder_token
from splitspec.shared.models import load_tokenizer
from splitspec.shared.tree import DraftTree

SECRETS = [
    "John Whitaker, 42 Maple Street, Springfield", "maria.gonzalez84@gmail.com", "hunter2", "Tr0ub4dor&3",
    "Sarah O'Connor, 1187 Elm Avenue, Apt 5B", "+1 (415) 555-0192", "4539 1488 0343 6467", "SSN 078-05-1120",
    "Dr. Rajesh Patel", "22B Baker Street, Zürich", "Zorblax", "correct horse battery staple",
    "k.nakamura@protonmail.ch", "Emily Chen, 7 Harbour Road, Wellington 6011", "P@ssw0rd!2024",
    "account 12345678, sort code 20-00-00", "Ahmed Al-Farsi", "Quackenbush",
    "Flat 3, 19 Rue de Rivoli, 75001 Paris", "Lena Müller, Hauptstraße 12, 10115 Berlin",
]
DATA = Path(__file__).resolve().parent.parent / "data" / "smollm2-answers.jsonl"
USER = "<|im_start|>user\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=300)
    parser.add_argument("--kind", choices=["synthetic", "other"], default="synthetic")
    parser.add_argument("--target", default="smollm2-135m", help="whose tokenizer")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.target)
    records = [json.loads(line) for line in DATA.read_text().splitlines()][1:]  # the first line is the header
    rng = random.Random(0)
    rng.shuffle(records)
    questions = []
    for record in records:
        text = tokenizer.decode(record["prompt_ids"])
        if USER in text and len(record["answer_ids"]) >= 8:
            question = text.rsplit(USER, 1)[-1].split("<|im_end|>")[0]
            if "<|im_start|>" not in question:
                questions.append((question.replace("<private>", "").replace("</private>", ""), record["answer_ids"]))
    questions = questions[:args.answers]
    placeholder = placeholder_token(tokenizer)
    counts = {"id rule": [0, 0], "shipped": [0, 0]}
    positions = 0
    for k, (question, answer) in enumerate(questions):
        if args.kind == "synthetic":
            secret = SECRETS[k % len(SECRETS)]
        else:
            words = tokenizer.decode(questions[(k + 1) % len(questions)][1], skip_special_tokens=True).split()
            n = rng.randint(4, 10)
            start = rng.randrange(max(1, len(words) - n))
            secret = " ".join(words[start:start + n])
        ids, mask = encode_private_chat(tokenizer, [{"role": "user", "content": f"{question}\nFor reference, my "
                                                                                f"details: <private>{secret}</private>"}])
        guards = {"id rule": PrivacyGuard(tuple(ids), tuple(mask), placeholder),
                  "shipped": PrivacyGuard(tuple(ids), tuple(mask), placeholder, decode=tokenizer.decode)}
        for i in range(len(answer)):
            context, path = ids + answer[:i], answer[i:i + 4]
            positions += 1
            for name, guard in guards.items():
                counts[name][0] += guard.private_run(context, path) > 0
                counts[name][1] += guard.prune(context, Proposal(DraftTree.chain(path))).tree.size < len(path)
    print(f"{args.kind} secrets, {len(questions)} answers, {positions} positions; per 1,000 answer tokens:")
    for name, (runs, prunes) in counts.items():
        print(f"  {name:8s} written locally (unverified) {1000 * runs / positions:6.2f}   "
              f"a node pruned {1000 * prunes / positions:6.2f}")


if __name__ == "__main__":
    main()
