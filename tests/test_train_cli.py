"""Input checks of `splitspec train` / `distill-data` (QA of the training commands): bad sizes and
held-out counts refused before anything runs, no held-out figures without held-out conversations,
distill-data files checked (header, records, target) with errors naming the file and line, and
run folders neither resumed into another recipe nor overwritten unasked."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from splitspec.cli.main import build_parser
from splitspec.train import distill
from splitspec.train.data import split_heldout
from splitspec.train.distill import DistillConfig, check_target, distill_data, load_distilled, same_model
from splitspec.train.trainer import TrainConfig, train

from .test_train_fast import _conversations, _small


@pytest.mark.parametrize("argv", [
    ["train", "--drafter", "eagle2", "--out", "x", "--heldout", "-1"],
    ["train", "--drafter", "eagle2", "--out", "x", "--batch", "0"],
    ["train", "--drafter", "eagle2", "--out", "x", "--batch", "-2"],
    ["train", "--drafter", "eagle2", "--out", "x", "--epochs", "0"],
    ["train", "--drafter", "eagle2", "--out", "x", "--max-tokens", "0"],
    # accepted until QA 56: -1 trained toward the largest KL with rc 0; the others were taken as no limit
    # or as the default
    ["train", "--drafter", "eagle2", "--out", "x", "--kl-weight", "-1"],
    ["train", "--drafter", "eagle2", "--out", "x", "--max-minutes", "-1"],
    ["train", "--drafter", "eagle2", "--out", "x", "--train-vocab", "-5"],
    ["train", "--drafter", "eagle2", "--out", "x", "--lr", "0"],
    ["distill-data", "--out", "x.jsonl", "--batch", "0"],
    ["distill-data", "--out", "x.jsonl", "--heldout", "-1"],
    ["distill-data", "--out", "x.jsonl", "--temperature", "-1"],
    ["draft-vocab", "--heldout", "-1"],
], ids=lambda argv: " ".join(argv[:1] + argv[-2:]))
def test_bad_sizes_are_refused_by_the_parser(argv, capsys):
    """A negative --heldout held out all but one conversation; --batch 0 / -2 and --epochs 0 crashed
    or trained nothing with rc 0: now argparse refuses them in one line."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert f"argument {argv[-2]}: must be " in capsys.readouterr().err


def test_bad_sizes_are_refused_by_the_configs():
    for bad in (dict(batch=0), dict(batch=-2), dict(epochs=0), dict(max_tokens=0), dict(heldout=-1)):
        with pytest.raises(ValueError, match="must be >= "):
            TrainConfig(drafter="moa", target="t", out=Path("x"), **bad)
    for bad, message in ((dict(kl_weight=-1.0), "kl_weight"), (dict(kl_weight=float("nan")), "kl_weight"),
                         (dict(lr=0.0), "lr must be"), (dict(staircase=2.0), r"staircase .* \[0, 1\]"),
                         (dict(max_minutes=-1.0), "max_minutes"), (dict(train_vocab=-5), "train_vocab")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(drafter="moa", target="t", out=Path("x"), **bad)
    for bad in (dict(batch=0), dict(heldout=-1), dict(temperature=-1.0)):
        with pytest.raises(ValueError):
            DistillConfig(target="t", out=Path("x.jsonl"), **bad)
    with pytest.raises(ValueError, match="heldout must be >= 0"):
        split_heldout([[{"role": "user", "content": "hi"}]] * 3, -1, 0)


def test_a_train_vocab_without_token_counts_says_how_to_make_them(stories, stories_path, tmp_path):
    """--train-vocab N for a target with no token counts names `draft-vocab` and --train-vocab 0 (it was
    a bare "No such file" naming a path the user never chose: QA 56)."""
    from splitspec.train.trainer import _vocab_ids

    cfg = TrainConfig(drafter="eagle2", target=str(stories_path), out=tmp_path / "run", train_vocab=256)
    with pytest.raises(FileNotFoundError, match="run `splitspec draft-vocab --target .*` first, or .* --train-vocab 0"):
        _vocab_ids(cfg, stories[1])
    assert _vocab_ids(TrainConfig(drafter="eagle2", target=str(stories_path), out=tmp_path / "run"), stories[1]) is None


def test_compressed_distill_output_is_refused():
    """distill-data --out x.jsonl.gz wrote plain JSONL under a .gz name."""
    for name in ("x.jsonl.gz", "x.jsonl.xz"):
        with pytest.raises(ValueError, match="writes plain JSONL"):
            DistillConfig(target="t", out=Path(name))


def test_no_heldout_conversations_give_no_heldout_figures(stories_path, tmp_path):
    """--heldout 0 reported held-out loss 0.0000 and top-1 0.0 as if measured: now NaN, and the card
    says nothing was held out; --eval-only without held-out conversations is refused."""
    out = train(_small(stories_path, tmp_path / "a", drafter="eagle2", max_tokens=150, heldout=0),
                progress=False)["eagle2"]
    assert out["heldout"] == out["heldout_scored"] == 0
    assert all(math.isnan(out[k]) for k in ("heldout_loss", "heldout_top1", "tau"))
    card = (tmp_path / "a" / "card.md").read_text()
    assert "- held-out: none (0 conversations held out" in card and "loss 0.0000" not in card
    with pytest.raises(ValueError, match="--heldout must be >= 1"):
        train(_small(stories_path, tmp_path / "b", drafter="eagle2", heldout=0, eval_only=True,
                     init=str(tmp_path / "a")), progress=False)


def test_the_record_says_how_many_heldout_conversations_were_scored(stories_path, tmp_path):
    """A held-out conversation with no assistant turn is held out but cannot be scored: the record
    counts both, and the card says what loss and top-1 pool over."""
    convs = _conversations(40, 1)
    convs = [c if i % 2 else c[:1] for i, c in enumerate(convs)]  # every other one: a user turn alone
    out = train(_small(stories_path, tmp_path / "a", drafter="eagle2", max_tokens=150, heldout=8,
                       conversations=convs), progress=False)["eagle2"]
    held = split_heldout(convs, 8, 0)[1]
    scored = sum(len(c) > 1 for c in held)
    assert (out["heldout"], out["heldout_scored"], len(out["per_conversation"])) == (len(held), scored, scored)
    assert 0 < scored < len(held)
    assert (f"held-out ({len(held)} conversations, loss and top-1 over the {scored} with an assistant turn"
            in (tmp_path / "a" / "card.md").read_text())


def _distilled(path: Path, records: list, header: dict | None = None, tail: str = "") -> Path:
    head = {"splitspec_distill": 1, "model_id": "m", "heldout": 1, "seed": 0} if header is None else header
    path.write_text("".join(json.dumps(r) + "\n" for r in [head, *records]) + tail)
    return path


def test_bad_distill_data_files_give_one_line_errors(tmp_path):
    """A truncated .gz, a record without a key, ids outside the vocabulary, a garbage or blank line
    and an empty file gave tracebacks or JSON errors naming no file: each now names the file and
    line; a torn last line (a killed distill-data) is skipped."""
    good = {"index": 0, "prompt_ids": [3] * 4, "answer_ids": [4] * 6}
    plain = _distilled(tmp_path / "ok.jsonl", [good, good])
    packed = tmp_path / "cut.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes() * 50)[:60])
    cases = {
        packed: "cut.jsonl.gz: cannot read it",
        _distilled(tmp_path / "key.jsonl", [good, {"prompt_ids": [1] * 9}]): "key.jsonl line 3: not a distill",
        _distilled(tmp_path / "oov.jsonl", [{**good, "answer_ids": [4, 600]}]): "oov.jsonl line 2: .* in \\[0, 512\\)",
        _distilled(tmp_path / "junk.jsonl", [good], tail="{oops\n" + json.dumps(good) + "\n"): "junk.jsonl line 3",
        _distilled(tmp_path / "blank.jsonl", [good], tail="\n" + json.dumps(good) + "\n"): "blank.jsonl line 3",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message):
            load_distilled(path, 64, vocab_size=512)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl line 1: not a distill-data header"):
        check_target(tmp_path / "empty.jsonl", "m")
    torn = _distilled(tmp_path / "torn.jsonl", [good, good], tail=json.dumps(good)[:20])
    assert len(load_distilled(torn, 64, vocab_size=512)) == 2
    assert len(load_distilled(plain, 64, slice(1, None), vocab_size=512)) == 1


def test_distill_data_of_another_model_is_refused(stories_path, tmp_path):
    """The header's model_id was only ever written: a file another target made trained a drafter on
    that tokenizer's ids. An alias and its upstream id, or two spellings of one folder, are one model."""
    made = _distilled(tmp_path / "other.jsonl", [{"index": 0, "prompt_ids": [3] * 4, "answer_ids": [4] * 6}],
                      header={"splitspec_distill": 1, "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
                              "target": "smollm2-135m", "heldout": 1, "seed": 0})
    with pytest.raises(ValueError, match="holds the answers of HuggingFaceTB/SmolLM2-135M-Instruct"):
        train(TrainConfig(drafter="eagle2", target=str(stories_path), out=tmp_path / "run", data=str(made),
                          heldout=1, max_tokens=100, compile="off", dtype="float32"), progress=False)
    assert not (tmp_path / "run" / "examples.pt").exists()
    from splitspec.train.throughput import bench_throughput

    with pytest.raises(ValueError, match="holds the answers of HuggingFaceTB/SmolLM2-135M-Instruct"):  # train-bench too
        bench_throughput(TrainConfig(drafter="eagle2", target=str(stories_path), out=tmp_path / "bench",
                                     data=str(made), heldout=1, compile="off", dtype="float32"), tokens=100)
    assert same_model("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m")
    relative = Path(*[".."] * len(Path.cwd().parts)) / str(stories_path).lstrip("/")
    assert same_model(str(relative), str(stories_path)) and not same_model(str(stories_path), "smollm2-135m")
    assert not same_model(f"{stories_path}@layers=2", str(stories_path))
    with pytest.raises(ValueError, match="does not say which model"):
        check_target(_distilled(tmp_path / "bare.jsonl", [], header={"splitspec_distill": 1}), "m")


def test_distill_data_leaves_other_files_untouched_and_rewrites_atomically(stories_path, tmp_path, monkeypatch):
    """distill-data trimmed a file's last line before finding it was no distill-data file, and
    rewrote files in place: now the header is checked first, and a torn line is trimmed through a
    temporary file (a failure during the rewrite leaves the old file whole)."""
    convs = _conversations(12, 4)
    common = dict(target=str(stories_path), batch=2, limit=4, max_new_tokens=4, heldout=2)
    other = tmp_path / "notes.txt"
    other.write_text("line one\nline two no newline")
    with pytest.raises(ValueError, match="not a distill-data header"):
        distill_data(DistillConfig(out=other, **common), convs)
    assert other.read_text() == "line one\nline two no newline"
    path = tmp_path / "d.jsonl"
    distill_data(DistillConfig(out=path, **common), convs)
    whole = path.read_text()
    path.write_text(whole + '{"index": 4, "prompt')  # what a kill mid-write leaves

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(distill.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        distill_data(DistillConfig(out=path, **common), convs)
    assert path.read_text() == whole + '{"index": 4, "prompt'
    monkeypatch.undo()
    distill_data(DistillConfig(out=path, **common), convs)
    assert path.read_text() == whole
    # a damaged line before the end: extended as it was, train refused the file later (QA 58)
    lines = whole.splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + "garbage{\n" + "".join(lines[3:]))
    with pytest.raises(ValueError, match=r"d.jsonl line 3: not a distill-data record, .* \(head -n 2\)"):
        distill_data(DistillConfig(out=path, **{**common, "limit": 8}), convs)


def test_run_folders_are_resumed_only_into_the_same_run(stories_path, tmp_path):
    """--resume on a folder without state started from scratch, a changed drafter list crashed with a
    KeyError, a changed batch or lr went unnoticed, and a new run silently replaced an old one's
    checkpoints: each is refused now, before any model loads; --overwrite starts afresh on purpose."""
    run = tmp_path / "run"
    train(_small(stories_path, run, drafter="eagle2", max_tokens=150), progress=False)
    with pytest.raises(ValueError, match="--resume continues it, --overwrite starts afresh"):
        train(_small(stories_path, run, drafter="eagle2", max_tokens=150), progress=False)
    with pytest.raises(ValueError, match="holds a run of eagle2, not of moa-tli0, eagle2"):
        train(_small(stories_path, run, max_tokens=150, resume=True), progress=False)
    with pytest.raises(ValueError, match=r"settings changed \(max_tokens 150 -> 300; batch 4 -> 2; lr 0.002 -> 0.01\)"):
        train(_small(stories_path, run, drafter="eagle2", max_tokens=300, batch=2, lr=0.01, resume=True),
              progress=False)
    with pytest.raises(ValueError, match="holds no saved run"):
        train(_small(stories_path, tmp_path / "new", drafter="eagle2", max_tokens=150, resume=True), progress=False)
    again = train(_small(stories_path, run, drafter="eagle2", max_tokens=150, overwrite=True), progress=False)
    assert again["eagle2"]["step"] >= 1
    resumed = train(_small(stories_path, run, drafter="eagle2", max_tokens=150, resume=True, eval_prompts=2),
                    progress=False)  # finished: nothing left to do, evaluation settings may differ
    assert resumed["eagle2"]["step"] == again["eagle2"]["step"]
    longer = train(_small(stories_path, run, drafter="eagle2", max_tokens=150, resume=True, epochs=2),
                   progress=False)  # more epochs extend the run, and its card says so
    assert longer["eagle2"]["step"] == 2 * again["eagle2"]["step"]
    assert (f"- resumed with changed settings: epochs 1 -> 2 at step {again['eagle2']['step']}"
            in (run / "card.md").read_text())


def test_qa58_run_folder_states_each_get_a_consistent_answer(stories_path, tmp_path):
    """QA 58 training findings 2, 5, 6 and 9: --overwrite left the earlier run's best/ (another recipe's
    weights) in place; a folder with checkpoints but no state was refused by a new run ("--resume
    continues it") and by --resume ("leave --resume out"); a damaged state gave an error naming no
    file; a resume whose --max-minutes was spent trained one more step without a word."""
    run = tmp_path / "run"
    train(_small(stories_path, run, drafter="eagle2", max_tokens=150), progress=False)
    assert (run / "best" / "model.safetensors").exists()
    train(_small(stories_path, run, drafter="eagle2", max_tokens=150, eval_prompts=0, lr=0.01, overwrite=True),
          progress=False)
    assert not (run / "best").exists()  # this run measured no tau: no best of its own, and none of the last one's
    assert "tau not measured (--eval-prompts 0), so no best/ checkpoint is kept" in (run / "card.md").read_text()
    with pytest.raises(ValueError, match=r"the run has trained 0\.\d+ min, and --max-minutes 0\.0001 counts over all"):
        train(_small(stories_path, run, drafter="eagle2", max_tokens=150, eval_prompts=0, lr=0.01, resume=True,
                     max_minutes=0.0001), progress=False)
    (run / "trainer_state.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"--resume: .*trainer_state.pt cannot be read .*--overwrite starts afresh"):
        train(_small(stories_path, run, drafter="eagle2", max_tokens=150, eval_prompts=0, lr=0.01, resume=True),
              progress=False)
    (run / "trainer_state.pt").unlink()  # as a kill between the first checkpoint and the first state leaves it
    with pytest.raises(ValueError, match="stopped before it saved its state .* it cannot be resumed; --overwrite"):
        train(_small(stories_path, run, drafter="eagle2", max_tokens=150), progress=False)
    with pytest.raises(ValueError, match="holds no saved run"):
        train(_small(stories_path, run, drafter="eagle2", max_tokens=150, resume=True), progress=False)
    # a single drafter's run writes into the folder itself: a run of two over it leaves none of it there
    train(_small(stories_path, run, max_tokens=150, overwrite=True), progress=False)
    assert not (run / "model.safetensors").exists() and not (run / "best").exists()
    assert (run / "eagle2" / "model.safetensors").exists() and (run / "moa-tli0" / "model.safetensors").exists()


def test_qa58_cards_reproduce_what_ran(stories_path, tmp_path):
    """QA 58 training findings 3 and 4: a single MoA's card said `--drafter moa-tli1` (a folder name the
    parser refuses) and left out --heldout (which decides the training split); a resume with another
    --micro-batch or --dtype went unrecorded."""
    from splitspec.train.cli import train_config

    run = tmp_path / "run"
    out = train(_small(stories_path, run, drafter="moa", tli=1, max_tokens=150), progress=False)["moa-tli1"]
    card = (run / "card.md").read_text()
    line = card[card.index("Reproduce: `") + len("Reproduce: `"): card.index(" --out DIR`")]
    assert "--drafter moa:tli=1 " in line and " --heldout 2" in line
    argv = line.split()[1:]  # splitspec train ... as a user would type it
    cfg = train_config(build_parser().parse_args([*argv, "--out", str(tmp_path / "again")]))
    assert [j.name for j in cfg.jobs()] == ["moa-tli1"] and cfg.heldout == 2
    train(_small(stories_path, run, drafter="moa", tli=1, max_tokens=150, resume=True, epochs=2, micro_batch=2),
          progress=False)
    assert (f"- resumed with changed settings: epochs 1 -> 2 at step {out['step']}; micro_batch 0 -> 2 at step "
            f"{out['step']}" in (run / "card.md").read_text())


def test_qa58_training_flags_that_did_nothing_are_refused(stories_path, tmp_path):
    """QA 58 training findings 1, 7, 10: --eval-only --device cuda without CUDA gave a traceback; an
    --init folder that does not exist trained from scratch (rc 0); --tli beside a drafter list, and
    --time-schedule without --max-minutes, were ignored."""
    import torch

    with pytest.raises(ValueError, match="--init .*nowhere: no such folder"):
        train(_small(stories_path, tmp_path / "a", drafter="eagle2", max_tokens=150, init=str(tmp_path / "nowhere")),
              progress=False)
    with pytest.raises(ValueError, match="--tli is for a single plain `moa`"):
        TrainConfig(drafter="moa,eagle2", target="x", out=tmp_path, tli=1).jobs()
    with pytest.raises(ValueError, match="--tli is for a single plain `moa`"):
        TrainConfig(drafter="moa:tli=2", target="x", out=tmp_path, tli=1).jobs()
    with pytest.raises(ValueError, match="--time-schedule follows --max-minutes"):
        TrainConfig(drafter="moa", target="x", out=tmp_path, time_schedule=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: this torch has no CUDA"):
            train(_small(stories_path, tmp_path / "b", drafter="eagle2", eval_only=True, device="cuda",
                         init=str(tmp_path)), progress=False)


def test_saved_tensors_are_as_readable_as_the_umask_allows(tmp_path):
    """QA 58 training finding 8: safetensors 0.8 writes its files 0600, so another user could not
    load a trained checkpoint (every other file of the run was 0644)."""
    import os

    import torch

    from splitspec.shared.drafters.checkpoint import _umask, save_tensors

    save_tensors({"w": torch.zeros(2)}, tmp_path / "model.safetensors", {"kind": "test"})
    assert os.stat(tmp_path / "model.safetensors").st_mode & 0o777 == 0o666 & ~_umask()
    assert not list(tmp_path.glob("*.tmp"))


def test_a_damaged_examples_cache_is_built_again(tmp_path, monkeypatch, caplog):
    """QA 58 training finding 6: a truncated examples.pt (only a cache) stopped every run, --overwrite
    included, with "[Errno 22] Invalid argument"."""
    from splitspec.train import trainer

    built = []
    monkeypatch.setattr(trainer, "load_examples", lambda cfg, tok: built.append(1) or ([], [[{"x": 1}]]))
    monkeypatch.setattr(trainer, "_data_files_state", lambda data: [])

    class Tok:
        name_or_path = "t"

        def __len__(self):
            return 10

    cfg = TrainConfig(drafter="eagle2", target="x", out=tmp_path, overwrite=True)
    (tmp_path / trainer.EXAMPLES).write_bytes(b"PK\x03\x04 truncated")
    assert trainer.cached_examples(cfg, Tok()) == ([], [[{"x": 1}]]) and built == [1]
    assert "cannot be read" in caplog.text
    assert trainer.cached_examples(cfg, Tok()) == ([], [[{"x": 1}]]) and built == [1]  # the rebuilt cache serves
