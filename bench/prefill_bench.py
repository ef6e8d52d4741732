"""`splitspec prefill-bench`: what one long prompt costs the other sessions of a verify service,
with chunked prefill (server `--prefill-chunk`) at several chunk sizes side by side (issue 11).

For each chunk size a `splitspec serve` child process starts (all before the first measurement).
In each of --rounds rounds, every server in turn gets a decoding client that sends verify steps of
a fixed 2x2x4-shaped tree back to back (a raw gRPC stub: no drafter, so the client costs the CPU
little) and, after a warm-up, one long prompt of --prompt-tokens seeded random token ids (prefill
cost does not depend on the text) from another client; an uncounted round first warms each
server up. Reported per chunk size: the long prompt's OpenSession round trip (its
time to first token) against one-forward prefill, and the decoding client's step round trips while
no prefill runs (p50) and while one does (p50, p99, max), against the idle p50 of the same server.
Server and clients share this machine's cores: the ratios within one run are the result.
"""
from __future__ import annotations

import statistics
import sys
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from splitspec.shared.config import ServerLimits
from splitspec.shared.models import load_tokenizer, tokenizer_fingerprint
from splitspec.v1 import verify_pb2 as pb
from splitspec.v1 import verify_pb2_grpc as pb_grpc

from .metrics import quantile
from .out_paths import writable_file
from .service_process import free_port, sigterm_exits, start_server, stop_server

TREE = pb.DraftTree(tokens=[100, 101, 102, 103], parents=[-1, -1, 0, 1])  # the default tree's shape
DECODE_PROMPT = 64  # tokens of the decoding session's prompt
DECODE_CONTEXT_MAX = 1536  # the decoding session reopens past this context, so its steps stay alike


@dataclass(frozen=True)
class PrefillPoint:
    chunk: int  # server --prefill-chunk (0: one forward)
    ttft_ms: list[float]  # the long prompts' OpenSession round trips
    idle_ms: list[float]  # decoding steps that overlapped no long prefill
    during_ms: list[float]  # decoding steps that overlapped one


def _decoding_client(stub, fingerprint: str, vocab: int, stop: threading.Event, steps: list[tuple[float, float]],
                     errors: list[BaseException]) -> None:
    """Verify steps back to back until `stop`; appends (start, end) perf_counter times per step."""
    gen = torch.Generator().manual_seed(1)
    try:
        while not stop.is_set():
            prompt = torch.randint(3, vocab, (DECODE_PROMPT,), generator=gen).tolist()
            sid = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt, tokenizer_fingerprint=fingerprint),
                                   timeout=600).session_id
            context, step = DECODE_PROMPT, 0
            while not stop.is_set() and context < DECODE_CONTEXT_MAX:
                step += 1
                start = time.perf_counter()
                reply = stub.Verify(pb.VerifyRequest(session_id=sid, step=step, tree=TREE), timeout=600)
                steps.append((start, time.perf_counter()))
                context += len(reply.accepted_tokens) + 1
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=30)
    except BaseException as err:  # noqa: BLE001 - reported by the caller
        errors.append(err)


def _round(port: int, fingerprint: str, vocab: int, prompt: list[int], warmup_s: float
           ) -> tuple[float, list[float], list[float]]:
    """One long prompt on the server at `port` beside a decoding client: (TTFT ms, decoding step
    round trips in ms that overlapped no prefill, those that overlapped it).

    Raises:
        RuntimeError: a client's call failed.
    """
    stop, steps, errors = threading.Event(), [], []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as dec_channel, \
            grpc.insecure_channel(f"127.0.0.1:{port}") as long_channel:
        decoder = threading.Thread(target=_decoding_client, daemon=True,
                                   args=(pb_grpc.VerifyServiceStub(dec_channel), fingerprint, vocab, stop, steps, errors))
        decoder.start()
        try:
            time.sleep(warmup_s)
            measured_from = time.perf_counter()
            long_stub = pb_grpc.VerifyServiceStub(long_channel)
            start = time.perf_counter()
            reply = long_stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt, tokenizer_fingerprint=fingerprint),
                                          timeout=600)
            end = time.perf_counter()
            long_stub.CloseSession(pb.CloseSessionRequest(session_id=reply.session_id), timeout=30)
            time.sleep(warmup_s)
        finally:
            stop.set()
            decoder.join(600)
    if errors:
        raise RuntimeError(f"the decoding client failed: {errors[0]}")
    overlaps = [(s < end and e > start, (e - s) * 1e3) for s, e in steps if s >= measured_from]
    return ((end - start) * 1e3, [ms for hit, ms in overlaps if not hit], [ms for hit, ms in overlaps if hit])


def run_points(target: str, chunks: list[int], prompt_tokens: int, rounds: int, threads: int | None,
               warmup_s: float = 2.0) -> list[PrefillPoint]:
    """A server per chunk size, all started first; then `rounds` rounds, each running one long
    prompt on every server in turn (interleaved, so that a slow spell of this shared machine falls
    on every chunk size alike). The first long prompt of each server is a warm-up, not counted.

    Raises:
        RuntimeError: a server did not start, or a client's call failed.
    """
    tokenizer = load_tokenizer(target)
    fingerprint, vocab = tokenizer_fingerprint(tokenizer), len(tokenizer)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(rounds + 1)]
    servers: dict[int, tuple[int, object]] = {}
    results = {c: ([], [], []) for c in chunks}
    try:
        for chunk in chunks:
            port = free_port()
            servers[chunk] = (port, start_server(target, port, threads=threads, extra=["--prefill-chunk", str(chunk)]))
        for r, prompt in enumerate(prompts):
            for chunk in chunks:
                ttft, idle, during = _round(servers[chunk][0], fingerprint, vocab, prompt, warmup_s)
                if r == 0:
                    continue  # first-call costs (allocation, kernel set-up for new shapes)
                results[chunk][0].append(ttft)
                results[chunk][1].extend(idle)
                results[chunk][2].extend(during)
                print(f"round {r} chunk {chunk or 'off'}: TTFT {ttft:.0f} ms, {len(during)} steps during it",
                      file=sys.stderr, flush=True)
    finally:
        for _, server in servers.values():
            stop_server(server)
    return [PrefillPoint(c, *results[c]) for c in chunks]


def format_table(points: list[PrefillPoint], prompt_tokens: int) -> str:
    base = next((p for p in points if p.chunk == 0), points[0])  # without chunk 0: the first chunk size
    base_ttft = statistics.median(base.ttft_ms)
    against = "one forward" if base.chunk == 0 else f"chunk {base.chunk}"
    lines = [f"prefill of {prompt_tokens} tokens beside a decoding session (2x2x4 tree), "
             f"{len(base.ttft_ms)} prompts per chunk size",
             f"| --prefill-chunk | long prompt TTFT ms (median) | / {against} | decoding step p50 idle ms | "
             "during prefill p50 / p99 / max ms | max / idle p50 |",
             "|---|---|---|---|---|---|"]
    for p in points:
        ttft = statistics.median(p.ttft_ms)
        idle = quantile(p.idle_ms, 0.5, "nearest")
        worst = max(p.during_ms) if p.during_ms else float("nan")
        lines.append(f"| {p.chunk or 'off (one forward)'} | {ttft:.0f} | {ttft / base_ttft:.2f}x | {idle:.1f} | "
                     f"{quantile(p.during_ms, 0.5, 'nearest'):.1f} / {quantile(p.during_ms, 0.99, 'nearest'):.1f} / {worst:.0f} | "
                     f"{worst / idle:.1f}x |")
    return "\n".join(lines)


def cmd_prefill_bench(args) -> None:
    """Raises ValueError, OSError: a bad --out before anything starts; RuntimeError: a server or
    client failed."""
    limit = ServerLimits().max_prompt_tokens  # the servers run on the default limits
    if args.prompt_tokens > limit:
        raise ValueError(f"--prompt-tokens {args.prompt_tokens} is over the verify service's prompt limit of {limit}")
    if args.out:
        writable_file(args.out)
    with sigterm_exits():
        points = run_points(args.target, args.chunks, args.prompt_tokens, args.rounds, args.threads)
    table = format_table(points, args.prompt_tokens)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
