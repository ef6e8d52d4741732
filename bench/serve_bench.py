"""`splitspec serve-bench`: the verify service under 1, 4, 8, 16 concurrent clients, with batched
verification on and off, side by side in one run (issue 11).

For each --max-batch value (and window) a `splitspec serve` child process starts (the same target,
the same threads), all of them before the first measurement; then for each client count, on every
server in turn (interleaved, so that the points a ratio compares ran close in time), that many
clients (threads of this process, each with its own gRPC channel, session and drafter) generate
answers to Spec-Bench prompts for --seconds, one after another; with --rounds R the whole
interleaved pass runs R times and the table gives each point's median with its range, ratios taken
within a round (a single 15-20 s point varies by +-10% on a shared 2-core machine, session 55).
With --client-processes P the clients are spread over P child processes instead, so that their drafting and gRPC work is not held to one interpreter lock: on a GPU server with
spare host cores (session 37, an H200: a 135M target's verify step is ~30 ms of host work) a
16-thread client process may itself be the bottleneck the table measures. Reported per
(max_batch, clients): aggregate generated tokens/s, per-client tokens/s, p50/p99 latency of a
Verify call as the client sees it (round trip), ratios against one client and against
unbatched serving, and how many Verify steps a target forward scored on average (read from the
server's Prometheus metrics before and after the point). Clients and server share this
machine's cores: the ratios within one run are the result, not the absolute figures.
"""
from __future__ import annotations

import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from splitspec.client.drafters.factory import make_drafter
from splitspec.client.loop import SpeculativeDecoder
from splitspec.client.transport import RemoteVerifier
from splitspec.shared.drafters.spec import SELF_DRAFTING, DrafterSpec
from splitspec.shared.models import encode_chat, load_model, load_tokenizer, tokenizer_fingerprint

from .metrics import quantile
from .out_paths import writable_file
from .prompts import load_prompts
from .service_process import free_port, sigterm_exits, start_server, stop_server


@dataclass(frozen=True)
class ServeResult:
    max_batch: int
    batching: str  # "ragged" | "padded" (server --batching) | "graphs" (ragged, server --cuda-graphs)
    clients: int
    tokens: int
    seconds: float
    per_client_tok_s: float
    step_ms_p50: float
    step_ms_p99: float
    steps_per_forward: float | None = None  # mean Verify steps a target forward scored (the server's metrics)
    window_ms: float | None = None  # server --batch-window-ms (None: not set by the bench)
    round: int = 0  # which --rounds pass measured it (0 = the first)
    step_ms: tuple[float, ...] = ()  # every Verify round trip of the point, for quantiles pooled over rounds

    @property
    def label(self) -> str:
        return point_label(self.max_batch, self.batching, self.window_ms)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def point_label(max_batch: int, batching: str, window_ms: float | None) -> str:
    """The max-batch column of a point: '8', '8 (padded)' for the padded way of batching, '1 (graphs)',
    with ', window W ms' where the bench set the batching window of a max batch above 1."""
    if batching == "graphs":
        base = f"{max_batch} (graphs)"
    else:
        base = f"{max_batch}" if batching == "ragged" or max_batch == 1 else f"{max_batch} ({batching})"
    return base + (f", window {window_ms:g} ms" if window_ms is not None and max_batch > 1 else "")


def forward_batches(metrics_port: int) -> tuple[float, float]:
    """(Verify steps scored, target forwards) so far, from a server's Prometheus metrics
    (server/metrics.py `splitspec_forward_batch_size`).

    Raises:
        OSError: the metrics endpoint cannot be read.
    """
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return samples.get("splitspec_forward_batch_size_sum", 0.0), samples.get("splitspec_forward_batch_size_count", 0.0)


def _percentile(values: list[float], q: float) -> float:
    """The step latencies' q-quantile, a latency that occurred; 0.0 when no step completed."""
    return quantile(values, q, method="nearest") if values else 0.0


def shared_target(drafter: DrafterSpec, target: str):
    """The target model whose frozen parts `drafter`'s clients share (loaded once, read-only), or
    None for a drafter not built on them (ngram, none, a draft model; swift, whose clients each
    load their own copy of the target, as before).

    Raises RuntimeError when the target does not load (a set-up failure, like a drafter's)."""
    if drafter.resolve(target).kind not in SELF_DRAFTING:
        return None
    try:
        return load_model(target)[0]
    except Exception as err:  # noqa: BLE001 - reported as a set-up failure
        raise RuntimeError(f"a client could not be set up (target: {type(err).__name__}: {err})") from None


def run_clients(address: str, n: int, prompts: list[list[int]], drafter: DrafterSpec, fingerprint: str, target: str,
                seconds: float, max_new_tokens: int, offset: int = 0, ready: Callable[[], None] | None = None,
                target_model=None) -> tuple[int, float, list[float], list[float]]:
    """`n` clients (threads of this process) answer prompts, client i starting at prompt
    `offset + i`, until `seconds` pass; returns (tokens, elapsed s, per-client tokens/s, Verify
    round trips in ms). `ready`, when given, is called once every client is set up and before any
    starts (the cross-process start of `run_client_processes`). A drafter built on the target's
    frozen parts (moa, eagle2, falcon, tokenswift) gets them from one copy of the target for all
    `n` clients, read-only: `target_model` when given, else `shared_target` loads it here.

    Raises RuntimeError when a client cannot be set up (its drafter or the target does not load):
    no client runs; or when a client stopped on an error other than the service refusing an answer
    (a drafter or loop failure mid-run): its share would be missing from the tokens."""
    tokens, rates, steps, errors, failures = [0] * n, [0.0] * n, [], [], []
    if target_model is None:
        target_model = shared_target(drafter, target)
    lock = threading.Lock()
    set_up, start = threading.Barrier(n + 1), threading.Barrier(n + 1)

    def client(i: int) -> None:
        try:
            verifier = RemoteVerifier(address)
            decoder = SpeculativeDecoder(verifier, make_drafter(drafter, target_fingerprint=fingerprint, target=target,
                                                                target_model=target_model))
        except Exception as err:  # a drafter that cannot load: stop every client, not wait for this one
            with lock:
                errors.append(f"set-up: {type(err).__name__}: {err}")
            set_up.abort()
            return
        try:
            set_up.wait()
            start.wait()
        except threading.BrokenBarrierError:  # another client (or process) failed to set up
            verifier.close()
            return
        began, k = time.perf_counter(), offset + i
        try:
            while time.perf_counter() - began < seconds:
                prompt = prompts[k % len(prompts)]
                k += 1
                try:
                    gen = decoder.generate(prompt, max_new_tokens)
                except grpc.RpcError as err:  # e.g. a prompt too long for the target's context: next one
                    with lock:
                        errors.append(err.code().name)
                    continue
                tokens[i] += gen.stats.new_tokens
                with lock:
                    steps.extend(c.rtt_ms for c in gen.stats.calls[1:])
        except Exception as err:  # noqa: BLE001 - raised by run_clients once every client has stopped
            with lock:
                failures.append(f"client {i}: {type(err).__name__}: {err}")
        finally:
            rates[i] = tokens[i] / (time.perf_counter() - began)
            verifier.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        set_up.wait()
    except threading.BrokenBarrierError:
        start.abort()
        raise RuntimeError(f"a client could not be set up ({'; '.join(e for e in errors if e.startswith('set-up'))})") \
            from None
    if ready is not None:
        try:
            ready()
        except BaseException:  # the other processes' clients did not start: neither do these
            start.abort()
            raise
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError(f"{len(failures)} of {n} clients failed, so the point's throughput would be wrong: "
                           + "; ".join(failures))
    if errors:
        print(f"{len(errors)} answers refused ({', '.join(sorted(set(errors)))}); their clients went on", file=sys.stderr)
    return sum(tokens), time.perf_counter() - began, rates, steps


def _client_process(results, start, address: str, n: int, offset: int, prompts: list[list[int]], drafter: str,
                    fingerprint: str, target: str, seconds: float, max_new_tokens: int) -> None:
    """One child of `run_client_processes`: `n` clients as threads; puts its `run_clients` result
    (or the error that stopped it) on `results`."""
    try:
        out = run_clients(address, n, prompts, DrafterSpec.parse(drafter), fingerprint, target, seconds,
                          max_new_tokens, offset=offset, ready=start.wait)
    except BaseException as err:  # noqa: BLE001 - reported by the parent, which must not wait forever
        start.abort()
        results.put(("error", f"{type(err).__name__}: {err}"))
        return
    results.put(("ok", out))


def run_client_processes(address: str, n: int, processes: int, prompts: list[list[int]], drafter: str,
                         fingerprint: str, target: str, seconds: float,
                         max_new_tokens: int) -> tuple[int, float, list[float], list[float]]:
    """`run_clients` with the `n` clients spread as evenly as they go over min(processes, n) child
    processes (spawned, each with its own interpreter lock), all started together once every
    client is set up. Returns what `run_clients` returns, over all of them (elapsed: the longest).

    Raises RuntimeError when a child fails or does not report within `seconds` + 120 s."""
    procs = min(processes, n)
    counts = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    results, start = ctx.Queue(), ctx.Barrier(procs)
    children = [ctx.Process(target=_client_process, daemon=True,
                            args=(results, start, address, c, sum(counts[:i]), prompts, drafter, fingerprint, target,
                                  seconds, max_new_tokens))
                for i, c in enumerate(counts)]
    for child in children:
        child.start()
    outs = []
    try:
        for _ in children:
            try:
                status, out = results.get(timeout=seconds + 120)
            except Exception as err:  # queue.Empty: a child died without reporting
                raise RuntimeError(f"a client process did not report within {seconds + 120:g} s") from err
            if status != "ok":
                raise RuntimeError(f"a client process failed: {out}")
            outs.append(out)
    finally:
        for child in children:
            child.join(5)
            if child.is_alive():
                child.kill()
    return (sum(o[0] for o in outs), max(o[1] for o in outs), [r for o in outs for r in o[2]],
            [s for o in outs for s in o[3]])


def serve_points(batches: list[tuple[int, str]], windows: list[float]) -> list[tuple[int, str, float | None]]:
    """The (max batch, batching, window ms or None) servers a run starts: every window for a max
    batch above 1, no window at max batch 1.

    Raises:
        ValueError: two points with one label (the report would pool them; bench/cli.py refuses
            such arguments already).
    """
    points = [(max_batch, batching, window) for max_batch, batching in batches
              for window in (windows if max_batch > 1 else [None])]
    labels = [point_label(*point) for point in points]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(f"--max-batch and --batch-window-ms give the point {', '.join(twice)} more than once")
    return points


def cmd_serve_bench(args) -> None:
    """Raises ValueError, OSError: repeated points, bad prompts or --out, before anything starts;
    RuntimeError: a server or a client failed."""
    clients, batches = args.clients, args.max_batch  # parsed and checked by bench/cli.py
    if args.limit < 1 or args.max_new_tokens < 1:
        raise ValueError("--limit and --max-new-tokens must be >= 1")
    points = serve_points(batches, args.batch_window_ms)
    if args.device != "cuda" and any(batching == "graphs" for _, batching, _ in points):
        raise ValueError("--max-batch N:graphs runs the server with --cuda-graphs, which needs --device cuda")
    if args.out:
        writable_file(args.out)
    texts = load_prompts(["spec_bench"], args.limit, args.spec_bench)
    with sigterm_exits():
        _run_points(args, clients, points, texts)


def _run_points(args, clients: list[int], points: list[tuple[int, str, float | None]], texts: list[dict]) -> None:
    tokenizer = load_tokenizer(args.target)
    fingerprint = tokenizer_fingerprint(tokenizer)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p["text"]}]) for p in texts]
    drafter = DrafterSpec.parse(args.drafter)
    target_model = shared_target(drafter, args.target)  # once for every point run in this process
    results: list[ServeResult] = []
    servers: list[tuple[int, int, object]] = []  # (port, metrics port, process) per point
    try:
        for max_batch, batching, window in points:  # every server up before the first measurement
            port, metrics_port = free_port(), free_port()
            graphs = ["--cuda-graphs"] if batching == "graphs" else []
            windowed = ["--batch-window-ms", f"{window:g}"] if window is not None else []
            servers.append((port, metrics_port, start_server(
                args.target, port, extra=["--max-batch", str(max_batch), "--batching", "ragged" if graphs else batching,
                                          *graphs, *windowed, "--max-sessions", str(max(clients) + 1),
                                          "--device", args.device, "--dtype", args.dtype,
                                          "--metrics-port", str(metrics_port)],
                threads=args.threads)))
            run_clients(f"127.0.0.1:{port}", 1, prompts, drafter, fingerprint, args.target, 2.0, 8,  # warm-up
                        target_model=target_model)
        # interleaved: each client count on every server in turn, so that a slow spell of a shared
        # machine, or a drift over the run, falls on the points it compares alike (until session 55
        # every point of the first server ran first, and a lone client looked 8-13% slower batched)
        for rnd in range(args.rounds):
            for n in clients:
                for (max_batch, batching, window), (port, metrics_port, _) in zip(points, servers):
                    results.append(_measure_point(args, port, metrics_port, n, prompts, drafter, fingerprint,
                                                  target_model, max_batch, batching, window, rnd))
                    print(f"round {rnd + 1}/{args.rounds}, max-batch {results[-1].label}, {n} clients: "
                          f"{results[-1].tok_s:.1f} tokens/s", file=sys.stderr)
    finally:
        for _, _, server in servers:
            stop_server(server)
    order = {point: i for i, point in enumerate(points)}
    results.sort(key=lambda r: (order[(r.max_batch, r.batching, r.window_ms)], r.clients, r.round))
    table = render(results, args)
    print(table)
    if args.out:
        writable_file(args.out).write_text(table + "\n")


def _measure_point(args, port: int, metrics_port: int, n: int, prompts, drafter, fingerprint: str, target_model,
                   max_batch: int, batching: str, window: float | None, rnd: int = 0) -> ServeResult:
    """`n` clients for `args.seconds` against the server on `port`: one point of the table in round `rnd`."""
    steps_before, forwards_before = forward_batches(metrics_port)
    if args.client_processes > 1:
        tokens, elapsed, rates, steps = run_client_processes(
            f"127.0.0.1:{port}", n, args.client_processes, prompts, args.drafter, fingerprint, args.target,
            args.seconds, args.max_new_tokens)
    else:
        tokens, elapsed, rates, steps = run_clients(f"127.0.0.1:{port}", n, prompts, drafter, fingerprint,
                                                    args.target, args.seconds, args.max_new_tokens,
                                                    target_model=target_model)
    steps_after, forwards_after = forward_batches(metrics_port)
    forwards = forwards_after - forwards_before
    return ServeResult(max_batch, batching, n, tokens, elapsed, statistics.mean(rates), _percentile(steps, 0.5),
                       _percentile(steps, 0.99), (steps_after - steps_before) / forwards if forwards else None, window,
                       rnd, tuple(steps))


def _processes_label(processes: int) -> str:
    return "one process (threads)" if processes <= 1 else f"up to {processes} processes"


def render(results: list[ServeResult], args) -> str:
    """The serve-bench table and goal lines. With several rounds, each (max batch, clients) point
    shows the median over rounds with the range; its ratios are taken within each round (against
    that round's one client, that round's unbatched server) and shown the same way; step latency
    quantiles pool every round's steps.

    Raises:
        ValueError: two results of one (label, clients, round) point: their ratios would mix them.
    """
    keys = [(r.label, r.clients, r.round) for r in results]
    if len(set(keys)) != len(keys):
        raise ValueError("serve-bench results hold one (max batch, clients) point twice in a round")
    groups: dict[tuple[str, int], list[ServeResult]] = {}
    for r in results:
        groups.setdefault((r.label, r.clients), []).append(r)
    rounds = len({r.round for r in results})
    one = {(r.label, r.round): r.tok_s for r in results if r.clients == 1}
    unbatched = {(r.clients, r.round): r.tok_s for r in results if r.max_batch == 1 and r.batching != "graphs"}
    lines = [f"target {args.target}, drafter {args.drafter}, {args.seconds:g} s per point, up to "
             f"{args.max_new_tokens} tokens per answer, server on {args.device} "
             f"({getattr(args, 'dtype', 'float32')}), torch threads "
             f"{args.threads or 'default'}, clients in "
             f"{_processes_label(getattr(args, 'client_processes', 1))}"
             + (f"; {rounds} interleaved rounds: medians (range), ratios within a round" if rounds > 1 else ""),
             "",
             "| max batch | clients | aggregate tokens/s | vs 1 client | vs unbatched | per-client tokens/s | "
             "step p50 ms | step p99 ms | steps per forward |",
             "|---|---|---|---|---|---|---|---|---|"]
    goal = []
    for (label, clients), rs in groups.items():
        vs_one = [r.tok_s / one[(label, r.round)] for r in rs if one.get((label, r.round))]
        vs_unbatched = [r.tok_s / unbatched[(clients, r.round)] for r in rs if unbatched.get((clients, r.round))]
        steps = [s for r in rs for s in r.step_ms]
        p50 = _percentile(steps, 0.5) if steps else statistics.median(r.step_ms_p50 for r in rs)
        p99 = _percentile(steps, 0.99) if steps else statistics.median(r.step_ms_p99 for r in rs)
        per_forward = [r.steps_per_forward for r in rs if r.steps_per_forward is not None]
        lines.append(f"| {label} | {clients} | {_spread([r.tok_s for r in rs], '.1f')} | "
                     f"{_spread(vs_one, '.2f', 'x')} | {_spread(vs_unbatched, '.2f', 'x')} | "
                     f"{_spread([r.per_client_tok_s for r in rs], '.1f')} | {p50:.1f} | {p99:.1f} | "
                     f"{f'{statistics.median(per_forward):.2f}' if per_forward else '-'} |")
        if clients == 8 and rs[0].max_batch > 1 and vs_one:
            goal.append((label, vs_one))
    if goal:
        lines.append("")
    for label, ratios in goal:
        ratio = statistics.median(ratios)
        spread = f" (median of {len(ratios)} rounds, {min(ratios):.2f}x-{max(ratios):.2f}x)" if len(ratios) > 1 else ""
        lines.append(f"Goal (issue 11): 8 clients' aggregate tokens/s >= 4x one client's: measured {ratio:.2f}x"
                     f"{spread} (max batch {label}) -> {'met' if ratio >= 4 else 'missed'}")
    return "\n".join(lines)


def _spread(values: list[float], spec: str, unit: str = "") -> str:
    """'4.36x' for one value, 'median (min-max)' for several, '-' for none."""
    if not values:
        return "-"
    median = f"{statistics.median(values):{spec}}{unit}"
    return median if len(values) == 1 else f"{median} ({min(values):{spec}}-{max(values):{spec}}{unit})"
