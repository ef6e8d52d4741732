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

from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

K = 2  # tokens drafted per forward (the paper's k)


@dataclass(frozen=True)
class FalconConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    lstm_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    @classmethod
    def from_target(cls, config, intermediate_ratio: float = 2.0) -> "FalconConfig":
        heads = config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_heads=heads,
                   num_kv_heads=config.num_key_value_heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   intermediate_size=int(config.hidden_size * intermediate_ratio), rms_norm_eps=config.rms_norm_eps,
                   rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
                   max_position_embeddings=config.max_position_embeddings)

    def to_dict(self) -> dict:
        return asdict(self)


LSTMState = tuple[torch.Tensor, torch.Tensor]  # (h, c), each [lstm_layers, B, E]


class FalconDrafter(nn.Module):
    def __init__(self, config: FalconConfig) -> None:
        super().__init__()
        self.config = config
        block = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
                            num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
                            intermediate_size=config.intermediate_size, rms_norm_eps=config.rms_norm_eps,
                            max_position_embeddings=config.max_position_embeddings, num_hidden_layers=1,
                            vocab_size=config.vocab_size,
                            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
        block._attn_implementation = "sdpa"
        self.lstm = nn.LSTM(2 * config.hidden_size, config.hidden_size, num_layers=config.lstm_layers,
                            batch_first=True)
        self.layer = LlamaDecoderLayer(block, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(block)

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
        return self.layer(x, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=cache is not None,
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
