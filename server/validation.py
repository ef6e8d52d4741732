"""Request validation: everything a client sends is checked here, before any model work.

Each check raises `ServiceError` with the gRPC status code the client gets: INVALID_ARGUMENT for a
malformed request, RESOURCE_EXHAUSTED for a request over a limit, FAILED_PRECONDITION for a step
out of order or a tokenizer mismatch. A repeated field is counted against its limit before it is
copied into Python objects: a 4 MiB request's million token ids become ~50 MB of Python ints, and
refusing them after the copy let 256 pending calls take the server from 1.5 to 8 GB (session 56).
"""
from __future__ import annotations

import math

import grpc
import torch

from splitspec.shared import codec
from splitspec.shared.acceptance import SparseProbs
from splitspec.shared.config import MAX_ABANDONED_OPENS, OPEN_ID_BYTES, ServerLimits
from splitspec.shared.features import FeatureRequest
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import DraftTree, TreeError, TreeLimitError, validate_tree
from splitspec.v1 import verify_pb2 as pb


class ServiceError(Exception):
    """A refusal with its gRPC status code and a short message (no stack trace reaches the client).
    `retry_after_s`: when the client may try again (sent as `grpc-retry-pushback-ms` trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


MAX_LSA_ID_CHARS = 128


def check_open(request: pb.OpenSessionRequest, *, fingerprint: str, vocab_size: int, num_layers: int,
               limits: ServerLimits, max_context: int, lsa_ids=()) -> tuple[list[int], SamplingParams, FeatureRequest]:
    """Validate an OpenSession request; returns (prompt ids, sampling params, feature request).

    Raises:
        ServiceError: FAILED_PRECONDITION (another tokenizer fingerprint; an LSA this server does not
            host), RESOURCE_EXHAUSTED (a prompt over `max_prompt_tokens` or leaving no room in the
            context), INVALID_ARGUMENT (an empty prompt, token ids outside the vocabulary, sampling
            parameters, feature layers, quantization or codec, open names over OPEN_ID_BYTES or more
            than MAX_ABANDONED_OPENS of them).
    """
    if request.tokenizer_fingerprint != fingerprint:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                           "the client's tokenizer fingerprint differs from this server's target: the server's "
                           "target is not the model the client was built for (it changed since the client "
                           "connected?); restart the client")
    if len(request.open_id) > OPEN_ID_BYTES or len(request.abandoned_opens) > MAX_ABANDONED_OPENS or any(
            len(name) > OPEN_ID_BYTES for name in request.abandoned_opens):
        raise invalid(f"open_id and abandoned_opens hold names of at most {OPEN_ID_BYTES} bytes, at most "
                      f"{MAX_ABANDONED_OPENS} abandoned")
    if not request.prompt_ids:
        raise invalid("prompt_ids is empty")
    if len(request.prompt_ids) > limits.max_prompt_tokens:  # counted before copied (module docstring)
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"prompt has {len(request.prompt_ids)} tokens; the limit is {limits.max_prompt_tokens}")
    prompt = list(request.prompt_ids)
    if len(prompt) + 1 > max_context:
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"prompt of {len(prompt)} tokens leaves no room in the {max_context}-token context")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid(f"prompt token id {bad} outside [0, {vocab_size})")
    s = request.sampling
    if not all(math.isfinite(v) for v in (s.temperature, s.top_p)):
        raise invalid("sampling parameters must be finite")
    try:
        sampling = SamplingParams.from_pb(s)
    except ValueError as err:
        raise invalid(str(err)) from err
    features = FeatureRequest.from_pb(request.features)
    for layer in features.hidden_layers:
        if not -1 <= layer <= num_layers:
            raise invalid(f"hidden layer {layer} outside [-1, {num_layers}]")
    for layer in features.kv_layers:
        if not 0 <= layer < num_layers:
            raise invalid(f"kv layer {layer} outside [0, {num_layers})")
    hidden = [num_layers if layer == -1 else layer for layer in features.hidden_layers]  # -1 and L: one tensor
    if len(set(hidden)) != len(hidden) or len(set(features.kv_layers)) != len(features.kv_layers):
        raise invalid(f"feature layers must not repeat (hidden layer -1 is layer {num_layers}, the last)")
    if features.quantization not in (pb.QUANTIZATION_NONE, pb.QUANTIZATION_INT8, pb.QUANTIZATION_FP8_E4M3):
        raise invalid(f"unknown feature quantization {features.quantization}")
    if len(features.lsa_id) > MAX_LSA_ID_CHARS:
        raise invalid(f"lsa_id has {len(features.lsa_id)} characters; the limit is {MAX_LSA_ID_CHARS}")
    if features.lsa_id and features.lsa_id not in lsa_ids:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"this server does not host LSA {features.lsa_id!r}; it hosts {sorted(lsa_ids)}")
    if features.codec not in (pb.CODEC_NONE, pb.CODEC_ZSTD):
        raise invalid(f"unknown feature codec {features.codec}")
    return prompt, sampling, features


def check_tree(request: pb.VerifyRequest, *, vocab_size: int, limits: ServerLimits) -> DraftTree:
    """Validate the draft tree of a Verify request against the limits.

    Raises:
        ServiceError: RESOURCE_EXHAUSTED over `max_tree_nodes` or `max_tree_depth` (`TreeLimitError`),
            INVALID_ARGUMENT for a malformed tree (any other `TreeError`).
    """
    tokens, parents = request.tree.tokens, request.tree.parents  # counted before copied (module docstring)
    try:
        validate_tree(tokens, parents, vocab_size=vocab_size, max_nodes=limits.max_tree_nodes,
                      max_depth=limits.max_tree_depth)
    except TreeLimitError as err:
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)) from err
    except TreeError as err:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
    return DraftTree(tuple(tokens), tuple(parents))


def check_forced(request: pb.VerifyRequest, *, vocab_size: int, limits: ServerLimits) -> tuple[int, ...]:
    """Validate a Verify request's forced tokens (at most max_prompt_tokens ids below the vocab size).

    Raises:
        ServiceError: RESOURCE_EXHAUSTED (too many), INVALID_ARGUMENT (an id outside the vocabulary).
    """
    if len(request.forced_tokens) > limits.max_prompt_tokens:  # counted before copied (module docstring)
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{len(request.forced_tokens)} forced tokens exceed the limit of {limits.max_prompt_tokens}")
    forced = tuple(request.forced_tokens)
    if any(t < 0 or t >= vocab_size for t in forced):
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"forced token ids must lie in [0, {vocab_size})")
    return forced


def check_context(context_len: int, new_positions: int, max_context: int) -> None:
    """The cached context plus the positions a step's forward adds (its pending token or forced
    tokens, and the tree; see `step_positions`) must fit the session's context.

    Raises:
        ServiceError: RESOURCE_EXHAUSTED when they do not.
    """
    if context_len + new_positions > max_context:
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"context {context_len} + {new_positions} new positions (pending or forced tokens and "
                           f"tree nodes) exceeds {max_context}")


def step_positions(tree: DraftTree, forced: tuple[int, ...]) -> int:
    """Positions one Verify forward adds to the cache at its peak: the forced tokens (or the pending
    token) and every tree node."""
    return max(len(forced), 1) + tree.size


def check_draft_probs(msg: pb.DraftProbs, tree: DraftTree, *, vocab_size: int,
                      limits: ServerLimits) -> dict[int, SparseProbs]:
    """Decode and validate the proposal rows of a sampled step.

    Each row must name the root or a tree node, at most once; the tensors' declared dtypes and
    shapes ([R, S] with R = len(rows) <= N + 1 and S <= limits.max_draft_support) are checked
    before anything is decompressed, so decoding allocates at most R x S elements per tensor; ids in
    range; probabilities finite, >= 0, summing to 1 within 1e-3; every child of the row's node must
    have positive probability and siblings must differ (they were drawn without replacement).
    CPU work grows with R x V (each row is made dense): the servicer runs this off the event loop.

    Raises:
        ServiceError: INVALID_ARGUMENT for a malformed message, RESOURCE_EXHAUSTED for rows wider
            than max_draft_support.
    """
    rows = list(msg.rows)
    if not rows:
        return {}
    if len(set(rows)) != len(rows) or any(not -1 <= r < tree.size for r in rows):
        raise invalid("draft_probs rows must be distinct node indices in [-1, N)")
    width = _declared_width(msg, len(rows), limits.max_draft_support)
    try:
        ids = codec.decode(msg.token_ids, max_numel=len(rows) * width)
        probs = codec.decode(msg.probs, max_numel=len(rows) * width)
    except codec.CodecError as err:
        raise invalid(f"draft_probs: {err}") from err
    if ids.dtype != torch.int32 or probs.dtype != torch.float32:
        raise invalid("draft_probs: token_ids must be int32 and probs float32")
    if ids.dim() != 2 or ids.shape != probs.shape or ids.shape[0] != len(rows):
        raise invalid(f"draft_probs: shapes {codec.describe_shape(ids.shape)} / {codec.describe_shape(probs.shape)} do not match "
                      f"{len(rows)} rows")
    if ((ids < 0) | (ids >= vocab_size)).any():
        raise invalid(f"draft_probs: token id outside [0, {vocab_size})")
    if not torch.isfinite(probs).all() or (probs < 0).any():
        raise invalid("draft_probs: probabilities must be finite and >= 0")
    if ((probs.sum(-1) - 1).abs() > 1e-3).any():
        raise invalid("draft_probs: each row must sum to 1")
    out = {}
    for r, row_ids, row_probs in zip(rows, ids, probs):
        row = SparseProbs(row_ids.long(), row_probs)
        dense = row.dense(vocab_size)
        children = [tree.tokens[c] for c in tree.children(r)]
        if len(set(children)) != len(children):
            raise invalid(f"children of node {r} repeat a token; siblings are drawn without replacement")
        if any(dense[t] <= 0 for t in children):
            raise invalid(f"a child of node {r} has zero draft probability")
        out[r] = row
    return out


def _declared_width(msg: pb.DraftProbs, rows: int, max_width: int) -> int:
    """S of the [R, S] tensors, read from their declared dtypes and shapes (nothing decoded yet).

    Raises:
        ServiceError: INVALID_ARGUMENT for a wrong dtype or shape, RESOURCE_EXHAUSTED for S > max_width.
    """
    if msg.token_ids.dtype != pb.DTYPE_INT32 or msg.probs.dtype != pb.DTYPE_FLOAT32:
        raise invalid("draft_probs: token_ids must be int32 and probs float32")
    shapes = tuple(msg.token_ids.shape), tuple(msg.probs.shape)
    for shape in shapes:
        if len(shape) != 2 or shape[0] != rows or shape[1] < 0:
            raise invalid(f"draft_probs: shapes {codec.describe_shape(shapes[0])} / {codec.describe_shape(shapes[1])} do not match "
                          f"{rows} rows")
        if shape[1] > max_width:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"draft_probs rows hold {shape[1]} entries; the limit is {max_width}")
    if shapes[0] != shapes[1]:
        raise invalid(f"draft_probs: shapes {codec.describe_shape(shapes[0])} / {codec.describe_shape(shapes[1])} differ")
    return shapes[0][1]
