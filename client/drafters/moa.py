"""Runtime of the MoA drafter (seed 001, §3 and Appendix A.3) drafting EAGLE-2 dynamic trees.

State per sequence:
- CA memory: cross-attention keys/values of every verified position, grown after each
  verification from the features the server returns (all layers' K/V, turned into memory by LSA
  here; or the LSA output itself when LSA runs on the server).
- SA cache: the drafter's self-attention over committed tokens (depends on tokens only, so the
  pending token's entry stays valid after verification).
- TLI cache (TLI = N > 0): the target's true K/V of its last N layers for verified positions; the
  pending token and tree nodes get predicted entries during a proposal, dropped afterwards.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from splitspec.shared import kv
from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.moa import MoADrafter, lsa_autocast, stack_layer_kv
from splitspec.shared.drafters.target_parts import TargetParts
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.shared.sampling import SamplingParams, Stream, make_generator
from splitspec.v1 import verify_pb2 as pb

from .base import DraftLimits, Drafter, Proposal, check_contiguous
from .dynamic_tree import build_tree, frontier_mask


class MoARuntime(Drafter):
    """`lsa_placement`: "client" (features = every layer's K/V) or "server" (features = LSA
    output + the TLI layers' K/V; the server must host the checkpoint `lsa_id`)."""

    def __init__(self, module: MoADrafter, parts: TargetParts, tree: TreeConfig = TreeConfig(), *,
                 lsa_placement: str = "client", lsa_id: str = "", quantization: int = pb.QUANTIZATION_NONE,
                 seed: int = 0) -> None:
        if lsa_placement not in ("client", "server"):
            raise ValueError(f"lsa_placement must be client or server, got {lsa_placement!r}")
        if lsa_placement == "server" and not lsa_id:
            raise ValueError("LSA on the server needs the checkpoint's lsa_id")
        self.module, self.parts, self.tree = module, parts, tree
        self.tli = parts.tli
        self.lsa_placement = lsa_placement
        self.name = f"moa(tli={self.tli}, lsa={lsa_placement})"
        layers = parts.num_layers
        tli_layers = tuple(range(layers - self.tli, layers))
        self.feature_request = FeatureRequest(
            kv_layers=tuple(range(layers)) if lsa_placement == "client" else tli_layers,
            quantization=quantization, lsa_id=lsa_id if lsa_placement == "server" else "")
        self.dtype = parts.dtype
        self.generator = make_generator(seed, Stream.DRAFTER)
        self.reset((), FeatureBatch(0, 0))

    def reset(self, prompt_ids, features: FeatureBatch) -> None:
        cfg = self.module.config
        self.mem_keys = torch.zeros(1, cfg.num_kv_heads, 0, cfg.head_dim, dtype=self.dtype)
        self.mem_values = self.mem_keys.clone()
        self.sa_cache = DynamicCache()
        self.tli_cache = DynamicCache()
        self.verified = 0
        if features.count:
            self.commit((), features)

    @torch.inference_mode()
    def commit(self, new_tokens, features: FeatureBatch) -> None:
        """Grow the memory (and TLI cache) by the newly verified positions."""
        check_contiguous(features, self.verified)
        if self.lsa_placement == "server":
            memory = features.lsa.to(self.dtype)
        else:
            layers = range(self.parts.num_layers)
            layer_kv = stack_layer_kv([features.keys[i].to(self.dtype) for i in layers],
                                      [features.values[i].to(self.dtype) for i in layers])
            with lsa_autocast(features.count, self.dtype, layer_kv.device):  # a prompt's LSA in bf16 where faster
                memory = self.module.memory(layer_kv).to(self.dtype)
        positions = torch.arange(self.verified, self.verified + features.count)
        keys, values = self.module.memory_kv(memory, positions)
        self.mem_keys = torch.cat([self.mem_keys, keys], dim=2)
        self.mem_values = torch.cat([self.mem_values, values], dim=2)
        if self.tli:  # predicted TLI entries past the verified positions give way to the true ones
            kv.truncate(self.tli_cache, self.verified, layer=self.parts.first_tli_layer)
        for layer in range(self.parts.first_tli_layer, self.parts.num_layers):
            self.tli_cache.update(features.keys[layer][None].to(self.dtype), features.values[layer][None].to(self.dtype),
                                  layer)
        self.verified += features.count

    def _step(self, tokens: list[int], positions: torch.Tensor, sa_mask: torch.Tensor, tli_mask: torch.Tensor
              ) -> torch.Tensor:
        """SA + CA over `tokens` (appended to the SA cache); the last q = tli_mask.shape[2] rows go
        through the TLI layers (appended to the TLI cache) and the LM head: logits [q, V]."""
        embeds = self.parts.embed(torch.tensor([tokens]))
        # CA: every row sees the whole memory (verified positions only), so no mask
        o = self.module(embeds, positions, sa_mask, self.mem_keys, self.mem_values, None, self.sa_cache)
        rows = tli_mask.shape[2]
        logits, _ = self.parts.logits(o[:, -rows:], positions[:, -rows:], tli_mask, self.tli_cache)
        return logits[0].float()

    @torch.inference_mode()
    def propose(self, context: Sequence[int], limits: DraftLimits, sampling: SamplingParams) -> Proposal:
        """Positions after the verified ones (the pending token, and offline or privately produced
        tokens) have no target activations: CA sees only verified memory, and with TLI their K/V in
        the target's last layers are the drafter's own predictions (kept between proposals)."""
        pending = len(context) - 1
        if self.verified > pending:
            raise RuntimeError(f"{self.verified} positions verified but the pending token is at {pending}")
        # rows still to run through the TLI layers need their SA/CA outputs; the pending row is always
        # run (a proposal after a failed Verify sees the same context as the one before it)
        tli_len = kv.cache_length(self.tli_cache, self.parts.first_tli_layer) if self.tli else pending
        tli_len = min(tli_len, pending)
        start = min(kv.cache_length(self.sa_cache), tli_len)
        kv.truncate(self.sa_cache, start)
        if self.tli:
            kv.truncate(self.tli_cache, tli_len, layer=self.parts.first_tli_layer)
        new = list(context[start:])
        positions = torch.arange(start, len(context))[None]
        sa_mask = torch.zeros(1, 1, len(new), len(context), dtype=self.dtype)
        sa_mask[0, 0] = torch.where(torch.arange(len(context))[None, :] <= positions[0, :, None], 0.0,
                                    torch.finfo(self.dtype).min)
        tli_rows = len(context) - tli_len
        tli_mask = sa_mask[:, :, -tli_rows:]  # causal: each row sees every earlier position
        root_logits = self._step(new, positions, sa_mask, tli_mask)[-1]
        slots: dict[int, int] = {}

        def expand(frontier: list[int], pool) -> torch.Tensor:
            mask = frontier_mask(frontier, pool, slots, len(context), kv.cache_length(self.sa_cache), self.dtype)
            node_positions = torch.tensor([[pending + pool[n].depth for n in frontier]])
            return self._step([pool[n].token for n in frontier], node_positions, mask, mask)

        proposal = build_tree(root_logits, expand, self.tree, limits, sampling, self.generator)
        kv.truncate(self.sa_cache, len(context))
        if self.tli:
            kv.truncate(self.tli_cache, len(context), layer=self.parts.first_tli_layer)
        return proposal

    def rollback(self, length: int) -> None:
        kv.truncate(self.sa_cache, min(length, kv.cache_length(self.sa_cache)))
        if self.tli:
            first = self.parts.first_tli_layer
            kv.truncate(self.tli_cache, min(length, kv.cache_length(self.tli_cache, first)), layer=first)
