"""Training forwards and losses for the MoA and EAGLE drafters (seed 001 §3.3; EAGLE §3).

Both are trained by distillation from the frozen target, whose activations are computed on the
fly: loss = 0.1 * forward KL(target || drafter) (as cross-entropy against the target's softmax)
+ SmoothL1 between the predicted and the target's activations, averaged over positions whose
next token belongs to an assistant turn. With TLI = N > 0 the SmoothL1 term is split evenly
between the final state and the predicted input of layer L - N (the official code's weighting).

MoA "variable future length" (seed 001 §3.1.2): each sequence is cut into chunks of K tokens, K
drawn per sequence; a position i in a chunk starting at s(i) plays the drafting situation "the
target verified everything before s(i)": its cross-attention sees memory j < s(i) only (plus
position 0, so no query is left without memory; token 0's K/V depend on token 0 alone), and the
target layers run by TLI see the target's true K/V before s(i) and predicted states from s(i) on.
Prompt positions are all chunk starts, as they are verified in one prefill at inference.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from splitspec.shared.drafters.eagle import EagleDrafter
from splitspec.shared.drafters.moa import MoADrafter, stack_layer_kv
from splitspec.shared.drafters.target_parts import TargetParts

KL_WEIGHT = 0.1
EAGLE_NOISE = 0.1  # uniform feature noise in units of the features' std (EAGLE §3.3)


@dataclass
class TargetPass:
    """What the frozen target computed for one sequence [T]."""

    input_ids: torch.Tensor  # [T]
    trained: torch.Tensor  # [N] positions i whose next token i + 1 is trained on (assistant turns)
    logits: torch.Tensor  # [N, V] target logits at those positions
    hidden: tuple[torch.Tensor, ...]  # L + 1 tensors [T, E]; hidden[-1] after the final norm
    keys: list[torch.Tensor]  # L tensors [Hkv, T, D]
    values: list[torch.Tensor]  # L tensors [Hkv, T, D]


@torch.no_grad()
def run_target(model, input_ids: torch.Tensor, loss_mask: list[int] | None = None) -> TargetPass:
    """Target forward with every layer's K/V and hidden states; logits only where they are trained
    (positions whose next token has loss_mask 1; all positions when no mask is given)."""
    T = input_ids.shape[0]
    trained = (torch.tensor(loss_mask[1:] + [0]).nonzero().flatten() if loss_mask is not None
               else torch.arange(T))
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids[None], cache=cache, use_cache=True, output_hidden_states=True,
                logits_to_keep=trained.to(input_ids.device))
    keys = [layer.keys[0] for layer in cache.layers]
    values = [layer.values[0] for layer in cache.layers]
    return TargetPass(input_ids, trained, out.logits[0].float(), tuple(h[0] for h in out.hidden_states), keys, values)


def chunk_starts(loss_mask: list[int], chunk: int, rng: random.Random) -> torch.Tensor:
    """s(i) [T] for every position: the start of its drafting chunk (>= 1).

    Positions outside assistant turns start their own chunk; inside, chunks of `chunk` tokens
    begin at a random offset. s(i) is the last j in 1..i that starts a chunk (1 if none), taken
    with a running maximum in numpy: a fast-trainer step at batch 128 x 1,024 tokens spent ~80 ms of
    host time in the per-token Python loop this replaces (`tests/test_train_fast.py` checks the two agree).
    """
    offset = rng.randrange(chunk)
    i = np.arange(len(loss_mask))
    starts_here = (~np.asarray(loss_mask, dtype=bool)) | ((i - offset) % chunk == 0)
    starts_here[:1] = False  # position 0 belongs to the first chunk, which starts at 1
    return torch.from_numpy(np.maximum.accumulate(np.where(starts_here, i, 1)))


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def moa_forward(drafter: MoADrafter, parts: TargetParts, target: TargetPass, starts: torch.Tensor):
    """Returns (pre-TLI prediction o [T, E], logits at target.trained [N, V], final state [T, E])."""
    T = target.input_ids.shape[0]
    dtype = parts.dtype
    memory = drafter.memory(stack_layer_kv(target.keys, target.values))  # [T, E]
    positions = torch.arange(T)[None]
    mem_keys, mem_values = drafter.memory_kv(memory, positions[0])
    j = torch.arange(T)
    causal = j[None, :] <= j[:, None]
    ca_visible = (j[None, :] < starts[:, None]) | (j[None, :] == 0)
    o = drafter(parts.embed(target.input_ids)[None], positions, _additive(causal, dtype), mem_keys, mem_values,
                _additive(ca_visible, dtype))
    if parts.tli == 0:
        final = o
    else:
        cache = DynamicCache()
        first = parts.first_tli_layer
        for layer in range(first, parts.num_layers):
            cache.update(target.keys[layer][None], target.values[layer][None], layer)
        true_part = j[None, :] < starts[:, None]
        pred_part = causal & (j[None, :] >= starts[:, None])
        mask = _additive(torch.cat([true_part, pred_part], dim=1), dtype)
        _, final = parts.logits(o, positions, mask, cache, head=False)
    final = final[0]
    return o[0], parts.lm_head(final[target.trained]), final


def eagle_forward(drafter: EagleDrafter, parts: TargetParts, target: TargetPass, noise: float, rng: torch.Generator):
    """Slot j holds (token j+1, feature f_j) and predicts f_{j+1}, the feature at position j + 1.
    Returns the predicted features [T-1, E]."""
    feats = target.hidden[-1][:-1]
    if noise:
        feats = feats + (torch.rand(feats.shape, generator=rng) * 2 - 1) * noise * feats.std()
    T = feats.shape[0]
    j = torch.arange(T)
    mask = _additive(j[None, :] <= j[:, None], parts.dtype)
    return drafter(parts.embed(target.input_ids[1:])[None], feats[None], j[None], mask)[0]


def distill_loss(logits: torch.Tensor, target_logits: torch.Tensor,
                 l1_terms: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, dict]:
    """0.1 * CE(softmax(target), drafter) + mean of SmoothL1 terms, averaged over the N trained
    positions. logits, target_logits: [N, V]; l1_terms: (prediction, target) pairs [N, E]."""
    n = max(1, logits.shape[0])
    target_probs = torch.softmax(target_logits.float(), -1)
    kl = -(target_probs * torch.log_softmax(logits.float(), -1)).sum() / n
    l1 = sum(F.smooth_l1_loss(p.float(), t.float(), reduction="none").mean(-1).sum() / n
             for p, t in l1_terms) / len(l1_terms)
    top1 = (logits.argmax(-1) == target_logits.argmax(-1)).float().sum() / n
    return KL_WEIGHT * kl + l1, {"kl": kl.item(), "smooth_l1": l1.item(), "top1": top1.item()}


def moa_loss(drafter, parts, target: TargetPass, starts: torch.Tensor):
    o, logits, final = moa_forward(drafter, parts, target, starts)
    sel = target.trained
    terms = [(final[sel], target.hidden[-1][sel])]
    if parts.tli:
        terms.append((o[sel], target.hidden[parts.first_tli_layer][sel]))
    return distill_loss(logits, target.logits, terms)


def eagle_loss(drafter, parts, target: TargetPass, noise: float, rng: torch.Generator):
    pred = eagle_forward(drafter, parts, target, noise, rng)
    keep = target.trained >= 1  # position i is predicted by slot i - 1; position 0 has none
    slots = target.trained[keep] - 1
    return distill_loss(parts.lm_head(pred[slots]), target.logits[keep], [(pred[slots], target.hidden[-1][slots + 1])])
