"""Private spans: the server sees placeholders; a canary in a private span appears in no serialized
outgoing message and in no TCP stream captured on loopback, even when the drafter reproduces it."""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import string
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import torch

from splitspec.client.drafters import Drafter, NgramDrafter, Proposal
from splitspec.client.loop import PRIVATE, TARGET, SpeculativeDecoder
from splitspec.client.privacy import (PrivacyGuard, Segment, encode_private_chat, parse_private_tags,
                                      placeholder_token)
from splitspec.client.transport import RemoteVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.acceptance import SparseProbs
from splitspec.shared.tree import ROOT, DraftTree


def test_parse_private_tags():
    assert parse_private_tags("a <private>b c</private> d") == [Segment("a "), Segment("b c", True), Segment(" d")]
    with pytest.raises(ValueError):
        parse_private_tags("a <private>b")


def test_guard_prune_and_private_run():
    guard = PrivacyGuard((1, 10, 11, 12, 2), (False, True, True, True, False), placeholder=99, ngram=2)
    # root -> 10 -> 11 (a private 2-gram) -> 12 ; root -> 5 ; 10's later sibling 7 dropped with it
    tree = DraftTree((10, 5, 11, 12, 7), (ROOT, ROOT, 0, 2, 0))
    pruned = guard.prune([1, 3], Proposal(tree))
    assert pruned.tree.tokens == (10, 5) and pruned.tree.parents == (ROOT, ROOT)
    assert pruned.drafted is None
    assert guard.prune([1, 3], Proposal(tree, drafted=4)).drafted == 2  # nodes 0-1 kept of the drafter's 0-3
    assert guard.private_run([1, 3], [10, 11, 12, 4]) == 3  # the drafter reproduces the span: write it here
    assert guard.private_run([1, 3], [4, 10, 11]) == 0  # private text later in the path: prune instead
    assert guard.private_run([1, 10], [11, 4]) == 1  # the run started in the context
    strict = PrivacyGuard((1, 10, 2), (False, True, False), placeholder=99, ngram=1)
    assert strict.private_run([1], [10, 4]) == 1


def _row(*pairs) -> SparseProbs:
    return SparseProbs(torch.tensor([t for t, _ in pairs]), torch.tensor([p for _, p in pairs]))


def test_guard_withholds_draft_rows_that_name_private_text():
    """qa-privacy F1: a sampled tree's rows are the drafter's next-token distributions, computed
    from the private text. A row naming a private continuation (after 10, the private bigram
    10 -> 11 at p 0.95) went out even when its child 11 had been pruned; now the row goes with every
    child drawn from it, and rows of childless nodes are not sent."""
    guard = PrivacyGuard((1, 10, 11, 12, 2), (False, True, True, True, False), placeholder=99, ngram=2)
    # root -> 5, root -> 10 (one private token alone: allowed at n = 2) -> 11 (10 -> 11: pruned)
    tree = DraftTree((5, 10, 11), (ROOT, ROOT, 1))
    rows = {ROOT: _row((5, 0.4), (10, 0.6)), 1: _row((11, 0.95), (5, 0.05))}
    pruned = guard.prune([1, 3], Proposal(tree, rows))
    assert pruned.tree.tokens == (5, 10) and set(pruned.draft_probs) == {ROOT}
    # a row naming 11 after 10 cuts every child drawn from it, though the child itself is public
    tree = DraftTree((10, 5), (ROOT, 0))
    rows = {ROOT: _row((10, 1.0)), 0: _row((5, 0.5), (11, 0.5))}
    pruned = guard.prune([1, 3], Proposal(tree, rows))
    assert pruned.tree.tokens == (10,) and set(pruned.draft_probs) == {ROOT}
    # the committed context ends in a private token: the root's row naming its successor goes, the tree with it
    pruned = guard.prune([1, 10], Proposal(DraftTree((5,), (ROOT,)), {ROOT: _row((5, 0.9), (11, 0.1))}))
    assert pruned.tree.size == 0 and not pruned.draft_probs
    assert guard.rows_leak([1, 10], DraftTree((5,), (ROOT,)), {ROOT: _row((11, 1.0))})
    assert not guard.rows_leak([1, 3], DraftTree((5,), (ROOT,)), {ROOT: _row((11, 1.0))})  # 11 alone: n = 2
    # a zero-probability entry names nothing
    assert not guard.names_private([10], _row((11, 0.0), (5, 1.0)))


def test_encode_private_chat_marks_the_span(stories):
    _, tokenizer, _ = stories
    ids, mask = encode_private_chat(tokenizer, [{"role": "user", "content": "My code is <private>zqx 4417</private>."}])
    private_text = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "zqx" in private_text and "4417" in private_text and "code" not in private_text
    plain, plain_mask = encode_private_chat(tokenizer, [{"role": "user", "content": "My code is zqx 4417."}])
    assert plain == ids and not any(plain_mask)  # tags change nothing but the mask


def _masked(tokenizer, messages) -> str:
    ids, mask = encode_private_chat(tokenizer, messages)
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


@pytest.mark.parametrize("name", ["stories", "smollm2"])
def test_private_span_is_masked_where_its_message_is(name, stories, request):
    """A private message whose text also comes earlier in the prompt (a role name, the template's
    default system prompt, an earlier public message) is masked in its own message, and only there:
    a search for the text masked the earlier place and sent the private words in clear."""
    if name == "smollm2":
        from splitspec.shared.models import load_tokenizer

        try:
            tokenizer = load_tokenizer("smollm2-135m")
        except Exception as err:  # noqa: BLE001  the default target not pulled on this machine
            pytest.skip(f"smollm2-135m not available: {err}")
    else:
        tokenizer = stories[1]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                             tokenize=False)
    earlier = [w for w in ("user", "Hugging Face", "assistant") if w in rendered.split("x")[0]]
    chats = [[{"role": "user", "content": "my code is 4711"}, {"role": "assistant", "content": "ok"},
              {"role": "user", "content": "<private>4711</private>"}]]
    chats += [[{"role": "user", "content": f"<private>{w}</private>"}] for w in earlier]
    for chat in chats:
        secret = parse_private_tags(chat[-1]["content"])[0].text
        ids, mask = encode_private_chat(tokenizer, chat)
        assert tokenizer.decode([t for t, m in zip(ids, mask) if m]).strip() == secret
        last = max(k for k, m in enumerate(mask) if m)
        # after the masked tokens comes only what the template writes after the last message's content
        tail = tokenizer.apply_chat_template(chat[:-1] + [{"role": "user", "content": "qqq"}],
                                             add_generation_prompt=True, tokenize=False).split("qqq")[-1]
        assert tokenizer.decode(ids[last + 1:]) == tail
    if name == "smollm2":
        assert {"user", "Hugging Face"} <= set(earlier)  # the collisions the bug report found are exercised
    two = [{"role": "user", "content": "<private>alpha</private> and beta"}, {"role": "assistant", "content": "beta"},
           {"role": "user", "content": "gamma <private>beta</private>"}]
    assert _masked(tokenizer, two).split() == ["alpha", "beta"]


def test_an_answer_may_hold_a_tag_as_text(stories):
    """The model may write "<private>" in an answer; the next turn sends the answer back, and a
    user's unmatched tag is refused while the answer's is text (the client's own tags still count)."""
    tokenizer = stories[1]
    answer = "Write <private> before the secret, then <private>4711</private>."
    chat = [{"role": "user", "content": "How do I mark text?"}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "thanks"}]
    assert parse_private_tags(answer, strict=False)[0] == Segment("Write ")
    ids, mask = encode_private_chat(tokenizer, chat)
    assert "4711" in tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "4711" not in tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    lone = [chat[0], {"role": "assistant", "content": "use a </private> tag"}, chat[2]]
    assert not any(encode_private_chat(tokenizer, lone)[1])
    with pytest.raises(ValueError, match="unmatched"):
        encode_private_chat(tokenizer, [{"role": "user", "content": "use a </private> tag"}])


def test_private_spans_need_a_template_that_copies_contents(stories):
    """A chat template that changes a message's text cannot have private spans placed in it."""
    _, tokenizer, _ = stories
    import copy

    shouting = copy.copy(tokenizer)
    shouting.chat_template = "{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}"
    with pytest.raises(ValueError, match="verbatim"):
        encode_private_chat(shouting, [{"role": "user", "content": "my <private>pin</private>"}])
    ids, mask = encode_private_chat(shouting, [{"role": "user", "content": "no tags here"}])
    assert ids and not any(mask)


class LeakyDrafter(Drafter):
    """Always proposes the secret as its best path next to a harmless branch: the worst case."""

    name = "leaky"

    def __init__(self, secret: list[int], other: int) -> None:
        self.secret, self.other = secret, other

    def reset(self, prompt_ids, features) -> None:
        pass

    def propose(self, context, limits, sampling) -> Proposal:
        depth = min(len(self.secret), limits.max_depth)
        if depth < 1:
            return Proposal(DraftTree.empty())
        return Proposal(DraftTree((*self.secret[:depth], self.other), (ROOT, *range(depth - 1), ROOT)))


class _LeakyOffline(LeakyDrafter):
    """Proposes a public token first (a Verify call the link can lose), then the secret."""

    def __init__(self, secret: list[int], other: int) -> None:
        super().__init__(secret, other)
        self.calls = 0

    def propose(self, context, limits, sampling) -> Proposal:
        self.calls += 1
        return Proposal(DraftTree((self.other,), (ROOT,))) if self.calls == 1 else super().propose(context, limits, sampling)


class Spy(grpc.UnaryUnaryClientInterceptor):
    """Keeps the serialized bytes of every outgoing request."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def intercept_unary_unary(self, continuation, details, request):
        self.sent.append((details.method, request.SerializeToString()))
        return continuation(details, request)


def _packed(ids: list[int]) -> bytes:
    out = bytearray()
    for value in ids:
        while True:
            byte, value = value & 0x7F, value >> 7
            out.append(byte | (0x80 if value else 0))
            if not value:
                break
    return bytes(out)


def _contains_run(haystack: list[int], needle: list[int], n: int) -> bool:
    grams = {tuple(needle[i:i + n]) for i in range(len(needle) - n + 1)}
    return any(tuple(haystack[i:i + n]) in grams for i in range(len(haystack) - n + 1))


def _tcp_streams(pcap: Path) -> dict[tuple, bytes]:
    """Reassembled TCP payloads of a pcap (Ethernet or Linux cooked capture), per direction."""
    data = pcap.read_bytes()
    magic = struct.unpack("<I", data[:4])[0]
    endian = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
    linktype = struct.unpack(endian + "I", data[20:24])[0]
    segments: dict[tuple, dict[int, bytes]] = {}
    offset = 24
    while offset + 16 <= len(data):
        incl = struct.unpack(endian + "I", data[offset + 8:offset + 12])[0]
        frame = data[offset + 16:offset + 16 + incl]
        offset += 16 + incl
        ip = frame[14:] if linktype == 1 else frame[16:] if linktype == 113 else frame[4:] if linktype == 0 else frame
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
            continue
        ihl = (ip[0] & 0xF) * 4
        total = struct.unpack(">H", ip[2:4])[0]
        tcp = ip[ihl:total]
        sport, dport, seq = struct.unpack(">HHI", tcp[:8])
        payload = tcp[(tcp[12] >> 4) * 4:]
        if payload:
            segments.setdefault((sport, dport), {})[seq] = payload
    return {key: b"".join(p for _, p in sorted(parts.items())) for key, parts in segments.items()}


def _wait_for_quiet(path: Path, quiet_s: float = 1.0, limit_s: float = 20.0) -> None:
    """Until the capture file has stopped growing for `quiet_s` (tcpdump is slow on a loaded CPU)."""
    deadline, size, since = time.time() + limit_s, -1, time.time()
    while time.time() < deadline:
        now = path.stat().st_size if path.exists() else 0
        if now != size:
            size, since = now, time.time()
        elif now > 24 and time.time() - since >= quiet_s:
            return
        time.sleep(0.1)


def _start_capture(path: Path, port: int):
    if shutil.which("tcpdump") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "tcpdump"], capture_output=True, timeout=300,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if shutil.which("tcpdump") is None or os.geteuid() != 0:
        return None
    proc = subprocess.Popen(["tcpdump", "-i", "lo", "-U", "-s", "0", "-w", str(path), f"tcp port {port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 10
    while time.time() < deadline and not path.exists():  # tcpdump writes the header once listening
        time.sleep(0.05)
    time.sleep(0.3)
    return proc


@pytest.mark.parametrize("drafter_kind", ["leaky", "ngram"])
def test_canary_never_leaves_the_device(stories, serve, drafter_kind):
    model, tokenizer, model_id = stories
    rng = random.Random(7)
    canary = "".join(rng.choice(string.ascii_lowercase) for _ in range(10))
    content = f"Please repeat my secret word exactly: <private>{canary}</private>. The secret word is"
    ids, mask = encode_private_chat(tokenizer, [{"role": "user", "content": content}])
    secret_ids = [t for t, m in zip(ids, mask) if m]
    assert len(secret_ids) >= 3
    guard = PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(tokenizer))
    server = serve(TargetRunner(model, tokenizer, model_id))
    capture = _start_capture(pcap := Path(tempfile.mkdtemp()) / "lo.pcap", server.port)
    spy = Spy()
    verifier = RemoteVerifier(server.address)
    verifier.channel = grpc.intercept_channel(verifier.channel, spy)
    from splitspec.v1 import verify_pb2_grpc as pb_grpc

    verifier.stub = pb_grpc.VerifyServiceStub(verifier.channel)
    drafter = LeakyDrafter(secret_ids, other=ids[-1]) if drafter_kind == "leaky" else NgramDrafter()
    gen = SpeculativeDecoder(verifier, drafter).generate(ids, 24, stop_on_eos=False, privacy=guard)
    verifier.close()
    if drafter_kind == "leaky":  # the drafter reproduced the secret: written here, marked private
        assert gen.stats.private_tokens >= len(secret_ids) and PRIVATE in gen.sources
        assert canary in tokenizer.decode(gen.tokens)
    assert set(gen.sources) <= {TARGET, PRIVATE}

    from splitspec.v1 import verify_pb2 as pb

    assert spy.sent
    for method, raw in spy.sent:
        assert canary.encode() not in raw and _packed(secret_ids) not in raw
        if method.endswith("OpenSession"):
            msg = pb.OpenSessionRequest.FromString(raw)
            assert not _contains_run(list(msg.prompt_ids), secret_ids, 2)
            assert list(msg.prompt_ids).count(guard.placeholder) >= len(secret_ids)
        elif method.endswith("Verify"):
            msg = pb.VerifyRequest.FromString(raw)
            sent = list(msg.forced_tokens) + list(msg.tree.tokens)
            assert not _contains_run(list(msg.forced_tokens), secret_ids, 1)
            assert not _contains_run(sent, secret_ids, 2)
    if capture is None:
        pytest.skip("tcpdump unavailable (needs root and the Debian package): message spy checked only")
    _wait_for_quiet(pcap)  # SIGINT drops packets tcpdump has not read yet: let it catch up first
    capture.send_signal(signal.SIGINT)
    capture.wait(timeout=10)
    streams = _tcp_streams(pcap)
    assert streams, "the capture saw no TCP payload on the server's port"
    for stream in streams.values():
        assert canary.encode() not in stream and _packed(secret_ids) not in stream


@pytest.mark.parametrize("on_reconnect", ["keep", "heal"])
def test_private_text_written_offline_is_private_from_its_first_token(stories, on_reconnect):
    """qa-privacy F3: offline, a token counted as private only when it completed a private n-gram,
    so the n-gram's first token was labelled offline: --on-reconnect keep then forced it to the
    server in clear, and a chat history kept it outside the `<private>` tags (the next turn's
    prompt sent it). Now every token of a reproduced private n-gram is private, and no private id
    is ever forced or drafted as a run."""
    from splitspec.client.loop import OfflinePolicy

    from .helpers import EventLog, FlakyVerifier

    model, tokenizer, model_id = stories
    canary, content, secret = _canary_turn(tokenizer)
    ids, mask = encode_private_chat(tokenizer, [{"role": "user", "content": content}])
    guard = PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(tokenizer))
    log = EventLog()
    sent: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (forced, tree tokens) of each step
    verifier = FlakyVerifier(TargetRunner(model, tokenizer, model_id), {1: "before"}, down_probes=0,
                             gate=lambda: len(log.tokens) >= 2 * len(secret))
    real_open = verifier.open

    def open_(*args):
        session, opened = real_open(*args)
        real_verify = session.verify

        def verify(tree, draft_probs, forced_tokens=()):
            sent.append((tuple(forced_tokens), tuple(tree.tokens)))
            return real_verify(tree, draft_probs, forced_tokens)

        session.verify = verify
        return session, opened

    verifier.open = open_
    policy = OfflinePolicy(on_reconnect=on_reconnect, backoff_initial_s=0.01, backoff_max_s=0.05)
    drafter = _LeakyOffline(secret, other=ids[-1])  # the link fails on the first call: then it writes the secret
    gen = SpeculativeDecoder(verifier, drafter, policy).generate(ids, 3 * len(secret), stop_on_eos=False,
                                                                 privacy=guard, on_event=log)
    runs = [i for i in range(len(gen.tokens) - len(secret) + 1) if gen.tokens[i:i + len(secret)] == secret]
    assert runs, "the drafter wrote the secret"
    for i in runs:
        assert gen.sources[i:i + len(secret)] == [PRIVATE] * len(secret), gen.sources
    for forced, tree in sent:
        assert not set(forced) & set(secret), (forced, secret)
        assert not _contains_run(list(tree), secret, 2)


def _spied_verifier(address: str) -> tuple[RemoteVerifier, Spy]:
    """A RemoteVerifier whose outgoing requests a Spy keeps."""
    from splitspec.v1 import verify_pb2_grpc as pb_grpc

    spy = Spy()
    verifier = RemoteVerifier(address)
    verifier.channel = grpc.intercept_channel(verifier.channel, spy)
    verifier.stub = pb_grpc.VerifyServiceStub(verifier.channel)
    return verifier, spy


def _sent_text(tokenizer, spy: Spy) -> str:
    """Every token id the spy saw go out (prompts, forced tokens, trees), decoded."""
    from splitspec.v1 import verify_pb2 as pb

    ids: list[int] = []
    for method, raw in spy.sent:
        if method.endswith("OpenSession"):
            ids += pb.OpenSessionRequest.FromString(raw).prompt_ids
        elif method.endswith("Verify"):
            msg = pb.VerifyRequest.FromString(raw)
            ids += [*msg.forced_tokens, *msg.tree.tokens]
    return tokenizer.decode(ids)


def _canary_turn(tokenizer) -> tuple[str, str, list[int]]:
    rng = random.Random(11)
    canary = "".join(rng.choice(string.ascii_lowercase) for _ in range(10))
    content = f"Please repeat my secret word exactly: <private>{canary}</private>. The secret word is"
    ids, mask = encode_private_chat(tokenizer, [{"role": "user", "content": content}])
    return canary, content, [t for t, m in zip(ids, mask) if m]


def test_private_spans_of_an_answer_are_found_and_tagged(stories):
    from splitspec.client.privacy import private_answer_spans, tag_private_answer

    _, tokenizer, _ = stories
    words = [tokenizer.encode(w, add_special_tokens=False) for w in ("Once upon", " a secret", " time")]
    tokens = [t for w in words for t in w]
    sources = ["target"] * len(words[0]) + ["private"] * len(words[1]) + ["target"] * len(words[2])
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    start = len(tokenizer.decode(words[0]))
    end = len(tokenizer.decode(words[0] + words[1]))
    assert private_answer_spans(tokenizer, tokens, sources) == [(start, end)]
    assert tag_private_answer(tokenizer, tokens, sources) == f"{text[:start]}<private>{text[start:end]}</private>{text[end:]}"
    assert private_answer_spans(tokenizer, tokens, sources, text[: start + 2]) == [(start, start + 2)]  # a stop cut it
    assert private_answer_spans(tokenizer, tokens, sources, text[:start]) == []
    assert private_answer_spans(tokenizer, tokens, ["target"] * len(tokens)) == []
    assert private_answer_spans(tokenizer, tokens, sources, "not the answer") == [(0, 14)]  # unplaceable: all of it
    with pytest.raises(ValueError):
        private_answer_spans(tokenizer, tokens, sources[1:])


def test_private_text_in_a_chat_answer_stays_private_in_the_next_turn(stories, serve, tmp_path):
    """The drafter reproduced a private span, so the client wrote it into the answer; the next
    chat turn sends the answer back as part of its prompt, and the span must stay on the device."""
    from types import SimpleNamespace

    from splitspec.client.build import ClientSetup
    from splitspec.client.cli import _chat_turn, _encode
    from splitspec.client.history import ChatHistory
    from splitspec.shared.sampling import SamplingParams

    model, tokenizer, model_id = stories
    canary, content, secret_ids = _canary_turn(tokenizer)
    server = serve(TargetRunner(model, tokenizer, model_id))
    verifier, spy = _spied_verifier(server.address)
    decoder = SpeculativeDecoder(verifier, LeakyDrafter(secret_ids, other=tokenizer.eos_token_id or 0))
    setup = ClientSetup(decoder, tokenizer, SamplingParams(0.0), "split")
    args = SimpleNamespace(max_new_tokens=24, private_ngram=2, system=None)
    history_db = ChatHistory(tmp_path / "chat.sqlite3")
    conversation = history_db.new_conversation(model_id, "leaky")
    turn = [{"role": "user", "content": content}]
    prompt_ids, privacy = _encode(setup, args, turn)
    gen, text = _chat_turn(setup, args, history_db, conversation, content, prompt_ids, privacy, lambda event: None)
    assert PRIVATE in gen.sources and canary in tokenizer.decode(gen.tokens)
    assert canary in text and canary not in re.sub("<private>.*?</private>", "", text, flags=re.DOTALL)
    assert history_db.messages(conversation)[-1]["content"] == text
    assert canary not in _sent_text(tokenizer, spy)

    spy.sent.clear()
    history = turn + [{"role": "assistant", "content": text}, {"role": "user", "content": "Say it once more."}]
    prompt_ids, privacy = _encode(setup, args, history)
    decoder.generate(prompt_ids, 8, setup.sampling, privacy=privacy)
    assert spy.sent and canary not in _sent_text(tokenizer, spy)
    verifier.close()
    history_db.close()


def test_private_text_in_an_api_answer_stays_private_when_sent_back(stories, serve, stories_path):
    """The daemon names the answer's private spans in the returned message; a client that appends
    the message to its history as it came keeps them private in the next request."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from splitspec.client.build import ClientSetup
    from splitspec.client.daemon.cli import DaemonServer, daemon_app
    from splitspec.shared.sampling import SamplingParams

    model, tokenizer, model_id = stories
    canary, content, secret_ids = _canary_turn(tokenizer)
    server = serve(TargetRunner(model, tokenizer, model_id))
    verifier, spy = _spied_verifier(server.address)
    decoder = SpeculativeDecoder(verifier, LeakyDrafter(secret_ids, other=tokenizer.eos_token_id or 0))
    daemon = DaemonServer(daemon_app(ClientSetup(decoder, tokenizer, SamplingParams(0.0), "split"),
                                     str(stories_path)), port=0).start()

    def post(messages):
        reply = httpx.post(f"{daemon.url}/v1/chat/completions", timeout=120, json={
            "model": model_id, "messages": messages, "temperature": 0, "max_tokens": 24})
        assert reply.status_code == 200, reply.text
        return reply.json()

    try:
        turn = [{"role": "user", "content": content}]
        first = post(turn)
        message = first["choices"][0]["message"]
        assert canary in message["content"]
        (start, end), = message["splitspec"]["private_spans"]
        assert canary in message["content"][start:end]
        assert first["splitspec"]["private_spans"] == [[start, end]]
        assert canary not in _sent_text(tokenizer, spy)
        spy.sent.clear()
        second = post(turn + [message, {"role": "user", "content": "Say it once more."}])
        assert second["splitspec"]["private_prompt_tokens"] > first["splitspec"]["private_prompt_tokens"]
        assert spy.sent and canary not in _sent_text(tokenizer, spy)
    finally:
        daemon.stop()
        verifier.close()
