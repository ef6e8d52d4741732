"""The Falcon drafter (Gao et al. 2025, "Falcon: Faster and Parallel Inference of Large Language
Models through Enhanced Semi-Autoregressive Drafting and Custom-Designed Decoding Tree", AAAI;
seed 004 §2): semi-autoregressive drafting of k = 2 tokens per forward.

Slot j holds [embedding of token j+1, target feature f_j] (EAGLE's fused input; f = the target's
final hidden state after its norm) and predicts f_{j+2}, k = 2 steps ahead. Slots are read in
blocks of k: an LSTM (2E -> E) carries the past along the sequence, then one decoder block with a
*relaxed* causal mask, under which a slot sees every slot up to the end of its own block (seed
004 §2.2, Fig. 3), then the target's LM head. A block of two known slots (f_{n-1}, t_n), (f_n,
t_{n+1}) thus yields f_{n+1} and f_{n+2}, the logits of t_{n+2} and t_{n+3}, in one forward.

Sized for a CPU client: one LSTM layer where the paper uses two, one decoder block with an MLP of
2E, about 7 M trainable parameters for SmolLM2-135M (E = 576). Trained with Coupled Sequential
Glancing Distillation (train/batched.py, `falcon_loss_batch`); drafts the custom decoding tree
(client/drafters/falcon.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .eagle import EagleConfig, decoder_block

K = 2  # tokens drafted per forward (the paper's k)


@dataclass(frozen=True)
class FalconConfig(EagleConfig):
    """EAGLE's decoder-block shape (`from_target` included) plus the LSTM's depth."""

    lstm_layers: int = 1


LSTMState = tuple[torch.Tensor, torch.Tensor]  # (h, c), each [lstm_layers, B, E]


class FalconDrafter(nn.Module):
    def __init__(self, config: FalconConfig) -> None:
        super().__init__()
        self.config = config
        self.lstm = nn.LSTM(2 * config.hidden_size, config.hidden_size, num_layers=config.lstm_layers,
                            batch_first=True)
        self.layer, self.rotary = decoder_block(config)

    def mix(self, embeds: torch.Tensor, features: torch.Tensor,
            state: LSTMState | None = None) -> tuple[torch.Tensor, LSTMState]:
        """The LSTM over fused slots. embeds, features: [B, T, E]; state: the LSTM state before
        the first slot (None = zeros). Returns (x [B, T, E], the state after the last slot)."""
        x = torch.cat([embeds, features], dim=-1)
        # nn.LSTM runs in its weights' dtype: under autocast it would otherwise get bf16 inputs
        # against fp32 weights
        with torch.autocast(x.device.type, enabled=False):
            out, state = self.lstm(x.to(self.lstm.weight_ih_l0.dtype), state)
        return out, state

    def attend(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache=None) -> torch.Tensor:
        """The decoder block. x [B, T, E]; positions [B, T]; mask [B|1, 1, T, S] additive (relaxed
        causal, see `relaxed_visible`). Returns predicted features f_{j+2} [B, T, E]."""
        rope = self.rotary(x, positions)
        return self.layer(x, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None,
                          position_embeddings=rope)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                state: LSTMState | None = None, cache=None) -> tuple[torch.Tensor, LSTMState]:
        x, state = self.mix(embeds, features, state)
        return self.attend(x, positions, mask, cache), state


def relaxed_visible(block_ends: torch.Tensor) -> torch.Tensor:
    """bool [B, T, T]: slot i sees slot j <= the last slot of i's block. block_ends: [B, T], the
    index of each slot's last block mate (i itself for a slot alone)."""
    j = torch.arange(block_ends.shape[-1], device=block_ends.device)
    return j[None, None, :] <= block_ends[:, :, None]


def block_ends(length: int, offset: int, k: int = K) -> torch.Tensor:
    """[length]: each slot's block end when blocks of `k` start at `offset` (slots before it form
    a block of their own)."""
    i = torch.arange(length)
    first = torch.where(i < offset, torch.zeros_like(i), offset + (i - offset) // k * k)
    last = torch.where(i < offset, torch.full_like(i, offset - 1), first + k - 1)
    return last.clamp(max=length - 1)
