"""The bench commands refuse what they cannot measure before anything loads or starts (repeated
points, empty or malformed prompt files, unwritable outputs, out-of-range numbers, a link that is
cut), fail loudly where a run went wrong (a crashed client, a lossy answer), and never leave a
`splitspec serve` child behind when they are signalled. See /work/notes/qa-bench.md (findings 1-13)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from splitspec.bench import bench as bench_mod
from splitspec.bench import long_bench, offline_eval, prompts as prompts_mod, serve_bench, verify_cost_bench
from splitspec.bench.out_paths import writable_dir, writable_file
from splitspec.bench.report import inexact_answers, render_markdown
from splitspec.cli.main import build_parser, main

from .helpers import SPEC_BENCH
from .test_bench import META, record, synthetic_run


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The commands pin torch's thread count; the rest of the session keeps its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def spec_bench() -> Path:
    if not SPEC_BENCH.exists():
        pytest.skip(f"{SPEC_BENCH} not found (the ../shared folder beside the checkout)")
    return SPEC_BENCH


class LoadedAModel(AssertionError):
    """Raised by a monkeypatched model loader: the command got past its argument checks."""


def _no_model(*args, **kwargs):
    raise LoadedAModel("a model was loaded before the arguments were checked")


def _refused(argv: list[str], capsys) -> str:
    """The parse error argparse gives for `argv` (it exits with status 2)."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def _questions(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


QUESTION = json.dumps({"question_id": 1, "category": "writing", "turns": ["Write a poem."]})


# --- 1. serve-bench: repeated points -------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--batch-window-ms", "5,5"], ["--batch-window-ms", "0,0.0"],
                                  ["--max-batch", "1,1:padded"], ["--max-batch", "8,8:ragged"]])
def test_serve_bench_refuses_a_point_given_twice(argv, capsys):
    assert "twice" in _refused(["serve-bench", *argv], capsys)


def test_serve_bench_points_and_table_refuse_one_label_twice():
    assert serve_bench.serve_points([(1, "ragged"), (8, "ragged")], [0.0, 5.0]) == [
        (1, "ragged", None), (8, "ragged", 0.0), (8, "ragged", 5.0)]
    with pytest.raises(ValueError, match="more than once"):
        serve_bench.serve_points([(1, "ragged"), (1, "padded")], [5.0])
    twice = [serve_bench.ServeResult(8, "ragged", 1, 10, 1.0, 10.0, 1.0, 2.0, window_ms=5.0)] * 2
    with pytest.raises(ValueError, match="twice"):
        serve_bench.render(twice, None)
    rounds = [serve_bench.ServeResult(8, "ragged", 1, 10, 1.0, 10.0, 1.0, 2.0, window_ms=5.0, round=r)
              for r in (0, 1)]  # one point in two rounds is no repeat
    assert "| 8, window 5 ms | 1 | 10.0 (10.0-10.0) |" in serve_bench.render(rounds, _SERVE_ARGS)


_SERVE_ARGS = SimpleNamespace(target="t", drafter="ngram", seconds=1.0, max_new_tokens=12, threads=1, device="cpu")


def test_serve_bench_rounds_pair_ratios_within_a_round_and_pool_latencies():
    """--rounds: each point's median over rounds with its range; a ratio against one client (or the
    unbatched server) is taken within one round, so a slow round slows both sides of it alike."""
    def point(max_batch, clients, tok, rnd, steps):
        return serve_bench.ServeResult(max_batch, "ragged", clients, tok, 1.0, tok / clients, 0.0, 0.0,
                                       round=rnd, step_ms=tuple(steps))

    results = [point(1, 1, 100, 0, [10] * 9), point(8, 1, 100, 0, [10] * 9), point(8, 8, 420, 0, [30] * 9),
               point(1, 1, 50, 1, [20] * 9), point(8, 1, 50, 1, [20] * 9), point(8, 8, 190, 1, [60] * 9),
               point(1, 1, 80, 2, [15] * 9), point(8, 1, 80, 2, [15] * 9), point(8, 8, 360, 2, [45] * 8 + [900]),
               point(1, 8, 100, 0, [40]), point(1, 8, 60, 1, [80]), point(1, 8, 90, 2, [50])]
    table = serve_bench.render(results, _SERVE_ARGS)
    # rounds' ratios 4.2, 3.8, 4.5: median 4.2 (pooled tokens/s would give 970 / 230 = 4.22, the
    # medians' 360 / 80 = 4.5: neither is a within-round ratio)
    assert "| 8 | 8 | 360.0 (190.0-420.0) | 4.20x (3.80-4.50x) | 4.00x (3.17-4.20x) |" in table
    assert "measured 4.20x (median of 3 rounds, 3.80x-4.50x) (max batch 8) -> met" in table
    assert "| 1 | 1 | 80.0 (50.0-100.0) | 1.00x (1.00-1.00x) | 1.00x (1.00-1.00x) |" in table
    row = next(line for line in table.splitlines() if line.startswith("| 8 | 8 |"))
    assert row.endswith("| 45.0 | 900.0 | - |")  # p50 and p99 of all 27 steps pooled
    assert "3 interleaved rounds" in table


# --- 2. verify-cost: a random target's onednn rows are packed like a real target's ---------------

def test_random_target_onednn_is_packed_like_a_real_one():
    from splitspec.shared.packed_linear import PackedLinear, onednn_available, onednn_supports

    plain = verify_cost_bench.random_model("llama-tiny", "float32", "cpu", "torch")
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    if not (onednn_available() and onednn_supports(torch.float32)):
        pytest.skip("this torch or CPU has no oneDNN prepacked linear")
    packed = verify_cost_bench.random_model("llama-tiny", "float32", "cpu", "onednn")
    assert any(isinstance(m, PackedLinear) for m in packed.modules())


def test_random_target_skips_a_dtype_oneDNN_cannot_prepack(monkeypatch, capsys):
    """As for a real target: an AVX2-only CPU has no bf16 oneDNN row, random weights or not."""
    built = []
    original = verify_cost_bench.random_model

    def random_model(name, dtype, device, linear="torch"):
        built.append((dtype, linear))
        return original(name, dtype, device, "torch")  # the packing itself: the test above

    monkeypatch.setattr(verify_cost_bench, "random_model", random_model)
    monkeypatch.setattr(verify_cost_bench, "onednn_available", lambda: True)
    monkeypatch.setattr(verify_cost_bench, "onednn_supports", lambda dtype: dtype != torch.bfloat16)
    monkeypatch.setattr(verify_cost_bench, "POSITIONS", (1, 25))
    monkeypatch.setattr(verify_cost_bench, "copy_bandwidth_gbs", lambda device: 10.0)
    args = build_parser().parse_args(["verify-cost", "--target", "random:llama-tiny", "--prompts", "0", "--repeats",
                                      "1", "--threads", "1", "--context", "8"])
    verify_cost_bench.cmd_verify_cost(args)
    assert built == [("float32", "torch"), ("float32", "onednn"), ("bfloat16", "torch")]
    assert "cannot prepack bfloat16" in capsys.readouterr().err


# --- 3. serve-bench: a crashed client fails the run; no empty prompt set or answer ---------------

@pytest.mark.parametrize("argv", [["--limit", "0"], ["--max-new-tokens", "0"], ["--threads", "0"]])
def test_serve_bench_refuses_zero_counts_at_parse_time(argv, capsys):
    assert "must be >= 1" in _refused(["serve-bench", *argv], capsys)


def test_serve_bench_client_crash_fails_the_point(monkeypatch):
    class Verifier:
        def __init__(self, address):
            pass

        def close(self):
            pass

    class Crashing:
        def __init__(self, verifier, drafter):
            pass

        def generate(self, prompt, max_new_tokens):
            raise ZeroDivisionError("a drafter bug mid-run")

    monkeypatch.setattr(serve_bench, "RemoteVerifier", Verifier)
    monkeypatch.setattr(serve_bench, "SpeculativeDecoder", Crashing)
    from splitspec.shared.drafters.spec import DrafterSpec

    with pytest.raises(RuntimeError, match="2 of 2 clients failed.*ZeroDivisionError: a drafter bug"):
        serve_bench.run_clients("127.0.0.1:1", 2, [[1, 2, 3]], DrafterSpec.parse("ngram"), "fp", "t", 5.0, 4)


# --- 4. no orphaned `splitspec serve` child ---------------------------------------------------------

def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, ...
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# what bench, demo and serve-bench do around their servers, without their imports (seconds, not a minute)
_HOLDS_A_SERVER = """
import sys, time
from splitspec.bench.service_process import free_port, sigterm_exits, start_server, stop_server
with sigterm_exits():
    server = start_server(sys.argv[1], free_port(), threads=1)
    try:
        time.sleep(600)
    finally:
        stop_server(server)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_signalled_command_leaves_no_server_behind(how, stories_path):
    """The command is signalled while its server child starts (it waits on the health check):
    SIGTERM and SIGINT unwind through the clean-up, SIGKILL leaves it to PR_SET_PDEATHSIG."""
    _signal_while_the_server_starts([sys.executable, "-c", _HOLDS_A_SERVER, str(stories_path)], how)


@pytest.mark.slow  # a fresh interpreter importing the whole command: ~20 s on a loaded 2-core VM
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_demo_leaves_no_server_behind(stories_path, spec_bench):
    _signal_while_the_server_starts([sys.executable, "-m", "splitspec.cli", "demo", "--target", str(stories_path),
                                     "--limit", "1", "--max-new-tokens", "4", "--spec-bench", str(spec_bench)],
                                    "SIGTERM")


def _signal_while_the_server_starts(command: list[str], how: str) -> None:
    """Run `command`, send `how` to it once its `splitspec serve` child exists, and check that the
    child is gone soon after (a child started in the background inherits SIGINT ignored: restored)."""
    holder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    server = None
    try:
        deadline = time.monotonic() + 60
        while server is None and time.monotonic() < deadline and holder.poll() is None:
            server = next(iter(_children(holder.pid)), None)
            time.sleep(0.05)
        assert server is not None, "the command started no server"
        holder.send_signal(getattr(signal, how))
        holder.wait(timeout=60)
        deadline = time.monotonic() + 15
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server), f"the server outlived a {how}ed command"
    finally:
        holder.kill()
        holder.wait()
        if server is not None and _alive(server):
            os.kill(server, signal.SIGKILL)


def test_sigterm_raises_system_exit_inside_and_not_after():
    from splitspec.bench.service_process import sigterm_exits

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc, sigterm_exits():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert exc.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before


# --- 5. demo --limit ----------------------------------------------------------------------------------

def test_demo_limit_must_be_positive(capsys):
    assert "must be >= 1" in _refused(["demo", "--limit", "0"], capsys)
    assert "must be >= 1" in _refused(["demo", "--limit", "-1"], capsys)
    from splitspec.bench.demo import demo_prompts

    with pytest.raises(ValueError, match="--limit must be >= 1"):
        demo_prompts(-1, None)
    with pytest.raises(ValueError, match=">= 1"):
        prompts_mod.load_problems(None, -1)  # no "all" meaning for a limit below 1


# --- 6 and 10. empty or malformed prompt files, before any model ---------------------------------

def test_offline_eval_refuses_an_empty_problems_file_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(offline_eval, "load_model", _no_model)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    rc = main(["offline-eval", "--problems", str(empty), "--out", str(tmp_path / "out")])
    assert rc == 2 and f"{empty}: no HumanEval problems" in capsys.readouterr().err



def test_offline_eval_keeps_an_earlier_run_and_rescore_refuses_generation_flags(tmp_path, monkeypatch, capsys):
    """QA 56 tools finding 7: a second run replaced the first one's answers without a word, and
    --rescore dropped --drafters/--cut-after silently while scoring the stored answers."""
    monkeypatch.setattr(offline_eval, "load_model", _no_model)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text('{"drafter": "eagle2"}\n')
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"task_id": "t/0", "prompt": "def f():\n", "test": "", "entry_point": "f"}) + "\n")
    rc = main(["offline-eval", "--problems", str(problems), "--out", str(out)])
    assert rc == 2 and "holds the answers of an earlier run: --rescore" in capsys.readouterr().err
    assert (out / "results.jsonl").read_text() == '{"drafter": "eagle2"}\n'
    with pytest.raises(LoadedAModel):  # --overwrite goes on to the run
        main(["offline-eval", "--problems", str(problems), "--out", str(out), "--overwrite"])
    rc = main(["offline-eval", "--rescore", "--drafters", "moa", "--cut-after", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "--drafters, --cut-after would not apply (drop them" in err
    assert main(["offline-eval", "--rescore", "--threads", "1", "--out", str(out)]) == 2
    assert "--threads would not apply (drop it" in capsys.readouterr().err
    assert main(["offline-eval", "--rescore", "--overwrite", "--out", str(out)]) == 2
    assert "choose one" in capsys.readouterr().err

def test_prompt_files_name_the_bad_line(tmp_path):
    with pytest.raises(ValueError, match="no Spec-Bench questions"):
        prompts_mod.load_prompts(["spec_bench"], 1, str(_questions(tmp_path / "e.jsonl", [])))
    blank = _questions(tmp_path / "b.jsonl", [QUESTION, "", json.dumps({**json.loads(QUESTION), "category": "math"})])
    assert [p["category"] for p in prompts_mod.load_prompts(["spec_bench"], 1, str(blank))] == ["writing", "math"]
    bad = _questions(tmp_path / "m.jsonl", [QUESTION, "{not json"])
    with pytest.raises(ValueError, match=f"{bad}:2: not JSON"):
        prompts_mod.load_prompts(["spec_bench"], 1, str(bad))
    lacking = _questions(tmp_path / "k.jsonl", ["", json.dumps({"question_id": 1, "turns": ["x"]})])
    with pytest.raises(ValueError, match=f"{lacking}:2: the record lacks category"):
        prompts_mod.load_prompts(["spec_bench"], 1, str(lacking))
    problem = json.dumps({"task_id": "t/0", "prompt": "def f():\n", "test": "", "entry_point": "f"})
    bad_problems = _questions(tmp_path / "p.jsonl", [problem, "[1, 2]"])
    with pytest.raises(ValueError, match=f"{bad_problems}:2: expected a JSON object"):
        prompts_mod.load_problems(str(bad_problems), 5)


def test_bench_refuses_an_empty_spec_bench_file_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_mod, "load_model", _no_model)
    empty = _questions(tmp_path / "empty.jsonl", [])
    rc = main(["bench", "--methods", "", "--local-methods", "", "--datasets", "spec_bench", "--spec-bench", str(empty)])
    assert rc == 2 and "no Spec-Bench questions" in capsys.readouterr().err


# --- 7. a lossy greedy answer is surfaced ------------------------------------------------------------

def test_report_warns_of_a_lossy_answer_by_arm_and_prompt():
    rows = synthetic_run()
    assert inexact_answers(rows) == ""
    rows[4] = record("split", "eagle2", "lan", category="writing", exact=False)
    warning = inexact_answers(rows)
    assert "1 greedy answers differ" in warning and "split eagle2 @lan on writing/writing" in warning
    assert render_markdown(rows, META).count(warning) == 2  # under the header and under the goals
    sampled = [record("local", "generate()", None, exact=None), record("split", "none", "lan", exact=None)]
    assert inexact_answers(sampled) == ""  # sampled answers are not compared


def _bench_without_models(monkeypatch, run_arms) -> None:
    """`bench` with no target loaded and no arms built: `run_arms` stands in for the measuring."""
    monkeypatch.setattr(bench_mod, "load_model", lambda target: (None, None, "tiny"))
    monkeypatch.setattr(bench_mod, "check_prompts_fit", lambda *args, **kw: None)
    monkeypatch.setattr(bench_mod, "build_arms", lambda *args: [])
    monkeypatch.setattr(bench_mod, "run_arms", run_arms)


def test_bench_fails_after_writing_a_report_with_a_lossy_answer(tmp_path, monkeypatch, capsys, spec_bench):
    rows = [record("local", "generate()", None), record("local", "ngram", None, exact=False)]
    _bench_without_models(monkeypatch, lambda *args: rows)
    out = tmp_path / "out"
    rc = main(["bench", "--methods", "", "--local-methods", "ngram", "--datasets", "spec_bench", "--categories",
               "writing", "--spec-bench", str(spec_bench), "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 2 and "not lossless" in captured.err and "WARNING" in captured.err
    assert "local ngram on writing/writing" in captured.out
    assert "WARNING" in (out / "table.md").read_text() and (out / "results.jsonl").exists()



@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit, RuntimeError])
def test_an_interrupted_bench_keeps_the_answers_it_finished(tmp_path, monkeypatch, capsys, spec_bench, stop):
    """QA 56 tools finding 8: Ctrl-C (or the SIGTERM sigterm_exits turns into SystemExit) after some
    answers left --out empty, minutes of measurement lost without a word; QA 58: so did an error."""
    rows = [record("local", "generate()", None), record("local", "ngram", None)]

    def interrupted(cfg, prompts, arms, model, tokenizer, meta, records):
        records += rows
        raise stop()

    _bench_without_models(monkeypatch, interrupted)
    out = tmp_path / "out"
    argv = ["bench", "--methods", "", "--local-methods", "ngram", "--datasets", "spec_bench", "--categories",
            "writing", "--spec-bench", str(spec_bench), "--out", str(out)]
    if stop is KeyboardInterrupt:
        assert main(argv) == 130
    elif stop is RuntimeError:
        assert main(argv) == 2  # the CLI reports the error on one line
    else:
        with pytest.raises(SystemExit):
            main(argv)
    kept = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in kept] == ["generate()", "ngram"] and not (out / "table.md").exists()
    err = capsys.readouterr().err
    assert "the 2 answers finished are in" in err
    assert ("bench: stopped by the error below;" in err) == (stop is RuntimeError)
    assert ("splitspec: interrupted" in err) == (stop is KeyboardInterrupt)  # QA 57: Ctrl-C exited without a word

def test_prompts_that_do_not_fit_are_refused_before_measuring(stories):
    """QA 58: a run reaching a prompt longer than the target's context died there, after minutes of
    answers (and, then, kept none of them); one that left less room than --max-new-tokens had every
    arm stop at the full context while generate() ran on, and failed as lossy at the end."""
    from types import SimpleNamespace

    _, tokenizer, _ = stories
    context = lambda n: SimpleNamespace(config=SimpleNamespace(max_position_embeddings=n))  # noqa: E731
    prompts = [{"category": "writing", "id": "1", "text": "a short one"},
               {"category": "rag", "id": "2", "text": "word " * 700}]
    with pytest.raises(ValueError, match=r"1 of the 2 prompts do not fit \(the target's context is 512 tokens, prompt "
                                         r"and --max-new-tokens 16 together\): rag/2 \(\d+ tokens\)"):
        bench_mod.check_prompts_fit(prompts, context(512), tokenizer, 16, split=False)
    bench_mod.check_prompts_fit(prompts, context(8192), tokenizer, 16, split=False)
    n = len(bench_mod.encode_chat(tokenizer, [{"role": "user", "content": "word " * 50}]))
    near = [{"category": "qa", "id": "4", "text": "word " * 50}]
    bench_mod.check_prompts_fit(near, context(n + 48), tokenizer, 48, split=False)
    with pytest.raises(ValueError, match="qa/4"):
        bench_mod.check_prompts_fit(near, context(n + 47), tokenizer, 48, split=False)
    with pytest.raises(ValueError, match="a split prompt at most 4096"):
        bench_mod.check_prompts_fit([{"category": "rag", "id": "3", "text": "word " * 5000}], context(8192), tokenizer, 16,
                                    split=True)


# --- 8. output paths checked before measuring ---------------------------------------------------------

def test_output_paths_are_created_or_refused(tmp_path):
    assert writable_dir(tmp_path / "a" / "b").is_dir()
    assert writable_file(tmp_path / "c" / "d.md") == tmp_path / "c" / "d.md" and (tmp_path / "c").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="cannot write to the output folder"):
        writable_dir(blocker / "out")
    with pytest.raises(OSError, match="is a folder"):
        writable_file(tmp_path)


def test_bench_and_offline_eval_check_out_before_loading(tmp_path, monkeypatch, capsys, spec_bench):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(bench_mod, "load_model", _no_model)
    monkeypatch.setattr(offline_eval, "load_model", _no_model)
    rc = main(["bench", "--methods", "", "--local-methods", "", "--datasets", "spec_bench", "--spec-bench",
               str(spec_bench), "--out", str(blocker / "out")])
    assert rc == 2 and "cannot write to the output folder" in capsys.readouterr().err
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"task_id": "t/0", "prompt": "def f():\n", "test": "", "entry_point": "f"}) + "\n")
    rc = main(["offline-eval", "--problems", str(problems), "--out", str(blocker / "out")])
    assert rc == 2 and "cannot write to the output folder" in capsys.readouterr().err


def test_long_bench_creates_the_out_folder_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(long_bench, "load_model", _no_model)
    out = tmp_path / "new" / "lb.md"
    args = build_parser().parse_args(["long-bench", "--drafter", "ngram", "--lengths", "8", "--out", str(out)])
    with pytest.raises(LoadedAModel):
        long_bench.cmd_long_bench(args)
    assert out.parent.is_dir()


# --- 9. numeric options at parse time ---------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--context", "0"], ["--batch-nodes", "0"],
                                  ["--batch-nodes", "-1"], ["--prompts", "-1"], ["--new-tokens", "0"],
                                  ["--threads", "0"], ["--linear", ""], ["--linear", "torch,mkl"]])
def test_verify_cost_refuses_bad_numbers_at_parse_time(argv, capsys):
    assert "verify-cost" in _refused(["verify-cost", *argv], capsys)


def test_verify_cost_refuses_more_prompts_than_categories_before_loading(monkeypatch, spec_bench):
    monkeypatch.setattr(verify_cost_bench, "load_model", _no_model)
    args = build_parser().parse_args(["verify-cost", "--prompts", "100", "--spec-bench", str(spec_bench)])
    with pytest.raises(ValueError, match="--prompts 100: the Spec-Bench questions have"):
        verify_cost_bench.cmd_verify_cost(args)


@pytest.mark.parametrize("argv", [["--lengths", ""], ["--lengths", "abc"], ["--lengths", "0"], ["--lengths", "8,8"],
                                  ["--penalty", "0"], ["--penalty", "nan"], ["--penalty-window", "0"],
                                  ["--threads", "0"]])
def test_long_bench_refuses_bad_numbers_at_parse_time(argv, capsys):
    assert "long-bench" in _refused(["long-bench", *argv], capsys)


def test_long_bench_checks_the_penalty_before_loading(monkeypatch):
    monkeypatch.setattr(long_bench, "load_model", _no_model)
    args = build_parser().parse_args(["long-bench", "--drafter", "ngram", "--lengths", "8"])
    args.penalty = float("inf")  # past argparse: SamplingParams refuses it before the model loads
    with pytest.raises(ValueError, match="contextual penalty"):
        long_bench.cmd_long_bench(args)


# --- 11. bench profiles ---------------------------------------------------------------------------------

def _bench_config(*argv: str):
    return bench_mod.BenchConfig.from_args(build_parser().parse_args(["bench", *argv]))


def test_bench_refuses_a_cut_link_and_a_goal_profile_outside_the_run():
    with pytest.raises(ValueError, match="offline cuts the link"):
        _bench_config("--profiles", "offline")
    with pytest.raises(ValueError, match="offline cuts the link"):
        _bench_config("--profiles", "lan~offline/5s")
    with pytest.raises(ValueError, match="--goal-profile lan is not a profile of this run"):
        _bench_config("--profiles", "4g", "--goal-profile", "lan")
    with pytest.raises(ValueError, match="--goal-profile 4g"):
        _bench_config("--goal-profile", "4g")  # no --profiles: plain loopback
    assert _bench_config("--profiles", "lan,4g", "--goal-profile", "lan").goal == "lan"
    default = _bench_config()
    assert default.goal == "4g" and "--goal-profile" not in default.command()  # the command repeats as given


def test_goal_section_says_when_the_goal_profile_was_not_run():
    rows = [r for r in synthetic_run() if r.profile != "4g"]
    assert "Profile 4g was not among this run's link profiles (lan)" in render_markdown(rows, META)
    assert "was not among" not in render_markdown(synthetic_run(), META)
    local = [r for r in synthetic_run() if r.mode == "local"]  # --methods '' (QA 57: "run with --profiles 4g")
    assert "This run has no split methods" in render_markdown(local, META)
    assert "--profiles 4g" not in render_markdown(local, META)


# --- 12. offline-eval: like with like -----------------------------------------------------------------

def test_offline_ratio_is_against_the_targets_decoding_only():
    ref = {"drafter": offline_eval.REFERENCE, "task_id": "t/0", "new_tokens": 11, "elapsed_s": 3.0, "decode_s": 1.0,
           "passed": False, "completion": "a"}
    run = {"drafter": "moa", "task_id": "t/0", "cut": True, "fraction": 0.5, "common_prefix": 1, "offline_s": 1.0,
           "offline_tokens": 20, "passed": False, "completion": "b", "prefix_equal": True}
    (row,) = offline_eval.summarize([ref, run])
    assert row["vs_target"] == pytest.approx(20 / 10)  # 10 decoded tokens in 1 s, not 11 tokens in 3 s
    assert row["target_timing"] == "decoding only"
    old = {k: v for k, v in ref.items() if k != "decode_s"}  # an earlier run's records (--rescore)
    (row,) = offline_eval.summarize([old, run])
    assert row["vs_target"] == pytest.approx(20 / (11 / 3)) and "prefill included" in row["target_timing"]


def test_reference_decode_time_leaves_the_prefill_out(stories):
    model, tokenizer, _ = stories
    tokens, elapsed, decode = offline_eval.timed_target_greedy(model, [1, 2, 3, 4], 6, [])
    assert len(tokens) == 6 and 0 < decode < elapsed


# --- 13. the docs list every bench command ------------------------------------------------------------

def test_readme_lists_every_bench_command():
    from splitspec.bench.cli import add_bench_parsers

    sub = argparse.ArgumentParser().add_subparsers()
    add_bench_parsers(sub)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
    rooms_row = next(line for line in readme if line.startswith("| `bench/` |"))
    layout_line = next(line for line in readme if line.startswith("bench/ "))
    assert all(f"`{name}`" in rooms_row and f" {name}" in layout_line for name in sub.choices), (rooms_row, layout_line)


@pytest.mark.parametrize("argv", [["--chunks", "512,512"], ["--chunks", "-1"], ["--chunks", "a"], ["--chunks", ","],
                                  ["--rounds", "0"], ["--prompt-tokens", "0"]])
def test_prefill_bench_refuses_bad_points_at_parse_time(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill-bench", *argv])
    assert "error" in capsys.readouterr().err


def test_prefill_bench_table_compares_with_one_forward():
    from splitspec.bench.prefill_bench import PrefillPoint, format_table

    table = format_table([PrefillPoint(0, [4000.0], [40.0, 44.0, 48.0], [4100.0]),
                          PrefillPoint(512, [4400.0], [40.0, 44.0], [600.0, 1200.0])], 2000)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "1.10x" in rows["512"] and "1200" in rows["512"] and "30.0x" in rows["512"]  # 1200 ms against the idle p50 of 40
    assert "1.00x" in rows["off (one forward)"] and "| / one forward |" in table
    # without a one-forward run the column says what it is against (QA 57: "/ one forward" over chunk 32)
    chunked = format_table([PrefillPoint(32, [4000.0], [40.0], [100.0])], 2000)
    assert "| / chunk 32 |" in chunked and "one forward" not in chunked


def test_serve_bench_interleaves_its_points_and_reports_them_by_server(monkeypatch, capsys):
    """Every server starts before the first measurement, each client count runs on every server in
    turn (a drift over the run falls on compared points alike), --rounds repeats that whole pass, and
    the table lists each server's points together, once per point; every server is stopped."""
    started, stopped, measured = [], [], []

    def start(target, port, extra=(), threads=None):
        started.append(extra[1])  # --max-batch N
        return f"server-{len(started)}"

    def clients(address, n, prompts, drafter, fingerprint, target, seconds, max_new_tokens, **kw):
        if seconds != 2.0:  # not the warm-up
            measured.append((address, n))
        return n * 10, 1.0, [10.0] * n, [5.0, 6.0]

    monkeypatch.setattr(serve_bench, "start_server", start)
    monkeypatch.setattr(serve_bench, "stop_server", stopped.append)
    monkeypatch.setattr(serve_bench, "run_clients", clients)
    monkeypatch.setattr(serve_bench, "forward_batches", lambda port: (0.0, 0.0))
    monkeypatch.setattr(serve_bench, "shared_target", lambda drafter, target: None)
    monkeypatch.setattr(serve_bench, "load_tokenizer", lambda target: None)
    monkeypatch.setattr(serve_bench, "tokenizer_fingerprint", lambda tokenizer: "fp")
    monkeypatch.setattr(serve_bench, "encode_chat", lambda tokenizer, messages: [1, 2])
    ports = iter(range(9000, 9100))
    monkeypatch.setattr(serve_bench, "free_port", lambda: next(ports))
    args = argparse.Namespace(target="t", drafter="ngram", seconds=20.0, max_new_tokens=8, threads=2, device="cpu",
                              dtype="float32", client_processes=1, out=None, rounds=2)
    points = serve_bench.serve_points([(1, "ragged"), (8, "ragged")], [5.0])
    serve_bench._run_points(args, [1, 4], points, [{"text": "hi"}])
    assert started == ["1", "8"] and stopped == ["server-1", "server-2"]
    first, second = "127.0.0.1:9000", "127.0.0.1:9002"
    assert measured == [(first, 1), (second, 1), (first, 4), (second, 4)] * 2
    rows = [line.split("|")[1:3] for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "max" not in line]
    assert [(a.strip(), b.strip()) for a, b in rows] == [("1", "1"), ("1", "4"), ("8, window 5 ms", "1"),
                                                        ("8, window 5 ms", "4")]


def test_bench_command_line_repeats_empty_method_lists():
    """QA 57 bench finding 2: `--methods ''` (no split method) was left out of the printed command,
    and the command then ran every default split method."""
    import shlex

    from splitspec.cli.main import build_parser

    parser = build_parser()
    for argv in (["bench", "--methods", "none,ngram", "--local-methods", ""], ["bench", "--methods", "", "--local-methods", "moa"]):
        cfg = bench_mod.BenchConfig.from_args(parser.parse_args(argv))
        again = bench_mod.BenchConfig.from_args(parser.parse_args(shlex.split(cfg.command())[1:]))
        assert again == cfg


def test_bench_keeps_an_earlier_run_unless_overwrite(tmp_path, monkeypatch, capsys, spec_bench):
    """QA 57 bench finding 3: a second run replaced the first silently, and an interrupted one left its
    partial results.jsonl beside the earlier run's table and plots."""
    rows = [record("local", "generate()", None), record("local", "ngram", None)]
    _bench_without_models(monkeypatch, lambda *args: rows)
    out = tmp_path / "out"
    out.mkdir()
    (out / "table.md").write_text("earlier\n")
    (out / "itl_p99.png").write_text("earlier")
    (out / "notes.txt").write_text("mine")
    argv = ["bench", "--methods", "", "--local-methods", "ngram", "--datasets", "spec_bench", "--categories",
            "writing", "--spec-bench", str(spec_bench), "--out", str(out)]
    assert main(argv) == 2
    assert "holds an earlier run (table.md, itl_p99.png): --overwrite" in capsys.readouterr().err
    assert (out / "table.md").read_text() == "earlier\n"
    assert main(argv + ["--overwrite"]) == 0
    assert (out / "table.md").read_text() != "earlier\n" and not (out / "itl_p99.png").exists()
    assert (out / "notes.txt").read_text() == "mine"  # only the files a run writes are removed


def test_offline_eval_refuses_ngram_before_loading_and_rescore_creates_nothing(tmp_path, monkeypatch, capsys):
    """QA 57 bench finding 10: `--drafters ngram` was refused only after the target loaded, and
    `--rescore` on a missing --out created the folder before refusing."""
    monkeypatch.setattr(offline_eval, "load_model", _no_model)
    assert main(["offline-eval", "--drafters", "moa,ngram", "--out", str(tmp_path / "o")]) == 2
    assert "'ngram' cannot write alone" in capsys.readouterr().err
    assert main(["offline-eval", "--rescore", "--out", str(tmp_path / "missing")]) == 2
    assert not (tmp_path / "missing").exists()


def test_an_interrupted_offline_eval_keeps_the_problems_answered(tmp_path, monkeypatch, capsys, stories_path):
    """QA 57 bench finding 1: Ctrl-C after some problems wrote nothing; their answers are now kept
    for --rescore."""
    problems = tmp_path / "p.jsonl"
    problems.write_text("".join(json.dumps({"task_id": f"t/{i}", "prompt": "def f():\n", "test": "", "entry_point": "f"})
                                + "\n" for i in range(3)))
    answered = []

    def run_problem(problem, *args):
        if len(answered) == 2:
            raise KeyboardInterrupt
        answered.append(problem["task_id"])
        return [{"drafter": offline_eval.REFERENCE, "task_id": problem["task_id"]}]

    monkeypatch.setattr(offline_eval, "run_problem", run_problem)
    out = tmp_path / "out"
    assert main(["offline-eval", "--target", str(stories_path), "--drafters", f"draft-model:{stories_path}@layers=3",
                 "--cut-after", "2", "--max-new-tokens", "4", "--problems", str(problems), "--limit", "3",
                 "--out", str(out)]) == 130
    kept = [json.loads(line)["task_id"] for line in (out / "results.jsonl").read_text().splitlines()]
    assert kept == ["t/0", "t/1"] and json.loads((out / "run.json").read_text())["interrupted_after"] == 2
    assert "the answers to 2 of 3 problems are in" in capsys.readouterr().err


def test_demo_keeps_the_lsa_placement_a_user_chose():
    """QA 57 bench finding 4: `demo --drafter 'moa;lsa=client'` ran with LSA on the server."""
    from splitspec.bench.demo import demo_drafter

    assert demo_drafter(None, "smollm2-135m")[1] and demo_drafter("moa", "smollm2-135m")[0].lsa == "server"
    chosen, on_server = demo_drafter("moa;lsa=client", "smollm2-135m")
    assert chosen.lsa == "client" and not on_server
    from splitspec.shared.drafters.spec import DrafterSpec

    assert demo_drafter("ngram", "smollm2-135m") == (DrafterSpec.parse("ngram"), False)


def test_impossible_serve_and_prefill_bench_runs_are_refused_before_any_server(capsys, monkeypatch):
    """QA 57 bench finding 11: --seconds inf measured forever; a prompt over the service's limit and
    :graphs on a CPU server failed only after servers had started."""
    from splitspec.bench import prefill_bench

    assert "finite" in _refused(["serve-bench", "--seconds", "inf"], capsys)
    monkeypatch.setattr(serve_bench, "load_tokenizer", _no_model)
    monkeypatch.setattr(prefill_bench, "load_tokenizer", _no_model)
    assert main(["serve-bench", "--max-batch", "1:graphs"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err
    assert main(["prefill-bench", "--prompt-tokens", "9000"]) == 2
    assert "over the verify service's prompt limit of 4096" in capsys.readouterr().err
