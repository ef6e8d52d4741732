"""The fast training path: batched conversations, one target pass shared by every drafter.

What makes it fast, against the per-conversation reference in `objectives.py`:
- conversations of similar length are batched ([B, T], right-padded: with a causal target the
  valid positions never see a pad, so no attention mask is needed and their activations are
  exact); pads get no LSA, no LM head and no loss;
- the frozen target runs once per batch (`run_target_batch`) and its activations feed every
  drafter being trained;
- the LM head and the loss run only at trained positions, optionally over a training vocabulary
  (the FR-Spec draft vocabulary the drafter drafts from at run time; the target's probabilities are
  renormalised over it);
- matmuls run in bf16 under autocast where the caller enables it (AMX-BF16 on this CPU, tensor
  cores on a GPU), while the drafter's weights, the loss and the optimizer state stay fp32;
- with `--compile` on, MoA's LSA block (`MoADrafter.compile_lsa`) and, in bf16, the target's forward
  (`compile_target`) run through torch.compile, which fuses the elementwise work that dominated a
  CPU step (docs/training.md, "Measuring training throughput").

With every option at its reference value (full vocabulary, fully causal SA, raw TLI targets, fp32)
the losses equal the reference path's token-weighted mean (tested).

MoA training departures from the first version, following the official trainer (seed 001 §3.1.2,
"variable future length"; huawei-noah/HEBO `mixture-of-attentions`):
- staircase SA: early in training SA sees only the current chunk (plus `sa_window` tokens before
  it), widening to fully causal; this forces the drafter to take its context through CA;
- chunks of 1..4 tokens (distances 0..3 from the last verified position), the distances the
  drafted trees use;
- with TLI > 0 the prediction of layer L - N's input is compared after dividing by a fixed
  per-dimension scale (the residual stream's outliers otherwise swamp the KL term).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from splitspec.shared.drafters.eagle import EagleDrafter
from splitspec.shared.drafters.falcon import K as FALCON_K
from splitspec.shared.drafters.falcon import FalconDrafter, block_ends, relaxed_visible
from splitspec.shared.drafters.moa import MoADrafter
from splitspec.shared.drafters.target_parts import TargetParts

from .data import Example
from .objectives import KL_WEIGHT, chunk_starts


@dataclass
class Batch:
    """Right-padded conversations, with the flat indices (b * T + t) of their real tokens and of the
    positions that carry loss, made on the host: indexing with them, and counting rows, never waits
    for a GPU (boolean-mask indexing does: its `nonzero` is a host-device synchronisation)."""

    input_ids: torch.Tensor  # [B, T] (pads are 0)
    examples: list[Example]
    valid_rows: torch.Tensor  # [Nv] ascending flat indices of real tokens (on the batch's device)
    trained_rows: torch.Tensor  # [N] ascending flat indices of positions whose next token belongs to an
    #                             assistant turn (on the batch's device)
    trained_rows_host: torch.Tensor  # the same [N] on the CPU, for index arithmetic on the host

    @property
    def tokens(self) -> int:
        """Real tokens in the batch (the unit of training budgets)."""
        return sum(len(e.input_ids) for e in self.examples)

    def rows_from(self, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The trained positions with t >= `first` (the rows a slot `first` positions back predicts):
        (their index [N'] into `trained_rows`, conversation b [N'], position t [N']), on the batch's
        device, in `trained_rows`' order; computed on the host."""
        T = self.input_ids.shape[1]
        rows = self.trained_rows_host.numpy()
        keep = np.flatnonzero(rows % T >= first)
        device = self.input_ids.device
        return tuple(to_device(torch.from_numpy(x), device) for x in (keep, rows[keep] // T, rows[keep] % T))


def to_device(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory without blocking (a plain copy
    from pageable memory waits for the device's queue to drain)."""
    device = torch.device(device)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def make_batch(examples: list[Example], device: str | torch.device = "cpu") -> Batch:
    """Pad `examples` to the longest one (filled in numpy: converting the token lists with
    `torch.tensor` cost ~50 ms of host time a step at batch 128 x 1,024 tokens, 5x numpy's)."""
    T = max(len(e.input_ids) for e in examples)
    ids = np.zeros((len(examples), T), dtype=np.int64)
    valid = np.zeros((len(examples), T), dtype=bool)
    trained = np.zeros((len(examples), T), dtype=bool)
    for b, e in enumerate(examples):
        n = len(e.input_ids)
        ids[b, :n] = e.input_ids
        valid[b, :n] = True
        trained[b, : n - 1] = e.loss_mask[1:]
    trained_rows = torch.from_numpy(np.flatnonzero(trained))
    return Batch(to_device(torch.from_numpy(ids), device), examples,
                 to_device(torch.from_numpy(np.flatnonzero(valid)), device), to_device(trained_rows, device),
                 trained_rows)


def bucketed_order(lengths: list[int], batch: int, seed: int, pool: int = 64) -> list[list[int]]:
    """Batches of example indices with little padding: shuffle, sort pools of `pool` batches by
    length, cut them into batches, shuffle the batches. Deterministic under `seed`."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches = []
    for p in range(0, len(order), pool * batch):
        chunk = sorted(order[p: p + pool * batch], key=lambda i: lengths[i])
        batches.extend(chunk[i: i + batch] for i in range(0, len(chunk), batch))
    rng.shuffle(batches)
    return batches


@dataclass
class TargetBatch:
    """What the frozen target computed for a batch."""

    batch: Batch
    rows: torch.Tensor  # [N] flat indices b * T + t of trained positions
    logits: torch.Tensor  # [N, V'] float32 target logits there (V' = training vocabulary)
    final: torch.Tensor  # [B, T, E] final hidden state after the norm
    layer_inputs: dict[int, torch.Tensor]  # layer l -> [B, T, E] input of decoder layer l (TLI targets)
    keys: list[torch.Tensor]  # L tensors [B, Hkv, T, D]
    values: list[torch.Tensor]  # L tensors [B, Hkv, T, D]


def head_weight(lm_head: torch.nn.Module, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's weight [V', E] (and bias) restricted to `vocab` [V'] ids, or whole."""
    bias = getattr(lm_head, "bias", None)
    if vocab is None:
        return lm_head.weight, bias
    return lm_head.weight[vocab], (bias[vocab] if bias is not None else None)


def compile_target(model) -> None:
    """Run the frozen target's decoder through `torch.compile` (dynamic shapes: batches differ in size
    and length) for `run_target_batch`; the layers stay the module's own, so TLI's use of the last
    layers is unchanged. For a model with transformers' own `nn.Linear` (`load_model(linear="torch")`):
    dynamo cannot trace the prepacked oneDNN linears. Measured on this project's AMX CPU in bf16 over
    4 x ~300-token batches: the forward 1.3x faster, after ~60 s of compiling in the first batch.
    A batch of one conversation (an epoch's last) would compile it again (dynamo specialises sizes
    of 1), so `run_target_batch` runs such a batch twice over instead (`COMPILED_MIN_BATCH`)."""
    decoder = model.get_decoder()
    decoder.forward = torch.compile(decoder.forward, dynamic=True)
    decoder.splitspec_min_batch = COMPILED_MIN_BATCH


COMPILED_MIN_BATCH = 2  # smallest batch a compiled target decoder sees (see compile_target)


@torch.no_grad()
def run_target_batch(model, batch: Batch, layer_inputs: tuple[int, ...] = (),
                     vocab: torch.Tensor | None = None) -> TargetBatch:
    """One target forward over the batch, keeping every layer's K/V, the final state, the inputs
    of `layer_inputs` and logits [N, V'] at trained positions only."""
    cache = DynamicCache(config=model.config)
    decoder = model.get_decoder()
    B = batch.input_ids.shape[0]
    ids = batch.input_ids
    if B < getattr(decoder, "splitspec_min_batch", 1):  # a compiled decoder: pad with copies, drop them after
        ids = ids.repeat(-(-decoder.splitspec_min_batch // B), 1)
    out = decoder(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=True)
    final = out.last_hidden_state[:B]  # [B, T, E], after the final norm
    rows = batch.trained_rows
    weight, bias = head_weight(model.get_output_embeddings(), vocab)
    logits = F.linear(final.flatten(0, 1)[rows], weight, bias).float()
    return TargetBatch(batch, rows, logits, final, {l: out.hidden_states[l][:B] for l in layer_inputs},
                       [layer.keys[:B] for layer in cache.layers], [layer.values[:B] for layer in cache.layers])


def stack_layer_kv_batch(keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Batched `stack_layer_kv`: L tensors [B, Hkv, T, D] -> [B, T, L, W], W = 2 * Hkv * D."""
    per_layer = [torch.cat([k, v], dim=-1).permute(0, 2, 1, 3).flatten(2) for k, v in zip(keys, values)]
    return torch.stack(per_layer, dim=2)


def batch_chunk_starts(batch: Batch, chunk_min: int, chunk_max: int, rng: random.Random) -> torch.Tensor:
    """s(i) [B, T]: per conversation a chunk length in [chunk_min, chunk_max] (`chunk_starts`).
    Pads start chunks of their own."""
    T = batch.input_ids.shape[1]
    starts = torch.arange(T).repeat(len(batch.examples), 1)
    for b, e in enumerate(batch.examples):
        starts[b, : len(e.input_ids)] = chunk_starts(e.loss_mask, rng.randint(chunk_min, chunk_max), rng)
    return to_device(starts, batch.input_ids.device)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, T, S] -> additive mask [B, 1, T, S]."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, torch.finfo(dtype).min)[:, None]


def _shuffled(memory: torch.Tensor, lengths: list[int], gen: torch.Generator) -> torch.Tensor:
    """memory [B, T, E] with each conversation's first `lengths[b]` (valid) rows permuted (the
    memory-gain control)."""
    out = memory.clone()
    for b, n in enumerate(lengths):
        out[b, :n] = memory[b, torch.randperm(n, generator=gen).to(memory.device)]
    return out


def moa_forward_batch(drafter: MoADrafter, parts: TargetParts, target: TargetBatch, starts: torch.Tensor,
                      dtype: torch.dtype, sa_window: int | None = None,
                      shuffle: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MoA over a batch.

    Args:
        starts: [B, T] chunk starts s(i); CA sees memory j < s(i) (and j = 0).
        dtype: dtype of the additive masks (the compute dtype).
        sa_window: SA of row i sees j in [s(i) - sa_window, i]; None = fully causal.
        shuffle: permute the memory across positions (memory-gain control).
    Returns:
        o [B, T, E] (prediction of layer L - N's input, or the final state for N = 0) and the final
        normed state [B, T, E].
    """
    batch = target.batch
    B, T = batch.input_ids.shape
    layer_kv = stack_layer_kv_batch(target.keys, target.values)  # [B, T, L, W]
    flat = drafter.memory(layer_kv.flatten(0, 1)[batch.valid_rows])  # [Nv, E]
    memory = flat.new_zeros(B * T, flat.shape[-1]).index_copy(0, batch.valid_rows, flat).view(B, T, -1)
    if shuffle is not None:
        memory = _shuffled(memory, [len(e.input_ids) for e in batch.examples], shuffle)
    positions = torch.arange(T, device=memory.device).expand(B, T)
    mem_keys, mem_values = drafter.ca.memory_kv(memory, drafter.rotary(memory, positions))
    j = torch.arange(T, device=memory.device)
    causal = j[None, None, :] <= j[None, :, None]  # [1, T, T]
    sa_visible = causal if sa_window is None else causal & (j[None, None, :] >= starts[:, :, None] - sa_window)
    ca_visible = (j[None, None, :] < starts[:, :, None]) | (j[None, None, :] == 0)
    o = drafter(parts.embed(batch.input_ids), positions, _additive(sa_visible, dtype), mem_keys, mem_values,
                _additive(ca_visible, dtype))
    if parts.tli == 0:
        return o, o
    cache = DynamicCache()
    for layer in range(parts.first_tli_layer, parts.num_layers):
        cache.update(target.keys[layer], target.values[layer], layer)
    true_part = j[None, None, :] < starts[:, :, None]
    pred_part = causal & (j[None, None, :] >= starts[:, :, None])
    _, final = parts.logits(o, positions, _additive(torch.cat([true_part, pred_part], dim=2), dtype), cache,
                            head=False)
    return o, final


def _uniform(like: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """U[0, 1) noise of `like`'s shape on its device, drawn from the CPU generator `gen`.

    On a CPU it is drawn from `gen` itself (what the reference path draws, tested to the bit).
    Elsewhere `gen` only seeds a generator on that device: drawing [32, 1023, 576] on the host and
    copying it over took ~65 ms of host time per step on an H100 (session 26's profile: aten::uniform_),
    a tenth of the step. Resume stays exact: the seed comes from `gen`, whose state is saved.
    """
    if like.device.type == "cpu":
        return torch.rand(like.shape, generator=gen)
    return torch.rand(like.shape, generator=device_generator(gen, like.device), device=like.device)


def device_generator(gen: torch.Generator | None, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded from the CPU generator `gen` (advancing it by one draw)."""
    seed = int(torch.randint(2**62, (1,), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


def eagle_forward_batch(drafter: EagleDrafter, parts: TargetParts, target: TargetBatch, dtype: torch.dtype,
                        noise: float = 0.0, gen: torch.Generator | None = None) -> torch.Tensor:
    """Slot j holds (token j+1, feature f_j) and predicts f_{j+1}. Returns [B, T-1, E]."""
    batch = target.batch
    feats = target.final[:, :-1]
    if noise:
        real = target.final.flatten(0, 1)[batch.valid_rows].float()  # [Nv, E]
        # the sample std written out: torch's std of a whole CPU tensor reads a scalar back (`.item()`)
        std = (real - real.mean()).pow(2).sum().div(max(1, real.numel() - 1)).sqrt()
        feats = feats + ((_uniform(feats, gen) * 2 - 1) * noise * std).to(feats.dtype)
    T = feats.shape[1]
    j = torch.arange(T, device=feats.device)
    mask = _additive((j[None, :] <= j[:, None])[None], dtype)
    positions = j.expand(feats.shape[0], T)
    return drafter(parts.embed(batch.input_ids[:, 1:]), feats, positions, mask)


@dataclass(frozen=True)
class LossOptions:
    """How a batch's loss is computed (defaults = the reference path)."""

    vocab: torch.Tensor | None = None  # [V'] training vocabulary; None = all
    tli_scale: torch.Tensor | None = None  # [E] per-dimension scale of layer L-N's input; None = raw
    sa_window: int | None = None  # MoA staircase; None = fully causal
    eagle_noise: float = 0.0
    falcon_glance: float | None = None  # Falcon CSGD's glancing ratio; None = one teacher-forced pass
    kl_weight: float = KL_WEIGHT  # weight of the token term against the SmoothL1 feature term(s)
    per_conversation: bool = False  # metrics gain "per_conversation" (held-out figures' intervals)
    device_metrics: bool = False  # kl / smooth_l1 / top1 as 0-d tensors on the loss's device, not floats


def distill_loss_rows(logits: torch.Tensor, target_logits: torch.Tensor,
                      l1_terms: list[tuple[torch.Tensor, torch.Tensor]],
                      kl_weight: float = KL_WEIGHT, conversations: tuple[torch.Tensor, int] | None = None,
                      device_metrics: bool = False) -> tuple[torch.Tensor, dict]:
    """kl_weight (EAGLE's 0.1 by default) * CE(softmax(target), drafter) + mean of SmoothL1 terms,
    averaged over the N rows (token-weighted). logits, target_logits: [N, V']; l1_terms:
    (prediction, target) pairs [N, E].

    With `conversations` = (index [N] of each row's conversation in the batch, B), the metrics gain
    "per_conversation": B lists [rows, top-1 matches, summed loss], from which the held-out top-1
    and loss can be pooled over any resample of the conversations (`trainer.paired_heldout`).

    The metrics kl, smooth_l1 and top1 are floats, or with `device_metrics` detached 0-d tensors
    where the loss is: turning them into floats makes the host wait for the device, which a GPU
    training step should do once every few steps, not three times per drafter per step (session
    47's H200 profile: 24 synchronisations a step). "rows" is an int either way.
    """
    n = max(1, logits.shape[0])
    target_probs = torch.softmax(target_logits.float(), -1)
    kl_rows = -(target_probs * torch.log_softmax(logits.float(), -1)).sum(-1)  # [N]
    l1_rows = sum(F.smooth_l1_loss(p.float(), t.float(), reduction="none").mean(-1)
                  for p, t in l1_terms) / len(l1_terms)  # [N]
    kl, l1 = kl_rows.sum() / n, l1_rows.sum() / n
    # max().indices, not argmax(): the same first-index tie rule, several times faster on a CPU over
    # [N, 8192] (argmax was ~13 ms of a 0.5 s step per call, AMX Xeon)
    hits = (logits.detach().max(-1).indices == target_logits.max(-1).indices).float()  # [N]
    metrics = {"kl": kl.detach(), "smooth_l1": l1.detach(), "top1": hits.sum() / n}
    metrics = {**(metrics if device_metrics else {k: v.item() for k, v in metrics.items()}), "rows": n}
    if conversations is not None:
        index, count = conversations
        per = torch.zeros(count, 3, dtype=torch.float64, device=hits.device)
        rows = torch.stack([torch.ones_like(hits), hits, kl_weight * kl_rows + l1_rows], -1).detach().double()
        metrics["per_conversation"] = per.index_add_(0, index, rows).tolist()
    return kl_weight * kl + l1, metrics


def _conversations(opts: LossOptions, target: TargetBatch, index: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(index [N] of each loss row's conversation, B) where `opts` asks for per-conversation metrics."""
    return (index, target.batch.input_ids.shape[0]) if opts.per_conversation else None


def moa_loss_batch(drafter, parts, target: TargetBatch, starts: torch.Tensor, opts: LossOptions,
                   dtype: torch.dtype, shuffle: torch.Generator | None = None):
    o, final = moa_forward_batch(drafter, parts, target, starts, dtype, opts.sa_window, shuffle)
    rows = target.rows
    final_rows = final.flatten(0, 1)[rows]
    weight, bias = head_weight(parts.lm_head, opts.vocab)
    logits = F.linear(final_rows, weight, bias)
    terms = [(final_rows, target.final.flatten(0, 1)[rows])]
    if parts.tli:
        truth = target.layer_inputs[parts.first_tli_layer].flatten(0, 1)[rows]
        pred = o.flatten(0, 1)[rows]
        if opts.tli_scale is not None:
            pred, truth = pred / opts.tli_scale, truth / opts.tli_scale
        terms.append((pred, truth))
    return distill_loss_rows(logits, target.logits, terms, kl_weight=opts.kl_weight,
                             conversations=_conversations(opts, target, rows // target.batch.input_ids.shape[1]),
                             device_metrics=opts.device_metrics)


def eagle_loss_batch(drafter, parts, target: TargetBatch, opts: LossOptions, dtype: torch.dtype,
                     gen: torch.Generator | None = None):
    """Position i (trained) is predicted by slot i - 1; position 0 has no slot."""
    pred = eagle_forward_batch(drafter, parts, target, dtype, opts.eagle_noise, gen)  # [B, T-1, E]
    keep, b, t = target.batch.rows_from(1)
    slots = pred[b, t - 1]  # [N', E]
    weight, bias = head_weight(parts.lm_head, opts.vocab)
    return distill_loss_rows(F.linear(slots, weight, bias), target.logits[keep],
                             [(slots, target.final[b, t])], kl_weight=opts.kl_weight,
                             conversations=_conversations(opts, target, b), device_metrics=opts.device_metrics)


def falcon_forward_batch(drafter: FalconDrafter, parts: TargetParts, target: TargetBatch, dtype: torch.dtype,
                         offsets: list[int], feats: torch.Tensor | None = None) -> torch.Tensor:
    """Slot j holds (token j+1, feature f_j) and predicts f_{j+2}; blocks of k slots start at each
    conversation's offset and read each other under the relaxed mask (seed 004 §2.2).

    Args:
        offsets: [B] where the first whole block starts (0 .. k-1), so both slots of a block are
            trained at every position.
        feats: [B, T-1, E] the slots' input features; None = the target's (teacher forcing).
    Returns:
        [B, T-1, E] predicted features. Right padding reaches no trained slot: a trained row i is
        predicted by slot i-2, whose block ends at i-1 at the latest.
    """
    batch = target.batch
    feats = target.final[:, :-1] if feats is None else feats
    B, T = feats.shape[:2]
    ends = torch.stack([block_ends(T, o) for o in offsets]).to(feats.device)
    positions = torch.arange(T, device=feats.device).expand(B, T)
    out, _ = drafter(parts.embed(batch.input_ids[:, 1:]), feats, positions, _additive(relaxed_visible(ends), dtype))
    return out


def falcon_loss_batch(drafter, parts, target: TargetBatch, opts: LossOptions, dtype: torch.dtype,
                      rng: random.Random):
    """Coupled Sequential Glancing Distillation (seed 004 §2.1), as we read it.

    Pass 1 (no gradient) predicts every slot's f^_{j+2} with the target's features as inputs. Its
    top-1 error rate e per conversation sets how much truth pass 2 glances at: each block keeps
    the target's features with probability min(1, glance * e), and the others take pass 1's
    predictions (f^_j from slot j-2, what a block after the root has at run time). Tokens and
    features are replaced together, whole blocks at a time (coupled, consecutive). The loss (as
    EAGLE's: 0.1 x KL + SmoothL1 on features) is on pass 2. Tokens stay the true ones: a drafted
    path is verified only as far as its tokens are right.

    Rows: trained position i is predicted by slot i - 2 (i >= 2). With `opts.falcon_glance` None
    there is one teacher-forced pass (held-out figures: every input the target's).
    """
    B, T = target.batch.input_ids.shape
    offsets = [rng.randrange(FALCON_K) for _ in range(B)]
    true = target.final[:, :-1]
    keep, b, t = target.batch.rows_from(FALCON_K)
    weight, bias = head_weight(parts.lm_head, opts.vocab)
    if opts.falcon_glance is None:
        slots = falcon_forward_batch(drafter, parts, target, dtype, offsets)[b, t - FALCON_K]
        return distill_loss_rows(F.linear(slots, weight, bias), target.logits[keep], [(slots, target.final[b, t])],
                                 kl_weight=opts.kl_weight, conversations=_conversations(opts, target, b),
                                 device_metrics=opts.device_metrics)
    with torch.no_grad():
        first = falcon_forward_batch(drafter, parts, target, dtype, offsets)
        wrong = (F.linear(first[b, t - FALCON_K], weight, bias).argmax(-1)
                 != target.logits[keep].argmax(-1)).float()
        # counts by index_add_, not bincount (which reads its input's max back from a GPU)
        counts = torch.zeros(B, device=wrong.device).index_add_(0, b, torch.ones_like(wrong))
        error = torch.zeros(B, device=wrong.device).index_add_(0, b, wrong) / counts.clamp_min(1)
    predicted = torch.cat([true[:, :FALCON_K], first[:, :-FALCON_K].to(true.dtype)], dim=1)
    reveal = torch.ones(B, T - 1, dtype=torch.bool)  # built on the host, sent once
    errors = error.tolist()  # one wait for the device, not one per conversation
    for row in range(B):
        ends = block_ends(T - 1, offsets[row])
        p = min(1.0, opts.falcon_glance * errors[row])
        chosen = {e: rng.random() < p for e in ends.unique().tolist()}
        reveal[row] = torch.tensor([chosen[e] for e in ends.tolist()])
    reveal = to_device(reveal, true.device)
    out = falcon_forward_batch(drafter, parts, target, dtype, offsets, torch.where(reveal[..., None], true, predicted))
    slots = out[b, t - FALCON_K]
    return distill_loss_rows(F.linear(slots, weight, bias), target.logits[keep], [(slots, target.final[b, t])],
                             kl_weight=opts.kl_weight, conversations=_conversations(opts, target, b),
                             device_metrics=opts.device_metrics)


def tokenswift_loss_batch(heads, parts, target: TargetBatch, opts: LossOptions, dtype: torch.dtype):
    """TokenSwift's heads (seed 003 §2.2) by distillation: head i at position t predicts token
    t + 1 + i, so its rows are the trained positions p = t + i, judged against the target's
    distribution there, plus SmoothL1 of h_i against the target's own f_p. Pooled over the heads."""
    hs = heads(target.final)  # [B, T, gamma, E]
    slots, wanted, feats, owners = [], [], [], []
    for i in range(1, hs.shape[2] + 1):
        keep, b, p = target.batch.rows_from(i)
        slots.append(hs[b, p - i, i - 1])
        wanted.append(target.logits[keep])
        feats.append(target.final[b, p])
        owners.append(b)
    slots = torch.cat(slots)
    weight, bias = head_weight(parts.lm_head, opts.vocab)
    return distill_loss_rows(F.linear(slots, weight, bias), torch.cat(wanted), [(slots, torch.cat(feats))],
                             kl_weight=opts.kl_weight, conversations=_conversations(opts, target, torch.cat(owners)),
                             device_metrics=opts.device_metrics)


def tli_scale(target: TargetBatch, layer: int, floor: float = 1e-2) -> torch.Tensor:
    """Per-dimension RMS [E] of layer `layer`'s input over the batch's valid positions (fp32)."""
    h = target.layer_inputs[layer].flatten(0, 1)[target.batch.valid_rows].float()
    return h.pow(2).mean(0).sqrt().clamp_min(floor)
