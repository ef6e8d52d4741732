"""TokenSwift's multi-token heads (Wu et al. 2025, "From Hours to Minutes: Lossless Acceleration of
Ultra Long Sequence Generation up to 100K Tokens"; seed 003 §2.2).

gamma linear layers chained with residuals over the target's last hidden state h_0 (after its
final norm): h_i = f_i(h_{i-1}) + h_{i-1}, i = 1..gamma, each read out by the target's own LM
head, so h_0 at position t gives the next token (the target's own prediction) and h_i the token
i steps further. The layers start at zero (h_i = h_0) and are trained by distillation from the
frozen target (train/batched.py, `tokenswift_loss_batch`); about gamma x E^2 parameters (1 M for
SmolLM2-135M at gamma = 3).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TokenSwiftConfig:
    vocab_size: int
    hidden_size: int
    heads: int = 3  # gamma: extra tokens per forward beyond the target's own

    @classmethod
    def from_target(cls, config, heads: int = 3) -> "TokenSwiftConfig":
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size, heads=heads)

    def to_dict(self) -> dict:
        return asdict(self)


class TokenSwiftHeads(nn.Module):
    def __init__(self, config: TokenSwiftConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size, bias=False)
                                    for _ in range(config.heads))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)

    def forward(self, h0: torch.Tensor) -> torch.Tensor:
        """h0: [..., E] the target's final normed hidden state. Returns [..., gamma, E]: h_1 .. h_gamma."""
        out, h = [], h0
        for layer in self.layers:
            h = layer(h) + h
            out.append(h)
        return torch.stack(out, dim=-2)
