"""An independent small causal LM as drafter (seed 002, Leviathan et al. 2023, §3), drafting
EAGLE-2 dynamic trees (client/drafters/dynamic_tree.py).

`draft-model:MODEL` loads any causal LM sharing the target's tokenizer; `MODEL@layers=N` keeps
only its first N decoder layers plus the final norm and LM head (early exit, training-free).
The drafter keeps its own KV cache of the committed context; tree nodes are appended to it during
a proposal with a tree mask and removed afterwards.
"""
from __future__ import annotations

from typing import Sequence

import torch

from splitspec.shared import kv
from splitspec.shared.config import TreeConfig
from splitspec.shared.sampling import SamplingParams, Stream, make_generator

from .base import DraftLimits, Drafter, Proposal
from .dynamic_tree import build_tree, frontier_mask


class DraftModelDrafter(Drafter):
    name = "draft-model"

    def __init__(self, model, tree: TreeConfig = TreeConfig(), seed: int = 0) -> None:
        self.model = model
        self.tree = tree
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.generator = make_generator(seed, Stream.DRAFTER)
        self.cache = kv.new_cache(model.config)

    def reset(self, prompt_ids, features) -> None:
        self.cache = kv.new_cache(self.model.config)

    def rollback(self, length: int) -> None:
        kv.truncate(self.cache, min(length, kv.cache_length(self.cache)))

    @torch.inference_mode()
    def propose(self, context: Sequence[int], limits: DraftLimits, sampling: SamplingParams) -> Proposal:
        cached = kv.cache_length(self.cache)
        if cached >= len(context):  # never happens in the loop; keep the invariant anyway
            kv.truncate(self.cache, len(context) - 1)
            cached = len(context) - 1
        new = torch.tensor([list(context[cached:])], device=self.device)
        root_logits = self.model(input_ids=new, cache=self.cache, use_cache=True,
                                 logits_to_keep=1).logits[0, -1]
        context_len = len(context)
        slots: dict[int, int] = {}  # pool index -> cache position

        def expand(frontier: list[int], pool) -> torch.Tensor:
            mask = frontier_mask(frontier, pool, slots, context_len, kv.cache_length(self.cache), self.dtype)
            ids = torch.tensor([[pool[n].token for n in frontier]], device=self.device)
            positions = torch.tensor([[context_len - 1 + pool[n].depth for n in frontier]], device=self.device)
            out = self.model(input_ids=ids, cache=self.cache, use_cache=True,
                             attention_mask=mask.to(self.device), position_ids=positions)
            return out.logits[0].float()

        proposal = build_tree(root_logits, expand, self.tree, limits, sampling, self.generator)
        kv.truncate(self.cache, context_len)
        return proposal
