"""The EAGLE drafter (Li et al. 2024, EAGLE §3; drafting with EAGLE-2 dynamic trees, §4), the
baseline MoA is measured against.

One decoder block over fused inputs: slot j holds [embedding of token j+1, target feature f_j]
(f = the target's final hidden state after its norm), projected from 2E to E, and predicts f_{j+1};
the target's LM head turns a predicted feature into logits. While drafting, predicted features
stand in for the target's (1-step bounded, unlike MoA's cross-attention).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding


@dataclass(frozen=True)
class EagleConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    @classmethod
    def from_target(cls, config, intermediate_ratio: float = 2.0) -> "EagleConfig":
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


def decoder_block(config: EagleConfig) -> tuple[LlamaDecoderLayer, LlamaRotaryEmbedding]:
    """One Llama decoder layer (SDPA attention) and its rotary embedding, shaped by `config`."""
    block = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
                        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
                        intermediate_size=config.intermediate_size, rms_norm_eps=config.rms_norm_eps,
                        max_position_embeddings=config.max_position_embeddings, num_hidden_layers=1,
                        vocab_size=config.vocab_size,
                        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
    block._attn_implementation = "sdpa"
    return LlamaDecoderLayer(block, layer_idx=0), LlamaRotaryEmbedding(block)


class EagleDrafter(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layer, self.rotary = decoder_block(config)
        self.layer.input_layernorm = nn.Identity()  # the fused input is not normalised (EAGLE §3)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache=None) -> torch.Tensor:
        """embeds, features: [B, T, E]; positions [B, T]; mask [B|1, 1, T, S] additive.
        Returns predicted next features [B, T, E]."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        rope = self.rotary(x, positions)
        return self.layer(x, attention_mask=mask, position_ids=positions, cache=cache,
                          use_cache=cache is not None, position_embeddings=rope)
