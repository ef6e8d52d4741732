"""Runtime of the Falcon drafter (seed 004): semi-autoregressive drafting, k = 2 tokens per
forward, into a custom decoding tree (§2.2).

Slot j holds (token j+1, feature f_j) and predicts f_{j+2} (shared/drafters/falcon.py). With the
pending token at position p, the root block is slots p-2 and p-1 (true features where the
server sent them): one forward under the relaxed mask gives f^_p and f^_{p+1}, the logits of
depth 1 and depth 2 of the tree. A depth-2 node and its depth-1 parent then form the next
block, fed their own predicted features: one forward per kept depth-2 node gives the logits of
depth 3 (its children) and depth 4 (its grandchildren, whichever depth-3 token is chosen), and so
on. So a depth-D tree costs ceil(D / 2) drafter forwards instead of EAGLE's D, and every other
depth is expanded for free; the tree is grown and reranked as an EAGLE-2 dynamic tree
(client/drafters/dynamic_tree.py: expansion by joint probability, then the best `max_nodes`).

Context slots are cached (the decoder block's K/V do not depend on the mask, the LSTM runs
along the sequence); the LSTM state is kept at every length a forward ended at, and a cut to
another length recomputes from the last one kept. Tree slots are dropped after each proposal.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from splitspec.shared import kv
from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.falcon import K, FalconDrafter
from splitspec.shared.drafters.target_parts import TargetParts
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.shared.sampling import SamplingParams, Stream, make_generator
from splitspec.shared.tree import ROOT, DraftTree
from splitspec.v1 import verify_pb2 as pb

from .base import DraftLimits, Drafter, Growing, Proposal, check_contiguous
from .dynamic_tree import build_tree


KEEP_STATES = 64  # slots behind the verified end whose LSTM states and outputs are kept


class FalconRuntime(Drafter):
    """A Falcon drafter (module docstring) over the target's final hidden states [T, E], two tokens
    per forward. `tree`: the dynamic tree's depth, top-B and node count; `quantization`: the
    feature format asked of the server (pb.QUANTIZATION_*); `seed`: the user's seed, from which the
    drafter's own random stream (`Stream.DRAFTER`, sampled drafts) is derived."""

    name = "falcon"

    def __init__(self, module: FalconDrafter, parts: TargetParts, tree: TreeConfig = TreeConfig(), *,
                 quantization: int = pb.QUANTIZATION_NONE, seed: int = 0) -> None:
        self.module, self.parts, self.tree = module, parts, tree
        self.feature_request = FeatureRequest(hidden_layers=(-1,), quantization=quantization)
        self.dtype = parts.dtype
        self.generator = make_generator(seed, Stream.DRAFTER)
        self.forwards = 0  # drafter forwards, for the stats
        self.reset((), FeatureBatch(0, 0))

    def reset(self, prompt_ids, features: FeatureBatch) -> None:
        self.features = Growing(torch.zeros(0, self.module.config.hidden_size, dtype=self.dtype))  # [verified, E]
        self.cache = DynamicCache()
        self.states: dict[int, tuple | None] = {0: None}  # cached slots -> LSTM state after them
        self.outputs: dict[int, torch.Tensor] = {}  # slot j -> its predicted f^_{j+2} [E]
        if features.count:
            self.commit((), features)

    def commit(self, new_tokens, features: FeatureBatch) -> None:
        check_contiguous(features, len(self.features))
        if kv.cache_length(self.cache) > features.start:  # slots fed predicted features give way
            self._truncate(features.start)
        self.features.append(features.hidden[-1])
        # what a cut or an offline slot may still need; a rollback further back recomputes from slot 0
        keep_from = len(self.features) - KEEP_STATES
        self.states = {n: s for n, s in self.states.items() if n == 0 or n >= keep_from}
        self.outputs = {j: f for j, f in self.outputs.items() if j >= keep_from}

    def rollback(self, length: int) -> None:
        self._truncate(min(length - 1, kv.cache_length(self.cache)))

    def _truncate(self, length: int) -> None:
        """Keep the first `length` slots or fewer: down to the longest prefix whose LSTM state is kept."""
        kept = max(n for n in self.states if n <= length)
        kv.truncate(self.cache, kept)
        self.states = {n: s for n, s in self.states.items() if n <= kept}
        self.outputs = {j: f for j, f in self.outputs.items() if j < kept}

    def _input_feature(self, j: int) -> torch.Tensor:
        """Slot j's feature: the target's f_j, else the drafter's own f^_j (zeros before slot 2)."""
        if j < len(self.features):
            return self.features[j]
        return self.outputs.get(j - K, torch.zeros(self.module.config.hidden_size, dtype=self.dtype))

    def _context(self, context: Sequence[int], start: int, end: int, relaxed: bool) -> torch.Tensor:
        """Append context slots [start, end) to the cache (causal, or one relaxed block);
        returns their predicted features [end - start, E]."""
        n, cached = end - start, kv.cache_length(self.cache)
        embeds = self.parts.embed(torch.tensor([context[start + 1: end + 1]]))
        feats = torch.stack([self._input_feature(j) for j in range(start, end)])[None]
        x, state = self.module.mix(embeds, feats, self.states[cached])
        row = torch.arange(n)[:, None]
        visible = torch.ones(n, cached + n, dtype=torch.bool)
        visible[:, cached:] = True if relaxed else torch.arange(n)[None, :] <= row
        mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill(~visible, torch.finfo(self.dtype).min)
        out = self.module.attend(x, torch.arange(start, end)[None], mask[None, None], self.cache)[0]
        self.forwards += 1
        self.states[end] = state
        for j in range(start, end):
            self.outputs[j] = out[j - start]
        return out

    @torch.inference_mode()
    def propose(self, context: Sequence[int], limits: DraftLimits, sampling: SamplingParams) -> Proposal:
        pending = len(context) - 1
        verified = len(self.features)
        if verified > pending:
            raise RuntimeError(f"{verified} features known but the pending token is at {pending}")
        if pending < K:
            return Proposal(DraftTree.empty())
        root = pending - K  # the root block: slots root .. pending - 1
        if kv.cache_length(self.cache) > root:
            self._truncate(root)
        j = kv.cache_length(self.cache)
        while j < root:  # true features in one forward; the drafter's own a block at a time
            end = min(root, verified) if j < verified else min(root, j + K)
            self._context(context, j, end, relaxed=False)
            j = end
        first, second = self._context(context, root, pending, relaxed=True)  # f^_p, f^_{p+1}
        base = kv.cache_length(self.cache)
        src: dict[int, torch.Tensor] = {}  # node -> the feature its logits came from (its slot's input)
        after: dict[int, torch.Tensor] = {}  # node -> the feature giving its children's logits
        grand: dict[int, torch.Tensor] = {}  # even-depth node -> the feature giving its grandchildren's
        states: dict[int, tuple] = {}  # even-depth node -> LSTM state after its block
        block_slots: dict[int, list[int]] = {}  # even-depth node -> its block's cache slots

        def expand(frontier: list[int], pool) -> torch.Tensor:
            for n in frontier:  # parents were expanded before their children
                parent = pool[n].parent
                src[n] = first if parent == ROOT else after[parent]
            if pool[frontier[0]].depth % 2:  # odd depth: the children's logits came with the block before
                for n in frontier:
                    parent = pool[n].parent
                    after[n] = second if parent == ROOT else grand[parent]
            else:
                self._blocks(frontier, pool, src, after, grand, states, block_slots, pending, base)
            return self.parts.head(torch.stack([after[n] for n in frontier])).float()

        proposal = build_tree(self.parts.head(first).float(), expand, self.tree, limits, sampling, self.generator)
        kv.truncate(self.cache, base)
        return proposal

    def _blocks(self, frontier, pool, src, after, grand, states, block_slots, pending: int, base: int) -> None:
        """One forward over the blocks (parent, node) of the even-depth `frontier` nodes."""
        F, E = len(frontier), self.module.config.hidden_size
        parents = [pool[n].parent for n in frontier]
        tokens = torch.tensor([[pool[p].token, pool[n].token] for p, n in zip(parents, frontier)])
        feats = torch.stack([torch.stack([src[p], src[n]]) for p, n in zip(parents, frontier)])  # [F, 2, E]
        earlier = [pool[p].parent for p in parents]  # the even-depth node whose block came before, or ROOT
        before = [self.states[base] if e == ROOT else states[e] for e in earlier]
        state = tuple(torch.cat([s[i] for s in before], dim=1) for i in range(2))  # [layers, F, E] each
        x, (h, c) = self.module.mix(self.parts.embed(tokens), feats, state)
        cached = kv.cache_length(self.cache)
        visible = torch.zeros(2 * F, cached + 2 * F, dtype=torch.bool)
        visible[:, :base] = True
        for row, (n, e) in enumerate(zip(frontier, earlier)):
            while e != ROOT:  # the blocks on the path, each cached by an earlier forward
                visible[2 * row: 2 * row + 2, block_slots[e]] = True
                e = pool[pool[e].parent].parent
            visible[2 * row: 2 * row + 2, cached + 2 * row: cached + 2 * row + 2] = True
            block_slots[n] = [cached + 2 * row, cached + 2 * row + 1]
        mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill(~visible, torch.finfo(self.dtype).min)
        depth = pool[frontier[0]].depth
        positions = torch.tensor([pending + depth - 2, pending + depth - 1]).repeat(F)[None]
        out = self.module.attend(x.reshape(1, 2 * F, E), positions, mask[None, None], self.cache)[0]
        self.forwards += 1
        for row, n in enumerate(frontier):
            after[n], grand[n] = out[2 * row], out[2 * row + 1]
            states[n] = (h[:, row: row + 1], c[:, row: row + 1])
