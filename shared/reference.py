"""The target alone: plain transformers greedy decoding, the baseline of every lossless claim
(greedy speculative output must equal it token for token) and of every speed-up; and plain
sampling, the speed baseline of sampled runs."""
from __future__ import annotations

from typing import Sequence

import torch


def target_greedy(model, prompt_ids: Sequence[int], max_new_tokens: int,
                  eos_token_ids: Sequence[int] | None = None, streamer=None, *, penalty: float = 1.0,
                  penalty_window: int = 1024) -> list[int]:
    """The target's greedy continuation of `prompt_ids` [P] with `generate()`.

    Args:
        eos_token_ids: stop after the first of these (included in the answer); None disables EOS,
            so exactly `max_new_tokens` tokens come back.
        streamer: a transformers streamer (`put` / `end`), e.g. to time each token's arrival.
        penalty, penalty_window: TokenSwift's contextual penalty over the last `penalty_window`
            tokens (shared/sampling.py), as a logits processor: the penalised target's reference.
    Returns:
        The new token ids [N], N <= max_new_tokens.
    """
    stop = dict(eos_token_id=list(eos_token_ids), pad_token_id=eos_token_ids[0]) if eos_token_ids else \
        dict(eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
    processors = None
    if penalty != 1.0:
        from transformers import LogitsProcessorList

        processors = LogitsProcessorList([_ContextualPenalty(penalty, penalty_window)])
    ids = torch.tensor([list(prompt_ids)], device=next(model.parameters()).device)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         streamer=streamer, logits_processor=processors, **stop)[0, len(prompt_ids):].tolist()
    return _through_first_eos(out, eos_token_ids) if eos_token_ids else out


def _through_first_eos(out: list[int], eos_token_ids: Sequence[int]) -> list[int]:
    """`out` up to and including its first EOS token (all of it when there is none)."""
    return out[: next((i + 1 for i, t in enumerate(out) if t in eos_token_ids), len(out))]


def target_sampled(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int],
                   sampling, streamer=None) -> list[int]:
    """The target's sampled continuation of `prompt_ids` [P] with `generate()` and transformers' own
    temperature / top-k / top-p warpers, seeded with `sampling.seed` (the global RNG is left as it
    was): plain autoregressive sampling, the speed baseline of sampled speculative decoding. Its
    tokens are one sample, not a reference any other sample must equal.

    Args:
        sampling: a non-greedy `SamplingParams` (its contextual penalty is not applied here).
        eos_token_ids: stop after the first of these (included in the answer).
    Returns:
        The new token ids [N], N <= max_new_tokens.
    Raises:
        ValueError: `sampling` is greedy.
    """
    if sampling.greedy:
        raise ValueError("target_sampled needs a temperature > 0; use target_greedy")
    ids = torch.tensor([list(prompt_ids)], device=next(model.parameters()).device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sampling.seed)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=sampling.temperature,
                             top_p=sampling.top_p, top_k=sampling.top_k, streamer=streamer,
                             eos_token_id=list(eos_token_ids), pad_token_id=eos_token_ids[0])
    return _through_first_eos(out[0, len(prompt_ids):].tolist(), eos_token_ids)


class _ContextualPenalty:
    """A transformers logits processor: `apply_contextual_penalty` over each row's last tokens."""

    def __init__(self, penalty: float, window: int) -> None:
        self.penalty, self.window = penalty, window

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from splitspec.shared.sampling import apply_contextual_penalty

        windows = [row[-self.window:].tolist() for row in input_ids]
        return apply_contextual_penalty(scores.float(), windows, self.penalty)
