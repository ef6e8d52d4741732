"""Admission control of the verify service: KV-cache budgets and a per-client rate limit.

Both answer before any model work, so a refusal costs the server microseconds. A refusal is a
`ServiceError` with RESOURCE_EXHAUSTED and a short message (and, for the rate limit, a retry hint).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from splitspec.shared.config import ServerLimits
from splitspec.shared.features import FeatureRequest
from splitspec.v1 import verify_pb2 as pb

from .auth import HEALTH_PREFIX
from .validation import ServiceError

BUSY_RETRY_S = 1.0  # retry hint (grpc-retry-pushback-ms) of refusals that last only while others hold the server
HEALTH_WATCHES = 8  # Health.Watch streams open at once: a cap of their own, beside call_limit
HEALTH_CHECK_SPARE = 16  # room for instant health checks in gRPC's backstop cap (create_server)


class CallLimits(grpc.aio.ServerInterceptor):
    """Calls in flight over all connections, capped apart for the standard health service's Watch
    streams (`watches`) and for the service's own calls (`calls`, ServerLimits.call_limit); a call
    beyond its cap is refused at once with RESOURCE_EXHAUSTED and a retry hint (BUSY_RETRY_S: calls
    end within a step), told to `on_refusal(method)`. Health checks (unary `Check`, which answers
    without waiting) pass uncounted: they are what clients probe the link with.

    Health needs no token and a Watch stream stays open as long as its caller likes: counted with
    the rest (gRPC's maximum_concurrent_rpcs counts every method), unauthenticated Watch streams held
    every slot and locked every client out; counted with the checks, they made every reconnect probe
    fail (QA 58). gRPC's own cap stays as a backstop above the sum (create_server). It counts calls
    from their arrival, before the limiter sees them: half-open calls (no request message sent)
    still fill it while they stay open, a gap the limiter does not close. Counted on the server's
    event loop: no lock is needed.
    """

    def __init__(self, calls: int, watches: int = HEALTH_WATCHES,
                 on_refusal: Callable[[str], None] | None = None) -> None:
        self.caps = {"calls": calls, "watches": watches}
        self.active = {"calls": 0, "watches": 0}
        self.on_refusal = on_refusal

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or (handler.request_streaming and handler.response_streaming):  # none such here
            return handler
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX) and not handler.response_streaming:
            return handler  # Check
        kind = "watches" if method.startswith(HEALTH_PREFIX) else "calls"
        wrap = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.request_streaming:  # VerifyService's methods (service.py `service_handlers`)
            return grpc.stream_unary_rpc_method_handler(self._counted_unary(handler.stream_unary, kind, method), **wrap)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(self._counted_stream(handler.unary_stream, kind, method), **wrap)
        return grpc.unary_unary_rpc_method_handler(self._counted_unary(handler.unary_unary, kind, method), **wrap)

    def _counted_unary(self, behaviour, kind: str, method: str):
        async def call(request, context):  # `request`: a message, or the iterator of a stream_unary call
            await self._enter(context, kind, method)
            try:
                return await behaviour(request, context)
            finally:
                self.active[kind] -= 1
        return call

    def _counted_stream(self, behaviour, kind: str, method: str):
        async def call(request, context):  # writes its replies (context.write), as the health servicer does
            await self._enter(context, kind, method)
            try:
                replies = behaviour(request, context)
                if hasattr(replies, "__aiter__"):
                    async for reply in replies:
                        await context.write(reply)
                else:
                    await replies
            finally:
                self.active[kind] -= 1
        return call

    async def _enter(self, context, kind: str, method: str) -> None:
        if self.active[kind] >= self.caps[kind]:
            if self.on_refusal is not None:
                self.on_refusal(method.rpartition("/")[2])
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(round(BUSY_RETRY_S * 1e3))),))
            what = "health Watch streams" if kind == "watches" else "calls (--max-calls)"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the server has {self.active[kind]} {what} in flight, its limit; retry shortly")
        self.active[kind] += 1


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys + values one cached token costs: 2 x layers x KV heads x head_dim x element size.

    `config` is a transformers model config (num_hidden_layers, num_attention_heads, hidden_size,
    optional num_key_value_heads and head_dim).
    """
    kv_heads, head_dim = _kv_heads_and_dim(config)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element


def _kv_heads_and_dim(config) -> tuple[int, int]:
    """(KV heads, head_dim) of a transformers config (num_key_value_heads and head_dim optional)."""
    heads = config.num_attention_heads
    return (getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


def reply_feature_bytes(config, spec: FeatureRequest, positions: int, lsa_width: int = 0) -> int:
    """An upper bound of the bytes the features of `positions` positions take in a reply, known
    before any model work: hidden [P, E] per hidden layer, keys and values [Hkv, P, D] per KV layer,
    lsa [P, `lsa_width`]; 2 bytes an element unquantized (fp16 on the wire), 1 quantized plus a
    4-byte scale per row; zstd never grows a tensor by more than 1/256 + a frame's few bytes
    (ZSTD_compressBound); 256 bytes per tensor cover its header. `config`: as `kv_bytes_per_token`."""
    kv_heads, head_dim = _kv_heads_and_dim(config)
    quantized = spec.quantization != pb.QUANTIZATION_NONE
    element, scale = (1, 4) if quantized else (2, 0)
    per_position = len(spec.hidden_layers) * (config.hidden_size * element + scale)
    per_position += 2 * len(spec.kv_layers) * kv_heads * (head_dim * element + scale)
    tensors = len(spec.hidden_layers) + 2 * len(spec.kv_layers)
    if spec.lsa_id:
        per_position += lsa_width * element + scale
        tensors += 1
    raw = positions * per_position
    return raw + raw // 256 + 256 * tensors


@dataclass
class Reservation:
    """KV tokens admitted for one model work item and not (yet) held by its session's cache."""

    tokens: int = 0


class KVBudget:
    """Per-session and server-wide KV-cache budgets, in tokens and bytes.

    `held()` returns the tokens all sessions' caches hold now. A step is admitted with `reserve`
    (on the event loop, before the model work is queued) for the growth from its session's current
    length to its peak; as the work grows the session's cache, `settle` moves that growth from the
    reservation to the cache (so a prefill in chunks never counts its finished chunks twice); and
    `release` frees what is left once the work item is over: done, failed, or cancelled before it
    ran (server/service.py `_submit`). Thread-safe. Bytes are tokens x `bytes_per_token`.
    """

    def __init__(self, limits: ServerLimits, bytes_per_token: int, held: Callable[[], int]) -> None:
        self.limits = limits
        self.bytes_per_token = bytes_per_token
        self.held = held
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens held by all caches plus those reserved for steps in flight."""
        with self._lock:
            return self.held() + self._reserved

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def reserve(self, current_tokens: int, peak_tokens: int, what: str = "step") -> Reservation:
        """Admit a call (`what`: "step", "prompt") that takes a session's cache from
        `current_tokens` to `peak_tokens` positions.

        Returns the reservation of the growth (pass it to `settle` and `release`).
        Raises:
            ServiceError: RESOURCE_EXHAUSTED naming the budget that would be broken; a server-wide
                budget's refusal carries a retry hint (BUSY_RETRY_S), since closing sessions frees it.
        """
        lim, per_token = self.limits, self.bytes_per_token
        _check("session KV tokens", what, peak_tokens, lim.max_session_kv_tokens, "tokens")
        _check("session KV bytes", what, peak_tokens * per_token, lim.max_session_kv_bytes, "bytes")
        growth = max(peak_tokens - current_tokens, 0)
        with self._lock:
            total = self.held() + self._reserved + growth
            _check("server KV tokens", what, total, lim.max_total_kv_tokens, "tokens", BUSY_RETRY_S)
            _check("server KV bytes", what, total * per_token, lim.max_total_kv_bytes, "bytes", BUSY_RETRY_S)
            self._reserved += growth
        return Reservation(growth)

    def settle(self, reservation: Reservation | None, record: Callable[[], int]) -> None:
        """Run `record()`, which sets a session's held tokens (what `held()` sums) and returns by how
        many they grew, under the budget's lock, and take that growth off `reservation` (None: a
        call that reserved nothing): no moment counts those tokens both held and reserved."""
        with self._lock:
            grown = record()
            if reservation is not None:
                moved = min(max(grown, 0), reservation.tokens)
                reservation.tokens -= moved
                self._reserved -= moved

    def release(self, reservation: Reservation | None) -> None:
        """Free what is left of `reservation`; releasing it again frees nothing."""
        if reservation is None:
            return
        with self._lock:
            self._reserved -= reservation.tokens
            reservation.tokens = 0


def _check(budget: str, what: str, value: int, limit: int | None, unit: str, retry_after_s: float | None = None
           ) -> None:
    if limit is not None and value > limit:
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{budget} budget exceeded: this {what} needs {value} {unit}, the limit is {limit}",
                           retry_after_s=retry_after_s)


class RateLimiter:
    """A token bucket per client identity: `rate_per_s` calls per second on average, `burst` at once.

    Buckets of clients that have been quiet long enough to refill completely are forgotten, and at
    most `max_clients` buckets are kept (the least recently seen go first), so a flood of identities
    cannot grow memory. Not thread-safe: call from the event loop.
    """

    def __init__(self, rate_per_s: float, burst: int, max_clients: int = 10_000, clock=time.monotonic) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"rate limit needs rate > 0 and burst >= 1, got {rate_per_s}, {burst}")
        self.rate, self.burst, self.max_clients, self.clock = rate_per_s, burst, max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # identity -> (tokens, time)

    def acquire(self, identity: str) -> float:
        """Take one call from `identity`'s bucket. Returns 0.0 when allowed, else the seconds until
        a call would be allowed (the bucket is left unchanged)."""
        now = self.clock()
        tokens, last = self._buckets.pop(identity, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            tokens -= 1.0
            wait = 0.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[identity] = (tokens, now)
        self._forget(now)
        return wait

    def _forget(self, now: float) -> None:
        full_after = self.burst / self.rate
        while self._buckets:
            identity, (_, last) = next(iter(self._buckets.items()))
            if len(self._buckets) <= self.max_clients and now - last < full_after:
                break
            del self._buckets[identity]

    def __len__(self) -> int:
        return len(self._buckets)
