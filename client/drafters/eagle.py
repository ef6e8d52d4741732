"""Runtime of the EAGLE drafter (Li et al. 2024, EAGLE §3) drafting EAGLE-2 dynamic trees (§4).

Slot j of the drafter's cache holds (token j+1, target feature f_j). With the pending token at
position t, the slots up to t-1 use the target's true features (received after verification);
tree nodes use the drafter's own predicted features, and are dropped after the proposal.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from splitspec.shared import kv
from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.eagle import EagleDrafter
from splitspec.shared.drafters.target_parts import TargetParts
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.shared.sampling import SamplingParams, Stream, make_generator
from splitspec.v1 import verify_pb2 as pb

from .base import DraftLimits, Drafter, Growing, Proposal, check_contiguous
from .dynamic_tree import build_tree, frontier_mask


class EagleRuntime(Drafter):
    """An EAGLE drafter (module docstring) over the target's final hidden states [T, E], which the
    server returns for every committed position. `tree`: the dynamic tree's depth, top-B and node count; `quantization`: the
    feature format asked of the server (pb.QUANTIZATION_*); `seed`: the user's seed, from which the
    drafter's own random stream (`Stream.DRAFTER`, sampled drafts) is derived."""

    name = "eagle2"

    def __init__(self, module: EagleDrafter, parts: TargetParts, tree: TreeConfig = TreeConfig(), *,
                 quantization: int = pb.QUANTIZATION_NONE, seed: int = 0) -> None:
        self.module, self.parts, self.tree = module, parts, tree
        self.feature_request = FeatureRequest(hidden_layers=(-1,), quantization=quantization)
        self.dtype = parts.dtype
        self.generator = make_generator(seed, Stream.DRAFTER)
        self.reset((), FeatureBatch(0, 0))

    def reset(self, prompt_ids, features: FeatureBatch) -> None:
        self.features = Growing(torch.zeros(0, self.module.config.hidden_size, dtype=self.dtype))  # [verified, E]
        self.cache = DynamicCache()
        self.predicted: dict[int, torch.Tensor] = {}  # position -> f^ for positions without true features
        if features.count:
            self.commit((), features)

    def commit(self, new_tokens, features: FeatureBatch) -> None:
        check_contiguous(features, len(self.features))
        if kv.cache_length(self.cache) > features.start:  # slots fed with predicted features give way
            kv.truncate(self.cache, features.start)
        self.predicted.clear()
        self.features.append(features.hidden[-1])

    def _run(self, tokens: list[int], feats: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Predicted features [n, E] for slots (tokens [n], feats [n, E]) appended to the cache."""
        embeds = self.parts.embed(torch.tensor([tokens]))
        return self.module(embeds, feats[None], positions, mask, self.cache)[0]

    @torch.inference_mode()
    def propose(self, context: Sequence[int], limits: DraftLimits, sampling: SamplingParams) -> Proposal:
        pending = len(context) - 1
        if len(self.features) > pending:
            raise RuntimeError(f"{len(self.features)} features known but the pending token is at {pending}")
        verified = len(self.features)
        cached = kv.cache_length(self.cache)
        if cached < verified:  # slot j: (token j+1, f_j), true features
            slots_new = list(range(cached, verified))
            positions = torch.tensor([slots_new])
            mask = torch.where(torch.arange(verified)[None, :] <= positions[0, :, None], 0.0,
                               torch.finfo(self.dtype).min)
            out = self._run([context[j + 1] for j in slots_new], self.features[cached:verified], positions,
                            mask.to(self.dtype)[None, None])
            self.predicted[verified] = out[-1]
            cached = verified
        for j in range(cached, pending):  # offline / private tokens: fed the drafter's own f^_j
            mask = torch.zeros(1, 1, 1, j + 1, dtype=self.dtype)
            self.predicted[j + 1] = self._run([context[j + 1]], self.predicted[j][None], torch.tensor([[j]]), mask)[0]
        root_feature = self.predicted[pending]  # f^_t, the pending token's predicted feature
        node_feature: dict[int, torch.Tensor] = {}
        slots: dict[int, int] = {}

        def expand(frontier: list[int], pool) -> torch.Tensor:
            frontier_mask_ = frontier_mask(frontier, pool, slots, pending, kv.cache_length(self.cache), self.dtype)
            feats = torch.stack([node_feature[pool[n].parent] if pool[n].parent >= 0 else root_feature
                                 for n in frontier])
            node_positions = torch.tensor([[pending - 1 + pool[n].depth for n in frontier]])
            out = self._run([pool[n].token for n in frontier], feats, node_positions, frontier_mask_)
            for n, f in zip(frontier, out):
                node_feature[n] = f
            return self.parts.head(out).float()

        root_logits = self.parts.head(root_feature).float()
        proposal = build_tree(root_logits, expand, self.tree, limits, sampling, self.generator)
        kv.truncate(self.cache, pending)
        return proposal

    def rollback(self, length: int) -> None:
        kv.truncate(self.cache, min(length - 1, kv.cache_length(self.cache)))
        self.predicted = {j: f for j, f in self.predicted.items() if j < length}
