"""The command line: generate (local and split, text and JSON), chat, refusals."""
from __future__ import annotations

import io
import json

import pytest

from splitspec.cli.main import main
from splitspec.server.runner import TargetRunner
from splitspec.shared.config import ServerLimits

from .helpers import reference_greedy


def _run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_local_json_equals_generate(stories, stories_path, capsys):
    model, tokenizer, _ = stories
    code, out, _ = _run(capsys, ["generate", "--local", "--target", str(stories_path), "--prompt", "Once upon a time",
                                 "--drafter", "ngram", "--max-new-tokens", "30", "--json"])
    assert code == 0
    result = json.loads(out)
    from splitspec.shared.models import encode_chat

    prompt = encode_chat(tokenizer, [{"role": "user", "content": "Once upon a time"}])
    ref = reference_greedy(model, prompt, 30)
    eos = tokenizer.eos_token_id
    expected = ref[: ref.index(eos) + 1] if eos in ref else ref
    assert result["token_ids"] == expected
    assert result["stats"]["new_tokens"] == len(expected) and result["mode"] == "single-device"
    assert result["context_full"] is False  # said in --json too (QA 57: only the text mode said it)
    # top-k 1 at any temperature is greedy decoding, and is run as such (QA 57: as sampled, it
    # switched off what only greedy answers use)
    code, out, _ = _run(capsys, ["generate", "--local", "--target", str(stories_path), "--prompt", "Once upon a time",
                                 "--drafter", "ngram", "--max-new-tokens", "30", "--json", "--temperature", "0.9",
                                 "--top-k", "1", "--seed", "4"])
    assert code == 0 and json.loads(out)["token_ids"] == expected


def test_generate_json_reports_what_was_written_when_the_link_stays_down(stories, stories_path, capsys):
    """qa-ops F8: `generate --json` printed nothing when the answer failed part way (the link
    stayed down), though the verified tokens were known; now it prints them, `complete: false` and
    the error, and still exits 2."""
    from splitspec.cli.main import build_parser
    from splitspec.client.cli import cmd_generate

    from .helpers import FlakyVerifier

    model, tokenizer, model_id = stories

    def flaky(target, device, dtype):  # the link drops on the 4th step and never returns
        return FlakyVerifier(TargetRunner(model, tokenizer, model_id), {4: "before"}, down_probes=10**9), tokenizer

    args = build_parser().parse_args(["generate", "--local", "--target", str(stories_path), "--prompt",
                                      "Once upon a time", "--drafter", "ngram", "--max-new-tokens", "30", "--json",
                                      "--no-offline"])
    with pytest.raises(Exception) as err:
        cmd_generate(args, local_verifier=flaky)
    result = json.loads(capsys.readouterr().out)
    assert result["complete"] is False and type(err.value).__name__ in result["error"]
    assert 3 <= len(result["token_ids"]) < 30 and set(result["sources"]) == {"target"}
    assert result["text"] == tokenizer.decode(result["token_ids"], skip_special_tokens=True)


def test_generate_split_streams_and_reports(stories, stories_path, serve, capsys):
    model, tokenizer, model_id = stories
    server = serve(TargetRunner(model, tokenizer, model_id))
    code, out, _ = _run(capsys, ["generate", "--server", server.address, "--target", str(stories_path),
                                 "--prompt", "Tom had a red ball", "--drafter", f"draft-model:{stories_path}@layers=2",
                                 "--max-new-tokens", "25"])
    assert code == 0
    assert "target calls" in out and "tau" in out and "sent" in out
    code, out, _ = _run(capsys, ["generate", "--server", server.address, "--target", str(stories_path),
                                 "--prompt", "Tom had a red ball", "--no-spec", "--max-new-tokens", "10", "--json"])
    stats = json.loads(out)["stats"]
    assert stats["target_calls"] == stats["new_tokens"] and stats["bytes_sent"] > 0


def test_a_tree_beyond_the_servers_limits_is_cut_with_a_note(stories, stories_path, serve, capsys):
    """QA 57: a draft tree or lookup chain larger than the server takes was cut each step without a
    word. Now one line on stderr says so; the answer is still the target's."""
    model, tokenizer, model_id = stories
    server = serve(TargetRunner(model, tokenizer, model_id), ServerLimits(max_tree_nodes=6, max_tree_depth=4))
    argv = ["generate", "--server", server.address, "--target", str(stories_path), "--prompt", "Tom had a red ball",
            "--drafter", f"draft-model:{stories_path}@layers=2", "--max-new-tokens", "12", "--json"]
    code, out, err = _run(capsys, [*argv, "--tree-depth", "5", "--tree-nodes", "10", "--prompt-lookup", "3"])
    assert code == 0 and err.count("splitspec: the verifier takes draft trees of at most depth 4 and 6 nodes") == 1
    assert "the 5x2x10 draft tree is cut to that" in err, err
    baseline = _run(capsys, [*argv[:argv.index("--drafter")], "--no-spec", "--max-new-tokens", "12", "--json"])[1]
    assert json.loads(out)["token_ids"] == json.loads(baseline)["token_ids"]
    code, _, err = _run(capsys, [*argv, "--tree-depth", "3", "--tree-nodes", "6", "--prompt-lookup", "5"])
    assert code == 0 and "the 5-token prompt-lookup chain is cut to that" in err and "draft tree is" not in err
    code, _, err = _run(capsys, [*argv, "--tree-depth", "4", "--tree-nodes", "6", "--prompt-lookup", "4"])
    assert code == 0 and "verifier takes" not in err


def test_sampling_is_seeded(stories_path, capsys):
    argv = ["generate", "--local", "--target", str(stories_path), "--prompt", "Lily saw a cat", "--drafter", "ngram",
            "--max-new-tokens", "20", "--temperature", "0.9", "--top-p", "0.9", "--seed", "7", "--json"]
    first = json.loads(_run(capsys, argv)[1])["token_ids"]
    assert json.loads(_run(capsys, argv)[1])["token_ids"] == first
    # and the options reach the decoding: another seed samples other tokens, and these are not greedy's
    other_seed = json.loads(_run(capsys, argv[:-3] + ["--seed", "8", "--json"])[1])["token_ids"]
    greedy = json.loads(_run(capsys, argv[:argv.index("--temperature")] + ["--json"])[1])["token_ids"]
    assert other_seed != first and greedy != first


def test_chat_commands_and_history(stories_path, monkeypatch, capsys, tmp_path):
    from splitspec.client.history import ChatHistory

    db = tmp_path / "chat.sqlite3"
    monkeypatch.setattr("sys.stdin", io.StringIO("/stats\nHello there\n/stats\n/reset\nBye <private>zq</private>\n/quit\n"))
    args = ["chat", "--local", "--target", str(stories_path), "--drafter", "ngram", "--max-new-tokens", "8",
            "--history", str(db)]
    code, out, _ = _run(capsys, args)
    assert code == 0
    assert "(no answer yet)" in out and "target calls" in out and "(new conversation)" in out
    assert out.count("bot>") == 2
    history = ChatHistory(db)
    last = history.last_conversation()
    messages = history.messages(last)
    assert [m["role"] for m in messages] == ["user", "assistant"] and all(m["complete"] for m in messages)
    assert messages[0]["content"] == "Bye <private>zq</private>"
    assert len(history.tokens(messages[1]["id"])) == 8  # the answer's tokens, written as they committed
    monkeypatch.setattr("sys.stdin", io.StringIO("/quit\n"))
    code, out, _ = _run(capsys, args)  # a chat opened and left: no empty conversation to resume (QA 56, F3)
    assert code == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("/reset\n/quit\n"))
    code, out, _ = _run(capsys, args + ["--resume"])
    assert code == 0 and "2 earlier messages" in out
    monkeypatch.setattr("sys.stdin", io.StringIO("/quit\n"))
    code, out, _ = _run(capsys, args + ["--resume"])  # nor after a /reset right before quitting
    assert code == 0 and "2 earlier messages" in out
    assert len(history.conversations()) == 2  # the two that hold messages: none left empty
    # a turn that failed before its first token left an empty, incomplete answer: not replayed
    failed = history.new_conversation(str(stories_path), "ngram")
    history.add_message(failed, "user", "Are you there?")
    history.add_message(failed, "assistant", "", complete=False)
    code, out, _ = _run(capsys, args + ["--resume"])
    assert code == 0 and "1 earlier messages" in out


def test_chat_goes_on_when_a_turn_fails_or_the_context_is_full(stories, stories_path, serve, monkeypatch, capsys,
                                                               tmp_path):
    """An answer that fills the target's context ends there and says so; a turn the service refuses
    (the next prompt no longer fits) is explained and the chat goes on; /reset starts again; an
    unknown /command is not sent to the model; /stats after /reset has no answer (QA of the CLI:
    the chat ended with the refusal, /bogus went to the model)."""
    from splitspec.client.history import ChatHistory
    from splitspec.shared.config import ServerLimits

    model, tokenizer, model_id = stories
    server = serve(TargetRunner(model, tokenizer, model_id), ServerLimits(max_context=64))
    db = tmp_path / "chat.sqlite3"
    monkeypatch.setattr("sys.stdin", io.StringIO(
        "Once upon a time\nAnd then?\n/bogus\n/stats\n/reset\n/stats\nHi\n/quit\n"))
    code, out, err = _run(capsys, ["chat", "--server", server.address, "--target", str(stories_path),
                                   "--drafter", "ngram", "--max-new-tokens", "100", "--temperature", "0",
                                   "--history", str(db)])
    assert code == 0, err
    before, after = out.split("(new conversation)")
    assert before.count("context of 64 tokens is full") == 1 and after.count("context of 64 tokens is full") == 1
    refused = before.split("is full")[1]
    assert "(no answer: " in refused and "fill the target's context" in refused
    assert "(unknown command /bogus" in before and "target calls" in before  # /stats: the first answer's
    assert after.count("(no answer yet)") == 1 and after.count("bot>") == 1
    history = ChatHistory(db)
    last = history.last_conversation()
    assert [(m["role"], bool(m["complete"])) for m in history.messages(last)] == [("user", True), ("assistant", True)]
    assert all(m["content"] != "/bogus" for m in history.messages(last - 1))


@pytest.mark.parametrize("flag, value, message", [
    ("--server", "127.0.0.1:83587", "port in 1..65535"), ("--server", "", "HOST:PORT"),
    ("--timeout", "-1", "must be > 0"), ("--step-timeout", "0", "must be > 0"),
    ("--connect-timeout", "0", "must be > 0"), ("--busy-wait", "-1", "must be >= 0"),
    ("--max-new-tokens", "0", "must be >= 1"), ("--private-ngram", "0", "must be >= 1"),
    ("--timeout", "soon", "invalid float value"),
])
def test_client_flags_out_of_range_are_refused_up_front(flag, value, message, capsys):
    """Values that used to be taken as something else (a port modulo 65536, every step timing out
    at once, an error blamed on the service) are refused by the parser, before any model loads."""
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "hi", flag, value])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_tokenizer_mismatch_is_refused(stories_path, serve, stories, capsys, tiny_random):
    model, tokenizer, model_id = stories
    from splitspec.client.drafters.factory import TokenizerMismatch, make_drafter
    from splitspec.shared.drafters.spec import DrafterSpec

    with pytest.raises(TokenizerMismatch):
        make_drafter(DrafterSpec.parse(f"draft-model:{stories_path}@layers=1"), target_fingerprint="0" * 32)
    server = serve(TargetRunner(model, tokenizer, model_id))
    code, _, err = _run(capsys, ["generate", "--server", server.address, "--target", "smollm2-135m",
                                 "--prompt", "hi", "--max-new-tokens", "5"])
    assert code == 2 and "tokenizer" in err


def test_unreachable_server_is_a_clear_error(stories_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = _run(capsys, ["generate", "--server", f"127.0.0.1:{port}", "--target", str(stories_path),
                                 "--prompt", "hi", "--connect-timeout", "1"])
    assert code == 2 and "no verify service reachable" in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_text_stream_marks_offline_text_and_rewrites(stories):
    """On a terminal the chat shows offline text (dim), confirmations and a rewrite after
    reconnection; to a file or a pipe it writes only the answer: offline text once confirmed, kept
    or left at the end, withdrawn text never (QA 56, finding 6: a redirected answer held the
    withdrawn text and a marker pointing at the wrong place)."""
    from splitspec.client.stream import TextStream
    from splitspec.client.loop import StreamEvent

    _, tokenizer, _ = stories
    hello, world, there, again = (tokenizer.encode(w, add_special_tokens=False)
                                  for w in ("Hello", " world", " there", " again"))
    events = [StreamEvent("tokens", 0, tuple(hello)),
              StreamEvent("tokens", len(hello), tuple(world), source="offline"),
              StreamEvent("retract", len(hello)),
              StreamEvent("tokens", len(hello), tuple(there)),
              StreamEvent("tokens", len(hello + there), tuple(world), source="offline"),
              StreamEvent("verified", len(hello + there), count=len(world)),
              StreamEvent("tokens", len(hello + there + world), tuple(again), source="offline")]
    terminal, piped = _Terminal(), io.StringIO()
    for out in (terminal, piped):
        stream = TextStream(tokenizer, out)
        shown = []
        for event in events:
            stream(event)
            shown.append(out.getvalue())
        stream.finish()
        assert stream.ids == hello + there + world + again
    text = terminal.getvalue()
    assert "\x1b[2m world\x1b[0m" in text and "rewrote the offline text" in text
    assert text.replace("\x1b[2m", "").replace("\x1b[0m", "").endswith("there world again")
    assert piped.getvalue() == "Hello there world again"  # the answer, and only it
    assert shown[1] == "Hello" and shown[5] == "Hello there world"  # offline text held until confirmed
    assert shown[6] == shown[5]  # " again" is offline until the end: written by finish


def test_answer_tokens_follow_every_event_kind(tmp_path):
    """`generate --json`'s record of an answer (client/answer.py AnswerTokens): appends, relabels of
    offline tokens (verified -> target, kept -> kept) and retractions; the chat history's token rows
    (client/history.py AnswerWriter) end the same."""
    from splitspec.client.answer import AnswerTokens, EventKind, Provenance, StreamEvent
    from splitspec.client.history import ChatHistory

    history = ChatHistory(tmp_path / "history.db")
    message = history.add_message(history.new_conversation("t", "ngram"), "assistant", "", complete=False)
    answer, writer = AnswerTokens(), history.answer_writer(message)

    def both(event):
        answer(event)
        writer(event)

    both(StreamEvent(EventKind.TOKENS, 0, (1, 2)))
    both(StreamEvent(EventKind.TOKENS, 2, (3, 4, 5, 6), Provenance.OFFLINE))
    both(StreamEvent(EventKind.VERIFIED, 2, count=1))
    both(StreamEvent(EventKind.KEPT, 3, count=1))
    assert answer.ids == [1, 2, 3, 4, 5, 6]
    assert answer.sources == ["target", "target", "target", "kept", "offline", "offline"]
    both(StreamEvent(EventKind.RETRACT, 4))
    both(StreamEvent(EventKind.TOKENS, 4, (9,), Provenance.PRIVATE))
    assert answer.ids == [1, 2, 3, 4, 9] and answer.sources[-2:] == ["kept", "private"]
    assert history.tokens(message) == list(zip(answer.ids, answer.sources))
    history.close()
    with pytest.raises(ValueError, match="relabels no tokens"):
        StreamEvent(EventKind.RETRACT, 0).relabelled_to


@pytest.mark.slow
def test_demo_runs_end_to_end(stories_path, capsys):
    """`splitspec demo` (what `make demo` runs) on the tiny target: a server process, streamed answers."""
    code, out, err = _run(capsys, ["demo", "--target", str(stories_path), "--drafter", "ngram", "--limit", "1",
                                   "--max-new-tokens", "6"])
    assert code == 0, err
    assert out.count("===") == 3 and out.count("target calls") == 3


def test_chat_samples_by_default_and_is_greedy_on_request(stories_path, tmp_path):
    """chat (and up) sample by default, from the target's generation config when it names values;
    generate stays greedy."""
    from splitspec.cli.main import build_parser
    from splitspec.client.build import chat_sampling
    from splitspec.client.cli import client_config
    from splitspec.shared.models import chat_sampling_defaults

    parser = build_parser()
    chat = ["chat", "--local", "--target", str(stories_path)]
    sampling = chat_sampling(client_config(parser.parse_args(chat)), str(stories_path))
    assert (sampling.temperature, sampling.top_p) == (0.7, 0.9)
    greedy = client_config(parser.parse_args(chat + ["--temperature", "0"]))
    assert chat_sampling(greedy, str(stories_path)).greedy
    assert client_config(parser.parse_args(["generate", "--local", "--target", str(stories_path), "--prompt", "x"])
                         ).sampling.greedy
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95}))
    assert chat_sampling_defaults(str(tmp_path)) == (0.6, 0.95)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert chat_sampling_defaults(str(tmp_path))[0] == 0.0


def test_chat_draws_a_seed_per_answer_unless_one_is_given(stories_path, monkeypatch, capsys, tmp_path):
    """chat samples, and without --seed each answer draws its own seed: a fixed default seed gave
    the same answer to the same question in every run (QA 56, finding 8); --seed S repeats them."""
    from splitspec.client import cli
    from splitspec.client.history import ChatHistory

    drawn = []
    monkeypatch.setattr(cli.secrets, "randbits", lambda bits: drawn.append(bits) or 1000 + len(drawn))
    base = ["chat", "--local", "--target", str(stories_path), "--drafter", "ngram", "--max-new-tokens", "12"]
    answers = {}
    for name, flags in (("random", []), ("seed 5", ["--seed", "5"]), ("seed 5 again", ["--seed", "5"])):
        monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time\n/reset\nOnce upon a time\n/quit\n"))
        db = tmp_path / f"{name}.sqlite3"
        code, out, _ = _run(capsys, base + flags + ["--history", str(db)])
        assert code == 0 and out.count("bot>") == 2
        history = ChatHistory(db)
        answers[name] = [history.messages(c["id"])[1]["content"] for c in history.conversations()]
        history.close()
        if name == "random":
            assert drawn == [63, 63]  # one seed per answer
            assert ", seed " not in out.split("history")[0]
        else:
            assert ", seed 5," in out
    assert len(drawn) == 2  # none drawn with --seed
    assert answers["seed 5"] == answers["seed 5 again"] and answers["seed 5"][0] == answers["seed 5"][1]


def test_text_that_is_not_utf8_is_refused_with_one_line(stories_path, monkeypatch, capsys, tmp_path):
    """Bytes that are not UTF-8 (argv and stdin hand them over as lone surrogates) are refused with a
    one-line error naming the byte, before the models load for --prompt and --system, and as a
    skipped turn in chat; the tokenizer's TypeError traceback ended generate and the whole chat
    (QA 56, finding 2)."""
    code, _, err = _run(capsys, ["generate", "--local", "--target", "/no/such/model", "--prompt", "Say \udcff hi"])
    assert code == 2 and "--prompt is not valid UTF-8 text (byte 0xff at character 5)" in err
    code, _, err = _run(capsys, ["chat", "--local", "--target", "/no/such/model", "--system", "Be \udcfe",
                                 "--history", str(tmp_path / "h.sqlite3")])
    assert code == 2 and "--system is not valid UTF-8 text (byte 0xfe at character 4)" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("Say \udcff hi\nOnce upon a time\n/quit\n"))
    code, out, _ = _run(capsys, ["chat", "--local", "--target", str(stories_path), "--drafter", "ngram",
                                 "--max-new-tokens", "4", "--history", str(tmp_path / "h.sqlite3")])
    assert code == 0 and "(the user message is not valid UTF-8 text (byte 0xff at character 5))" in out
    assert out.count("bot>") == 1  # the next line is answered


def test_unmatched_tags_in_prompt_or_system_are_refused_before_loading(capsys, tmp_path):
    """QA 57 finding 9: an unmatched <private> in --system was found after the models loaded, and
    in chat every line then failed with an error that did not name --system."""
    code, _, err = _run(capsys, ["generate", "--local", "--target", "/no/such/model", "--prompt", "x <private>abc"])
    assert code == 2 and "--prompt: unmatched or nested <private> tag" in err
    for command in (["chat", "--history", str(tmp_path / "h.sqlite3")], ["up"]):
        code, _, err = _run(capsys, [*command, "--local", "--target", "/no/such/model", "--system", "Code <private>abc"])
        assert code == 2 and "--system: unmatched or nested <private> tag" in err


def test_a_history_that_cannot_be_opened_is_one_line(monkeypatch, capsys, tmp_path):
    """--history naming a folder or a file that is not SQLite: one line naming it, before the
    models load (was: sqlite3's traceback after they loaded; QA 56, finding 7)."""
    (tmp_path / "notes.txt").write_text("not a database\n" * 100)
    for path, what in ((tmp_path, "a folder"), (tmp_path / "notes.txt", "not a usable SQLite database")):
        code, _, err = _run(capsys, ["chat", "--local", "--target", "/no/such/model", "--history", str(path)])
        assert code == 2 and f"chat history {path}: {what}" in err, err


def test_no_spec_with_adaptive_tree_names_the_flags(capsys):
    """--no-spec --adaptive-tree names the two flags (it blamed "the none drafter", never given)."""
    code, _, err = _run(capsys, ["generate", "--local", "--target", "/no/such/model", "--prompt", "x", "--no-spec",
                                 "--adaptive-tree"])
    assert code == 2 and "--adaptive-tree picks draft trees, and --no-spec sends none" in err


@pytest.mark.parametrize("argv, message", [
    (["--drafter", "eagle2", "--lsa-placement", "client"], "--lsa-placement does nothing for the drafter eagle2"),
    (["--drafter", "swift", "--draft-vocab", "100"], "--draft-vocab does nothing for the drafter swift"),
    (["--drafter", "ngram", "--feature-quant", "fp8"], "--feature-quant does nothing for the drafter ngram"),
    (["--no-spec", "--draft-vocab", "0"], "--draft-vocab does nothing for the drafter none"),
])
def test_a_flag_the_drafter_ignores_is_refused_before_loading(argv, message, capsys):
    """QA 57: --lsa-placement / --draft-vocab / --feature-quant passed silently for drafters that do
    nothing with them (the same options written after the drafter's name were already refused)."""
    code, _, err = _run(capsys, ["generate", "--local", "--target", "/no/such/model", "--prompt", "x", *argv])
    assert code == 2 and message in err, err


def test_flags_a_drafter_uses_still_apply():
    from splitspec.cli.main import build_parser
    from splitspec.client.cli import client_config
    args = build_parser().parse_args(["generate", "--prompt", "x", "--drafter", "moa", "--lsa-placement", "server", "--draft-vocab",
                                      "100", "--feature-quant", "fp16"])
    spec = client_config(args).drafter
    assert (spec.lsa, spec.vocab, spec.quant) == ("server", 100, "fp16")
    spec = client_config(build_parser().parse_args(["generate", "--prompt", "x", "--drafter", "moa;vocab=7", "--draft-vocab", "9"])).drafter
    assert spec.vocab == 7  # an option after the name still wins over the flag
    default = client_config(build_parser().parse_args(["generate", "--prompt", "x", "--drafter", "eagle2"])).drafter
    assert (default.lsa, default.vocab, default.quant) == ("client", -1, "int8")


def test_missing_shipped_checkpoint_names_what_ships_and_how_to_train(capsys):
    from splitspec.shared.drafters.spec import DrafterSpec

    with pytest.raises(FileNotFoundError) as err:
        DrafterSpec.parse("moa:tli=7").checkpoint("smollm2-135m")
    message = str(err.value)
    assert "moa-tli0" in message and "eagle2" in message and "moa-tli7" not in message
    assert "splitspec train --drafter moa:tli=7 --target smollm2-135m" in message
    assert DrafterSpec.parse("moa:/some/dir").checkpoint("smollm2-135m").as_posix() == "/some/dir"


def test_train_command_defaults_are_the_trainers():
    """`splitspec train` keeps its defaults as literals (the CLI does not import torch to build its
    parser), so a bare command must still give TrainConfig's own defaults; only the learning rate
    differs on purpose (a run from scratch on the command line takes 1e-3, the tests' tiny runs 5e-4),
    and --compile (auto on the command line; the tests' tiny runs stay eager rather than pay seconds of
    compiling each)."""
    import dataclasses

    from pathlib import Path

    from splitspec.cli.main import build_parser
    from splitspec.train.cli import train_config
    from splitspec.train.trainer import TrainConfig, can_compile

    cfg = train_config(build_parser().parse_args(["train", "--drafter", "moa", "--out", "x", "--dtype", "float32"]))
    default = TrainConfig(drafter="moa", target=cfg.target, out=Path("x"), dtype="float32")
    differ = {f.name for f in dataclasses.fields(TrainConfig) if getattr(cfg, f.name) != getattr(default, f.name)}
    assert differ - {"compile"} == {"lr"}, differ
    assert cfg.compile == ("on" if can_compile("cpu") else "off") and default.compile == "off"


@pytest.mark.parametrize("argv, shown", [
    (["generate"], ["--max-new-tokens MAX_NEW_TOKENS", "default: 256", "0 = greedy (default: 0.0)", "(default int8:"]),
    (["netsim", "run"], ["(default: 600.0)"]),
    (["offline-eval"], ["(default smollm2-135m)"]),  # a help that names its default keeps its own words
    (["serve-bench"], ["(default: 1,4,8,16)"]),  # a list as it is typed (QA 57: "[1, 4, 8, 16]")
    (["train"], ["(default: 1-4)"]),  # --chunk is typed MIN-MAX (QA 58: shown "1,4", which it refuses)
])
def test_help_names_each_default_once(argv, shown, capsys, monkeypatch):
    """QA 56: --help omitted the defaults of most options (--max-new-tokens, --lsa-placement, ...)."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    out = capsys.readouterr().out
    for text in shown:
        assert text in out
    assert "default: None" not in out and "default: False" not in out and "(default: smollm2-135m)" not in out
    assert "default: [" not in out and "default: (" not in out


def test_version_names_the_libraries_behind_the_numbers(capsys):
    with pytest.raises(SystemExit) as end:
        main(["--version"])
    out = capsys.readouterr().out
    assert end.value.code == 0 and out.startswith("splitspec ") and out.split()[1][0].isdigit() and "torch 2." in out and "transformers " in out
    assert out.count("\n") == 1  # one line to paste into a bug report


def test_conversation_titles_hide_private_spans(tmp_path):
    """QA 57 finding 13: the conversation list showed private text in clear, with a tag cut in half."""
    from splitspec.client.history import ChatHistory

    history = ChatHistory(tmp_path / "h.sqlite3")
    chat = history.new_conversation("t", "d")
    history.add_message(chat, "user", "Repeat after me: My name is <private>Hortensia Quackenbush</private> and "
                                      "I live in Paris, in a small flat near the river, since 2019.")
    (listed,) = history.conversations()
    assert listed["title"].startswith("Repeat after me: My name is [private] and I live in Paris")
    assert "Hortensia" not in listed["title"] and "<" not in listed["title"] and len(listed["title"]) == 80
    history.close()


def test_grpc_core_logs_only_errors_unless_the_user_asks():
    """QA 57 link finding 6: after a cut over ~10 s, gRPC core's INFO line about the GOAWAY landed on
    the CLI's stderr. The command sets GRPC_VERBOSITY=ERROR before grpc loads; a user's value wins."""
    import os
    import subprocess
    import sys

    code = "import os, splitspec.cli.main; print(os.environ['GRPC_VERBOSITY'])"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == "ERROR"
    mine = subprocess.run([sys.executable, "-c", code], env={**env, "GRPC_VERBOSITY": "INFO"}, capture_output=True,
                          text=True)
    assert mine.stdout.strip() == "INFO"
