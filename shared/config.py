"""Configuration dataclasses, built from the command line in one place (each room's cli.py), and the
readers of the secrets some of them hold (bearer tokens, PEM files)."""
from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

TOKEN_ENV = "SPLITSPEC_AUTH_TOKENS"  # the server's accepted tokens, one per line or comma-separated
CLIENT_TOKEN_ENV = "SPLITSPEC_AUTH_TOKEN"  # the token a client presents
MIN_TOKEN_CHARS = 16
# how often the splitspec client pings the server (client/transport.py `channel_options`): the
# server's `min_ping_interval_s` must not exceed it, or idle clients get GOAWAY too_many_pings
CLIENT_KEEPALIVE_TIME_S = 30.0
# OpenSessionRequest.open_id and each of its abandoned_opens: at most this many bytes; at most
# MAX_ABANDONED_OPENS names a request
OPEN_ID_BYTES = 16
MAX_ABANDONED_OPENS = 8
_TOKEN_RE = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces: a valid metadata value
# the default server-wide cap on calls in flight (ServerLimits.call_limit): a splitspec client keeps
# at most 3 calls open per session (a step, a health probe, a close), plus room for opens and probes
CALLS_PER_SESSION = 4
CALLS_SPARE = 16
# the longest batching window (ServerLimits.batch_window_ms): the window waits only for sessions
# answered within this long (server/service.py ACTIVE_SESSION_S), so a longer one gathers nothing more
MAX_BATCH_WINDOW_MS = 1000.0


@dataclass(frozen=True)
class ServerLimits:
    """What the verify service accepts; every request is checked against these before model work.

    KV budgets count the tokens whose keys/values a session's cache holds at the peak of a step
    (context + the step's new tokens + its tree), and bytes as tokens x the model's KV bytes per
    token (server/limits.py). None means unlimited (a session stays bounded by `max_context`).

    Raises:
        ValueError: a limit is not positive.
    """

    max_tree_nodes: int = 64
    max_tree_depth: int = 32
    max_prompt_tokens: int = 4096
    max_context: int | None = None  # tokens per session; None = the model's max_position_embeddings
    max_sessions: int = 16
    session_idle_ttl_s: float = 300.0
    max_draft_support: int = 256  # entries per draft-probability row
    max_receive_bytes: int = 4 * 2**20  # per request message
    # concurrent calls (HTTP/2 streams) per client connection; a client needs at most 3 (a step, a
    # health probe, a close) and further calls wait on the client, so 32 bounds what one connection
    # can make the server buffer (32 x max_receive_bytes) without slowing any real client
    max_concurrent_streams: int = 32
    # the service's calls in flight over all connections (health calls apart), beyond which new ones
    # are refused with RESOURCE_EXHAUSTED and a retry hint (server/limits.py CallLimits):
    # each may hold a request of up to max_receive_bytes, and the per-connection cap above does not
    # bound many connections (8 x 32 pending calls took a server from 1.5 to 8 GB, session 56);
    # None = `call_limit`'s default, CALLS_PER_SESSION per session plus CALLS_SPARE
    max_calls: int | None = None
    max_send_bytes: int = 64 * 2**20  # per reply message
    max_session_kv_tokens: int | None = None
    max_session_kv_bytes: int | None = None
    max_total_kv_tokens: int | None = None  # over all sessions
    max_total_kv_bytes: int | None = 4 * 2**30
    rate_limit_per_s: float | None = None  # OpenSession + Verify calls per client identity; None = off
    rate_limit_burst: int = 200  # token-bucket depth (calls a client may make at once)
    keepalive_time_s: float = 30.0  # server pings an idle-looking connection this often
    keepalive_timeout_s: float = 10.0  # and closes it when the ping is not acknowledged in time
    min_ping_interval_s: float = 5.0  # clients may ping this often (>= it) without a ping strike
    max_ping_strikes: int = 2  # too-frequent pings tolerated before GOAWAY; 0 = unlimited
    # Verify steps of different sessions scored in one target forward: the steps queued when the
    # model worker gets free, up to this many; 1 = off
    max_batch: int = 8
    # and the worker waits up to this long for the next steps of the other sessions due within it
    # (by each one's measured reply-to-next-step turnaround: server/service.py _gather_steps); a
    # lone session never waits; 0 = take what is queued
    batch_window_ms: float = 5.0
    # a prompt is prefilled in forwards of at most this many tokens, and the other sessions' verify
    # steps queued meanwhile are scored between them (chunked prefill); None = one forward
    prefill_chunk: int | None = 512

    @property
    def call_limit(self) -> int:
        """Calls in flight over all connections that the server serves (`max_calls` or its default)."""
        return self.max_calls if self.max_calls is not None else CALLS_PER_SESSION * self.max_sessions + CALLS_SPARE

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            zero_ok = f.name in ("max_ping_strikes", "batch_window_ms")
            if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
                raise ValueError(f"server limit {f.name} must be {'>= 0' if zero_ok else '> 0'}, got {value}")
        if self.batch_window_ms > MAX_BATCH_WINDOW_MS:
            raise ValueError(f"server limit batch_window_ms must be <= {MAX_BATCH_WINDOW_MS:g} (a session counts as "
                             f"active that long after its reply; a longer window gathers no more), got "
                             f"{self.batch_window_ms}")
        if self.min_ping_interval_s > CLIENT_KEEPALIVE_TIME_S:
            raise ValueError(f"server limit min_ping_interval_s must be <= {CLIENT_KEEPALIVE_TIME_S:g} (the splitspec "
                             f"client pings that often; each ping would be a strike: GOAWAY too_many_pings), got "
                             f"{self.min_ping_interval_s}")


@dataclass(frozen=True)
class ServerSecurity:
    """Who may call the verify service. `tokens`: accepted bearer tokens (empty = no auth);
    `tls_cert`/`tls_key`: PEM server certificate chain and key (None = plaintext);
    `tls_client_ca`: PEM CA bundle that client certificates must chain to (mTLS).
    Secrets never appear in the repr.

    Raises:
        ValueError: a key without a certificate (or the reverse), mTLS without TLS, a malformed token.
    """

    tokens: tuple[str, ...] = field(default=(), repr=False)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)
    tls_client_ca: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its private key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("mTLS (a client CA) needs TLS: give the server certificate and key too")
        for token in self.tokens:
            check_token(token)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def check_token(token: str) -> str:
    """A bearer token must be printable ASCII without whitespace, >= MIN_TOKEN_CHARS long.

    Raises:
        ValueError: naming the rule broken, never the token.
    """
    if not _TOKEN_RE.fullmatch(token):
        raise ValueError("an auth token must be printable ASCII without spaces")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"an auth token must have at least {MIN_TOKEN_CHARS} characters")
    return token


def read_tokens(path: str | os.PathLike) -> tuple[str, ...]:
    """Tokens from a file, one per line; blank lines and lines starting with '#' are skipped.

    Raises:
        ValueError: the file holds no token, or a malformed one.
        OSError: the file cannot be read.
    """
    try:
        lines = Path(path).read_bytes().decode("ascii").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: auth tokens must be ASCII") from None
    tokens = tuple(check_token(line.strip()) for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not tokens:
        raise ValueError(f"{path} holds no auth token")
    return tokens


def tokens_from_env(name: str = TOKEN_ENV) -> tuple[str, ...]:
    """Tokens from an environment variable (newline- or comma-separated); () when it is unset."""
    raw = os.environ.get(name, "")
    return tuple(check_token(t.strip()) for t in re.split(r"[,\n]", raw) if t.strip())


def at_least(low: float, kind: type = float, strict: bool = False, finite: bool = False):
    """argparse type of a number of `kind` (int or float) >= `low` (> `low` when `strict`); NaN is
    refused, and infinity too when `finite`. Text that is no `kind` raises ValueError, which argparse
    reports as "invalid float value" (or int), the type's name being `kind`'s.

    Raises:
        argparse.ArgumentTypeError: the number is out of range.
    """
    def parse(text: str):
        number = kind(text)
        if not (number > low if strict else number >= low) or (finite and not math.isfinite(number)):  # NaN fails
            raise argparse.ArgumentTypeError(
                f"must be {'a finite number ' if finite else ''}{'>' if strict else '>='} {low:g}, got {text}")
        return number
    parse.__name__ = kind.__name__
    return parse


def port_number(text: str) -> int:
    """argparse type of a TCP port: an integer in 0..65535 (0: any free port). gRPC would take a
    larger number modulo 65536 and listen on a port nobody asked for.

    Raises:
        argparse.ArgumentTypeError: not an integer, or outside 0..65535.
    """
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} must lie in 0..65535")
    return port


def parse_size(text: str) -> int:
    """'4096', '512K', '64M', '4G' (binary units) -> bytes.

    Raises:
        ValueError: not a positive size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 512K, 64M, 4G)")
    value = float(match.group(1)) * 1024 ** " KMG".index(match.group(2).upper() or " ")
    if value < 1:
        raise ValueError(f"size must be >= 1 byte: {text!r}")
    return int(value)


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 dynamic draft tree (Li et al. 2024, EAGLE-2, §4): at each of `depth` levels expand
    the `top_b` best frontier nodes by joint probability, each into its `top_b` best children;
    verify the `max_nodes` best nodes overall.

    Defaults (depth 2, top-2, 4 nodes) were measured on the project's 2-core CPU with the shipped
    SmolLM2-135M drafters (docs/results.md, "Draft trees on a 2-core CPU"): each tree level costs a drafter
    pass, while these drafters' tokens past depth 2 are rarely accepted. Among 5x4x24, 4x3x12, 4x2x8,
    3x2x6, 5x2x10, 2x3x5, 3x1x3 and 2x2x4 the last was fastest single-device and over the 4g link
    when a 5-position verify cost ~1.6-1.9 decode steps; with prepacked linears (a 5-position verify
    ~1.0-1.1 steps, session 21) 1x4x4, 2x3x6, 2x4x8 and 2x3x9 tie with it within noise and deeper
    trees still lose (docs/benchmarks.md). Stronger drafters (or a GPU server) want deeper, wider
    trees: `--tree-*`.
    """

    depth: int = 2
    top_b: int = 2
    max_nodes: int = 4

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_b < 1 or self.max_nodes < 1:
            raise ValueError(f"tree depth, top_b and max_nodes must be >= 1: {self}")
