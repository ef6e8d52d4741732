"""The frozen pieces of the target a self-drafting drafter reuses on the client: token embedding,
LM head, final norm and, for Target Layer Inference (seed 001, §3.2), the last N decoder layers.

They are taken from the target checkpoint at load time, never stored in a drafter checkpoint.
"""
from __future__ import annotations

import torch
from torch import nn


class TargetParts(nn.Module):
    """embed [V, E], lm_head, norm, and the target's decoder layers L-N .. L-1 (N = `tli`)."""

    def __init__(self, model, tli: int = 0) -> None:
        super().__init__()
        decoder = model.get_decoder()
        layers = len(decoder.layers)
        if not 0 <= tli < layers:
            raise ValueError(f"tli={tli} needs 0 <= tli < {layers} target layers")
        self.tli = tli
        self.num_layers = layers
        self.embed = decoder.embed_tokens
        self.norm = decoder.norm
        self.lm_head = model.get_output_embeddings()
        self.layers = nn.ModuleList(decoder.layers[layers - tli:]) if tli else nn.ModuleList()
        self.rotary = decoder.rotary_emb
        self.requires_grad_(False)

    @property
    def first_tli_layer(self) -> int:
        """Index of the first target layer run by the drafter (= L - N)."""
        return self.num_layers - self.tli

    def logits(self, hidden: torch.Tensor, positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
               cache=None, head: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Turn the drafter's predicted activation into logits.

        Args:
            hidden: [B, T, E] prediction of the input of layer L - N (N = tli), or of the final
                normed hidden state when N = 0.
            positions, mask, cache: for the TLI layers: [B, T] positions, [B|1, 1, T, S] additive
                mask, and a DynamicCache indexed by the original layer numbers.
        Returns:
            (logits [B, T, V], final normed hidden [B, T, E])
        """
        if self.tli:
            rope = self.rotary(hidden, positions)
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=mask, position_ids=positions, past_key_values=cache,
                               use_cache=cache is not None, position_embeddings=rope)
            hidden = self.norm(hidden)
        return (self.lm_head(hidden) if head else None), hidden
