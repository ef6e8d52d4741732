"""The Mixture-of-Attentions drafter (seed 001: Zimmer, Gritta et al. 2024, §3).

Trainable parts (this module):
- LSA, Layer Self-Attention (§3.1.1): for each committed token, the target's per-layer key/value
  vectors form a sequence over the *layer* axis, [L, W] with W = 2 * Hkv * D (per kv head, key and
  value joined). One decoder block attends bidirectionally across layers (rotary positions = layer
  index), the outputs are averaged over layers and projected to the drafter width E: one memory
  vector per committed token. LSA can run on the client or on the server.
- SA (§3.1.2): a causal self-attention decoder block over the target's (frozen) embeddings of the
  tokens (context + drafts), rotary at absolute positions.
- CA (§3.1.2): cross-attention, queries from SA, keys/values from the LSA memory of positions the
  target has verified, so one pass predicts several future tokens without new target input
  ("T-step bounded"). Memory keys get rotary at their token position.
LSA pooling: the paper averages the LSA outputs over layers (`lsa_pool="mean"`, the default and
every shipped checkpoint). `lsa_pool="learned"` (our departure, measured in docs/training.md) weighs
them by a softmax over one learned logit per layer instead; the logits start at zero, which is the
mean exactly, so a mean checkpoint warm-starts it unchanged.
The output `o` [.., E] predicts the target's activation at layer L - TLI (§3.2): for TLI = 0 the
final hidden state after the target's norm, fed to the LM head directly; for TLI = N the input of
decoder layer L - N, which the target's own last N layers (frozen, with their KV cache), final
norm and LM head turn into logits (see shared/drafters/target_parts.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    repeat_kv,
)

from splitspec.shared.models import fastest_dtype

LSA_POOLS = ("mean", "learned")
LSA_CHUNK = 64  # tokens per LSA pass on a CPU (see MoADrafter.memory)
LSA_CHUNK_ACCELERATOR = 8192  # elsewhere: few passes (each pass is ~25 kernel launches, ~75 with backward)
LSA_BF16_MIN = 16  # runtimes compute the memory of this many new positions or more in bf16 (see lsa_autocast)


def lsa_chunk(device: torch.device) -> int:
    """Tokens per LSA pass on `device` (see `MoADrafter.memory`): small on a CPU, where chunks that
    stay in cache are faster; large elsewhere, where each pass is a round of kernel launches."""
    return LSA_CHUNK if torch.device(device).type == "cpu" else LSA_CHUNK_ACCELERATOR


def lsa_autocast(tokens: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
    """The context a runtime computes the MoA memory of `tokens` new positions in: bf16 autocast
    when the drafter runs in fp32, `tokens` >= LSA_BF16_MIN (a prompt at open, not the 1-3
    positions of a verify step, where converting costs more than it saves) and a bf16 matmul is
    measured faster on the device (shared/models.py, `fastest_dtype`); else no change.

    On this project's 2-core AVX512-BF16 CPU the shipped moa-tli0's LSA over 64 / 200 / 769 prompt
    positions took 22 / 61 / 258 ms instead of 42 / 95 / 388, and its memory moved by 0.25% (relative
    L2). Only drafts depend on it: the target verifies every token. Training keeps its own `--dtype`.
    """
    device = torch.device(device)
    if dtype != torch.float32 or tokens < LSA_BF16_MIN or fastest_dtype(device.type) != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


@dataclass(frozen=True)
class MoAConfig:
    """Sizes of the drafter; `from_target` derives them from the target's config."""

    vocab_size: int
    hidden_size: int  # E, the target's width
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layers: int  # L
    target_kv_heads: int
    target_head_dim: int
    lsa_heads: int
    lsa_kv_heads: int
    lsa_intermediate_size: int
    tli: int = 0
    lsa_pool: str = "mean"  # "mean" (seed 001) | "learned" (softmax weights over layers)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.lsa_pool not in LSA_POOLS:
            raise ValueError(f"lsa_pool must be one of {LSA_POOLS}, got {self.lsa_pool!r}")

    @property
    def kv_width(self) -> int:
        """W: one layer's key + value width per token."""
        return 2 * self.target_kv_heads * self.target_head_dim

    @classmethod
    def from_target(cls, config, tli: int = 0, intermediate_ratio: float = 2.0,
                    lsa_pool: str = "mean") -> "MoAConfig":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = config.num_key_value_heads
        width = 2 * kv_heads * head_dim
        lsa_heads = max(1, width // 64)
        if not 0 <= tli < config.num_hidden_layers:
            raise ValueError(f"tli must lie in [0, {config.num_hidden_layers})")
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_heads=heads,
                   num_kv_heads=kv_heads, head_dim=head_dim,
                   intermediate_size=int(config.hidden_size * intermediate_ratio),
                   target_layers=config.num_hidden_layers, target_kv_heads=kv_heads, target_head_dim=head_dim,
                   lsa_heads=lsa_heads, lsa_kv_heads=max(1, lsa_heads // 3) if lsa_heads % 3 == 0 else lsa_heads,
                   lsa_intermediate_size=2 * width, tli=tli, lsa_pool=lsa_pool, rms_norm_eps=config.rms_norm_eps,
                   rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
                   max_position_embeddings=config.max_position_embeddings)

    def to_dict(self) -> dict:
        return asdict(self)

    def block_config(self, width: int, heads: int, kv_heads: int, intermediate: int, positions: int,
                     attention: str = "sdpa") -> LlamaConfig:
        config = LlamaConfig(hidden_size=width, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=width // heads, intermediate_size=intermediate, rms_norm_eps=self.rms_norm_eps,
                             max_position_embeddings=positions, num_hidden_layers=1, vocab_size=self.vocab_size,
                             rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        config._attn_implementation = attention
        return config


def stack_layer_kv(keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Per-token LSA input from per-layer caches.

    Args:
        keys, values: L tensors [Hkv, T, D] (layer order).
    Returns:
        [T, L, W] with W = 2 * Hkv * D: for each kv head, key then value.
    """
    per_layer = [torch.cat([k, v], dim=-1).permute(1, 0, 2).flatten(1) for k, v in zip(keys, values)]  # [T, W]
    return torch.stack(per_layer, dim=1)


class CrossAttentionBlock(nn.Module):
    """Pre-norm cross-attention + SwiGLU MLP with residuals; one norm serves queries and memory."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        width = config.hidden_size
        self.input_layernorm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def memory_kv(self, memory: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Project memory [B, M, E] to keys/values [B, Hkv, M, Dh], rotary applied at its positions."""
        mem = self.input_layernorm(memory)
        shape = (*memory.shape[:2], self.kv_heads, self.head_dim)
        keys = self.k_proj(mem).view(shape).transpose(1, 2)
        values = self.v_proj(mem).view(shape).transpose(1, 2)
        cos, sin = rope
        keys = keys * cos.unsqueeze(1) + _rotate_half(keys) * sin.unsqueeze(1)
        return keys, values

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """hidden [B, T, E]; keys/values [B, Hkv, M, Dh]; mask [B or 1, 1, T, M] additive, or None
        where every query sees every memory position (drafting: the memory holds verified positions
        only), which SDPA then serves with grouped query heads instead of keys repeated per head
        (the same values to the bit; ~0.1 ms less per pass over 300-800 positions on a 2-core CPU)."""
        residual = hidden
        x = self.input_layernorm(hidden)
        q = self.q_proj(x).view(*x.shape[:2], self.heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q = q * cos.unsqueeze(1) + _rotate_half(q) * sin.unsqueeze(1)
        groups = self.heads // self.kv_heads
        if mask is None:
            attn = torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=groups > 1)
        else:  # every query sees at least memory position 0 (the first prompt token), so no row is empty
            attn = torch.nn.functional.scaled_dot_product_attention(
                q, repeat_kv(keys, groups), repeat_kv(values, groups), attn_mask=mask.to(q.dtype))
        hidden = residual + self.o_proj(attn.transpose(1, 2).reshape(*x.shape[:2], -1))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MoADrafter(nn.Module):
    """The trainable MoA modules. Frozen target parts live in `TargetParts`."""

    def __init__(self, config: MoAConfig) -> None:
        super().__init__()
        self.config = config
        width = config.kv_width
        # `self.lsa` holds LSA's weights; `lsa_pooled` runs them (the block with its pooling folded in).
        # LSA attends over L ~ 30 layers for thousands of tokens at once: plain matmul + softmax
        # ("eager", as `lsa_pooled` does) beats CPU SDPA there, whose flash kernel takes a mask and tiles
        # for long sequences (AMX Xeon, 2 threads, bf16: training fwd + bwd 973 -> 623 ms per 1,024
        # tokens; fp32 open of 64 / 400 positions 15 -> 9 / 89 -> 58 ms; docs/training.md, session 44)
        lsa_cfg = config.block_config(width, config.lsa_heads, config.lsa_kv_heads, config.lsa_intermediate_size,
                                      config.target_layers, attention="eager")
        main_cfg = config.block_config(config.hidden_size, config.num_heads, config.num_kv_heads,
                                       config.intermediate_size, config.max_position_embeddings)
        self.lsa = LlamaDecoderLayer(lsa_cfg, layer_idx=0)
        self.lsa_rotary = LlamaRotaryEmbedding(lsa_cfg)
        self.lsa_out = nn.Linear(width, config.hidden_size, bias=True)
        self.sa = LlamaDecoderLayer(main_cfg, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(main_cfg)
        self.ca = CrossAttentionBlock(main_cfg)
        if config.lsa_pool == "learned":
            self.lsa_layer_logits = nn.Parameter(torch.zeros(config.target_layers))
        self._lsa_compiled = None  # set by compile_lsa (training); a plain attribute, not a submodule

    def compile_lsa(self) -> None:
        """Run LSA (`lsa_pooled`) through `torch.compile` where gradients are on (training steps).

        The block's elementwise work (norms, rotary, SwiGLU, their backward) is most of a MoA training
        step on a CPU; inductor fuses it. Every pass gets the same shape (the last chunk is padded
        with zero rows, their outputs dropped), so it compiles once per dtype. Passes without
        gradients (held-out figures, drafting) stay eager. The first step pays the compile (~10-30 s
        on a 2-core CPU). The weights are the module's own: checkpoints are unchanged.
        """
        self._lsa_compiled = torch.compile(self.lsa_pooled, dynamic=False)  # a function: no new submodule

    def lsa_pooled(self, layer_kv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """LSA's decoder block over the layer axis of each token, pooled over layers (§3.1.1).

        The same function as `self.lsa` (transformers' LlamaDecoderLayer: pre-norm attention across
        layers, bidirectional, eager matmul + softmax in fp32, then a pre-norm SwiGLU MLP) followed by
        the pooling, with the pooling moved inside: the MLP's down projection is linear and the last
        step, so pool(h + down(a)) = pool(h) + down(pool(a)) and `down_proj` runs once per token
        instead of once per token and layer. That removes ~23% of LSA's FLOPs and changes the memory
        only by rounding (2-core AVX2 CPU, fp32, the shipped moa-tli0, one process: training fwd + bwd
        over 1,024 tokens 1.28x faster, a verify step's 3-position memory ~1.1x, a prompt's within
        noise; docs/benchmarks.md, session 48). Weights and checkpoints are `self.lsa`'s.

        Args:
            layer_kv: [N, L, W] per-token target K/V stacks (`stack_layer_kv`).
            rope: (cos, sin), each [1, L, Dh], rotary at layer indices.
        Returns:
            [N, W], pooled over layers (mean, or the learned softmax weights).
        """
        block = self.lsa
        attn, mlp = block.self_attn, block.mlp
        n, layers, _ = layer_kv.shape
        heads, kv_heads, head_dim = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
        groups = heads // kv_heads
        x = block.input_layernorm(layer_kv)
        q = attn.q_proj(x).view(n, layers, heads, head_dim).transpose(1, 2)  # [N, H, L, Dh]
        k = attn.k_proj(x).view(n, layers, kv_heads, head_dim).transpose(1, 2)  # [N, Hkv, L, Dh]
        v = attn.v_proj(x).view(n, layers, kv_heads, head_dim).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in rope)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # query head h reads kv head h // groups (transformers' repeat_kv): group the queries instead
        # of repeating the keys, [N, Hkv, groups * L, Dh]
        scores = torch.matmul(q.reshape(n, kv_heads, groups * layers, head_dim), k.transpose(2, 3)) * attn.scaling
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).view(n, heads, layers, head_dim).transpose(1, 2).reshape(n, layers, -1)
        hidden = layer_kv + attn.o_proj(out)  # [N, L, W]
        post = block.post_attention_layernorm(hidden)
        act = mlp.act_fn(mlp.gate_proj(post)) * mlp.up_proj(post)  # [N, L, I]
        if self.config.lsa_pool == "learned":
            weights = torch.softmax(self.lsa_layer_logits.float(), dim=0).to(hidden.dtype)  # [L]
            return torch.einsum("nlw,l->nw", hidden, weights) + mlp.down_proj(torch.einsum("nli,l->ni", act, weights))
        return hidden.mean(dim=1) + mlp.down_proj(act.mean(dim=1))

    def memory(self, layer_kv: torch.Tensor) -> torch.Tensor:
        """LSA over layers, pooling over layers (mean, or learned softmax weights), projection.

        Each token's layer stack is its own sequence, so tokens run in chunks (`lsa_chunk`): on a CPU
        `LSA_CHUNK` at a time, since over a long prompt the block's elementwise work on [N, L, W] is
        memory-bound and chunks that stay in cache made the open of a 769-token prompt 1.5x faster
        (2-core CPU, fp32); on an accelerator `LSA_CHUNK_ACCELERATOR`, since there every pass costs
        kernel launches (a training batch of 32 x 1,024 tokens in chunks of 64 was ~15K ops a step).
        layer_kv [N, L, W] -> memory [N, E].
        """
        n, layers, _ = layer_kv.shape
        if n == 0:
            return layer_kv.new_zeros(0, self.config.hidden_size)
        positions = torch.arange(layers, device=layer_kv.device)[None]  # [1, L], broadcast over tokens
        rope = self.lsa_rotary(layer_kv, positions)
        size = lsa_chunk(layer_kv.device)
        compiled = self._lsa_compiled if torch.is_grad_enabled() else None
        block = compiled or self.lsa_pooled
        pooled = []
        for chunk in layer_kv.split(size):
            rows = chunk.shape[0]
            if compiled is not None and rows < size:  # one static shape for the compiled block
                chunk = torch.cat([chunk, chunk.new_zeros(size - rows, *chunk.shape[1:])])
            pooled.append(block(chunk, rope)[:rows])
        return self.lsa_out(torch.cat(pooled) if len(pooled) > 1 else pooled[0])

    def memory_kv(self, memory: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CA keys/values [1, Hkv, M, Dh] of memory [M, E] at token positions [M]."""
        return self.ca.memory_kv(memory[None], self.rotary(memory[None], positions[None]))

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, sa_mask: torch.Tensor,
                mem_keys: torch.Tensor, mem_values: torch.Tensor, ca_mask: torch.Tensor | None,
                sa_cache=None) -> torch.Tensor:
        """Predict the activation at layer L - TLI for each input position.

        Args:
            embeds: [B, T, E] target embeddings of the input tokens.
            positions: [B, T] absolute positions.
            sa_mask: [B or 1, 1, T, S] additive mask over SA keys (cache + inputs).
            mem_keys, mem_values: [B, Hkv, M, Dh] from `ca.memory_kv`.
            ca_mask: [B or 1, 1, T, M] additive mask over memory positions, or None: all visible.
            sa_cache: optional DynamicCache for SA (inference).
        Returns:
            o: [B, T, E]
        """
        rope = self.rotary(embeds, positions)
        x = self.sa(embeds, attention_mask=sa_mask, position_ids=positions, cache=sa_cache,
                    use_cache=sa_cache is not None, position_embeddings=rope)
        return self.ca(x, rope, mem_keys, mem_values, ca_mask)
