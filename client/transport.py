"""The gRPC transport: a `Verifier` backed by the remote verify service (split mode).

Every call carries a deadline; message sizes are counted from the serialized protobufs so the
stats show exactly what crossed the wire (gRPC compression stays off: tensors are zstd inside).
"""
from __future__ import annotations

import time

import grpc
import torch

from splitspec.shared import codec
from splitspec.shared.features import FeatureBatch
from splitspec.v1 import verify_pb2 as pb
from splitspec.v1 import verify_pb2_grpc as pb_grpc

from .verifier import CallStats, OpenResult, ServerInfo, StepResult, Verifier, VerifierSession

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 4 * 2**20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class RemoteVerifier(Verifier):
    """Connects to `address` (HOST:PORT) and reads the server's Info. `timeout_s` is every call's
    deadline, `connect_timeout_s` the wait for the first connection.

    Raises:
        ConnectionError: the server cannot be reached within `timeout_s`.
        grpc.RpcError: the server refused the Info call.
    """

    def __init__(self, address: str, timeout_s: float = 60.0, connect_timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.VerifyServiceStub(self.channel)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError as err:
            self.channel.close()
            raise ConnectionError(f"no verify service reachable at {address} within {connect_timeout_s:g} s") from err
        info = self.stub.Info(pb.InfoRequest(), timeout=timeout_s)
        self.info = ServerInfo(
            model_id=info.model_id, tokenizer_fingerprint=info.tokenizer_fingerprint, vocab_size=info.vocab_size,
            num_layers=info.num_layers, hidden_size=info.hidden_size, max_context=info.max_context,
            max_tree_nodes=info.max_tree_nodes, max_tree_depth=info.max_tree_depth,
            max_draft_support=info.max_draft_support, eos_token_ids=tuple(info.eos_token_ids),
            lsa_ids=tuple(info.lsa_ids))

    def open(self, prompt_ids, sampling, features):
        request = pb.OpenSessionRequest(prompt_ids=prompt_ids, sampling=sampling.to_pb(pb.SamplingParams),
                                        features=features.to_pb(),
                                        tokenizer_fingerprint=self.info.tokenizer_fingerprint)
        reply, stats = _call(self.stub.OpenSession, request, self.timeout_s)
        session = _RemoteSession(self, reply.session_id)
        return session, OpenResult(reply.first_token, FeatureBatch.from_pb(reply.features), stats)

    def close(self) -> None:
        self.channel.close()


class _RemoteSession(VerifierSession):
    def __init__(self, verifier: RemoteVerifier, session_id: bytes) -> None:
        self.verifier = verifier
        self.session_id = session_id
        self.step = 0

    def verify(self, tree, draft_probs):
        request = pb.VerifyRequest(session_id=self.session_id, step=self.step + 1,
                                   tree=pb.DraftTree(tokens=tree.tokens, parents=tree.parents))
        if draft_probs:
            request.draft_probs.CopyFrom(encode_draft_probs(draft_probs))
        reply, stats = _call(self.verifier.stub.Verify, request, self.verifier.timeout_s)
        self.step += 1
        return StepResult(tuple(reply.accepted_tokens), reply.bonus_token, reply.bonus_recovered,
                          FeatureBatch.from_pb(reply.features), stats)

    def close(self) -> None:
        try:
            self.verifier.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id), timeout=5.0)
        except grpc.RpcError:
            pass  # the server drops idle sessions itself


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


def _call(method, request, timeout_s: float):
    start = time.perf_counter()
    reply = method(request, timeout=timeout_s)
    rtt_ms = (time.perf_counter() - start) * 1e3
    t = reply.timings
    return reply, CallStats(rtt_ms, t.total_ms, t.forward_ms, request.ByteSize(), reply.ByteSize())
