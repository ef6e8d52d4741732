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
    user's unmatched tag is refused while the answer's is read failing closed: no tag the model
    wrote can end a span early (QA 57: a literal </private> in a private span sent the rest in
    clear), so an unmatched opening tag makes the rest private and a stray closing tag the text
    before it."""
    tokenizer = stories[1]
    answer = "Write <private> before the secret, then <private>4711</private>."
    chat = [{"role": "user", "content": "How do I mark text?"}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "thanks"}]
    assert parse_private_tags(answer, strict=False) == [Segment("Write "),
                                                         Segment(" before the secret, then 4711.", True)]
    ids, mask = encode_private_chat(tokenizer, chat)
    assert "4711" in tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "4711" not in tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert parse_private_tags("use a </private> tag", strict=False) == [Segment("use a ", True), Segment(" tag")]
    wrapped = "<private>Close it with </private>. Your card is 4929-7731.</private>"  # a span around a literal tag
    assert parse_private_tags(wrapped, strict=False) == [Segment("Close it with . Your card is 4929-7731.", True)]
    lone = [chat[0], {"role": "assistant", "content": wrapped}, chat[2]]
    ids, mask = encode_private_chat(tokenizer, lone)
    assert "4929" not in tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    with pytest.raises(ValueError, match="unmatched"):
        encode_private_chat(tokenizer, [{"role": "user", "content": "use a </private> tag"}])


def test_tags_are_read_in_any_case_and_spacing():
    """QA 57 finding 5: `<PRIVATE>` and `<private >` were plain text, sent to the server in clear."""
    for text in ("My password is <PRIVATE>hunterzebra99</PRIVATE>.", "My password is <private >hunterzebra99</ private>.",
                 "My password is < Private>hunterzebra99</PRIVATE >."):
        assert parse_private_tags(text) == [Segment("My password is "), Segment("hunterzebra99", True), Segment(".")]
    with pytest.raises(ValueError, match="unmatched"):
        parse_private_tags("a <PRIVATE>b")
    assert parse_private_tags("<privately> and <private-ish>") == [Segment("<privately> and <private-ish>")]


def test_untagged_text_with_spans_beside_tags():
    from splitspec.client.privacy import untagged

    assert untagged("My PIN is 4711, ok", spans=[(10, 14)]) == ("My PIN is 4711, ok", [(10, 14)])
    # spans count the tags' characters; spans and tags together, and one that overlaps a tag
    assert untagged("My PIN is <private>4711</private>, zip 99", spans=[(39, 41)]) == \
        ("My PIN is 4711, zip 99", [(10, 14), (20, 22)])
    assert untagged("a <private>b</private> c", spans=[(0, 12)]) == ("a b c", [(0, 3)])
    assert untagged("<private>x", strict=False, spans=[(0, 10)]) == ("x", [(0, 1)])
    with pytest.raises(ValueError, match="unmatched"):
        untagged("<private>x", spans=[(0, 10)])
    assert untagged("") == ("", [])


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

    def open_(*args, **kwargs):
        session, opened = real_open(*args, **kwargs)
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
    import io
    from types import SimpleNamespace

    from splitspec.client.build import ClientSetup
    from splitspec.client.cli import _chat_turn, _encode
    from splitspec.client.history import ChatHistory
    from splitspec.client.stream import TextStream
    from splitspec.shared.sampling import SamplingParams

    model, tokenizer, model_id = stories
    canary, content, secret_ids = _canary_turn(tokenizer)
    server = serve(TargetRunner(model, tokenizer, model_id))
    verifier, spy = _spied_verifier(server.address)
    decoder = SpeculativeDecoder(verifier, LeakyDrafter(secret_ids, other=tokenizer.eos_token_id or 0))
    setup = ClientSetup(decoder, tokenizer, SamplingParams(0.0), "split")
    args = SimpleNamespace(max_new_tokens=24, private_ngram=2, system=None, seed=0)
    history_db = ChatHistory(tmp_path / "chat.sqlite3")
    conversation = history_db.new_conversation(model_id, "leaky")
    turn = [{"role": "user", "content": content}]
    prompt_ids, privacy = _encode(setup, args, turn)
    gen, text = _chat_turn(setup, args, history_db, conversation, content, prompt_ids, privacy,
                           TextStream(tokenizer, io.StringIO()))
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


# --- the text rule (qa-privacy F2): private words in another tokenization --------------------------

_VOCAB = {0: "<s>", 1: " My", 2: " pass", 3: " is", 4: " hunter", 5: "2", 6: " Hunter", 7: "hun", 8: "ter",
          9: " the", 10: " Z", 11: "orb", 12: "lax", 13: " ZOR", 14: "BL", 15: "AX", 16: ".", 17: " cat",
          18: "\n", 19: " a", 20: " fun", 30: "東京", 31: "タワー", 32: "私は東", 33: "京タワ", 34: "ー", 35: ". T",
          36: "HE", 99: " _"}


def _toy_decode(ids) -> str:
    return "".join(_VOCAB[i] for i in ids)


def _toy_guards(ngram: int = 2) -> tuple[list[int], PrivacyGuard, PrivacyGuard]:
    """(prompt "<s> My pass is[ hunter2]. the cat is[ Zorblax].\\n", the id rule alone, id + text rule)."""
    prompt = [0, 1, 2, 3, 4, 5, 16, 9, 17, 3, 10, 11, 12, 16, 18]
    mask = [i in (4, 5, 10, 11, 12) for i in range(len(prompt))]
    return (prompt, PrivacyGuard(tuple(prompt), tuple(mask), placeholder=99, ngram=ngram),
            PrivacyGuard(tuple(prompt), tuple(mask), placeholder=99, ngram=ngram, decode=_toy_decode))


def test_text_rule_catches_private_words_in_other_tokens():
    """The id rule misses " Hunter"+"2" for a private " hunter"+"2", and " ZOR"+"BL" for " Z"+"orb"+"lax";
    the text rule (the tokenizer's decode given) prunes the token completing the private phrase and
    withholds rows naming it, but writes no best path locally for it (`private_run` follows the id
    rule alone: what it writes is unverified); what a public context already says does not block
    what follows it."""
    prompt, ids_only, guard = _toy_guards()
    context = prompt + [19]  # the answer so far: " a"; the private span itself is in the context's tail
    # " Hunter2", "\nhunter2", " ZORBLAX" ("zorb", then "zorblax"): which tokens complete a private phrase
    variants = {(6, 5): [False, True], (18, 7, 8, 5): [False, False, False, True], (13, 14, 15): [False, True, True]}
    for path, hits in variants.items():
        proposal = Proposal(DraftTree.chain(path))
        assert ids_only.prune(context, proposal) is proposal  # the gap: other ids, the same words
        assert not any(ids_only.completes(context + list(path[:i + 1])) for i in range(len(path)))
        assert guard.prune(context, proposal).tree.tokens == path[:hits.index(True)]
        assert [guard.completes(context + list(path[:i + 1])) for i in range(len(path))] == hits  # offline's test
    # root -> " Hunter" -> "2" (completes "hunter2") ; root -> " the": the private word's branch is cut
    pruned = guard.prune(context, Proposal(DraftTree((6, 5, 9), (ROOT, 0, ROOT))))
    assert pruned.tree.tokens == (6, 9) and pruned.tree.parents == (ROOT, ROOT)
    # the best path: written locally for the private ids only; a text match is pruned (lossless) instead
    assert guard.private_run(context, [4, 5, 19]) == 2 == ids_only.private_run(context, [4, 5, 19])
    # " Hunter2", " ZORBL" ("zorb" by the 2nd token), "\nhunter2"
    for path in ([6, 5, 19], [13, 14, 19], [18, 7, 8, 5]):
        assert guard.private_run(context, path) == 0 == ids_only.private_run(context, path)
        assert guard.prune(context, Proposal(DraftTree.chain(path))).tree.size < len(path)
    # rows: after " Hunter", a row giving weight to "2" names the private phrase
    row = _row((5, 0.3), (9, 0.7))
    assert guard.names_private(context + [6], row) and not ids_only.names_private(context + [6], row)
    assert not guard.names_private(context + [9], row)  # " the2": no phrase
    tree = DraftTree((9,), (ROOT,))
    assert guard.rows_leak(context + [6], tree, {ROOT: row})
    assert not ids_only.rows_leak(context + [6], tree, {ROOT: row})
    pruned = guard.prune(context + [13], Proposal(tree, {ROOT: _row((9, 0.5), (14, 0.5))}))  # " ZOR" then "BL"
    assert pruned.tree.size == 0 and not pruned.draft_probs
    assert ids_only.prune(context + [13], Proposal(tree, {ROOT: _row((9, 0.5), (14, 0.5))})).tree.size == 1
    # public text holding the phrase: what follows it is drafted; writing the phrase again is not
    public = prompt + [1, 6, 5]  # " My Hunter2" committed (the target wrote it)
    proposal = Proposal(DraftTree.chain([3, 19, 20]), {ROOT: _row((3, 1.0)), 0: _row((19, 1.0))})
    assert guard.prune(public, proposal) is proposal and guard.private_run(public, [3, 19, 20]) == 0
    assert guard.prune(public, Proposal(DraftTree.chain([3, 6, 5]))).tree.tokens == (3, 6)


def test_text_rule_phrases_and_decode_none():
    """Phrases are the private n-grams' texts, case-folded and stripped, of 3 letters or digits or more, and
    for a gram starting inside a word, the text from the word's start through the gram ("orb"+"lax"
    of " Z"+"orb"+"lax": "zorblax"); without decode the guard is the id rule alone, unchanged."""
    prompt, ids_only, guard = _toy_guards()
    assert set(guard._phrases) == {"hunter2", "zorb", "orblax", "zorblax"}
    short = PrivacyGuard((0, 16, 18, 19), (False, True, True, False), placeholder=99, decode=_toy_decode)
    assert not short._phrases  # ".\n" -> "." is too short
    assert short.prune([0, 1], Proposal(DraftTree.chain([16, 18]))).tree.tokens == (16,)  # the id rule still
    assert PrivacyGuard((0, 9, 16), (False, True, True), placeholder=99, decode=_toy_decode)._phrases == ("the.",)
    assert not PrivacyGuard((0, 16, 19), (False, True, True), placeholder=99, decode=_toy_decode)._phrases  # ". a"
    unigram = _toy_guards(ngram=1)[2]
    assert {"hunter", "orb", "lax"} <= set(unigram._phrases) and "2" not in unigram._phrases
    assert unigram.prune(prompt, Proposal(DraftTree.chain([6, 19]))).tree.size == 0  # n = 1: " Hunter" is private text
    assert unigram.private_run(prompt, [6, 19]) == 0 and unigram.private_run(prompt, [4, 19]) == 1  # ids alone
    none = PrivacyGuard(ids_only.prompt_ids, ids_only.mask, placeholder=99, decode=None)
    assert none == ids_only and guard == ids_only  # decode is no part of a guard's identity
    for path in ((6, 5), (7, 8, 5), (13, 14, 15), (4, 5)):
        proposal = Proposal(DraftTree.chain(path))
        assert none.prune(prompt, proposal).tree.tokens == ids_only.prune(prompt, proposal).tree.tokens
        assert none.private_run(prompt, list(path)) == ids_only.private_run(prompt, list(path))
    assert guard.prune(prompt, Proposal(DraftTree.chain([6, 5]))).tree.size == 1


def _tokenizer(name: str, stories):
    if name == "stories":
        return stories[1]
    from splitspec.shared.models import load_tokenizer

    try:
        return load_tokenizer("smollm2-135m")
    except Exception as err:  # noqa: BLE001  the default target not pulled on this machine
        pytest.skip(f"smollm2-135m not available: {err}")


# variants of a private " hunter2" / " Zorblax" the id rule misses in each tokenizer (other ids)
_VARIANTS = {"stories": [" HUNTER2", "ZORBLAX", " ZOR"],
             "smollm2": [" Hunter2", "hunter2", " HUNTER2", " ZOR", "ZORBLAX", " Zorb"]}
_SECRET_CHAT = [{"role": "user", "content": "My password is <private>hunter2</private> and my cat is "
                                            "<private>Zorblax</private>."}]


@pytest.mark.parametrize("name", ["stories", "smollm2"])
def test_text_rule_with_real_tokenizers(name, stories):
    """qa-privacy F2 with real tokenizers: capitalised, upper-case, space-less spellings of a private
    "hunter2" or "Zorblax" are other token ids; the text rule prunes the token completing the private
    word (its text never reaches the server), withholds a row naming it, and leaves public text alone."""
    tokenizer = _tokenizer(name, stories)

    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False)

    ids, mask = encode_private_chat(tokenizer, _SECRET_CHAT)
    ids_only = PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(tokenizer))
    guard = PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(tokenizer), decode=tokenizer.decode)
    context = ids + enc("Sure, it is:\n")  # a word starts after it (the space-less variants too)
    other = enc(" the")[-1]
    for variant in _VARIANTS[name]:
        path = enc(variant)
        secret = "hunter2" if "hunter" in variant.lower() else "zor"
        assert secret in tokenizer.decode(path).casefold()
        proposal = Proposal(DraftTree((*path, other), (ROOT, *range(len(path) - 1), ROOT)))  # the word | " the"
        assert ids_only.prune(context, proposal) is proposal, variant  # the gap the text rule closes
        pruned = guard.prune(context, proposal)
        kept = [t for t, p in zip(pruned.tree.tokens, pruned.tree.parents) if t != other or p != ROOT]
        assert kept == path[:len(kept)] and len(kept) < len(path), variant
        assert secret not in tokenizer.decode(kept).casefold(), variant
        assert other in pruned.tree.tokens  # the public branch stays
        row = _row((path[len(kept)], 0.5), (other, 0.5))  # the next token of the word, at p 0.5
        assert guard.names_private(context + kept, row), variant
        assert not ids_only.names_private(context + kept, row)
        assert guard.completes(context + path[:len(kept) + 1]) and not ids_only.completes(context + path)
    # the same words in public text (the answer so far): what follows them is drafted as usual
    public = context + enc(" like the game Hunter2 or Zorblax")
    after = enc(" and I like it")
    proposal = Proposal(DraftTree.chain(after))
    assert guard.prune(public, proposal) is proposal and guard.private_run(public, after) == 0


def test_text_rule_counts_phrases_at_word_starts_only(stories):
    """An occurrence of a private phrase counts where it starts a word: after a character that is no
    letter or digit, at the text's start, or when the phrase itself starts with no letter or digit.
    Inside a public word it does not ("baker," holds "aker," of a private "Whitaker,"; "ishunter2"
    holds "hunter2"), so public answers lose no drafted nodes and no offline text to it."""
    prompt, ids_only, guard = _toy_guards()
    assert guard.completes([18, 7, 8, 5]) and guard.completes([7, 8, 5])  # "\nhunter2"; the text's start
    assert guard.completes([19, 16, 6, 5])  # " a. Hunter2"
    mid = prompt + [3, 7, 8, 5]  # " is"+"hun"+"ter"+"2": "ishunter2"
    assert not any(guard.completes(mid[:len(prompt) + i]) for i in range(1, 5))
    proposal = Proposal(DraftTree.chain([7, 8, 5]), {ROOT: _row((7, 1.0)), 0: _row((8, 1.0)), 1: _row((5, 1.0))})
    assert guard.prune(prompt + [3], proposal) is proposal
    assert guard.prune(prompt + [18], proposal).tree.tokens == (7, 8)  # after "\n" it is a word
    # a phrase starting with punctuation counts after a letter: ". the" of a private ". the"
    dot = PrivacyGuard((0, 16, 9, 17), (False, True, True, False), placeholder=99, decode=_toy_decode)
    assert dot._phrases == (". the",) and dot.completes([0, 17, 35, 36])  # " cat. THE"
    assert not dot.completes([0, 17, 35]) and not PrivacyGuard(dot.prompt_ids, dot.mask, 99).completes([0, 17, 35, 36])
    # scripts without spaces: any character may start a word ("私は東京タワー" holds a private "東京タワー")
    cjk = PrivacyGuard((0, 30, 31, 16), (False, True, True, False), placeholder=99, decode=_toy_decode)
    assert cjk._phrases == ("東京タワー",)
    assert [cjk.completes([0, 32, 33, 34][:i + 1]) for i in range(4)] == [False, False, False, True]
    # SmolLM2: " Whit"+"aker"+"," makes the phrase "aker,", which " Baker," holds inside its word
    tokenizer = _tokenizer("smollm2", stories)

    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False)

    ids, mask = encode_private_chat(tokenizer, [{"role": "user", "content": (
        "I am <private>John Whitaker, 42 Maple Street</private>.")}])
    guard = PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(tokenizer), decode=tokenizer.decode)
    assert "aker," in guard._phrases
    context = ids + enc("Sure! The recipe:\n")
    public = enc(" Ask the baker, then the maker, please")
    assert not any(guard.completes(context + public[:i + 1]) for i in range(len(public)))
    assert guard.prune(context, Proposal(DraftTree.chain(public))).tree.tokens == tuple(public)
    for variant in (" WHITAKER,", " Mr Whitaker, of", " john whitaker"):
        path = enc(variant)
        assert any(guard.completes(context + path[:i + 1]) for i in range(len(path))), variant
        assert guard.prune(context, Proposal(DraftTree.chain(path))).tree.size < len(path), variant


def test_cli_and_daemon_guards_use_the_tokenizers_text(stories):
    """`splitspec chat`/`generate` and the daemon build their guards with the tokenizer's decode."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from splitspec.client.cli import _encode
    from splitspec.client.daemon.engine import Engine, EngineConfig
    from splitspec.client.daemon.schema import Completion

    tokenizer = stories[1]
    variant = tokenizer.encode(" HUNTER2", add_special_tokens=False)  # ids no private n-gram holds
    setup = SimpleNamespace(tokenizer=tokenizer, decoder=SimpleNamespace(
        verifier=SimpleNamespace(info=SimpleNamespace(max_context=512, max_prompt_tokens=None))))
    ids, cli_guard = _encode(setup, SimpleNamespace(private_ngram=2), _SECRET_CHAT)
    worker = ThreadPoolExecutor(1)
    try:
        engine = Engine(setup, EngineConfig(("m",)), worker=worker)
        completion = Completion(model="m", messages=_SECRET_CHAT, stream=False, include_usage=False,
                                temperature=None, top_p=None, max_tokens=None, stop=(), seed=None)
        daemon_ids, daemon_guard, _ = engine.prepare(completion)
    finally:
        worker.shutdown()
    assert daemon_ids == ids
    for guard in (cli_guard, daemon_guard):
        pruned = guard.prune(ids, Proposal(DraftTree.chain(variant)))
        assert pruned.tree.size < len(variant) and "hunter2" not in tokenizer.decode(pruned.tree.tokens).casefold()


@pytest.mark.parametrize("name", ["stories", "smollm2"])
def test_text_rule_row_screen_skips_no_completing_token(name, stories):
    """Rows are screened by each token's own text before their tokens are decoded in context: over
    the vocabulary (every 7th token for SmolLM2), a single-token row names private text exactly when
    its token completes a private phrase (`completes`, which decodes every token in context)."""
    tokenizer = _tokenizer(name, stories)
    ids, mask = encode_private_chat(tokenizer, [{"role": "user", "content": (
        "My password is <private>hunter2</private>, my cat is <private>Zorblax</private>, I live at "
        "<private>22B Baker Street, Zürich</private>, <private>naïve café</private>.")}])
    ids_only = PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(tokenizer))
    guard = PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(tokenizer), decode=tokenizer.decode)
    tokens = range(0, len(tokenizer), 1 if name == "stories" else 7)
    found = 0
    for text in ("Sure, it is HUNTE", "The cat ZO", "at 22b BAKER", "in Zür", "naïve CAF", "Once upon a time"):
        context = ids + tokenizer.encode(text, add_special_tokens=False)
        for token in tokens:
            row = _row((token, 1.0))
            hit = guard.completes(context + [token])
            assert guard.names_private(context, row) == hit, (text, token, tokenizer.decode([token]))
            found += hit and not ids_only.completes(context + [token])
    assert found >= 5  # tokens only the text rule catches


def test_private_word_in_other_tokens_never_reaches_the_server(stories, serve):
    """End to end: a drafter proposing a private "hunter2" as " HUNTER2" (ids no private n-gram holds)
    sends no Verify whose tree spells a private phrase of it; the id rule alone sent it whole."""
    model, tokenizer, model_id = stories
    ids, mask = encode_private_chat(tokenizer, _SECRET_CHAT)
    variant = tokenizer.encode(" HUNTER2", add_special_tokens=False)
    server = serve(TargetRunner(model, tokenizer, model_id))
    from splitspec.v1 import verify_pb2 as pb

    def trees(guard) -> list[str]:
        verifier, spy = _spied_verifier(server.address)
        SpeculativeDecoder(verifier, LeakyDrafter(variant, other=ids[-1])).generate(
            ids, 16, stop_on_eos=False, privacy=guard)
        verifier.close()
        return [tokenizer.decode(list(pb.VerifyRequest.FromString(raw).tree.tokens)).casefold()
                for method, raw in spy.sent if method.endswith("Verify")]

    ids_only = trees(PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(tokenizer)))
    assert any("hunter2" in text for text in ids_only)  # the gap
    sent = trees(PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(tokenizer), decode=tokenizer.decode))
    assert sent and not any("unt" in text or "hunter2" in text for text in sent)


@pytest.mark.parametrize("name", ["stories", "smollm2"])
def test_a_private_numbers_digit_grams_do_not_make_public_numbers_local(name, stories):
    """A private number's n-grams of single digits (" ", "1") match public numbers: with the
    tokenizer's text the best path's short run is pruned (lossless) instead of written locally
    unverified; the private number itself is still written locally."""
    from splitspec.client.drafters.base import Proposal

    tokenizer = _tokenizer(name, stories)
    ids, mask = encode_private_chat(tokenizer, [{"role": "user", "content":
                                                 "My account is <private>12345678</private>. How do I log in?"}])
    placeholder = placeholder_token(tokenizer)
    with_text = PrivacyGuard(tuple(ids), tuple(mask), placeholder, decode=tokenizer.decode)
    ids_only = PrivacyGuard(tuple(ids), tuple(mask), placeholder)
    secret = [t for t, private in zip(ids, mask) if private]
    assert tokenizer.decode(secret).strip() == "12345678" and len(secret) >= 8  # one digit a token
    context = ids + tokenizer("Sure. Buy", add_special_tokens=False)["input_ids"]
    apples = tokenizer(" apples", add_special_tokens=False)["input_ids"]
    public = secret[:2] + apples  # "12 apples": its "1" "2" is a private gram
    assert ids_only.private_run(context, public) == 2  # the id rule alone wrote "12" unverified
    assert with_text.private_run(context, public) == 0
    pruned = with_text.prune(context, Proposal(DraftTree.chain(public)))
    assert pruned.tree.size == 1  # the private gram's node and what hangs below it are cut: lossless
    assert with_text.private_run(context, secret + apples) == ids_only.private_run(context, secret + apples) == len(secret)


def test_answer_spans_follow_the_decoding_the_text_was_made_with(stories):
    """A text completion's answer is decoded after the prompt (its first token's leading space kept);
    its private spans, worked out from the answer decoded alone, covered the whole text (the second
    review of QA 58's fixes): `decode` says how the text was made."""
    from splitspec.client.daemon.text import AnswerText
    from splitspec.client.privacy import private_answer_spans

    _, tokenizer, _ = stories
    prompt = tokenizer("Once upon a")["input_ids"]
    zqx = tokenizer(" zqx", add_special_tokens=False)["input_ids"]
    cat = tokenizer(" cat", add_special_tokens=False)["input_ids"]
    tokens, sources = zqx + cat, ["private"] * len(zqx) + ["target"] * len(cat)
    after = AnswerText(tokenizer, (), prompt)
    text = after.decode(tokens)
    assert text.startswith(" ") and private_answer_spans(tokenizer, tokens, sources, text) == [(0, len(text))]
    spans = private_answer_spans(tokenizer, tokens, sources, text, decode=after.decode)
    assert len(spans) == 1 and spans[0][0] == 0 and "zqx" in text[slice(*spans[0])] and "cat" not in text[slice(*spans[0])]
