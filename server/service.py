"""The verify service on grpc.aio.

The servicer is thin: validate (server/validation.py), hand model work to the single model worker
thread, convert the result to protobuf. Refusals carry a status code and a short message; an
unexpected error becomes INTERNAL without a stack trace, and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from splitspec.shared.config import ServerLimits
from splitspec.shared.kv import cache_length
from splitspec.shared.models import eos_token_ids, tokenizer_fingerprint
from splitspec.v1 import verify_pb2 as pb
from splitspec.v1 import verify_pb2_grpc as pb_grpc

from .runner import TargetRunner, TargetSession
from .validation import ServiceError, check_context, check_draft_probs, check_open, check_tree

log = logging.getLogger(__name__)

SERVICE_NAME = "splitspec.v1.VerifyService"


@dataclass
class _Entry:
    session_id: bytes
    session: TargetSession | None
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_reply: pb.VerifyReply | None = None
    closed: bool = False


def _refusals(method):
    """Map ServiceError to its status code and anything unexpected to INTERNAL."""
    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except ServiceError as err:
            await context.abort(err.code, err.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:  # noqa: BLE001 - the server must survive any one request
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error while serving the request")
    return wrapper


class VerifyServicer(pb_grpc.VerifyServiceServicer):
    """Sessions, each with its own KV cache, verified on one model worker thread."""

    def __init__(self, runner: TargetRunner, limits: ServerLimits = ServerLimits()) -> None:
        self.runner = runner
        self.limits = limits
        self.max_context = min(limits.max_context or runner.max_positions, runner.max_positions)
        self.fingerprint = tokenizer_fingerprint(runner.tokenizer)
        self.eos_ids = eos_token_ids(runner.model, runner.tokenizer)
        self.sessions: dict[bytes, _Entry] = {}
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target")

    async def _run(self, fn, *args):
        """Run model work on the worker; returns (result, perf_counter time the work started)."""
        def job():
            started = time.perf_counter()
            return fn(*args), started

        return await asyncio.get_running_loop().run_in_executor(self.worker, job)

    @_refusals
    async def Info(self, request, context):
        r, lim = self.runner, self.limits
        return pb.InfoReply(
            model_id=r.model_id, tokenizer_fingerprint=self.fingerprint, vocab_size=r.vocab_size,
            num_layers=r.num_layers, hidden_size=r.config.hidden_size, max_context=self.max_context,
            max_tree_nodes=lim.max_tree_nodes, max_tree_depth=lim.max_tree_depth,
            max_prompt_tokens=lim.max_prompt_tokens, max_sessions=lim.max_sessions,
            session_idle_ttl_s=lim.session_idle_ttl_s, dtype=str(r.dtype).removeprefix("torch."),
            eos_token_ids=self.eos_ids, max_draft_support=lim.max_draft_support, lsa_ids=sorted(r.lsa_modules))

    @_refusals
    async def OpenSession(self, request, context):
        arrived = time.perf_counter()
        prompt, sampling, features = check_open(
            request, fingerprint=self.fingerprint, vocab_size=self.runner.vocab_size,
            num_layers=self.runner.num_layers, limits=self.limits, max_context=self.max_context,
            lsa_ids=self.runner.lsa_modules.keys())
        self.evict_idle()
        if len(self.sessions) >= self.limits.max_sessions:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server holds its maximum of {self.limits.max_sessions} sessions")
        session_id = os.urandom(16)
        placeholder = _Entry(session_id, None)  # reserve the slot before awaiting the worker
        self.sessions[session_id] = placeholder
        try:
            (session, batch, forward_ms), started = await self._run(self.runner.open, prompt, sampling, features)
        except BaseException:
            self.sessions.pop(session_id, None)
            raise
        placeholder.session = session
        placeholder.last_used = time.monotonic()
        return pb.OpenSessionReply(
            session_id=session_id, first_token=session.pending_token, features=batch.to_pb(features),
            timings=_timings(arrived, (started - arrived) * 1e3, forward_ms))

    @_refusals
    async def Verify(self, request, context):
        arrived = time.perf_counter()
        entry = self._entry(request.session_id)
        async with entry.lock:
            entry.last_used = time.monotonic()
            tree = check_tree(request, vocab_size=self.runner.vocab_size, limits=self.limits)
            draft_probs = {}
            if not entry.session.sampling.greedy and request.HasField("draft_probs"):
                draft_probs = check_draft_probs(request.draft_probs, tree, vocab_size=self.runner.vocab_size,
                                                limits=self.limits)
            reply, _ = await self._run(self._verify_step, entry, request.step, tree, draft_probs, arrived)
            entry.last_used = time.monotonic()
            return reply

    def _verify_step(self, entry: _Entry, step: int, tree, draft_probs, arrived: float) -> pb.VerifyReply:
        """One step on the worker thread. Step bookkeeping happens here, serialized with the model
        work, so a call whose client gave up still records its reply and a retry gets that reply."""
        session = entry.session
        if entry.closed:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, "session closed")
        if step == session.step and entry.last_reply is not None:
            return entry.last_reply  # a retried step: same answer, no model work
        if step != session.step + 1:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"step {step} out of order; expected {session.step + 1}")
        check_context(cache_length(session.cache), tree.size, self.max_context)
        started = time.perf_counter()
        try:
            out = self.runner.verify(session, tree, draft_probs)
        except Exception:
            entry.closed = True  # the cache may be half-updated: this session cannot go on
            self.sessions.pop(entry.session_id, None)
            raise
        reply = pb.VerifyReply(
            step=step, accepted_nodes=out.accept.accepted_nodes, accepted_tokens=out.accepted_tokens,
            bonus_token=out.accept.bonus_token, bonus_recovered=out.accept.recovered,
            features=out.features.to_pb(session.features),
            timings=_timings(arrived, (started - arrived) * 1e3, out.forward_ms))
        session.step = step
        entry.last_reply = reply
        return reply

    @_refusals
    async def CloseSession(self, request, context):
        entry = self._entry(request.session_id)
        entry.closed = True
        self.sessions.pop(request.session_id, None)
        return pb.CloseSessionReply()

    def _entry(self, session_id: bytes) -> _Entry:
        if len(session_id) != 16:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "session_id must be 16 bytes")
        entry = self.sessions.get(session_id)
        if entry is None or entry.session is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, "unknown or expired session")
        if time.monotonic() - entry.last_used > self.limits.session_idle_ttl_s and not entry.lock.locked():
            self.sessions.pop(session_id, None)
            raise ServiceError(grpc.StatusCode.NOT_FOUND, "session expired (idle too long)")
        return entry

    def evict_idle(self) -> int:
        """Drop sessions idle longer than the TTL; returns how many were dropped."""
        now = time.monotonic()
        stale = [sid for sid, e in self.sessions.items()
                 if e.session is not None and not e.lock.locked()
                 and now - e.last_used > self.limits.session_idle_ttl_s]
        for sid in stale:
            self.sessions.pop(sid).closed = True
        return len(stale)


def _timings(arrived: float, queue_ms: float, forward_ms: float) -> pb.Timings:
    """queue_ms: from arrival until model work began (validation + waiting for the worker)."""
    return pb.Timings(queue_ms=max(queue_ms, 0.0), forward_ms=forward_ms, total_ms=(time.perf_counter() - arrived) * 1e3)


async def create_server(runner: TargetRunner, address: str = "127.0.0.1:0",
                        limits: ServerLimits = ServerLimits()):
    """Build and start a server. Returns (server, port, servicer, health).

    Tests bind port 0 with SO_REUSEPORT off so parallel servers never share a port.
    """
    options = [
        ("grpc.max_receive_message_length", limits.max_receive_bytes),
        ("grpc.max_send_message_length", limits.max_send_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    server = grpc.aio.server(options=options)
    servicer = VerifyServicer(runner, limits)
    pb_grpc.add_VerifyServiceServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    await server.start()
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, servicer, health


async def serve(runner: TargetRunner, host: str, port: int, limits: ServerLimits, grace_s: float = 5.0,
                on_bound=None) -> None:
    """Serve until SIGINT/SIGTERM, then report NOT_SERVING, drain in-flight calls and exit.
    `on_bound(port)` is called once the service listens."""
    server, bound, servicer, health = await create_server(runner, f"{host}:{port}", limits)
    print(f"splitspec verify service: {runner.model_id} listening on {host}:{bound}", flush=True)
    if on_bound is not None:
        on_bound(bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def sweep():
        while not stop.is_set():
            await asyncio.sleep(min(limits.session_idle_ttl_s / 4, 30.0))
            servicer.evict_idle()

    sweeper = asyncio.create_task(sweep())
    await stop.wait()
    print("splitspec verify service: shutting down", flush=True)
    await health.enter_graceful_shutdown()
    await server.stop(grace_s)
    sweeper.cancel()
    servicer.worker.shutdown(wait=True)
