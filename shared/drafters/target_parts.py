"""The frozen pieces of the target a self-drafting drafter reuses on the client: token embedding,
LM head, final norm and, for Target Layer Inference (seed 001, §3.2), the last N decoder layers.

They are taken from the target checkpoint at load time, never stored in a drafter checkpoint.
"""
from __future__ import annotations

import torch
from torch import nn

from splitspec.shared.packed_linear import PackedLinear


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
        self.draft_vocab: torch.Tensor | None = None  # ids [N] the drafter may propose; None = all
        self._draft_head: nn.Linear | None = None  # the LM head's rows for draft_vocab
        self.requires_grad_(False)

    def restrict_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft among `ids` [N] only (FR-Spec, see shared/drafters/draft_vocab.py); None restores
        the full vocabulary. The LM head's rows for `ids` are copied once here.

        Raises:
            ValueError: ids empty, repeated or outside the vocabulary.
        """
        if ids is None:
            self.draft_vocab = self._draft_head = None
            return
        vocab = self.lm_head.weight.shape[0]
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.lm_head.weight.device)
        if ids.ndim != 1 or not ids.numel() or ids.unique().numel() != ids.numel() \
                or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"a draft vocabulary must be distinct ids in [0, {vocab})")
        self.draft_vocab = ids
        weight, bias = self.lm_head.weight, getattr(self.lm_head, "bias", None)
        # on "meta": no random init of a [N, E] weight that is replaced at once
        head = nn.Linear(weight.shape[1], ids.numel(), bias=bias is not None, device="meta", dtype=weight.dtype)
        head.weight = nn.Parameter(weight.detach()[ids].clone(), requires_grad=False)
        if bias is not None:
            head.bias = nn.Parameter(bias.detach()[ids].clone(), requires_grad=False)
        self._draft_head = PackedLinear.convert(head) if isinstance(self.lm_head, PackedLinear) else head

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafting logits [..., V] of final normed states [..., E]: the LM head, or with a draft
        vocabulary its rows for those ids and -inf for every other token."""
        if self.draft_vocab is None:
            return self.lm_head(hidden)
        kept = self._draft_head(hidden)
        logits = kept.new_full((*hidden.shape[:-1], self.lm_head.weight.shape[0]), float("-inf"))
        return logits.index_copy_(-1, self.draft_vocab, kept)

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
            (logits [B, T, V] (-inf outside a draft vocabulary), final normed hidden [B, T, E])
        """
        if self.tli:
            rope = self.rotary(hidden, positions)
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=mask, position_ids=positions, cache=cache,
                               use_cache=cache is not None, position_embeddings=rope)
            hidden = self.norm(hidden)
        return (self.head(hidden) if head else None), hidden
