"""The verify service on grpc.aio.

The servicer is thin: validate (server/validation.py), hand model work to the single model worker
thread, convert the result to protobuf. Refusals carry a status code and a short message; an
unexpected error becomes INTERNAL without a stack trace, and the server keeps serving.

Admission happens before any model work, in this order: authentication (server/auth.py, an
interceptor), request parsing, drain state and the per-client rate limit (`_admitted`),
validation, session count and KV budgets (server/limits.py). Logs and metrics (server/metrics.py)
hold counts, sizes and times only, never prompt or output text or token ids.

Threads: the event loop does bookkeeping and O(request size) checks only. Decoding and checking
draft probabilities (CPU work that grows with rows x vocabulary) runs on a small parse pool, model
work on the single model worker. A reservation of KV tokens lives exactly as long as the work item
it was made for (`_run`; a chunked prefill's spans its chunks, `_prefill`): it is released when the
item finishes, fails or is cancelled while queued (its caller gone, or the server shutting down).
docs/reliability.md lists every guard.

Every tensor operation big enough for torch to run it on several cores (the model's, and the
features' quantization) runs on that one worker thread, which should also be the thread that loaded
the model (a `shared/compute.py` `compute_thread`, handed in as `worker`; `splitspec serve` does so):
one OpenMP pool per process, or every small kernel of a step pays a wake-up (that module says why).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from splitspec.shared.compute import compute_thread
from splitspec.shared.config import MAX_BATCH_WINDOW_MS, ServerLimits, ServerSecurity
from splitspec.shared.features import FeatureRequest
from splitspec.shared.kv import cache_length
from splitspec.shared.models import eos_token_ids, tokenizer_fingerprint
from splitspec.v1 import verify_pb2 as pb
from splitspec.v1 import verify_pb2_grpc as pb_grpc

from .auth import BearerAuthInterceptor, RefusalLog, TokenSet, client_identity, server_credentials
from .limits import (BUSY_RETRY_S, HEALTH_CHECK_SPARE, HEALTH_WATCHES, CallLimits, KVBudget, RateLimiter, Reservation,
                     kv_bytes_per_token, reply_feature_bytes)
from .metrics import ServiceMetrics
from .runner import TargetRunner, TargetSession
from .validation import (ServiceError, check_context, check_draft_probs, check_forced, check_open, check_tree,
                         step_positions)

log = logging.getLogger(__name__)

SERVICE_NAME = "splitspec.v1.VerifyService"
PARSE_THREADS = 2  # threads that decode and check draft probabilities beside the model worker
# a padded batched forward (a target the ragged path cannot serve, server/ragged.py) copies every
# session's KV prefix into rows padded to the longest one; beyond this many padded positions the
# steps are split over several forwards (SmolLM2-135M: 46 KB of fp32 KV per position, so ~0.75 GB
# transient at the limit). A ragged forward copies no prefix and is bounded by max_batch alone.
MAX_BATCH_PADDED_TOKENS = 16384
_DROP_NOTICE_S = 0.2  # shutdown: the longest wait, after the grace period, for dropped calls to be told
# the batching window (ServerLimits.batch_window_ms) waits only for sessions answered within this
# long whose next step is due inside the window by their measured turnaround
ACTIVE_SESSION_S = MAX_BATCH_WINDOW_MS / 1e3
RECLAIM_IDLE_S = 30.0  # a full server drops a session idle this long (3 default step deadlines)
REPLY_HEADROOM = 1024  # bytes of a reply beside its features (session id, tokens: <= 64 nodes, timings)
TURNAROUND_EMA = 0.3  # weight of the newest reply-to-next-step gap in a session's turnaround estimate


@dataclass
class _Entry:
    session_id: bytes
    session: TargetSession | None
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_reply: pb.VerifyReply | None = None
    closed: bool = False
    kv_tokens: int = 0  # positions its cache holds, set by the worker after each model call
    # memory it holds beside its cache, as KV tokens of the same bytes: its fixed-shape verify steps'
    # buffers (CUDA-graph inputs and outputs) and its last reply's features (kept for a retried step;
    # with every layer's K/V of 2,000 forced rows ~100 MB); counted in the server-wide budgets, not in the
    # session's own (a context limit)
    step_tokens: int = 0
    replied_at: float | None = None  # monotonic time its last Verify reply was ready
    turnaround_s: float | None = None  # moving average of the gap from a reply to the next step's arrival
    owner: str = ""  # the bearer token's or mTLS certificate's identity that opened it ("": not bound)
    open_id: bytes = b""  # the client's name for the open that made it (OpenSessionRequest.open_id)


@dataclass(eq=False)
class _Step:
    """One Verify call's model work, waiting to be scored alone or in a batch. Whichever worker job
    runs first takes every waiting step (up to `max_batch`) and fills in `reply` or `error`; each
    call's own job then just returns its outcome."""

    entry: _Entry
    step: int
    tree: object
    draft_probs: dict
    forced: tuple
    arrived: float
    wire: FeatureRequest  # the encoding its reply's features travel in (`_wire_features`)
    reservation: Reservation | None = None  # its KV admission (None: a replayed step), settled as it commits
    done: bool = False
    reply: pb.VerifyReply | None = None
    error: BaseException | None = None


class MalformedRequest:
    """Stands in for a request whose bytes do not parse; the servicer answers INVALID_ARGUMENT
    (gRPC itself would answer UNKNOWN)."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def _lenient_parser(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError, RecursionError):
            return MalformedRequest(message_cls.DESCRIPTOR.full_name)
    return parse


def _refusals(method):
    """Map ServiceError to its status code and anything unexpected to INTERNAL, count refusals.
    Logs name the method and the status code only: refusal messages may quote request contents."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            if isinstance(request, MalformedRequest):
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {request.type_name}")
            return await method(self, request, context)
        except ServiceError as err:
            self.refused(name, err.code.name)
            if err.retry_after_s is not None:
                pushback_ms = max(1, round(err.retry_after_s * 1e3))
                context.set_trailing_metadata((("grpc-retry-pushback-ms", str(pushback_ms)),))
            await context.abort(err.code, _bounded(err.message))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as err:  # noqa: BLE001 - the server must survive any one request
            self.metrics.refused(name, "INTERNAL")
            log.error("%s failed with %s at\n%s", name, type(err).__name__,
                      "".join(traceback.format_tb(err.__traceback__)))  # frames only: no message, no values
            await context.abort(grpc.StatusCode.INTERNAL, _internal_message(name, request))
    return wrapper


MAX_STATUS_CHARS = 1024  # a status message travels in one HTTP/2 trailer; 8 KiB is gRPC's soft limit


def _bounded(message: str) -> str:
    """A refusal's message cut to MAX_STATUS_CHARS: one that quotes a long request field would
    exceed the client's metadata limit, and the client would see RESOURCE_EXHAUSTED "Stream
    removed" instead of the refusal."""
    return message if len(message) <= MAX_STATUS_CHARS else message[:MAX_STATUS_CHARS - 15] + " ... (cut short)"


def _internal_message(name: str, request) -> str:
    """What a client is told of an unexpected server error: which call (and Verify step) failed and
    what became of its session; never the error's own message, which may quote request contents."""
    if name == "Verify":
        return (f"internal error while serving Verify step {request.step}; that session is closed (open a "
                "new one), the service is still serving")
    return f"internal error while serving {name}; the service is still serving"


def _admitted(method):
    """For calls that do model work: refused with UNAVAILABLE while the server drains and with
    RESOURCE_EXHAUSTED (and a retry hint) over the client's rate; counted as in flight until done."""
    @functools.wraps(method)
    async def wrapper(self, request, context):
        self._admit(context)
        self._inflight += 1
        self._idle.clear()
        try:
            return await method(self, request, context)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
    return wrapper


class VerifyServicer(pb_grpc.VerifyServiceServicer):
    """Sessions, each with its own KV cache, verified on one model worker thread.

    `authenticated`: the server checks bearer tokens, so clients are rate-limited by token rather
    than by address. Session bookkeeping (`sessions`) changes only on the event loop.
    """

    def __init__(self, runner: TargetRunner, limits: ServerLimits = ServerLimits(),
                 metrics: ServiceMetrics | None = None, authenticated: bool = False,
                 worker: ThreadPoolExecutor | None = None) -> None:
        """`worker`: the `compute_thread` that loaded the runner's model (one is made if None); the
        servicer owns it and shuts it down with the server."""
        self.runner = runner
        self.limits = limits
        self.max_context = min(limits.max_context or runner.max_positions, runner.max_positions)
        self.fingerprint = tokenizer_fingerprint(runner.tokenizer)
        self.eos_ids = eos_token_ids(runner.model, runner.tokenizer)
        self.sessions: dict[bytes, _Entry] = {}
        self.worker = worker if worker is not None else compute_thread("target")
        self.parser = ThreadPoolExecutor(max_workers=PARSE_THREADS, thread_name_prefix="parse")
        self._queued: set[Future] = set()  # model work submitted and not yet finished
        self.kv = KVBudget(limits, kv_bytes_per_token(runner.config, runner.dtype),
                           held=lambda: sum(e.kv_tokens + e.step_tokens for e in list(self.sessions.values())))
        self.rate = RateLimiter(limits.rate_limit_per_s, limits.rate_limit_burst) if limits.rate_limit_per_s else None
        self.authenticated = authenticated
        self.auth = None  # the BearerAuthInterceptor (create_server), whose tokens SIGHUP reloads
        self.metrics = metrics if metrics is not None else ServiceMetrics()
        self.refusal_log = RefusalLog(log, "call")  # aggregated WARNINGs: method and status code, never contents
        self.metrics.track(lambda: len(self.sessions), lambda: self.kv.tokens, lambda: self.kv.bytes)
        self.draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._waiting: list[_Step] = []  # Verify steps not yet taken by a worker job
        self._waiting_lock = threading.Condition()  # guards _waiting; notified when a step joins it
        self._prefill_turn = asyncio.Lock()  # held by the prefill of several chunks running now (FIFO)

    async def _run(self, fn, *args, reserved: Reservation | None = None):
        """Run model work on the worker; returns (result, perf_counter time the work started).

        Takes ownership of the `reserved` KV admission: what the work did not settle into its
        session's cache is released when the work item is over, whichever way: done, failed,
        cancelled while still queued (the caller's deadline passed or it went away: a queued item is
        dropped, not run), or never queued (the worker is shut down).

        Raises:
            ServiceError: UNAVAILABLE when shutdown dropped the queued work.
            asyncio.CancelledError: the call itself was cancelled.
        """
        return await self._wait(self._submit(fn, *args, reserved=reserved))

    def _submit(self, fn, *args, reserved: Reservation | None = None) -> Future:
        """Queue `fn(*args)` on the worker (see `_run`); its future's result is (result, start time).

        Raises:
            RuntimeError: the worker is shut down (`reserved` released).
        """
        def job():
            started = time.perf_counter()
            return fn(*args), started

        try:
            future = self.worker.submit(job)
        except BaseException:
            self.kv.release(reserved)
            raise
        self._queued.add(future)
        future.add_done_callback(functools.partial(self._work_over, reserved=reserved))
        return future

    async def _wait(self, future: Future):
        """Await a `_submit` future (see `_run` for what is raised)."""
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancelled() and self.draining and not asyncio.current_task().cancelling():
                raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                                   "the server is shutting down and dropped this queued call; reconnect later") from None
            raise

    def _work_over(self, future: Future, reserved: Reservation | None) -> None:
        """Done callback of a model work item (on the worker, or where it was cancelled)."""
        self.kv.release(reserved)
        self._queued.discard(future)

    def drop_queued(self) -> int:
        """Cancel the model work that has not started (shutdown after the grace period); the item
        running now finishes. Returns how many items were dropped."""
        return sum(future.cancel() for future in list(self._queued))

    async def _parse(self, fn, *args, **kwargs):
        """Run CPU-heavy request checking on the parse pool, off the event loop."""
        return await asyncio.wrap_future(self.parser.submit(functools.partial(fn, *args, **kwargs)))

    def _admit(self, context) -> None:
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; reconnect later")
        if self.rate is not None:
            wait = self.rate.acquire(client_identity(context, self.authenticated))
            if wait > 0:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"rate limit of {self.rate.rate:g} calls/s per client exceeded; "
                                   f"retry in {wait:.3f} s",
                                   retry_after_s=wait)

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no OpenSession/Verify call is in flight; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

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
    @_admitted
    async def OpenSession(self, request, context):
        """Prefill a prompt into a new session (`check_open` first, no model work on a refusal).

        Status: INVALID_ARGUMENT and FAILED_PRECONDITION as `check_open`; RESOURCE_EXHAUSTED for the
        prompt, the session or KV budgets, the rate limit or the reply size; UNAVAILABLE while
        draining; INTERNAL for an unexpected error, the service staying up. Every guard and its test:
        docs/reliability.md."""
        arrived = time.perf_counter()
        prompt, sampling, features = check_open(
            request, fingerprint=self.fingerprint, vocab_size=self.runner.vocab_size,
            num_layers=self.runner.num_layers, limits=self.limits, max_context=self.max_context,
            lsa_ids=self.runner.lsa_modules.keys())
        wire = self._wire_features(features, len(prompt))
        owner = self._owner(context)
        self._forget_abandoned(request.abandoned_opens, owner)  # before counting the sessions held
        self.evict_idle()
        if len(self.sessions) >= self.limits.max_sessions and not self._reclaim_abandoned():
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server holds its maximum of {self.limits.max_sessions} sessions",
                               retry_after_s=BUSY_RETRY_S)
        while True:
            try:
                reserved = self.kv.reserve(0, len(prompt), "prompt")
                break
            except ServiceError as err:  # a server-wide KV budget: abandoned sessions' caches give way first
                if err.retry_after_s is None or not self._reclaim_abandoned():
                    raise
        session_id = os.urandom(16)
        placeholder = _Entry(session_id, None, owner=owner, open_id=request.open_id)  # the slot, before awaiting the worker
        self.sessions[session_id] = placeholder
        try:
            (session, features_pb, forward_ms), started = await self._prefill(
                placeholder, prompt, sampling, features, wire, reserved)
        except BaseException:
            self._forget(placeholder)
            raise
        placeholder.session = session
        placeholder.last_used = time.monotonic()
        reply = pb.OpenSessionReply(
            session_id=session_id, first_token=session.pending_token, features=features_pb,
            timings=_timings(arrived, (started - arrived) * 1e3, forward_ms))
        self._fit_reply(reply, placeholder)
        log.debug("session opened: %d prompt tokens, %d sessions", len(prompt), len(self.sessions))
        return reply

    async def _prefill(self, entry: _Entry, prompt, sampling, features, wire, reserved: Reservation):
        """Prefill `prompt` as worker jobs of at most `limits.prefill_chunk` tokens (chunked
        prefill): verify steps of other sessions queued meanwhile run between the chunks, and a
        caller that goes away stops the prefill at the next chunk. Prompts of several chunks take
        turns, oldest first (`_prefill_turn`), while a prompt of one chunk is queued at once like a
        step: prefills whose chunks alternated all finished late together, and under load all of
        them missed their deadlines (four 2,048-token prompts with time for two: none answered,
        qa56-srv F3). The KV reservation covers the whole prompt from the first chunk on, each chunk
        settling its positions into the session's count; it is handed to the last chunk's job, or,
        when the call ends earlier, released once the chunk running then is over. Returns `_run`'s
        result of the last job, whose start time is replaced by the first job's."""
        chunk = self.limits.prefill_chunk
        prefill = self.runner.start_prefill(prompt, features)
        chunked = chunk is not None and prefill.left > chunk
        first_started = None
        running: Future | None = None
        try:
            async with self._prefill_turn if chunked else contextlib.nullcontext():
                while chunked and prefill.left > chunk:
                    running = self._submit(self._prefill_part, entry, prefill, chunk, reserved)
                    _, started = await self._wait(running)
                    first_started = first_started if first_started is not None else started
                handed, reserved = reserved, None  # owned by the job from here (`_submit` releases it if it cannot queue)
                running = self._submit(self._open_session, entry, prompt, sampling, features, wire, prefill, handed,
                                       reserved=handed)
                result, started = await self._wait(running)
            return result, first_started if first_started is not None else started
        finally:
            if reserved is not None:  # not handed to a job: the call ended between or during earlier chunks
                if running is not None and not running.done():
                    running.add_done_callback(lambda _, n=reserved: self.kv.release(n))
                else:
                    self.kv.release(reserved)

    def _prefill_part(self, entry: _Entry, prefill, max_tokens: int, reserved: Reservation) -> None:
        """One chunk of a prefill on the worker thread; settles the cache's new length into the KV budget."""
        self.runner.prefill_chunk(prefill, max_tokens)
        self.kv.settle(reserved, functools.partial(_hold, entry, cache_length(prefill.cache)))

    def _open_session(self, entry: _Entry, prompt, sampling, features, wire, prefill=None,
                      reserved: Reservation | None = None):
        """Prefill (the rest of `prefill`) on the worker thread and draw the first token; settles the
        new cache's length into the KV budget. The prompt's features are quantized and encoded (as
        `wire`) here too (a tensor op over the whole prompt)."""
        session, batch, forward_ms = self.runner.open(prompt, sampling, features, prefill=prefill)
        self.kv.settle(reserved, functools.partial(_hold, entry, cache_length(session.cache)))
        return session, batch.to_pb(wire), forward_ms

    def _wire_features(self, spec: FeatureRequest, positions: int) -> FeatureRequest:
        """How the features of a reply covering `positions` positions travel: as `spec` asks, or
        int8-quantized when unquantized (fp16) ones could exceed the send limit (a 3,200-token
        prompt's K/V of all 30 layers of SmolLM2 in fp16: ~67 MB). Each tensor names its encoding,
        so the client decodes either. Bounded by `reply_feature_bytes`, before any model work.

        Raises:
            ServiceError: RESOURCE_EXHAUSTED when int8 would not fit either.
        """
        limit = self.limits.max_send_bytes - REPLY_HEADROOM
        lsa_width = self.runner.lsa_modules[spec.lsa_id].config.hidden_size if spec.lsa_id else 0
        bound = reply_feature_bytes(self.runner.config, spec, positions, lsa_width)
        if bound == 0 or bound <= limit:
            return spec
        if spec.quantization == pb.QUANTIZATION_NONE:
            int8 = dataclasses.replace(spec, quantization=pb.QUANTIZATION_INT8)
            if reply_feature_bytes(self.runner.config, int8, positions, lsa_width) <= limit:
                return int8
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the features of {positions} positions could take {bound} bytes, over the server's "
                           f"reply limit of {self.limits.max_send_bytes} bytes even quantized: request fewer "
                           f"feature layers or send a shorter prompt")

    @_refusals
    @_admitted
    async def Verify(self, request, context):
        """Score one step's draft tree (`check_tree`, `check_forced`, `check_draft_probs` first); a
        repeated step number gets its recorded reply without model work.

        Status: INVALID_ARGUMENT (session id, tree, forced tokens, draft probabilities), NOT_FOUND
        (an unknown, expired or closed session), FAILED_PRECONDITION (a step out of order),
        RESOURCE_EXHAUSTED (tree limits, the context, KV budgets, the rate limit, a reply over the
        send limit, which closes the session), UNAVAILABLE (draining), INTERNAL (an unexpected error;
        the message names the step and says the session is closed; the service stays up). docs/reliability.md lists each guard."""
        arrived = time.perf_counter()
        entry = self._entry(request.session_id, context)
        async with entry.lock:
            entry.last_used = time.monotonic()
            if entry.replied_at is not None:  # the client's side of the last step: link, drafting
                gap = entry.last_used - entry.replied_at
                entry.turnaround_s = gap if entry.turnaround_s is None else \
                    (1 - TURNAROUND_EMA) * entry.turnaround_s + TURNAROUND_EMA * gap
            tree = check_tree(request, vocab_size=self.runner.vocab_size, limits=self.limits)
            forced = check_forced(request, vocab_size=self.runner.vocab_size, limits=self.limits)
            draft_probs = {}
            if not entry.session.sampling.greedy and request.HasField("draft_probs"):
                draft_probs = await self._parse(check_draft_probs, request.draft_probs, tree,
                                                vocab_size=self.runner.vocab_size, limits=self.limits)
            positions = step_positions(tree, forced)
            wire = self._wire_features(entry.session.features, positions)  # may refuse: before any reservation
            reserved = self._reserve_step(entry, request.step, positions)
            item = _Step(entry, request.step, tree, draft_probs, forced, arrived, wire, reserved)
            with self._waiting_lock:
                self._waiting.append(item)
                self._waiting_lock.notify_all()
            try:
                reply, _ = await self._run(self._verify_waiting, item, reserved=reserved)
            finally:
                with self._waiting_lock:  # dropped before any worker job took it (deadline, shutdown)
                    if item in self._waiting:
                        self._waiting.remove(item)
                if entry.closed:  # the model work failed on the worker
                    self._forget(entry)
            entry.last_used = entry.replied_at = time.monotonic()
            self._fit_reply(reply, entry)
            return reply

    def _reserve_step(self, entry: _Entry, step: int, new_tokens: int) -> Reservation | None:
        """KV admission of a step adding `new_tokens` positions at its peak (None for a replayed step)."""
        if step == entry.session.step:
            return None
        current = cache_length(entry.session.cache)
        return self.kv.reserve(current, current + new_tokens)

    def _fit_reply(self, reply, entry: _Entry) -> None:
        """Refuse a reply over the send limit with a clear message instead of gRPC's generic one;
        its session cannot go on (its state already moved past the reply), so it is closed."""
        size = reply.ByteSize()
        if size > self.limits.max_send_bytes:
            self._forget(entry)
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the reply of {size} bytes exceeds the server's limit of {self.limits.max_send_bytes} "
                               f"bytes; the session is closed (request fewer features or a shorter prompt)")

    def _verify_waiting(self, item: _Step) -> pb.VerifyReply:
        """A Verify call's job on the worker thread: unless an earlier job already scored its step
        in a batch, take it and every other waiting step (up to `max_batch`, in arrival order) and
        score them in one forward (`_verify_steps`). Returns this call's reply or raises its error."""
        if not item.done:
            with self._waiting_lock:
                self._gather_steps()
                batch = [item]
                for other in self._waiting:
                    if len(batch) >= self.limits.max_batch:
                        break
                    if other is not item and (self.runner.ragged or
                                              self._padded_tokens([*batch, other]) <= MAX_BATCH_PADDED_TOKENS):
                        batch.append(other)
                for s in batch:
                    if s in self._waiting:
                        self._waiting.remove(s)
            self._verify_steps(batch)
        if item.error is not None:
            raise item.error
        return item.reply

    def _gather_steps(self) -> None:
        """The batching window (worker thread, holding the waiting lock): wait, at most
        `batch_window_ms` in all and while fewer than `max_batch` steps wait, for the next steps of
        the sessions due inside the window: answered within ACTIVE_SESSION_S, no step waiting yet,
        and their last reply plus their measured turnaround (the client's side of a step: link and
        drafting) before the window's end. Clients answered by one forward send their next steps
        within a few ms of each other; without the wait the first to arrive takes the worker and the
        rest queue behind it, and a group of clients splits into forwards of half its size
        (measured: 4.0 steps per forward with 8 loopback clients and max_batch 8). A lone session
        never waits, nor does a step whose other sessions' turnaround (a 4G round trip) is longer
        than the window, which could not gather them."""
        window = self.limits.batch_window_ms / 1e3
        if window <= 0 or self.limits.max_batch <= 1:
            return
        deadline = time.monotonic() + window
        while len(self._waiting) < self.limits.max_batch:
            now = time.monotonic()
            waiting = {id(s.entry) for s in self._waiting}
            due = [e.replied_at for e in list(self.sessions.values())
                   if e.session is not None and not e.closed and id(e) not in waiting and e.replied_at is not None
                   and e.turnaround_s is not None and now - e.replied_at <= ACTIVE_SESSION_S
                   and e.replied_at + e.turnaround_s <= deadline]
            if not due or now >= deadline:
                return
            # until the window ends or the first due session stops counting as active (a client that
            # went quiet held every waiting step for the whole window: qa56-srv F5)
            self._waiting_lock.wait(min(deadline, min(due) + ACTIVE_SESSION_S) - now)

    @staticmethod
    def _padded_tokens(batch: list[_Step]) -> int:
        """Cache positions a padded batched forward of `batch` copies: rows x the longest prefix."""
        return len(batch) * max(cache_length(s.entry.session.cache) if s.entry.session else 0 for s in batch)

    def _verify_steps(self, batch: list[_Step]) -> None:
        """Score the steps of `batch` (one per session). Step bookkeeping happens here, serialized
        with the model work, so a call whose client gave up still records its reply and a retry
        gets that reply. Each step ends with `reply` or `error`; one step's error is its own."""
        ready = []
        for item in batch:
            try:
                reply = self._check_step(item)
            except Exception as err:
                item.error, item.done = err, True
                continue
            if reply is not None:
                item.reply, item.done = reply, True
            else:
                ready.append(item)
        if not ready:
            return
        started = time.perf_counter()
        steps = [(s.entry.session, s.tree, s.draft_probs, s.forced) for s in ready]
        outs: list = [None] * len(ready)
        if len(ready) == 1:
            try:
                outs = [self.runner.verify(*steps[0])]
            except Exception as err:
                outs = [err]
        else:
            try:
                outs = self.runner.verify_batch(steps)
            except Exception:  # the batched forward failed before any cache changed: score each alone
                log.warning("a batched forward of %d steps failed; scoring them one by one", len(ready))
        self.metrics.forward(len(ready))
        for item, out in zip(ready, outs):
            try:
                if out is None:
                    out = self.runner.verify(item.entry.session, item.tree, item.draft_probs, item.forced)
                if isinstance(out, Exception):
                    raise out
                item.reply = self._record_step(item, out, started)
            except Exception as err:
                item.entry.closed = True  # the cache may be half-updated: this session cannot go on
                item.error = err
            item.done = True

    def _check_step(self, item: _Step) -> pb.VerifyReply | None:
        """The recorded reply of a retried step (with the retry's own timings, `_replayed`), None
        for a step to score; raises for a closed session, a step out of order or one past the
        context."""
        entry, session, step = item.entry, item.entry.session, item.step
        if entry.closed:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, "session closed")
        if step == session.step and entry.last_reply is not None:
            return _replayed(entry.last_reply, item.arrived)  # a retried step: same answer, no model work
        if step != session.step + 1:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"step {step} out of order; expected {session.step + 1}")
        check_context(cache_length(session.cache), step_positions(item.tree, item.forced), self.max_context)
        return None

    def _record_step(self, item: _Step, out, started: float) -> pb.VerifyReply:
        entry, session = item.entry, item.entry.session
        reply = pb.VerifyReply(
            step=item.step, accepted_nodes=out.accept.accepted_nodes, accepted_tokens=out.accepted_tokens,
            bonus_token=out.accept.bonus_token, bonus_recovered=out.accept.recovered,
            features=out.features.to_pb(item.wire),
            timings=_timings(item.arrived, (started - item.arrived) * 1e3, out.forward_ms))
        held = self.runner.step_bytes(session) + reply.features.ByteSize()  # the rest: <= REPLY_HEADROOM
        entry.step_tokens = -(-held // self.kv.bytes_per_token)
        self.kv.settle(item.reservation, functools.partial(_hold, entry, cache_length(session.cache)))
        session.step = item.step
        entry.last_reply = reply
        t = reply.timings
        self.metrics.step(item.tree.size, len(out.accepted_tokens), t.queue_ms, t.forward_ms, t.total_ms)
        log.debug("step %d: %d of %d draft tokens accepted", item.step, len(out.accepted_tokens), item.tree.size)
        return reply

    @_refusals
    async def CloseSession(self, request, context):
        entry = self._entry(request.session_id, context)
        self._forget(entry)
        log.debug("session closed after %d steps, %d sessions", entry.session.step, len(self.sessions))
        return pb.CloseSessionReply()

    def refused(self, method: str, code: str, why: str = "") -> None:
        """Count a refusal of `method` with status `code` in the metrics and the aggregated refusal
        log (`why`: a fixed phrase beside the code; never request contents)."""
        self.metrics.refused(method, code)
        self.refusal_log.note(f"{method} {code}" + (f" ({why})" if why else ""))

    def _forget_abandoned(self, names, owner: str) -> None:
        """Close the sessions made by earlier opens of this caller whose replies never reached it
        (`names`: their OpenSessionRequest.open_id, as a later open lists them). Another caller's
        session is left alone: owners must match, "" (not bound) only "" (a network address alone)."""
        names = {name for name in names if name}
        if not names:
            return
        for entry in [e for e in self.sessions.values() if e.open_id in names and e.owner == owner]:
            log.info("closing a session whose open the client abandoned (%d sessions)", len(self.sessions) - 1)
            self._forget(entry)

    def _forget(self, entry: _Entry) -> None:
        """Close a session and drop it (its cache is freed once no worker job holds it)."""
        entry.closed = True
        if self.sessions.get(entry.session_id) is entry:
            del self.sessions[entry.session_id]

    def _owner(self, context) -> str:
        """Whom a new session belongs to: the identity of the caller's bearer token (when tokens
        are checked) or mTLS certificate; "" (anyone holding the id) for a network address alone,
        which a phone changes when it moves between networks."""
        identity = client_identity(context, self.authenticated)
        return "" if identity.startswith("peer:") else identity

    def _entry(self, session_id: bytes, context) -> _Entry:
        """The open session `session_id`, for the caller in `context`. A session opened under a
        bearer token or client certificate answers only that one: another tenant holding its id
        (a leaked log) gets NOT_FOUND, as for an unknown session."""
        if len(session_id) != 16:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "session_id must be 16 bytes")
        entry = self.sessions.get(session_id)
        if entry is None or entry.session is None or entry.closed or (entry.owner and entry.owner != self._owner(context)):
            raise ServiceError(grpc.StatusCode.NOT_FOUND, "unknown or expired session")
        if time.monotonic() - entry.last_used > self.limits.session_idle_ttl_s and not entry.lock.locked():
            self._forget(entry)
            raise ServiceError(grpc.StatusCode.NOT_FOUND, "session expired (idle too long)")
        return entry

    def _reclaim_abandoned(self) -> bool:
        """When a new session finds the server full (sessions or KV): drop the least recently used
        session idle for over RECLAIM_IDLE_S, far longer than a live client waits between steps.
        A client that crashed or vanished never closes its session, which otherwise held its slot
        and KV for the whole idle TTL (300 s): 16 crashed clients locked everyone out. A client
        that was only offline longer reopens its session (SessionLost) and loses nothing.
        Returns whether one was dropped."""
        now = time.monotonic()
        idle = [e for e in self.sessions.values()
                if e.session is not None and not e.lock.locked() and now - e.last_used > RECLAIM_IDLE_S]
        if not idle:
            return False
        entry = min(idle, key=lambda e: e.last_used)
        self._forget(entry)
        log.info("reclaimed a session idle for %.0f s: the server was full", now - entry.last_used)
        return True

    def evict_idle(self) -> int:
        """Drop sessions idle longer than the TTL; returns how many were dropped."""
        now = time.monotonic()
        stale = [e for e in self.sessions.values()
                 if e.session is not None and not e.lock.locked()
                 and now - e.last_used > self.limits.session_idle_ttl_s]
        for entry in stale:
            self._forget(entry)
        if stale:
            log.debug("evicted %d idle sessions", len(stale))
        return len(stale)


def _hold(entry: _Entry, tokens: int) -> int:
    """Record that `entry`'s cache holds `tokens` positions (under the KV budget's lock,
    `KVBudget.settle`); returns by how many that grew."""
    grown, entry.kv_tokens = tokens - entry.kv_tokens, tokens
    return grown


def _replayed(recorded: pb.VerifyReply, arrived: float) -> pb.VerifyReply:
    """A copy of a step's recorded reply for a repeat of that step, with the repeat's own timings
    (no forward: forward_ms 0). The recorded timings belong to the first call: a client that
    subtracts server time from its round trip (client/transport.py `CallStats`, the adaptive tree
    planner's link estimate) would otherwise see more server time than round trip."""
    reply = pb.VerifyReply()
    reply.CopyFrom(recorded)
    waited_ms = (time.perf_counter() - arrived) * 1e3
    reply.timings.CopyFrom(_timings(arrived, waited_ms, 0.0))
    return reply


def _timings(arrived: float, queue_ms: float, forward_ms: float) -> pb.Timings:
    """queue_ms: from arrival until model work began (validation + waiting for the worker)."""
    return pb.Timings(queue_ms=max(queue_ms, 0.0), forward_ms=forward_ms, total_ms=(time.perf_counter() - arrived) * 1e3)


def server_options(limits: ServerLimits) -> list[tuple[str, int]]:
    """gRPC channel arguments of the server: streams per connection, message sizes, keepalive,
    ping policy.

    `max_concurrent_streams` is announced in HTTP/2 SETTINGS: a client's further calls on the same
    connection wait on the client until one of its streams ends. A stream that has ended on the
    client can still count on the server for a moment; a call sent in that window is refused with
    REFUSED_STREAM (UNAVAILABLE, never seen by the servicer), which gRPC retries once by itself.
    Clients that run more calls per connection than the limit should enable a gRPC retry policy
    on UNAVAILABLE (splitspec's own client keeps far fewer calls open than the default limit, 32).

    The server pings every `keepalive_time_s` and drops a connection whose ping is not acknowledged
    within `keepalive_timeout_s`; it accepts client pings as often as every `min_ping_interval_s`
    (clients must not ping more often: after `max_ping_strikes` offences it sends GOAWAY).
    """
    ms = lambda s: max(1, round(s * 1e3))  # noqa: E731
    return [
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        ("grpc.max_receive_message_length", limits.max_receive_bytes),
        ("grpc.max_send_message_length", limits.max_send_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", ms(limits.keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", ms(limits.keepalive_timeout_s)),
        ("grpc.http2.ping_timeout_ms", ms(limits.keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", ms(limits.min_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", limits.max_ping_strikes),
    ]


def service_handlers(servicer: VerifyServicer) -> grpc.GenericRpcHandler:
    """The VerifyService methods, registered with lenient request parsers (see MalformedRequest).

    Each is unary on the wire, but served as a client-streaming handler that demands exactly one
    request message (`_one_request`): grpc.aio's unary path never answers a call whose client
    half-closes without a message (the call hung until the server stopped), and silently dropped a
    second message."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["VerifyService"].methods:
        request_cls = getattr(pb, method.input_type.name)
        handlers[method.name] = grpc.stream_unary_rpc_method_handler(
            _one_request(servicer, method.name), request_deserializer=_lenient_parser(request_cls),
            response_serializer=lambda reply: reply.SerializeToString())
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _one_request(servicer: VerifyServicer, name: str):
    """A stream-unary handler around the servicer's unary method `name`: it runs once the client
    has half-closed (as gRPC Java's unary calls do), and a call that carried no request message or
    more than one is refused with INVALID_ARGUMENT."""
    handler = getattr(servicer, name)

    async def one(requests, context):
        received = [request async for request in _at_most(requests, 2)]
        if len(received) != 1:
            servicer.refused(name, grpc.StatusCode.INVALID_ARGUMENT.name)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{name} takes exactly one request message; the call carried "
                                f"{'none' if not received else 'more than one'}")
        return await handler(received[0], context)
    return one


async def _at_most(requests, n: int):
    """The first `n` messages of an async request stream (stops reading after the n-th)."""
    count = 0
    async for request in requests:
        yield request
        count += 1
        if count == n:
            return


class _UndeliveredReplies(logging.Filter):
    """grpc-aio logs an ERROR with a traceback ("ExecuteBatchError raised in core by servicer
    method") when a handler returns on a call whose client has gone (its link dropped while the
    reply was made). That is a client going away, not a fault of the service: one WARNING line
    instead (docs/reliability.md: no stack traces for what clients do)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "ExecuteBatchError" not in record.getMessage():
            return True
        method = record.getMessage().rpartition("[")[2].rstrip("]")
        log.warning("a reply of %s could not be delivered: the client went away", method or "a call")
        return False


_GRPC_AIO_LOG = logging.getLogger("grpc._cython.cygrpc")
if not any(isinstance(f, _UndeliveredReplies) for f in _GRPC_AIO_LOG.filters):
    _GRPC_AIO_LOG.addFilter(_UndeliveredReplies())


async def create_server(runner: TargetRunner, address: str = "127.0.0.1:0",
                        limits: ServerLimits = ServerLimits(), security: ServerSecurity = ServerSecurity(),
                        metrics: ServiceMetrics | None = None, worker: ThreadPoolExecutor | None = None):
    """Build and start a server. Returns (server, port, servicer, health). `worker`: see
    `VerifyServicer`.

    `security`: bearer tokens (checked on every method but health), TLS and mTLS. Tests bind
    port 0 with SO_REUSEPORT off so parallel servers never share a port.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    metrics = metrics if metrics is not None else ServiceMetrics()
    servicer = VerifyServicer(runner, limits, metrics=metrics, authenticated=bool(security.tokens), worker=worker)
    auth = None
    if security.tokens:
        auth = BearerAuthInterceptor(TokenSet(security.tokens),
                                     on_refusal=lambda method: metrics.refused(method, "UNAUTHENTICATED"))
    servicer.auth = auth  # its TokenSet is swapped on SIGHUP (`serve`)

    limiter = CallLimits(limits.call_limit,
                         on_refusal=lambda method: servicer.refused(method, "RESOURCE_EXHAUSTED", "calls in flight"))
    # auth first: a refused token takes no slot; gRPC's own cap a backstop above the limiter's caps
    server = grpc.aio.server(options=server_options(limits), interceptors=[i for i in (auth, limiter) if i],
                             maximum_concurrent_rpcs=limits.call_limit + HEALTH_WATCHES + HEALTH_CHECK_SPARE)
    server.add_generic_rpc_handlers((service_handlers(servicer),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if security.tls:
        port = server.add_secure_port(address, server_credentials(security))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    await server.start()
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, servicer, health


async def shutdown(server: grpc.aio.Server, servicer: VerifyServicer, health, grace_s: float) -> bool:
    """Graceful shutdown: health NOT_SERVING first, then new OpenSession/Verify calls are refused
    with UNAVAILABLE while the calls in flight finish (up to `grace_s` seconds). Then the model work
    still queued is dropped (its callers get UNAVAILABLE), the server stops (cancelling the call
    whose step is running), and the model worker ends once that step is over: shutdown takes at
    most `grace_s` + one model step. Returns True if all calls finished within the grace period."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    await health.enter_graceful_shutdown()
    servicer.draining = True
    drained = await servicer.drained(grace_s)
    if not drained and servicer.drop_queued():
        await servicer.drained(_DROP_NOTICE_S)  # let the dropped calls send their UNAVAILABLE
    await server.stop(max(deadline - loop.time(), 0.0))
    servicer.parser.shutdown(wait=False, cancel_futures=True)
    # the loop stays free while the running step ends, so that cancelled calls unwind cleanly
    await loop.run_in_executor(None, functools.partial(servicer.worker.shutdown, wait=True, cancel_futures=True))
    return drained


def _reload_tokens(servicer: VerifyServicer, reload_tokens) -> None:
    """SIGHUP: swap the accepted bearer tokens for `reload_tokens()` (the token file read again).
    Calls already admitted finish; a session opened under a token that is no longer accepted answers
    only that token, so its client, once it presents a new one, gets NOT_FOUND and reopens. A token
    file that cannot be read or holds no token keeps the current tokens (an error line says why).
    SIGHUP ended the process before, without draining."""
    if reload_tokens is None or servicer.auth is None:
        print("splitspec verify service: SIGHUP ignored (no --auth-token-file to read again)", file=sys.stderr,
              flush=True)
        return
    try:
        tokens = TokenSet(reload_tokens())
    except (OSError, ValueError) as err:
        print(f"splitspec verify service: SIGHUP: the tokens were not reloaded ({err}); the current ones stay",
              file=sys.stderr, flush=True)
        return
    servicer.auth.tokens = tokens
    print(f"splitspec verify service: SIGHUP: {tokens.count} bearer token(s) reloaded", flush=True)


def _exit_now(sig: int) -> None:
    """A second SIGINT / SIGTERM during shutdown: end the process now (status 128 + the signal),
    abandoning the running model step (a prefill chunk or a verify step: seconds on a CPU; a whole
    prompt with `--prefill-chunk 0`, over a minute for 4,000 tokens). Clients see their calls fail
    and reopen their sessions elsewhere."""
    print(f"splitspec verify service: {signal.Signals(sig).name} again: stopped without waiting for the "
          "running model step", file=sys.stderr, flush=True)
    os._exit(128 + sig)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


async def serve(runner: TargetRunner, host: str, port: int, limits: ServerLimits, grace_s: float = 5.0,
                on_bound=None, security: ServerSecurity = ServerSecurity(), metrics_port: int | None = None,
                metrics_host: str = "127.0.0.1", worker: ThreadPoolExecutor | None = None,
                reload_tokens=None) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully (see `shutdown`).
    `on_bound(port)` is called once the service listens; `metrics_port` exports Prometheus metrics;
    `worker`: the `compute_thread` that loaded the runner's model (see `VerifyServicer`);
    `reload_tokens()`: the accepted bearer tokens read again (--auth-token-file), called on SIGHUP
    (token rotation without a restart; without it SIGHUP is logged and ignored).

    Raises:
        ValueError: a port outside 0..65535 (gRPC would listen on it modulo 65536).
        RuntimeError / OSError: the service or metrics port cannot be bound.
    """
    for name, value in (("port", port), ("metrics port", metrics_port)):
        if value is not None and not 0 <= value <= 65535:
            raise ValueError(f"{name} {value} must lie in 0..65535")
    metrics = ServiceMetrics()
    exported = None
    if metrics_port is not None:  # first: a busy metrics port must not leave the service half started
        try:
            exported = metrics.serve_http(metrics_port, metrics_host)
        except OSError as err:
            raise OSError(f"cannot export metrics on {metrics_host}:{metrics_port}: {err.strerror or err}") from None
    try:
        server, bound, servicer, health = await create_server(runner, f"{host}:{port}", limits, security, metrics,
                                                              worker=worker)
    except BaseException:
        metrics.stop_http()
        raise
    scheme = "TLS" if security.tls else "plaintext"
    auth = f"{len(security.tokens)} bearer token(s)" if security.tokens else "no auth"
    print(f"splitspec verify service: {runner.model_id} listening on {host}:{bound} ({scheme}, {auth})", flush=True)
    if not _is_loopback(host) and not (security.tls and security.tokens):
        log.warning("serving on %s without TLS and bearer tokens: anyone who can reach it can use it", host)
    if exported is not None:
        print(f"splitspec verify service: metrics on http://{metrics_host}:{exported}/metrics", flush=True)
    if on_bound is not None:
        on_bound(bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _reload_tokens, servicer, reload_tokens)

    async def sweep():
        while not stop.is_set():
            await asyncio.sleep(min(limits.session_idle_ttl_s / 4, 30.0))
            servicer.evict_idle()

    sweeper = asyncio.create_task(sweep())
    await stop.wait()
    print("splitspec verify service: shutting down (draining in-flight steps; a second Ctrl-C or SIGTERM "
          "stops at once)", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # one model step (a prefill chunk, a verify step) cannot be cut short
        loop.add_signal_handler(sig, _exit_now, sig)
    sweeper.cancel()
    drained = await shutdown(server, servicer, health, grace_s)
    metrics.stop_http()
    print(f"splitspec verify service: stopped{'' if drained else ' (grace period over, calls cancelled)'}", flush=True)
