"""The gRPC transport: a `Verifier` backed by the remote verify service (split mode).

Every call carries a deadline; message sizes are counted from the serialized protobufs so the
stats show exactly what crossed the wire (gRPC compression stays off: tensors are zstd inside).
The channel is plaintext, or TLS / mTLS when a CA or client certificate is given; a bearer token
rides as call credentials over TLS (or as metadata over plaintext, for loopback and test set-ups).
Keepalive pings notice a dead link within keepalive_time + keepalive_timeout.
An OpenSession refused with RESOURCE_EXHAUSTED and a retry hint (the server is full for now: its
session limit, its KV budget or the client's rate) is retried with backoff for `busy_wait_s`.
"""
from __future__ import annotations

import collections
import ipaddress
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from splitspec.shared import codec
from splitspec.shared.config import (CLIENT_KEEPALIVE_TIME_S, CLIENT_TOKEN_ENV, MAX_ABANDONED_OPENS, OPEN_ID_BYTES,
                                     check_token, read_tokens)
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.v1 import verify_pb2 as pb
from splitspec.v1 import verify_pb2_grpc as pb_grpc

from splitspec.shared.verifier import (CANCEL_POLL_S, BadReply, CallStats, LinkDown, OpenCancelled, OpenResult,
                                       ServerInfo, SessionLost, StepResult, Verifier, VerifierSession)

log = logging.getLogger(__name__)


RECONNECT_BACKOFF_INITIAL_S = 0.5  # gRPC's reconnect backoff after a lost connection (its defaults: 1 s .. 120 s)
RECONNECT_BACKOFF_MAX_S = 2.0


def channel_options(keepalive_time_s: float = CLIENT_KEEPALIVE_TIME_S, keepalive_timeout_s: float = 20.0,
                    max_receive_bytes: int = 64 * 2**20, max_send_bytes: int = 4 * 2**20) -> list[tuple[str, int]]:
    """gRPC channel arguments of the client.

    The client pings every `keepalive_time_s` (also while a call waits and while idle) and drops the
    connection when a ping is not acknowledged within `keepalive_timeout_s`: calls on a black-holed
    link fail with UNAVAILABLE within about keepalive_time_s + keepalive_timeout_s. The server must
    permit pings that often (ServerLimits.min_ping_interval_s <= keepalive_time_s) or it answers
    with GOAWAY. With grpcio 1.85 the timeout that closes the connection is
    `grpc.http2.ping_timeout_ms` (default 60 s), for keepalive and flow-control (BDP) pings alike,
    so it is set to `keepalive_timeout_s`. A ping's acknowledgement queues behind the reply bytes
    already in flight, so `keepalive_timeout_s` must exceed the longest a reply can take on the
    slowest link (bytes / rate: 20 s carries 12 MB at 5 Mbit/s).

    gRPC reconnects a lost connection after a backoff that grows 1.6x per attempt up to 120 s, and
    while it waits every call (the reconnect probe's included) fails at once: a service back after a
    25 s restart was seen 10-30 s late, so answers ran out their offline wait and the daemon answered
    503 for half a minute with the service up (QA 58). The backoff is capped at RECONNECT_BACKOFF_MAX_S,
    below the probe's own cap (client/reconnect.py OfflinePolicy.backoff_max_s).
    """
    ms = lambda s: max(1, round(s * 1e3))  # noqa: E731
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", max_send_bytes),
        ("grpc.keepalive_time_ms", ms(keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", ms(keepalive_timeout_s)),
        ("grpc.http2.ping_timeout_ms", ms(keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", ms(RECONNECT_BACKOFF_INITIAL_S)),
        ("grpc.max_reconnect_backoff_ms", ms(RECONNECT_BACKOFF_MAX_S)),
    ]


CHANNEL_OPTIONS = channel_options()


_CallFields = collections.namedtuple("_CallFields", "method timeout metadata credentials wait_for_ready compression")


class _CallDetails(_CallFields, grpc.ClientCallDetails):
    pass


class _BearerMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call of a plaintext channel."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _details(self, d):
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._entry], d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def make_channel(address: str, options=CHANNEL_OPTIONS, token: str | None = None, tls_ca: bytes | None = None,
                 client_cert: bytes | None = None, client_key: bytes | None = None) -> grpc.Channel:
    """A channel to HOST:PORT: TLS when `tls_ca` (PEM CA bundle; None = system roots) or a client
    certificate is given, mTLS with `client_cert` + `client_key` (PEM); plaintext otherwise.
    `token` is sent as `authorization: Bearer <token>` on every call.

    Raises:
        ValueError: a client certificate without its key or the reverse.
    """
    if (client_cert is None) != (client_key is None):
        raise ValueError("mTLS needs both the client certificate and its private key")
    if tls_ca is not None or client_cert is not None:
        credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca, private_key=client_key,
                                                   certificate_chain=client_cert)
        if token:
            credentials = grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(token))
        return grpc.secure_channel(address, credentials, options=options)
    channel = grpc.insecure_channel(address, options=options)
    if not token:
        return channel
    if not _is_loopback(address):
        log.warning("sending the auth token to %s without TLS: anyone on the path can read it", address)
    return grpc.intercept_channel(channel, _BearerMetadata(token))


def load_client_security(token_file: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                         tls_key: str | None = None) -> dict:
    """RemoteVerifier keyword arguments from files: the first token of `token_file` (else the
    SPLITSPEC_AUTH_TOKEN environment variable, else none) and the PEM files named.

    Raises:
        OSError: a file cannot be read. ValueError: the token file holds no valid token.
    """
    token = read_tokens(token_file)[0] if token_file else None
    if token is None and os.environ.get(CLIENT_TOKEN_ENV, "").strip():
        token = check_token(os.environ[CLIENT_TOKEN_ENV].strip())
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    return {"token": token, "tls_ca": read(tls_ca), "client_cert": read(tls_cert), "client_key": read(tls_key)}


class RemoteVerifier(Verifier):
    """Connects to `address` (HOST:PORT) and reads the server's Info. `timeout_s` is the deadline of
    Info and OpenSession (a prefill), `step_timeout_s` that of each Verify step (missing it sends
    the client offline: keep it short), `connect_timeout_s` the wait for the first connection. `token`: bearer token;
    `tls_ca`, `client_cert`, `client_key`: PEM bytes for TLS / mTLS (see `make_channel`);
    `options`: gRPC channel arguments (`channel_options(...)`, default CHANNEL_OPTIONS).
    `busy_wait_s`: how long `open` keeps retrying while the server refuses it for now
    (RESOURCE_EXHAUSTED with a retry hint: at its session limit, KV budget or this client's rate);
    0 = not at all. `on_busy(message)` is told before each wait, why and for how long.

    Raises:
        ConnectionError: the server cannot be reached (or the TLS handshake fails) within
            `connect_timeout_s`.
        grpc.RpcError: the server refused the Info call (UNAUTHENTICATED: missing or wrong token).
        ValueError: a client certificate without its key or the reverse.
    """

    def __init__(self, address: str, timeout_s: float = 60.0, connect_timeout_s: float = 10.0,
                 token: str | None = None, tls_ca: bytes | None = None, client_cert: bytes | None = None,
                 client_key: bytes | None = None, options=None, step_timeout_s: float = 10.0,
                 busy_wait_s: float = 0.0, on_busy: Callable[[str], None] | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.busy_wait_s = busy_wait_s
        self.on_busy = on_busy if on_busy is not None else log.warning
        # names of opens whose reply never came (LinkDown): the next open asks the server to close
        # the sessions they made (OpenSessionRequest.abandoned_opens), the newest MAX_ABANDONED_OPENS
        self.abandoned_opens: list[bytes] = []
        self.channel = make_channel(address, CHANNEL_OPTIONS if options is None else options, token=token,
                                    tls_ca=tls_ca, client_cert=client_cert, client_key=client_key)
        self.stub = pb_grpc.VerifyServiceStub(self.channel)
        self._wait_connected(connect_timeout_s, tls=bool(tls_ca or client_cert))
        info = self.stub.Info(pb.InfoRequest(), timeout=timeout_s)
        self.info = ServerInfo(
            model_id=info.model_id, tokenizer_fingerprint=info.tokenizer_fingerprint, vocab_size=info.vocab_size,
            num_layers=info.num_layers, hidden_size=info.hidden_size, max_context=info.max_context,
            max_tree_nodes=info.max_tree_nodes, max_tree_depth=info.max_tree_depth,
            max_draft_support=info.max_draft_support, eos_token_ids=tuple(info.eos_token_ids),
            lsa_ids=tuple(info.lsa_ids), max_prompt_tokens=info.max_prompt_tokens or None)

    def _wait_connected(self, timeout_s: float, tls: bool) -> None:
        """Until the channel is ready, within `timeout_s`. A server not (yet) listening is waited
        for; one that answers the connection but fails its setup (TLS on one side only, a
        certificate the other side refuses) ends the wait at once with gRPC's reason, since
        waiting cannot mend it (it took the whole timeout, then blamed reachability).

        Raises:
            ConnectionError: not connected within `timeout_s`, or a failed connection setup.
        """
        ready = grpc.channel_ready_future(self.channel)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ready.result(timeout=max(0.0, min(CONNECT_POLL_S, deadline - time.monotonic())))
                return
            except grpc.FutureTimeoutError:
                cause = self._connect_error()
                setup_failed = cause is not None and any(m in cause for m in _SETUP_FAILURES)
                if not setup_failed and time.monotonic() < deadline:
                    continue
                self.channel.close()
                if setup_failed:
                    hint = "" if tls else "; does the server require TLS (--tls-ca)?"
                    raise ConnectionError(f"the server at {self.address} refused the connection's setup "
                                          f"({cause}){hint}") from None
                raise ConnectionError(f"no verify service reachable at {self.address} within {timeout_s:g} s"
                                      f"{f' ({cause})' if cause else ''}") from None

    def _connect_error(self) -> str | None:
        """Why the channel does not connect, as gRPC words it (an Info call that does not wait for
        the channel), or None when the call got through."""
        try:
            self.stub.Info(pb.InfoRequest(), timeout=CONNECT_POLL_S)
        except grpc.RpcError as err:
            return err.details()
        return None

    def open(self, prompt_ids, sampling, features, cancelled=None):
        abandoned = list(self.abandoned_opens)  # at most MAX_ABANDONED_OPENS: kept so below
        request = pb.OpenSessionRequest(prompt_ids=prompt_ids, sampling=sampling.to_pb(pb.SamplingParams),
                                        features=features.to_pb(),
                                        tokenizer_fingerprint=self.info.tokenizer_fingerprint,
                                        open_id=os.urandom(OPEN_ID_BYTES), abandoned_opens=abandoned)
        try:
            reply, stats = self._open_when_admitted(request, cancelled)
        except (LinkDown, OpenCancelled):  # the server may have made the session: name it next time
            self.abandoned_opens = [*self.abandoned_opens, request.open_id][-MAX_ABANDONED_OPENS:]
            raise
        self.abandoned_opens = [name for name in self.abandoned_opens if name not in abandoned]
        session = _RemoteSession(self, reply.session_id, features)
        try:
            batch = _features(reply, "OpenSession", features, self.info.hidden_size)
        except BadReply:
            session.close()
            raise
        return session, OpenResult(reply.first_token, batch, stats)

    def _open_when_admitted(self, request: pb.OpenSessionRequest, cancelled=None):
        """OpenSession, retried while the server refuses it for now (see `busy_wait_s`), with
        exponential backoff and jitter, never sooner than the server's hint. `cancelled`: as
        `Verifier.open`'s.

        Raises:
            grpc.RpcError: any other refusal, or the last busy refusal once `busy_wait_s` is spent.
            OpenCancelled: `cancelled` returned True while the call ran.
        """
        give_up = time.monotonic() + self.busy_wait_s
        attempt = 0
        while True:
            try:
                return _call(self.stub.OpenSession, request, self.timeout_s, cancelled)
            except grpc.RpcError as err:
                hint = retry_hint_s(err)
                left = give_up - time.monotonic()
                if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or hint is None or left <= 0:
                    raise
                backoff = min(BUSY_BACKOFF_MAX_S, hint * 2 ** attempt) * random.uniform(0.5, 1.0)
                delay = min(max(hint, backoff), left)
                self.on_busy(f"the verify service is busy ({err.details()}); retrying in {delay:.1f} s "
                             f"(giving up in {left:.0f} s)")
                time.sleep(delay)
                attempt += 1

    def close(self) -> None:
        self.channel.close()

    def probe(self, timeout_s: float = 1.0) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service="splitspec.v1.VerifyService"), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


class _RemoteSession(VerifierSession):
    def __init__(self, verifier: RemoteVerifier, session_id: bytes, features: FeatureRequest) -> None:
        self.verifier = verifier
        self.session_id = session_id
        self.features = features  # what every reply's features must hold
        self.step = 0
        self.in_flight: pb.VerifyRequest | None = None  # a step whose outcome is unknown (LinkDown)

    def verify(self, tree, draft_probs, forced_tokens=()):
        if self.in_flight is not None:
            raise RuntimeError(f"step {self.in_flight.step} is unresolved: call resume() first")
        request = pb.VerifyRequest(session_id=self.session_id, step=self.step + 1,
                                   tree=pb.DraftTree(tokens=tree.tokens, parents=tree.parents),
                                   forced_tokens=forced_tokens)
        if draft_probs:
            request.draft_probs.CopyFrom(encode_draft_probs(draft_probs))
        self.in_flight = request
        return self._send()

    def resume(self):
        return self._send() if self.in_flight is not None else None

    def _send(self) -> StepResult:
        reply, stats = _call(self.verifier.stub.Verify, self.in_flight, self.verifier.step_timeout_s)
        features = _features(reply, f"Verify step {self.in_flight.step}", self.features,  # before the step
                             self.verifier.info.hidden_size)  # counts as done
        self.in_flight = None
        self.step += 1
        return StepResult(tuple(reply.accepted_tokens), reply.bonus_token, reply.bonus_recovered, features, stats)

    def close(self) -> None:
        try:
            self.verifier.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id), timeout=5.0)
        except grpc.RpcError:
            pass  # the server drops idle sessions itself


def _features(reply, call: str, request: FeatureRequest, hidden_size: int) -> FeatureBatch:
    """The reply's features, decoded: the layers `request` asked for, hidden states `hidden_size`
    wide (FeatureBatch.from_pb checks every shape before anything is inflated).

    Raises:
        BadReply: they do not decode (codec.CodecError), naming the call.
    """
    try:
        return FeatureBatch.from_pb(reply.features, request=request, hidden_size=hidden_size)
    except ValueError as err:  # codec.CodecError, and from_pb's own checks
        raise BadReply(f"the verify service's reply to {call} carries features this client cannot decode "
                       f"({err}); is the server a splitspec of another version?") from err


CONNECT_POLL_S = 0.5  # how often a connection that is not ready yet is asked why
# what gRPC says when a connection was made but its setup failed: TLS on one side only, or a
# certificate the other side refuses (no waiting mends these)
_SETUP_FAILURES = ("Socket closed", "handshake", "SSL", "WRONG_VERSION_NUMBER", "CERTIFICATE_VERIFY_FAILED")


def encode_draft_probs(draft_probs) -> pb.DraftProbs:
    """Pad the sparse rows to a common width S and encode them as [R, S] tensors."""
    rows = sorted(draft_probs)
    width = max(len(draft_probs[r].token_ids) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int32)
    probs = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(draft_probs[r].token_ids)
        ids[i, :n] = draft_probs[r].token_ids.to(torch.int32)
        probs[i, :n] = draft_probs[r].probs.float()
    return pb.DraftProbs(rows=rows, token_ids=codec.encode(ids), probs=codec.encode(probs))


_LINK_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
BUSY_BACKOFF_MAX_S = 8.0  # the longest wait between OpenSession retries while the server is full


def retry_hint_s(err: grpc.RpcError) -> float | None:
    """The server's retry hint of a refusal (`grpc-retry-pushback-ms` trailing metadata), in
    seconds; None when it sent none (the refusal will not pass by waiting)."""
    try:
        metadata = dict(err.trailing_metadata() or ())
    except (AttributeError, TypeError, ValueError):
        return None
    try:
        return max(int(metadata["grpc-retry-pushback-ms"]), 0) / 1e3
    except (KeyError, ValueError):
        return None


def _call(method, request, timeout_s: float, cancelled=None):
    """One unary call. Raises LinkDown (unreachable / deadline missed), SessionLost (NOT_FOUND) or
    the grpc.RpcError of any other refusal; OpenCancelled when `cancelled` (polled every
    CANCEL_POLL_S while the call runs) returned True: the call is cancelled (the service drops its
    queued work and stops a chunked prefill at the next chunk)."""
    start = time.perf_counter()
    try:
        if cancelled is None:
            reply = method(request, timeout=timeout_s)
        else:
            call = method.future(request, timeout=timeout_s)
            while True:
                try:
                    reply = call.result(timeout=CANCEL_POLL_S)
                    break
                except grpc.FutureTimeoutError:
                    if cancelled():
                        call.cancel()
                        raise OpenCancelled("the open was cancelled while the server prefilled") from None
    except grpc.RpcError as err:
        if err.code() in _LINK_DOWN:
            raise LinkDown(f"verify service: {err.code().name}: {err.details()}") from err
        if err.code() == grpc.StatusCode.NOT_FOUND:
            raise SessionLost(err.details()) from err
        raise
    rtt_ms = (time.perf_counter() - start) * 1e3
    t = reply.timings
    return reply, CallStats(rtt_ms, t.total_ms, t.forward_ms, request.ByteSize(), reply.ByteSize())
