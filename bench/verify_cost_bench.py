"""`splitspec verify-cost`: what one verify step costs on this hardware, in fp32 and bf16, against
the memory-bandwidth floor of the weights, side by side in one run (issue 11).

Measured here, in one process:
- memory bandwidth: a large tensor copy (read + write), best of several;
- the floor of one step: the weights' bytes read once at that bandwidth;
- a verify forward after a `--context`-token prefix with 1, 2, 5, 9, 25 positions (tree mask and
  position ids as the runner builds them, the runner's attention (server/ragged.py); the prefix
  cache copied outside the timed region), per
  dtype and per linear-layer backend (`--linear`: transformers' nn.Linear, which runs MKL's sgemm,
  and oneDNN with prepacked weights), median of `--repeats`;
- how often greedy decoding through the verifier differs from the same dtype's plain
  `generate()` (bf16 rounding depends on matmul shapes, which a tree forward changes): answers to
  `--prompts` Spec-Bench prompts with the ngram drafter, and where they first differ;
- `--device cuda` runs all of it on a GPU (the bandwidth copy on the GPU's memory, every timed
  forward synchronised), and `--target random:llama-8b` times a Llama of Llama-3-8B's shape with
  random weights (no tokenizer: pair it with `--prompts 0`), the large target the issue asks about
  where no such checkpoint is at hand;
- with `--batches 1,4,8,16`, one verify step of B sessions scored together (the service's batched
  path, `TargetRunner.verify_batch`: ragged where the model allows), each session a `--batch-nodes`
  tree after `--context` tokens of its own, against B: what a server verifying B clients in one
  forward pays per step (docs/scaling.md's T_verify(B));
- with `--cuda-graphs` (`--device cuda`), whole verify steps through `TargetRunner` (forward,
  greedy acceptance on the device, KV commit) eagerly and as fixed-shape forwards replayed from
  CUDA graphs (server/graphs.py), side by side, for each position count;
- with `--compile`, the same forwards through `torch.compile(model.forward, dynamic=True)` (the
  runner's cache class and mask, inductor's default mode), timed beside eager on the same inputs
  once compiled, with the compile time and the largest logit difference from eager.
"""
from __future__ import annotations

import math
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from splitspec.server import ragged
from splitspec.server.runner import TargetRunner
from splitspec.shared import kv
from splitspec.shared.features import FeatureRequest
from splitspec.shared.models import encode_chat, load_model, use_cudnn_attention
from splitspec.shared.packed_linear import onednn_available, onednn_supports, pack_linears
from splitspec.shared.reference import target_greedy
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import DraftTree, tree_buffers

from .cli import linear_backends
from .prompts import load_prompts

POSITIONS = (1, 2, 5, 9, 25)
RANDOM = "random:"
# Llama shapes built with random weights (`--target random:NAME`): llama-8b is Llama-3-8B's
# (meta-llama/Meta-Llama-3-8B config.json); smollm2-135m is the default target's (its config.json),
# for timing the served shape where the target's weights cannot travel; llama-tiny is for tests.
RANDOM_SHAPES = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
}


def random_model(name: str, dtype: str, device: str, linear: str = "torch"):
    """A Llama of the named shape (`RANDOM_SHAPES`) with random weights, built directly on `device`
    in `dtype` (an 8B model never passes through fp32 or host memory), its linear layers on the CPU
    prepacked as `load_model(..., linear=)` does a real target's (shared/packed_linear.py; "torch"
    leaves them as nn.Linear). Figures timed on it are shape figures, not a trained model's: say so
    wherever they are written.

    Raises:
        ValueError: an unknown shape name or linear backend.
        RuntimeError: linear "onednn" where oneDNN cannot serve the model (`pack_linears`).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if name not in RANDOM_SHAPES:
        raise ValueError(f"no random shape {name!r}; known: {', '.join(RANDOM_SHAPES)}")
    torch.manual_seed(0)
    config = LlamaConfig(**RANDOM_SHAPES[name])
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        pack_linears(model, linear)  # as load_model does for a CPU model
    elif torch.device(device).type == "cuda":
        use_cudnn_attention()  # as load_model does for a CUDA model
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbs(megabytes: int = 512, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Bytes moved (read + write) per second by a tensor copy on `device`, best of `repeats`, in GB/s."""
    device = torch.device(device)
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def step_ms(model, context: int, positions: int, repeats: int, forward=None) -> tuple[float, torch.Tensor]:
    """Median ms of a verify forward of `positions` rows (a chain tree) after `context` tokens.

    `forward` replaces `model.forward` (e.g. a compiled one). The token ids are the same for every
    call with the same arguments, so two forwards' logits [positions, V] can be compared.
    """
    forward = forward or model.forward
    vocab = model.config.vocab_size
    weight = next(model.parameters())
    device = weight.device
    generator = torch.Generator().manual_seed(context * 1000 + positions)  # ids drawn on the CPU: any device
    prefix = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (1, context), generator=generator).to(device), cache=prefix,
              use_cache=True)
        buffers = tree_buffers(DraftTree.chain(list(range(positions - 1))).parents)
        mask = buffers.attention_mask(context, weight.dtype, device)
        position_ids = buffers.position_ids(context).to(device)
        ids = torch.randint(0, vocab, (1, positions), generator=generator).to(device)
        times = []
        for _ in range(repeats + 1):
            cache = DynamicCache()
            for i, layer in enumerate(prefix.layers):
                cache.update(layer.keys.clone(), layer.values.clone(), i)
            _sync(device)
            start = time.perf_counter()
            out = forward(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask,
                          position_ids=position_ids)
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:]), out.logits[0].float().cpu()


def runner_step_ms(model, context: int, positions: int, repeats: int, use_graphs: bool
                   ) -> tuple[float, float, float]:
    """Median ms of a whole verify step through `TargetRunner` (forward, greedy acceptance, KV commit)
    of a chain of `positions` rows after `context` random tokens, the median of the forward's own
    part of it (`StepOutput.forward_ms`: for a replay, the inputs copied in and the graph run,
    synchronised; the rest is the runner's host work around the forward), and the ms of the
    session's first step, which the medians leave out: with graphs on CUDA it captures the step's
    graph (a warm-up forward, the capture, the first replay), the cost a session pays once per row
    bucket and storage. The session is cut back to its prefix after every step, so each step has
    the same shape."""
    runner = TargetRunner(model, None, "verify-cost", use_graphs=use_graphs)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(context * 1000 + positions)
    prompt = torch.randint(0, vocab, (context,), generator=generator).tolist()
    session, _, _ = runner.open(prompt, SamplingParams(), FeatureRequest())
    pending = session.pending_token
    tree = DraftTree.chain(torch.randint(0, vocab, (positions - 1,), generator=generator).tolist())
    device = next(model.parameters()).device
    times, forwards = [], []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        out = runner.verify(session, tree)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        forwards.append(out.forward_ms)
        kv.truncate(session.cache, context)
        session.pending_token = pending
    if use_graphs and (runner.static is None or not runner.static.runs):
        raise RuntimeError("the fixed-shape verify step failed; see the log above")
    return statistics.median(times[1:]), statistics.median(forwards[1:]), times[0]


def break_even_steps(first: float, replayed: float, eager: float) -> float:
    """Steps after which capturing a graph has paid for itself: the first (capturing) step's extra
    cost over a replay, `first - replayed`, divided by what each replay saves, `eager - replayed`
    (ms); inf where replay saves nothing."""
    saved = eager - replayed
    return (first - replayed) / saved if saved > 0 else math.inf


def batched_ms(model, context: int, nodes: int, batches: list[int], repeats: int) -> dict[int, float]:
    """Median ms of one verify step of B sessions scored together, per B in `batches`.

    Each session holds `context` random prompt tokens; each step verifies a `nodes`-node tree of random
    tokens per session through the service's runner (`TargetRunner.verify` for B = 1, `verify_batch`
    otherwise; acceptance included, so the sessions' caches grow by the one token each step commits).
    """
    runner = TargetRunner(model, None, "verify-cost")
    generator = torch.Generator().manual_seed(context * 1000 + nodes)  # ids drawn on the CPU: any device
    vocab = runner.vocab_size
    parents = tuple(-1 if i < 2 else (i - 2) // 2 for i in range(nodes))  # two roots, then two children a node
    out = {}
    for b in batches:
        sessions = [runner.open(torch.randint(0, vocab, (context,), generator=generator).tolist(), SamplingParams(),
                                FeatureRequest())[0] for _ in range(b)]
        times = []
        for _ in range(repeats + 1):
            items = [(session, DraftTree(tuple(torch.randint(0, vocab, (nodes,), generator=generator).tolist()),
                                         parents), None, ()) for session in sessions]
            _sync(runner.device)
            start = time.perf_counter()
            results = runner.verify_batch(items) if b > 1 else [runner.verify(*items[0])]
            _sync(runner.device)
            times.append((time.perf_counter() - start) * 1e3)
            failed = [r for r in results if isinstance(r, Exception)]
            if failed:
                raise failed[0]
        out[b] = statistics.median(times[1:])
    return out


def greedy_mismatches(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> tuple[list[int | None], float]:
    """Per prompt: the first answer position where the verifier's greedy output (ngram drafter)
    differs from the same model's `generate()`, or None; and that speculative decoding's tokens/s
    over all prompts."""
    if not prompts:  # --prompts 0: no agreement check
        return [], float("nan")
    from splitspec.client.drafters import NgramDrafter
    from splitspec.client.loop import SpeculativeDecoder
    from splitspec.server.local import LocalVerifier
    from splitspec.server.runner import TargetRunner

    decoder = SpeculativeDecoder(LocalVerifier(TargetRunner(model, tokenizer, "target")), NgramDrafter())
    out, tokens, seconds = [], 0, 0.0
    for prompt in prompts:
        ref = target_greedy(model, prompt, new_tokens)
        start = time.perf_counter()
        got = decoder.generate(prompt, new_tokens, stop_on_eos=False).tokens
        seconds += time.perf_counter() - start
        tokens += len(got)
        out.append(first_difference(ref, got))
    return out, tokens / seconds


def first_difference(reference: list[int], answer: list[int]) -> int | None:
    """The first position where `answer` differs from `reference`, or None when they are equal; an
    answer that stops early or runs on differs where the shorter one ends."""
    same = next((i for i, (a, b) in enumerate(zip(reference, answer)) if a != b), None)
    if same is None and len(reference) != len(answer):
        return min(len(reference), len(answer))
    return same


def _ratio(base: float | None, ms: float) -> str:
    return f"{base / ms:.2f}x" if base is not None else "-"


def _differ(diffs: list[int | None]) -> str:
    if not diffs:
        return "not checked (--prompts 0)"
    differ = [d for d in diffs if d is not None]
    where = f" (first at token {', '.join(map(str, differ))})" if differ else ""
    return f"{len(differ)} of {len(diffs)}{where}"


def cmd_verify_cost(args) -> None:
    """The verify-cost command (module docstring).

    Raises:
        ValueError: bad counts, --linear or prompts (bench/prompts.py), before any model loads.
        SystemExit: no CUDA device for --device cuda; a random target with --prompts.
    """
    if min(args.context, args.repeats, args.threads, args.new_tokens, args.batch_nodes) < 1 or args.prompts < 0:
        raise ValueError("--context, --repeats, --threads, --new-tokens and --batch-nodes must be >= 1, --prompts >= 0")
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("verify-cost --device cuda: torch sees no CUDA device here")
    linears = linear_backends(args.linear)  # torch first: the "1 pos vs torch" column's base
    if "onednn" in linears and (device != "cpu" or not onednn_available()):
        print("verify-cost: no oneDNN prepacked linear here (a CPU-only path, or this torch build lacks it); "
              "measuring torch only", file=sys.stderr)
        linears = [b for b in linears if b != "onednn"]
    randomised = args.target.startswith(RANDOM)
    if randomised and args.prompts:
        raise SystemExit(f"verify-cost --target {args.target}: random weights have no tokenizer; add --prompts 0")
    texts = load_prompts(["spec_bench"], 1, args.spec_bench) if args.prompts else []  # one per category
    if args.prompts > len(texts):
        raise ValueError(f"--prompts {args.prompts}: the Spec-Bench questions have {len(texts)} categories, one "
                         "prompt each")
    texts = texts[: args.prompts]
    variants, tokenizer, model_id = {}, None, args.target
    for dtype in ("float32", "bfloat16"):
        for linear in linears:
            if linear == "onednn" and not onednn_supports(getattr(torch, dtype)):
                print(f"verify-cost: this CPU's oneDNN cannot prepack {dtype} weights (bf16: an AVX2-only CPU); "
                      f"{dtype} is measured with torch's linear alone", file=sys.stderr)
                continue
            if randomised:
                variants[(dtype, linear)] = random_model(args.target[len(RANDOM):], dtype, device, linear)
                model_id = f"{args.target} (random weights)"
                continue
            model, tokenizer, model_id = load_model(args.target, device=device, dtype=dtype, linear=linear)
            variants[(dtype, linear)] = model
    for model in variants.values():
        ragged.enable(model)  # the attention the verify service runs (TargetRunner switches its model too)
    bandwidth = copy_bandwidth_gbs(device=device)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p["text"]}]) for p in texts]
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {args.threads} torch threads"
    lines = [f"target {model_id}, {where}, context {args.context} tokens, median of "
             f"{args.repeats}; copy bandwidth {bandwidth:.1f} GB/s (read + write); linear layers: torch = "
             "transformers' nn.Linear (MKL), onednn = prepacked (shared/packed_linear.py)", "",
             "| dtype | linear | weights MB | floor ms | " + " | ".join(f"{n} pos ms" for n in POSITIONS)
             + " | 1 pos / floor | 25 pos / 1 pos | 1 pos vs torch | greedy answers differing from generate() "
             "| ngram decoding tok/s |",
             "|---|---|---|---|" + "---|" * len(POSITIONS) + "---|---|---|---|---|"]
    goals, compiled_rows, one_pos, floors = [], [], {}, {}
    for (name, linear), model in variants.items():
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        floor = weights / (bandwidth / 2 * 1e9) * 1e3  # read once at the copy's read rate
        floors[(name, linear)] = floor
        timed = {n: step_ms(model, args.context, n, args.repeats) for n in POSITIONS}
        times = {n: t for n, (t, _) in timed.items()}
        if linear == "torch":
            one_pos[name] = times[1]
        print(f"{name} {linear}: " + ", ".join(f"{n} pos {t:.1f} ms" for n, t in times.items()), file=sys.stderr)
        diffs, tok_s = greedy_mismatches(model, tokenizer, prompts, args.new_tokens)
        lines.append(f"| {name} | {linear} | {weights / 1e6:.0f} | {floor:.1f} | "
                     + " | ".join(f"{times[n]:.1f}" for n in POSITIONS)
                     + f" | {times[1] / floor:.2f}x | {times[25] / times[1]:.2f}x | {_ratio(one_pos.get(name), times[1])} "
                     f"| {_differ(diffs)} | {'-' if math.isnan(tok_s) else f'{tok_s:.1f}'} |")
        goals.append(f"- {name} {linear}: 25-position verify / one-position step = {times[25] / times[1]:.2f}x (goal "
                     f"<= 1.3x: {'met' if times[25] / times[1] <= 1.3 else 'missed'}); one-position step / floor = "
                     f"{times[1] / floor:.2f}x (goal <= 2x: {'met' if times[1] / floor <= 2 else 'missed'})")
        if args.compile and linear == "torch":
            row, ratio = _compiled_row(name, model, args, timed)
            compiled_rows.append(row)
            goals.append(f"- {name} compiled: 25-position verify / one-position step = {ratio:.2f}x (goal <= 1.3x: "
                         f"{'met' if ratio <= 1.3 else 'missed'})")
    if args.batches:
        lines += ["", f"Batched sessions: one verify step of B sessions scored together ({args.batch_nodes}-node "
                  f"trees, {args.context} tokens of context each; the service's verify_batch), median of {args.repeats}:",
                  "", "| dtype | linear | " + " | ".join(f"B={b} ms" for b in args.batches)
                  + " | " + " | ".join(f"tokens/s gain at B={b}" for b in args.batches if b > 1) + " |",
                  "|---|---|" + "---|" * len(args.batches) + "---|" * sum(b > 1 for b in args.batches)]
        for (name, linear), model in variants.items():
            ms = batched_ms(model, args.context, args.batch_nodes, args.batches, args.repeats)
            base = ms.get(1)
            gains = [f"{b * base / ms[b]:.2f}x" if base else "-" for b in args.batches if b > 1]
            lines.append(f"| {name} | {linear} | " + " | ".join(f"{ms[b]:.1f}" for b in args.batches)
                         + " | " + " | ".join(gains) + " |")
            print(f"{name} {linear} batched: " + ", ".join(f"B={b} {t:.1f} ms" for b, t in ms.items()), file=sys.stderr)
    if args.cuda_graphs:
        lines += ["", f"Whole verify steps through TargetRunner (forward, greedy acceptance, KV commit; a chain "
                  f"after {args.context} tokens), eager and replayed from CUDA graphs (server/graphs.py), median of "
                  f"{args.repeats}" + ("" if device == "cuda" else " (on a CPU no graph: the fixed-shape forward runs "
                                        "eagerly, a dry run of this table)") + ":", "", "| dtype | linear | " + " | ".join(f"{n} pos ms eager / graphs" for n in POSITIONS)
                  + " | 1 pos graphs / floor | 25 pos / 1 pos (graphs) | 1 pos graphs: forward / rest ms "
                  "| first step with graphs (capture) ms, 1 / 25 pos | capture paid back after steps, 1 / 25 pos |",
                  "|---|---|" + "---|" * len(POSITIONS) + "---|---|---|---|---|"]
        for (name, linear), model in variants.items():
            eager = {n: runner_step_ms(model, args.context, n, args.repeats, False)[0] for n in POSITIONS}
            split = {n: runner_step_ms(model, args.context, n, args.repeats, True) for n in POSITIONS}
            graphed = {n: total for n, (total, _, _) in split.items()}
            first = {n: capture for n, (_, _, capture) in split.items()}
            forward = split[1][1]
            floor = floors[(name, linear)]
            paid = {n: break_even_steps(first[n], graphed[n], eager[n]) for n in (1, 25)}
            lines.append(f"| {name} | {linear} | " + " | ".join(f"{eager[n]:.2f} / {graphed[n]:.2f}" for n in POSITIONS)
                         + f" | {graphed[1] / floor:.2f}x | {graphed[25] / graphed[1]:.2f}x"
                         + f" | {forward:.2f} / {graphed[1] - forward:.2f} | {first[1]:.1f} / {first[25]:.1f}"
                         + f" | {paid[1]:.1f} / {paid[25]:.1f} |")
            print(f"{name} {linear} graphs: " + ", ".join(f"{n} pos {t:.2f} ms" for n, t in graphed.items()),
                  file=sys.stderr)
            how = "with CUDA graphs" if device == "cuda" else "fixed-shape, no graph (a CPU dry run)"
            goals.append(f"- {name} {linear} {how}: one-position step / floor = {graphed[1] / floor:.2f}x "
                         f"(goal <= 2x: {'met' if graphed[1] / floor <= 2 else 'missed'}); 25-position / one-position = "
                         f"{graphed[25] / graphed[1]:.2f}x (goal <= 1.3x: {'met' if graphed[25] / graphed[1] <= 1.3 else 'missed'})")
    if compiled_rows:
        lines += ["", "torch.compile (inductor, dynamic shapes, torch linear layers) beside eager, same inputs:", "",
                  "| dtype | compile + first calls s | " + " | ".join(f"{n} pos ms (eager)" for n in POSITIONS)
                  + " | 25 pos / 1 pos | largest logit difference from eager |",
                  "|---|---|" + "---|" * len(POSITIONS) + "---|---|", *compiled_rows]
    print("\n".join(lines + ["", "Goals (issue 11):", *goals]))


def _compiled_row(name: str, model, args, eager: dict[int, tuple[float, torch.Tensor]]) -> tuple[str, float]:
    """One table row: the compiled forward's step times beside eager's (same inputs) and its
    largest logit difference from eager; and its 25-position / one-position ratio.

    Only the steady state of a forward already compiled for these shapes is timed. Serving one
    would also pay recompiles: Dynamo specialises sizes 0 and 1 (tree width, batch) and guards on
    the cache tensors' strides (which `kv.keep_rows` changes) and on hidden-state output, each a
    compile of tens of seconds on a 2-core CPU (docs/serving.md, "The cost of one verify step").
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # fp32 and bf16 share forward's code
    compiled = torch.compile(model.forward, dynamic=True)
    start = time.perf_counter()
    for n in POSITIONS:  # the first calls compile (and recompile once shapes turn dynamic)
        step_ms(model, args.context, n, 1, compiled)
    compile_s = time.perf_counter() - start
    timed = {n: step_ms(model, args.context, n, args.repeats, compiled) for n in POSITIONS}
    diff = max((timed[n][1] - eager[n][1]).abs().max().item() for n in POSITIONS)
    print(f"{name} compiled: " + ", ".join(f"{n} pos {t:.1f} ms" for n, (t, _) in timed.items()), file=sys.stderr)
    ratio = timed[25][0] / timed[1][0]
    return (f"| {name} | {compile_s:.0f} | " + " | ".join(f"{timed[n][0]:.1f} ({eager[n][0]:.1f})" for n in POSITIONS)
            + f" | {ratio:.2f}x | {diff:.2g} |"), ratio
