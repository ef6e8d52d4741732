"""The frozen pieces of the target a self-drafting drafter reuses on the client: token embedding,
LM head, final norm and, for Target Layer Inference (seed 001, §3.2), the last N decoder layers.

They are taken from the target checkpoint at load time, never stored in a drafter checkpoint. A
drafter may compute in another dtype than the target (bf16 drafting beside an fp32 target on a
CPU with AVX512-BF16 or AMX): then the parts it runs are copies in that dtype, and the target,
which a single-device client shares with its drafter, is never changed.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from splitspec.shared.packed_linear import PackedLinear


class CastEmbedding(nn.Module):
    """The target's token embedding, its looked-up rows cast to `dtype`: ids [...] -> [..., E].
    No copy of the [V, E] table is made (and the target's own scaling, as Gemma's, is kept)."""

    def __init__(self, embed: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed, self.dtype = embed, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).to(self.dtype)


class TargetParts(nn.Module):
    """embed [V, E], lm_head, norm, and the target's decoder layers L-N .. L-1 (N = `tli`).

    `dtype`: what the drafter computes in (default: the target's). When it differs, `embed` casts
    the rows it looks up, `norm` and the TLI layers are copies in `dtype`, and the LM head is cast
    only for the rows drafting uses (`restrict_vocab`), or in full the first time a full-vocabulary
    head is asked for. `self.dtype` is the dtype drafting runs in either way.
    """

    def __init__(self, model, tli: int = 0, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        decoder = model.get_decoder()
        layers = len(decoder.layers)
        if not 0 <= tli < layers:
            raise ValueError(f"tli={tli} needs 0 <= tli < {layers} target layers")
        self.tli = tli
        self.num_layers = layers
        self.lm_head = model.get_output_embeddings()
        own = self.lm_head.weight.dtype
        self.dtype = own if dtype is None else dtype
        cast = self.dtype != own
        self.embed = CastEmbedding(decoder.embed_tokens, self.dtype) if cast else decoder.embed_tokens
        self.norm = copy.deepcopy(decoder.norm).to(self.dtype) if cast else decoder.norm
        tli_layers = list(decoder.layers[layers - tli:]) if tli else []
        copies = [copy.deepcopy(layer).to(self.dtype) for layer in tli_layers] if cast else tli_layers
        self.layers = nn.ModuleList(copies)
        self.rotary = decoder.rotary_emb
        self.draft_vocab: torch.Tensor | None = None  # ids [N] the drafter may propose; None = all
        self._draft_head: nn.Linear | None = None  # the LM head's rows for draft_vocab
        self._full_head: nn.Linear | None = None  # the LM head in self.dtype (made on first use when cast)
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
        self._draft_head = self._head_rows(ids)

    def _head_rows(self, ids: torch.Tensor | None) -> nn.Linear:
        """A frozen copy of the LM head's rows `ids` [N] (None: all rows) in self.dtype, prepacked
        where the target's head is. Made outside inference mode (it may be first asked for while
        drafting), so that its weight is an ordinary tensor."""
        weight, bias = self.lm_head.weight, getattr(self.lm_head, "bias", None)
        rows = slice(None) if ids is None else ids
        with torch.inference_mode(False), torch.no_grad():
            kept = weight.detach()[rows].to(self.dtype, copy=True)
            # on "meta": no random init of a [N, E] weight that is replaced at once
            head = nn.Linear(kept.shape[1], kept.shape[0], bias=bias is not None, device="meta", dtype=self.dtype)
            head.weight = nn.Parameter(kept, requires_grad=False)
            if bias is not None:
                head.bias = nn.Parameter(bias.detach()[rows].to(self.dtype, copy=True), requires_grad=False)
            return PackedLinear.convert(head) if isinstance(self.lm_head, PackedLinear) else head

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafting logits [..., V] of final normed states [..., E]: the LM head, or with a draft
        vocabulary its rows for those ids and -inf for every other token."""
        if self.draft_vocab is None:
            if self.dtype == self.lm_head.weight.dtype:
                return self.lm_head(hidden)
            if self._full_head is None:
                self._full_head = self._head_rows(None)
            return self._full_head(hidden)
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

