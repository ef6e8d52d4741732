"""Who may call the verify service: bearer tokens, TLS and mTLS credentials, client identities.

Every method but the health service needs `authorization: Bearer <token>` metadata when the server
holds tokens. The check is a grpc.aio server interceptor that compares SHA-256 digests of the
presented token with every accepted one in constant time; a refused call gets UNAUTHENTICATED
before its request is even parsed. Tokens are never logged; identities derived from them are
short digests.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable

import grpc

from splitspec.shared.config import ServerSecurity

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
_SCHEME = "bearer "


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii", "replace")).digest()


def bearer_token(metadata: Iterable | None) -> str | None:
    """The token of the first `authorization: Bearer <token>` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[:len(_SCHEME)].lower() == _SCHEME:
            return value[len(_SCHEME):].strip()
    return None


def token_identity(token: str) -> str:
    """A short, non-reversible name for a token (for rate limiting and logs)."""
    return "token:" + hashlib.sha256(b"splitspec-identity:" + token.encode("ascii", "replace")).hexdigest()[:16]


class TokenSet:
    """The accepted bearer tokens, kept only as SHA-256 digests."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._digests = tuple(_digest(t) for t in tokens)
        if not self._digests:
            raise ValueError("a TokenSet needs at least one token")

    def match(self, presented: str) -> bool:
        """True if `presented` is an accepted token. Time does not depend on which token matched or
        on how much of it did: every digest is compared in full."""
        probe = _digest(presented)
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(probe, digest)
        return found


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid bearer token with UNAUTHENTICATED; health calls pass.

    `on_refusal(method)` is told of each refusal (metrics); it must not raise.
    """

    def __init__(self, tokens: TokenSet, on_refusal: Callable[[str], None] | None = None) -> None:
        self.tokens = tokens
        self.on_refusal = on_refusal

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        presented = bearer_token(handler_call_details.invocation_metadata)
        if presented is not None and self.tokens.match(presented):
            return handler
        reason = ("missing 'authorization: Bearer <token>' metadata" if presented is None
                  else "the bearer token is not accepted")
        log.info("unauthenticated call to %s refused (%s)", method, "no token" if presented is None else "bad token")
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


def server_credentials(security: ServerSecurity) -> grpc.ServerCredentials:
    """TLS credentials for `security`; with a client CA, clients must present a certificate
    chaining to it (mTLS).

    Raises:
        ValueError: `security` has no TLS certificate.
    """
    if not security.tls:
        raise ValueError("no TLS certificate configured")
    return grpc.ssl_server_credentials(
        [(security.tls_key, security.tls_cert)], root_certificates=security.tls_client_ca,
        require_client_auth=security.tls_client_ca is not None)
