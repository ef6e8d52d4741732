"""Who may call the verify service: bearer tokens, TLS and mTLS credentials, client identities.

Every method but the health service needs `authorization: Bearer <token>` metadata when the server
holds tokens. The check is a grpc.aio server interceptor that compares SHA-256 digests of the
presented token with every accepted one in constant time; a refused call gets UNAUTHENTICATED
before its request is even parsed. Tokens are never logged; identities derived from them are
short digests. Refusals are logged aggregated (`RefusalLog`): a flood of unauthenticated calls
writes one line per interval, not one per call.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

import grpc

from splitspec.shared.config import ServerSecurity

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
_SCHEME = "bearer "
REFUSAL_LOG_INTERVAL_S = 60.0


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii", "replace")).digest()


def bearer_token(metadata: Iterable | None) -> str | None:
    """The token of the first `authorization: Bearer <token>` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[:len(_SCHEME)].lower() == _SCHEME:
            return value[len(_SCHEME):].strip()
    return None


def has_authorization(metadata: Iterable | None) -> bool:
    """True if any `authorization` entry is present, whatever its scheme."""
    return any(key == "authorization" for key, _ in metadata or ())


def token_identity(token: str) -> str:
    """A short, non-reversible name for a token (for rate limiting and logs)."""
    return "token:" + hashlib.sha256(b"splitspec-identity:" + token.encode("ascii", "replace")).hexdigest()[:16]


class TokenSet:
    """The accepted bearer tokens, kept only as SHA-256 digests."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._digests = tuple(_digest(t) for t in tokens)
        if not self._digests:
            raise ValueError("a TokenSet needs at least one token")

    @property
    def count(self) -> int:
        return len(self._digests)

    def match(self, presented: str) -> bool:
        """True if `presented` is an accepted token. Time does not depend on which token matched or
        on how much of it did: every digest is compared in full."""
        probe = _digest(presented)
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(probe, digest)
        return found


class RefusalLog:
    """Log lines for refused calls, at most one per `interval_s` seconds.

    The first refusal is logged at once; the ones after it are counted by reason and written as one
    summary line when a refusal arrives `interval_s` or more after the last line. A flood of N
    refusals over T seconds thus writes at most 1 + T / interval_s lines (the counts of a flood's
    tail are written with the next refusal). Not thread-safe: call from the event loop. Lines are
    WARNINGs, seen at serve's default level: an operator could not tell clients refused (a wrong
    token, a full server) from an idle service (QA 58).
    """

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = REFUSAL_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.what, self.interval_s, self.clock = logger, what, interval_s, clock
        self._counts: Counter[str] = Counter()
        self._since: float | None = None  # when the last line was written

    def note(self, reason: str) -> bool:
        """Count one refusal for `reason` (a short fixed phrase, never request data); True when a
        line was written for it."""
        now = self.clock()
        self._counts[reason] += 1
        if self._since is not None and now - self._since < self.interval_s:
            return False
        total = sum(self._counts.values())
        detail = ", ".join(f"{n} {r}" for r, n in sorted(self._counts.items()))
        if self._since is None:
            self.logger.warning("%s refused (%s); further refusals are logged as counts at most every %g s",
                                self.what, detail, self.interval_s)
        else:
            self.logger.warning("%d %ss refused in the last %.0f s (%s)", total, self.what, now - self._since, detail)
        self._counts.clear()
        self._since = now
        return True


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid bearer token with UNAUTHENTICATED; health calls pass.

    `on_refusal(method)` is told of each refusal (metrics); it must not raise. Refusals are logged
    through a `RefusalLog` (`refusal_log`).
    """

    def __init__(self, tokens: TokenSet, on_refusal: Callable[[str], None] | None = None,
                 refusal_log: RefusalLog | None = None) -> None:
        self.tokens = tokens
        self.on_refusal = on_refusal
        self.refusal_log = refusal_log if refusal_log is not None else RefusalLog(log, "unauthenticated call")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        metadata = handler_call_details.invocation_metadata
        presented = bearer_token(metadata)
        if presented is not None and self.tokens.match(presented):
            return handler
        if presented is not None:
            reason, logged = "the bearer token is not accepted", "with a wrong token"
        elif has_authorization(metadata):  # e.g. the bare token: say what is wrong, not "missing"
            reason, logged = ("the 'authorization' metadata does not use the Bearer scheme; "
                              "send 'authorization: Bearer <token>'"), "without the Bearer scheme"
        else:
            reason, logged = "missing 'authorization: Bearer <token>' metadata", "without a token"
        self.refusal_log.note(logged)
        if self.on_refusal is not None:
            self.on_refusal(method)
        return _refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, reason)


def _refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts at once, without parsing the request."""
    async def abort_unary(request, context):
        await context.abort(code, message)

    async def abort_stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers must be

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort_unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream)
    return grpc.unary_unary_rpc_method_handler(abort_unary)


def client_identity(context: grpc.aio.ServicerContext, authenticated: bool) -> str:
    """The key a client is rate-limited by: its bearer token when tokens are checked, else the
    common name of its mTLS certificate, else its network address without the port."""
    if authenticated:
        token = bearer_token(context.invocation_metadata())
        if token is not None:
            return token_identity(token)
    names = (context.auth_context() or {}).get("x509_common_name")
    if names:
        return "cert:" + names[0].decode("utf-8", "replace")
    peer = context.peer() or "unknown"
    host = peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return "peer:" + host


TLS_EXPIRY_WARNING_DAYS = 14  # check_tls warns when a certificate expires sooner than this


def _when(moment) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _subject(cert) -> str:
    return cert.subject.rfc4514_string() or "(empty subject)"


def _load_certificates(pem: bytes, name: str) -> list:
    """The certificates of a PEM bundle. Raises ValueError naming `name`: none can be read."""
    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        certs = []
    if not certs:
        raise ValueError(f"{name}: no PEM certificate can be read from it "
                         "(expected '-----BEGIN CERTIFICATE-----' blocks)")
    return certs


def _validity_problem(cert, now, name: str) -> str | None:
    """Why `cert` is not valid at `now` (a message with its dates), or None."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    span = f"valid from {_when(start)} to {_when(end)}"
    if now > end:
        return f"{name}: the certificate {_subject(cert)!r} expired on {_when(end)} ({span}; now {_when(now)})"
    if now < start:
        return (f"{name}: the certificate {_subject(cert)!r} is not valid yet ({span}; now {_when(now)}; "
                "is this machine's clock right?)")
    return None


def _expiry_warning(cert, now, name: str, warn_days: float) -> str | None:
    import datetime

    end = cert.not_valid_after_utc
    if now <= end < now + datetime.timedelta(days=warn_days):
        left = end - now
        return (f"{name}: the certificate {_subject(cert)!r} expires on {_when(end)}, in "
                f"{left.days} d {left.seconds // 3600} h; renew it before then (clients will refuse it)")
    return None


def check_tls(cert_pem: bytes, key_pem: bytes, client_ca_pem: bytes | None = None, *,
              cert_name: str = "the TLS certificate", key_name: str = "the TLS key",
              ca_name: str = "the TLS client CA", now=None,
              warn_days: float = TLS_EXPIRY_WARNING_DAYS) -> list[str]:
    """Check a server certificate chain, its private key and an optional mTLS client-CA bundle
    before gRPC gets them (gRPC only says "Failed to bind" when they are bad, and accepts an
    expired certificate that every client then refuses). `*_name`: how messages name each input
    (e.g. the flag and file). Returns warnings: a certificate that expires within `warn_days`,
    an expired CA in a bundle that holds a valid one.

    Raises:
        ValueError: naming the input: PEM that holds no certificate or no (unencrypted) private
            key, a key that does not belong to the first certificate of the chain, a certificate
            of the chain that has expired or is not valid yet, a client-CA bundle none of whose
            certificates is valid now.
    """
    import datetime

    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    now = now if now is not None else datetime.datetime.now(datetime.timezone.utc)
    chain = _load_certificates(cert_pem, cert_name)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:  # encrypted: gRPC takes no passphrase
        raise ValueError(f"{key_name}: the private key is encrypted; give it unencrypted "
                         "(e.g. `openssl pkey -in KEY -out KEY.plain`)") from None
    except (ValueError, UnsupportedAlgorithm) as err:
        raise ValueError(f"{key_name}: no PEM private key can be read from it ({str(err).split('. ')[0]})") from None
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*spki) != chain[0].public_key().public_bytes(*spki):
        raise ValueError(f"{key_name} does not match {cert_name}: the key is not the private key of its "
                         f"first certificate, {_subject(chain[0])!r}")
    warnings = []
    for cert in chain:
        problem = _validity_problem(cert, now, cert_name)
        if problem:
            raise ValueError(problem + "; clients would refuse it")
        warnings.append(_expiry_warning(cert, now, cert_name, warn_days))
    if client_ca_pem is not None:
        cas = _load_certificates(client_ca_pem, ca_name)
        problems = [_validity_problem(ca, now, ca_name) for ca in cas]
        if all(problems):
            raise ValueError(problems[0] + "; no client certificate could chain to it")
        warnings += problems
        warnings += [_expiry_warning(ca, now, ca_name, warn_days) for ca in cas]
    return [w for w in warnings if w]


def server_credentials(security: ServerSecurity) -> grpc.ServerCredentials:
    """TLS credentials for `security`; with a client CA, clients must present a certificate
    chaining to it (mTLS). The PEM inputs are checked first (`check_tls`; its warnings are the
    caller's: `splitspec serve` prints them at start-up).

    Raises:
        ValueError: `security` has no TLS certificate; a `check_tls` refusal.
    """
    if not security.tls:
        raise ValueError("no TLS certificate configured")
    check_tls(security.tls_cert, security.tls_key, security.tls_client_ca)
    return grpc.ssl_server_credentials(
        [(security.tls_key, security.tls_cert)], root_certificates=security.tls_client_ca,
        require_client_auth=security.tls_client_ca is not None)
