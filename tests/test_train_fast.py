"""The fast trainer (train/batched.py, train/trainer.py): equal to the reference path, several
drafters on one target pass, clean stops and exact resumes, distilled data, size limits."""
from __future__ import annotations

import gzip
import lzma
import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from splitspec.shared.drafters.target_parts import TargetParts
from splitspec.train.batched import (LossOptions, batch_chunk_starts, eagle_loss_batch, make_batch,
                                     moa_loss_batch, run_target_batch)
from splitspec.train.data import tokenize_conversation
from splitspec.train.objectives import eagle_loss, moa_loss, run_target
from splitspec.train.trainer import (CheckpointTooLarge, DrafterJob, TrainConfig, Trainee, attention_backends,
                                     build_drafter, check_size, sa_window, train, trainee_loss)


def _conversations(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    words = "the a little dog cat ran sat on mat big red ball happy sun tree".split()
    text = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    return [[{"role": "user", "content": text(rng.randint(3, 10))},
             {"role": "assistant", "content": text(rng.randint(8, 40))}] for _ in range(n)]


@pytest.fixture(scope="module")
def examples(stories):
    _, tokenizer, _ = stories
    out = [tokenize_conversation(tokenizer, c, 128) for c in _conversations(3, 0)]
    assert len({len(e.input_ids) for e in out}) == 3  # different lengths: the batch is padded
    return out


def _reference(job: DrafterJob, drafter, parts, model, examples, starts):
    """Token-weighted mean of the reference path's per-conversation losses."""
    total, rows = 0.0, 0
    for ex, s in zip(examples, starts):
        target = run_target(model, torch.tensor(ex.input_ids), ex.loss_mask)
        loss, _ = (moa_loss(drafter, parts, target, s) if job.kind == "moa"
                   else eagle_loss(drafter, parts, target, 0.0, None))
        n = int(target.trained.numel()) - (0 if job.kind == "moa" else int((target.trained < 1).sum()))
        total, rows = total + loss * n, rows + n
    return total / rows


@pytest.mark.parametrize("job", [DrafterJob("moa"), DrafterJob("moa", 1), DrafterJob("eagle2")], ids=str)
def test_fast_path_equals_reference(stories, examples, job):
    """fp32, full vocabulary, fully causal SA, raw TLI target: the batched loss and its gradients
    equal the reference's; in bf16 autocast the loss stays within bf16 tolerance."""
    model, _, _ = stories
    torch.manual_seed(0)
    drafter = build_drafter(job, model.config)
    parts = TargetParts(model, job.tli)
    batch = make_batch(examples)
    starts = batch_chunk_starts(batch, 1, 4, random.Random(0))
    per_example = [starts[b, : len(e.input_ids)] for b, e in enumerate(examples)]
    target = run_target_batch(model, batch, (parts.first_tli_layer,) if job.tli else ())
    fast = (moa_loss_batch(drafter, parts, target, starts, LossOptions(), torch.float32)[0] if job.kind == "moa"
            else eagle_loss_batch(drafter, parts, target, LossOptions(), torch.float32)[0])
    ref = _reference(job, drafter, parts, model, examples, per_example)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    g_fast = torch.autograd.grad(fast, list(drafter.parameters()))
    g_ref = torch.autograd.grad(ref, list(drafter.parameters()))
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        target16 = run_target_batch(model, batch, (parts.first_tli_layer,) if job.tli else ())
        bf16 = (moa_loss_batch(drafter, parts, target16, starts, LossOptions(), torch.bfloat16)[0]
                if job.kind == "moa" else eagle_loss_batch(drafter, parts, target16, LossOptions(), torch.bfloat16)[0])
    assert abs(bf16.item() - ref.item()) <= 0.03 * ref.item()


def test_chunk_starts_equals_the_per_token_rule():
    """`chunk_starts` (a running maximum in numpy) gives, for random masks, chunk lengths and
    offsets, what the per-token rule gives: position 0 and every position from 1 on that is outside
    an assistant turn or on the chunk grid start a chunk; s(i) is the last start <= i (1 if none);
    and it draws from `rng` as that rule did (one `randrange(chunk)`)."""
    from splitspec.train.objectives import chunk_starts

    def rule(mask, chunk, rng):
        offset = rng.randrange(chunk)
        starts, current = [], 1
        for i, m in enumerate(mask):
            if i >= 1 and (not m or (i - offset) % chunk == 0):
                current = i
            starts.append(current)
        return starts

    gen = random.Random(7)
    for trial in range(300):
        n = gen.choice([1, 2, 3, 17, 64, 301])
        mask = [int(gen.random() < gen.choice([0.0, 0.5, 0.9, 1.0])) for _ in range(n)]
        chunk = gen.randint(1, 9)
        seed = gen.randrange(1 << 30)
        a, b = random.Random(seed), random.Random(seed)
        got = chunk_starts(mask, chunk, a)
        assert got.dtype == torch.long and got.tolist() == rule(mask, chunk, b), (mask, chunk)
        assert a.random() == b.random()  # the same draws were taken


# operators that make the host wait for a GPU: `.item()` / `.tolist()` / `float()` of a device tensor, and
# boolean-mask indexing (its `nonzero`)
HOST_WAITS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select", "aten::is_nonzero")


@pytest.mark.parametrize("job", [DrafterJob("moa"), DrafterJob("moa", 1), DrafterJob("eagle2"), DrafterJob("falcon"),
                                 DrafterJob("tokenswift")], ids=str)
def test_a_training_step_never_waits_for_the_device(stories, job):
    """Making a batch, the target's pass over it, scoring it, back-propagating and the optimizer step
    issue no operator that would make the host wait for a GPU (session 47's H200 step waited 24
    times: `.item()` of every metric, boolean-mask indexing), and the metrics, read once afterwards,
    are those of a float-metric pass.
    Counted on the CPU, so what it cannot see is a `.tolist()` (no operator on a CPU tensor; Falcon's
    CSGD makes one a step to draw its glances) and host-to-device copies (`to_device` pins them)."""
    from torch.profiler import ProfilerActivity, profile

    import splitspec.train.trainer as trainer

    model, tokenizer, _ = stories
    chosen = [tokenize_conversation(tokenizer, c, 128) for c in _conversations(4, 5)]
    cfg = TrainConfig(drafter=job.name, target="x", out=None, dtype="float32", batch=4, chunk_min=1, chunk_max=4,
                      staircase=0.0)
    layers = (TargetParts(model, job.tli).first_tli_layer,) if job.tli else ()
    torch.manual_seed(0)
    drafter = build_drafter(job, model.config)
    t = trainer.Trainee(job, drafter, TargetParts(model, job.tli), TargetParts(model, job.tli),
                        torch.optim.SGD(drafter.parameters(), lr=0.0), random.Random(1), torch.Generator(), None)
    if job.tli:
        t.scale = torch.ones(model.config.hidden_size)
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the batch and the frozen target's pass
        target = run_target_batch(model, make_batch(chosen), layers)
    waits = {e.key: e.count for e in prof.key_averages() if e.key in HOST_WAITS}
    assert waits == {}, waits
    state = t.rng.getstate(), t.gen.get_state()
    opts = LossOptions(sa_window=sa_window(cfg, 0, 10), eagle_noise=trainer.EAGLE_NOISE,
                       falcon_glance=trainer.FALCON_GLANCE, kl_weight=cfg.kl_weight,
                       tli_scale=t.scale if cfg.tli_norm else None)
    loss, floats = trainee_loss(cfg, t, target, opts, t.parts)  # before the step changes the weights
    t.rng.setstate(state[0])
    t.gen.set_state(state[1])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        s = trainer.AccumulatedStep(cfg, t, 0, 10, whole=True)
        s.add(target, None)
        metrics = s.finish()
    waits = {e.key: e.count for e in prof.key_averages() if e.key in HOST_WAITS}
    assert waits == {}, waits
    assert all(isinstance(v, torch.Tensor) for k, v in metrics.items() if k != "rows")
    read = trainer.host_metrics({"m": metrics})["m"]
    assert read["rows"] == floats["rows"] and read["loss"] == pytest.approx(loss.item(), rel=1e-6)
    for key in ("kl", "smooth_l1", "top1"):
        assert isinstance(floats[key], float) and read[key] == pytest.approx(floats[key], rel=1e-6), key


@pytest.mark.parametrize("job", [DrafterJob("moa"), DrafterJob("moa", 1), DrafterJob("eagle2")], ids=str)
def test_micro_batches_accumulate_the_whole_batchs_gradient(stories, job, monkeypatch):
    """fp32: a batch of 4 scored as micro-batches of 1 and 2 gives the gradients (after clipping)
    and metrics of the batch scored whole; padding to a shorter length changes only rounding."""
    import splitspec.train.trainer as trainer

    monkeypatch.setattr(trainer, "EAGLE_NOISE", 0.0)  # its draws follow the batch's shape
    model, tokenizer, _ = stories
    chosen = [tokenize_conversation(tokenizer, c, 128) for c in _conversations(4, 3)]
    assert len({len(e.input_ids) for e in chosen}) == 4
    cfg = TrainConfig(drafter=job.name, target="x", out=None, dtype="float32", batch=4, chunk_min=1, chunk_max=4,
                      staircase=0.0)
    layers = (TargetParts(model, job.tli).first_tli_layer,) if job.tli else ()

    def step(size: int):
        torch.manual_seed(0)
        drafter = build_drafter(job, model.config)
        t = trainer.Trainee(job, drafter, TargetParts(model, job.tli), TargetParts(model, job.tli),
                            torch.optim.SGD(drafter.parameters(), lr=0.0), random.Random(1), torch.Generator(), None)
        if job.tli:
            t.scale = torch.ones(model.config.hidden_size)  # else fixed from the first (micro-)batch
        s = trainer.AccumulatedStep(cfg, t, 0, 10, whole=size == len(chosen))
        for m in range(0, len(chosen), size):
            s.add(run_target_batch(model, make_batch(chosen[m: m + size]), layers), None)
        return trainer.host_metrics({"m": s.finish()})["m"], [p.grad.clone() for p in drafter.parameters()]

    whole, g_whole = step(4)
    for size in (1, 2):
        metrics, grads = step(size)
        assert metrics["rows"] == whole["rows"]
        for key in ("loss", "top1", "kl"):
            assert metrics[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
        for a, b in zip(grads, g_whole):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="micro_batch must divide"):
        TrainConfig(drafter="moa", target="x", out=None, batch=4, micro_batch=3)


def test_time_schedule_follows_the_clock_where_it_is_further_along():
    from splitspec.train.trainer import schedule_step

    cfg = TrainConfig(drafter="moa", target="x", out=None, max_minutes=10, time_schedule=True)
    assert schedule_step(cfg, 5, 1000, elapsed_s=0) == 5
    assert schedule_step(cfg, 5, 1000, elapsed_s=300) == 500  # half the minutes: half the schedule
    assert schedule_step(cfg, 900, 1000, elapsed_s=300) == 900  # the steps are further along
    assert schedule_step(cfg, 5, 1000, elapsed_s=6000) == 1000  # never past the end
    assert sa_window(cfg, schedule_step(cfg, 5, 1000, elapsed_s=301), 1000) is None  # the staircase is done
    off = TrainConfig(drafter="moa", target="x", out=None, max_minutes=10)
    assert schedule_step(off, 5, 1000, elapsed_s=300) == 5  # opt-in: a plain --max-minutes run keeps its steps


def test_staircase_window_ramps():
    cfg = TrainConfig(drafter="moa", target="x", out=None, staircase=0.5, max_len=512)
    assert sa_window(cfg, 0, 100) == 0 and sa_window(cfg, 25, 100) == 256 and sa_window(cfg, 50, 100) is None
    assert sa_window(TrainConfig(drafter="moa", target="x", out=None, staircase=0.0), 0, 100) is None


def test_drafter_list_parsing():
    cfg = TrainConfig(drafter="moa,moa:tli=1,eagle2", target="x", out=None)
    assert [j.name for j in cfg.jobs()] == ["moa-tli0", "moa-tli1", "eagle2"]
    assert TrainConfig(drafter="moa", tli=2, target="x", out=None).jobs() == [DrafterJob("moa", 2)]
    pooled = TrainConfig(drafter="moa,moa:pool=learned,moa:tli=1:pool=learned", target="x", out=None).jobs()
    assert [j.name for j in pooled] == ["moa-tli0", "moa-tli0-learned", "moa-tli1-learned"]
    assert pooled[2] == DrafterJob("moa", 1, "learned")
    for bad in ("moa:tli=x", "medusa", "moa,moa", "eagle2:tli=1", "moa:pool=max", "moa:tli=1:tli=2",
                "eagle2:pool=learned", "moa,moa:pool=mean"):
        with pytest.raises(ValueError):
            TrainConfig(drafter=bad, target="x", out=None).jobs()


def _small(stories_path, out, **kw) -> TrainConfig:
    base = dict(drafter="moa,eagle2", target=str(stories_path), out=out, max_tokens=500, batch=4, lr=2e-3,
                heldout=2, eval_every=1000, eval_prompts=1, eval_new_tokens=4, conversations=_conversations(40, 1),
                seed=5)
    return TrainConfig(**{**base, **kw})


def _weights(path) -> dict:
    saved = torch.load(path / "trainer_state.pt", weights_only=False)
    return {name: t["drafter"] for name, t in saved["trainees"].items()}


@pytest.mark.parametrize("job", [DrafterJob("moa"), DrafterJob("eagle2")], ids=str)
def test_kl_weight_sets_the_token_terms_share(stories, examples, job):
    """--kl-weight w: loss = w * CE(target || drafter) + SmoothL1."""
    model, _, _ = stories
    torch.manual_seed(0)
    drafter = build_drafter(job, model.config)
    parts = TargetParts(model, job.tli)
    batch = make_batch(examples)
    target = run_target_batch(model, batch, ())
    starts = batch_chunk_starts(batch, 1, 4, random.Random(0))
    for w in (0.1, 1.0, 0.0):
        opts = LossOptions(kl_weight=w)
        loss, m = (moa_loss_batch(drafter, parts, target, starts, opts, torch.float32) if job.kind == "moa"
                   else eagle_loss_batch(drafter, parts, target, opts, torch.float32))
        assert m["kl"] > 1.0
        torch.testing.assert_close(loss.item(), w * m["kl"] + m["smooth_l1"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["moa", "eagle2", "falcon", "tokenswift"])
def test_per_conversation_counts_pool_to_the_batch_figures(stories, examples, kind):
    """LossOptions(per_conversation=True) splits the batch's rows, top-1 matches and loss by
    conversation (what the held-out intervals resample): they add up to the pooled figures, and a
    conversation's counts are what it gives alone in a batch of one (padding changes nothing)."""
    model, _, _ = stories
    torch.manual_seed(0)
    job = DrafterJob(kind)
    drafter = build_drafter(job, model.config)
    parts = TargetParts(model, job.tli)
    opts = LossOptions(per_conversation=True)
    cfg = _small(Path("unused"), Path("unused"), drafter=kind)

    def measure(batch_examples):
        t = Trainee(job, drafter, parts, parts, None, random.Random(3), torch.Generator().manual_seed(3), Path("x"))
        target = run_target_batch(model, make_batch(batch_examples), (parts.first_tli_layer,) if job.tli else ())
        return trainee_loss(replace(cfg, dtype="float32"), t, target, opts, parts)

    with torch.no_grad():
        loss, m = measure(examples)
        counts = m["per_conversation"]
        assert len(counts) == len(examples) and all(n > 0 for n, _, _ in counts)
        rows = sum(n for n, _, _ in counts)
        assert rows == m["rows"]
        assert sum(hits for _, hits, _ in counts) / rows == pytest.approx(m["top1"])
        assert sum(loss for _, _, loss in counts) / rows == pytest.approx(loss.item(), rel=1e-5)
        if kind in ("eagle2", "tokenswift"):  # no random draws in the loss: compare with each one alone
            for i, example in enumerate(examples):
                _, alone = measure([example])
                (n, hits, total), = alone["per_conversation"]
                assert (n, hits) == tuple(counts[i][:2]) and total == pytest.approx(counts[i][2], rel=1e-4)


def test_kl_weight_reaches_the_training_step(stories_path, tmp_path):
    """The trainer passes --kl-weight on: the weights move differently, and the card and its
    Reproduce line say the weight (and only when it is not the default)."""
    base = dict(drafter="eagle2", max_tokens=200)
    train(_small(stories_path, tmp_path / "a", **base), progress=False)
    train(_small(stories_path, tmp_path / "b", kl_weight=1.0, **base), progress=False)
    a, b = _weights(tmp_path / "a")["eagle2"], _weights(tmp_path / "b")["eagle2"]
    assert any(not torch.equal(a[k], b[k]) for k in a)
    card = (tmp_path / "b" / "card.md").read_text()
    assert "- loss: 1 x forward KL" in card and "--kl-weight 1 " in card
    assert "--kl-weight" not in (tmp_path / "a" / "card.md").read_text()


def test_eval_only_measures_the_init_checkpoints_and_writes_nothing(stories_path, tmp_path, monkeypatch):
    """--eval-only gives each --init checkpoint the held-out figures its run ended with (within the
    bf16 rounding of the stored weights), trains nothing and writes nothing, and says how many
    prompts its tau used; a drafter without a checkpoint is refused. With --against it measures a
    second set of checkpoints on the same prompts and pairs the differences by prompt."""
    last = train(_small(stories_path, tmp_path / "run", eval_prompts=2), progress=False)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    records = train(_small(stories_path, tmp_path / "none", init=str(tmp_path / "run"), eval_only=True,
                           eval_prompts=5), progress=False)
    assert not (tmp_path / "none").exists()
    assert before == {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    scratch = train(_small(stories_path, tmp_path / "scratch", max_tokens=1, eval_every=1), progress=False)
    for name in ("moa-tli0", "eagle2"):
        got, want = records[name], last[name]
        assert got["init"] == str(tmp_path / "run" / name) and got["tokens_total"] == want["tokens_total"]
        assert abs(got["heldout_loss"] - want["heldout_loss"]) < 0.02 * want["heldout_loss"]
        assert abs(got["heldout_loss"] - want["heldout_loss"]) < abs(scratch[name]["heldout_loss"]
                                                                     - want["heldout_loss"]) / 4
        assert got["tau"] >= 1.0 and ("memory_gain" in got) == (name == "moa-tli0")
        assert got["tau_prompts"] == got["heldout"] == 2  # as many as there are held-out conversations
        low, high = got["tau_ci95"]  # the bootstrap over those two answers holds the pooled tau
        assert 1.0 <= low <= got["tau"] <= high
        low, high = want["tau_ci95"]  # the run's card states its interval
        assert f"tau {want['tau']:.2f} (95% interval {low:.2f} to {high:.2f} over the prompts)" in \
            (tmp_path / "run" / name / "card.md").read_text()
        assert "interval" not in (tmp_path / "scratch" / name / "card.md").read_text()  # one prompt: none
    with pytest.raises(ValueError, match="no checkpoint to evaluate"):
        train(_small(stories_path, tmp_path / "x", init=str(tmp_path / "run"), drafter="moa,falcon",
                     eval_only=True), progress=False)
    # --against: other checkpoints on the same prompts, the differences paired by prompt
    pair = train(_small(stories_path, tmp_path / "none", init=str(tmp_path / "run"), eval_only=True, eval_prompts=5,
                        against=str(tmp_path / "scratch")), progress=False)
    for name in ("moa-tli0", "eagle2"):
        got, base = pair[name], pair[name]["against"]
        assert base["init"] == str(tmp_path / "scratch" / name) and base["tokens_total"] == scratch[name]["tokens"]
        assert got["tau"] == records[name]["tau"] and got["tau_answers"] == records[name]["tau_answers"]
        assert len(got["tau_answers"]) == len(base["tau_answers"]) == 2
        paired = got["paired"]
        assert paired["tau_difference"] == pytest.approx(got["tau"] - base["tau"])
        assert paired["loss_difference"] == pytest.approx(got["heldout_loss"] - base["heldout_loss"])
        assert paired["loss_difference"] < 0  # the trained checkpoint against one step from scratch
        for key in ("tau", "top1", "loss"):  # each difference inside its interval over the prompts
            low, high = paired[f"{key}_difference_ci95"]
            assert low <= paired[f"{key}_difference"] + 1e-12 and paired[f"{key}_difference"] - 1e-12 <= high
        assert paired["loss_difference_ci95"][1] < 0  # two conversations, both better after training
        for record in (got, base):  # the per-conversation counts pool to the held-out figures
            counts = record["per_conversation"]
            assert len(counts) == record["heldout"] == 2 and all(n > 0 for n, _, _ in counts)
            rows = sum(n for n, _, _ in counts)
            assert sum(hits for _, hits, _ in counts) / rows == pytest.approx(record["heldout_top1"])
            assert sum(loss for _, _, loss in counts) / rows == pytest.approx(record["heldout_loss"], rel=1e-5)
    same = train(_small(stories_path, tmp_path / "none", init=str(tmp_path / "run"), eval_only=True, eval_prompts=5,
                        against=str(tmp_path / "run")), progress=False)
    assert all(r["paired"] == {"tau_difference": 0.0, "tau_difference_ci95": [0.0, 0.0], "top1_difference": 0.0,
                               "loss_difference": 0.0, "top1_difference_ci95": [0.0, 0.0],
                               "loss_difference_ci95": [0.0, 0.0]} for r in same.values())
    import splitspec.train.trainer as trainer

    evaluated = []
    monkeypatch.setattr(trainer, "evaluate", lambda *a, **k: evaluated.append(1) or {})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no checkpoint to compare with"):  # before any evaluation is spent
        train(_small(stories_path, tmp_path / "x", init=str(tmp_path / "run"), eval_only=True,
                     against=str(tmp_path / "empty")), progress=False)
    with pytest.raises(ValueError, match="--against .*nowhere: no such folder"):
        train(_small(stories_path, tmp_path / "x", init=str(tmp_path / "run"), eval_only=True,
                     against=str(tmp_path / "nowhere")), progress=False)
    assert not evaluated
    with pytest.raises(ValueError, match="needs eval_only"):
        _small(stories_path, tmp_path / "x", against=str(tmp_path / "run"))


def test_heldout_figures_do_not_depend_on_the_training_max_len(stories_path, tmp_path, monkeypatch):
    """Held-out conversations and tau prompts are cut at HELDOUT_MAX_LEN whatever --max-len trains
    on, so a GPU run at 1,024 and a CPU run at 512 report comparable figures."""
    from splitspec.train import trainer

    train(_small(stories_path, tmp_path / "run", drafter="eagle2"), progress=False)
    whole = train(_small(stories_path, tmp_path / "none", drafter="eagle2", init=str(tmp_path / "run"),
                         eval_only=True), progress=False)["eagle2"]
    # shorter than the held-out conversations, long enough to reach their answers (at 12 none was
    # scored, and the test compared two held-out losses of 0.0 that measured nothing)
    monkeypatch.setattr(trainer, "HELDOUT_MAX_LEN", 40)
    figures = [train(_small(stories_path, tmp_path / "none", drafter="eagle2", init=str(tmp_path / "run"),
                            eval_only=True, max_len=max_len), progress=False)["eagle2"]
               for max_len in (16, 256)]
    assert figures[0]["heldout_scored"] == whole["heldout_scored"] == 2
    assert all(a[0] < b[0] for a, b in zip(figures[0]["per_conversation"], whole["per_conversation"]))
    assert figures[0]["heldout_loss"] == figures[1]["heldout_loss"] and figures[0]["tau"] == figures[1]["tau"]


@pytest.mark.slow
def test_drafters_trained_together_equal_alone(stories_path, tmp_path):
    together = train(_small(stories_path, tmp_path / "both"), progress=False)
    assert set(together) == {"moa-tli0", "eagle2"} and "memory_gain" in together["moa-tli0"]
    both = _weights(tmp_path / "both")
    for name, drafter in (("moa-tli0", "moa"), ("eagle2", "eagle2")):
        train(_small(stories_path, tmp_path / name, drafter=drafter), progress=False)
        alone = _weights(tmp_path / name)[name]
        for key, value in alone.items():
            torch.testing.assert_close(both[name][key], value, rtol=0, atol=0)
    assert (tmp_path / "both" / "moa-tli0" / "best" / "model.safetensors").exists()


@pytest.mark.slow
def test_max_minutes_stops_and_resume_continues_exactly(stories_path, tmp_path):
    straight = train(_small(stories_path, tmp_path / "a", epochs=2), progress=False)
    stopped = train(_small(stories_path, tmp_path / "b", epochs=2, max_minutes=1e-9), progress=False)
    assert stopped["eagle2"]["step"] == 1 < straight["eagle2"]["step"]
    resumed = train(_small(stories_path, tmp_path / "b", epochs=2, resume=True), progress=False)
    assert resumed["eagle2"]["step"] == straight["eagle2"]["step"]
    card = (tmp_path / "a" / "eagle2" / "card.md").read_text()
    epoch, tokens = re.search(r"2 epochs of ([\d,]+) tokens \(cap 500\)", card), straight["eagle2"]["tokens"]
    assert epoch and 2 * int(epoch[1].replace(",", "")) == tokens, card  # the card states the real epoch size
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    for name in a:
        for key in a[name]:
            torch.testing.assert_close(a[name][key], b[name][key], rtol=0, atol=0)


@pytest.mark.slow
def test_a_stop_signal_saves_and_resume_continues_exactly(stories_path, tmp_path, monkeypatch):
    """A SIGTERM during a step (`kill PID`) ends the run after that step with its checkpoints and
    state saved, as --max-minutes does; --resume then reaches the uninterrupted run's weights."""
    import os
    import signal

    import splitspec.train.trainer as trainer

    straight = train(_small(stories_path, tmp_path / "a", epochs=2), progress=False)
    finish = trainer.AccumulatedStep.finish

    sent = []

    def step_then_signal(*args, **kwargs):  # once: a second SIGTERM would terminate, as it should
        out = finish(*args, **kwargs)
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return out

    monkeypatch.setattr(trainer.AccumulatedStep, "finish", step_then_signal)
    before = signal.getsignal(signal.SIGTERM)
    stopped = train(_small(stories_path, tmp_path / "b", epochs=2), progress=False)
    assert signal.getsignal(signal.SIGTERM) is before  # the run gave the handler back
    assert stopped["eagle2"]["step"] == 1 < straight["eagle2"]["step"]
    assert (tmp_path / "b" / "eagle2" / "model.safetensors").exists()
    monkeypatch.setattr(trainer.AccumulatedStep, "finish", finish)
    resumed = train(_small(stories_path, tmp_path / "b", epochs=2, resume=True), progress=False)
    assert resumed["eagle2"]["step"] == straight["eagle2"]["step"]
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    for name in a:
        for key in a[name]:
            torch.testing.assert_close(a[name][key], b[name][key], rtol=0, atol=0)


def test_eval_every_zero_evaluates_only_when_the_run_stops(stories_path, tmp_path):
    """--eval-every 0: no held-out evaluation along the way, one at the end (it once divided by zero)."""
    out = train(_small(stories_path, tmp_path / "a", drafter="moa", epochs=2, eval_every=0), progress=False)
    assert out["moa-tli0"]["step"] >= 2
    history = (tmp_path / "a" / "history.jsonl").read_text().splitlines()
    assert len(history) == 1 and json.loads(history[0])["step"] == out["moa-tli0"]["step"]
    with pytest.raises(ValueError, match="eval_every"):
        _small(stories_path, tmp_path / "b", eval_every=-1)


def test_compile_setting(monkeypatch):
    """--compile: auto is on for a CPU with a C++ compiler and off elsewhere; on compiles each MoA's
    LSA and nothing else; a bad value is refused."""
    from splitspec.train import trainer

    monkeypatch.setattr(trainer.shutil, "which", lambda name: "/usr/bin/" + name)
    assert TrainConfig(drafter="moa", target="x", out=None, compile="auto").compile == "on"
    assert TrainConfig(drafter="moa", target="x", out=None, compile="auto", device="cuda").compile == "off"
    assert TrainConfig(drafter="moa", target="x", out=None).compile == "off"
    monkeypatch.setattr(trainer.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert TrainConfig(drafter="moa", target="x", out=None, compile="auto").compile == "off"
    with pytest.raises(ValueError, match="compile"):
        TrainConfig(drafter="moa", target="x", out=None, compile="yes")


def test_compile_on_in_bf16_trains_on_a_compiled_plain_linear_target(stories_path, tmp_path, monkeypatch):
    """--compile on with bf16: the training target is loaded with transformers' own linears (dynamo
    cannot trace prepacked ones) and its decoder compiled; the held-out target is the usual fp32 one.
    In fp32, or with --compile off, nothing of the target is compiled."""
    from splitspec.shared import models
    from splitspec.shared.drafters.moa import MoADrafter
    from splitspec.train import trainer

    loads, compiled = [], []
    real_load = models.load_model

    def load(name, **kw):
        loads.append((kw.get("dtype", "float32"), kw.get("linear", "auto")))
        return real_load(name, **kw)

    monkeypatch.setattr(models, "load_model", load)
    monkeypatch.setattr(trainer, "compile_target", lambda model: compiled.append(model))
    monkeypatch.setattr(MoADrafter, "compile_lsa", lambda self: None)
    train(_small(stories_path, tmp_path / "a", drafter="moa", compile="on", dtype="bfloat16"), progress=False)
    assert loads == [("float32", "auto"), ("bfloat16", "torch")] and len(compiled) == 1
    assert trainer.compiles_target(_small(stories_path, tmp_path, compile="on", dtype="bfloat16"))
    for kw in (dict(compile="on", dtype="float32"), dict(compile="off", dtype="bfloat16")):
        assert not trainer.compiles_target(_small(stories_path, tmp_path, **kw))


@pytest.mark.slow
def test_compiled_target_gives_the_targets_activations(stories_path, examples):
    """compile_target (the real inductor build) leaves run_target_batch's logits, states and K/V as
    the eager forward's, over batches of different sizes and lengths (dynamic shapes)."""
    from splitspec.shared.models import load_model
    from splitspec.train.batched import compile_target
    from splitspec.train.trainer import can_compile

    if not can_compile("cpu"):
        pytest.skip("no C++ compiler for inductor")
    model = load_model(str(stories_path), linear="torch")[0]
    batches = [make_batch(examples), make_batch(examples[1:]), make_batch(examples[2:])]  # 3, 2 and 1 rows
    eager = [run_target_batch(model, b, (1,)) for b in batches]
    from torch._dynamo.utils import counters

    compile_target(model)
    for i, (b, e) in enumerate(zip(batches, eager)):
        if i == 2:
            compiled = counters["stats"]["unique_graphs"]
        c = run_target_batch(model, b, (1,))
        assert c.final.shape == e.final.shape and c.keys[0].shape == e.keys[0].shape
        torch.testing.assert_close(c.logits, e.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c.final, e.final, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c.layer_inputs[1], e.layer_inputs[1], rtol=1e-4, atol=1e-4)
        for k1, k2 in zip(c.keys + c.values, e.keys + e.values):
            torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == compiled  # the one-row batch compiled nothing new


def test_compile_on_compiles_moas_lsa_only(stories, monkeypatch):
    from splitspec.train import trainer
    from splitspec.shared.drafters.checkpoint import TargetIdentity

    from splitspec.shared.drafters.moa import MoADrafter

    model, tokenizer, _ = stories
    compiled = []
    monkeypatch.setattr(MoADrafter, "compile_lsa", lambda self: compiled.append(self.config.tli))
    cfg = TrainConfig(drafter="moa,moa:tli=1,eagle2", target="x", out=None, compile="on")
    for job in cfg.jobs():
        trainer._init_drafter(cfg, job, model.config, TargetIdentity.of(model, tokenizer, "x"))
    assert compiled == [0, 1]


def test_train_bench_runs_both_paths_on_the_same_tokens(stories_path, tmp_path, monkeypatch):
    """train-bench: the reference and the fast path over the same conversations (and, with --compile
    on, the fast path with LSA left eager beside it), each with the tokens it trained on."""
    from splitspec.shared.drafters.moa import MoADrafter
    from splitspec.train.throughput import bench_throughput

    cfg = _small(stories_path, tmp_path, dtype="float32")
    runs = bench_throughput(cfg, tokens=300)
    assert [r.path for r in runs] == ["reference", "fast"]
    assert runs[0].tokens == runs[1].tokens >= 300 and all(r.seconds > 0 for r in runs)
    assert runs[0].drafters == runs[1].drafters == ["moa-tli0", "eagle2"]
    compiled = []
    monkeypatch.setattr(MoADrafter, "compile_lsa", lambda self: compiled.append(self))
    runs = bench_throughput(replace(cfg, compile="on"), tokens=300)
    assert [r.path for r in runs] == ["reference", "fast", "fast, not compiled"] and len(compiled) == 1


def test_profile_steps_write_where_the_time_went_and_change_nothing(stories_path, tmp_path):
    """--profile-steps N profiles steps 2 .. N + 1 into profile.txt (a run that ends first writes
    what it saw) and leaves the training itself exactly as it was."""
    plain = train(_small(stories_path, tmp_path / "a", drafter="moa", epochs=3), progress=False)
    steps = plain["moa-tli0"]["step"]
    assert steps >= 4
    train(_small(stories_path, tmp_path / "b", drafter="moa", epochs=3, profile_steps=2), progress=False)
    text = (tmp_path / "b" / "profile.txt").read_text()
    assert re.search(r"profiled steps: 2; wall s per step: [\d.]+, [\d.]+; operators per step: \d+", text), text
    assert int(re.search(r"operators per step: (\d+)", text)[1]) > 100 and "aten::" in text
    a, b = _weights(tmp_path / "a")["moa-tli0"], _weights(tmp_path / "b")["moa-tli0"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    train(_small(stories_path, tmp_path / "c", drafter="moa", epochs=3, profile_steps=100), progress=False)
    assert f"profiled steps: {steps - 1};" in (tmp_path / "c" / "profile.txt").read_text()
    with pytest.raises(ValueError, match="profile_steps"):
        _small(stories_path, tmp_path / "d", profile_steps=-1)


def test_cuda_training_leaves_cudnn_attention_out_unless_asked(tmp_path, monkeypatch):
    """On CUDA a training step's SDPA may not pick cuDNN (a graph build per batch shape: host time
    that dominated an H100 step) and --cudnn-attention puts it back, whatever the process-wide
    setting `load_model` made; both restore that setting afterwards, and on a CPU nothing changes.
    The flags are global, so this runs on a CPU build."""
    from splitspec.shared.models import CUDNN_ATTENTION_ENV, use_cudnn_attention

    def cfg(**kw):
        return TrainConfig(drafter="moa", target="x", out=tmp_path, dtype="float32", **kw)

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for process_wide in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(process_wide)
            with attention_backends(cfg(device="cuda")):
                assert not torch.backends.cuda.cudnn_sdp_enabled()
                assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
            assert torch.backends.cuda.cudnn_sdp_enabled() == process_wide
            with attention_backends(cfg(device="cuda", cudnn_attention=True)):
                assert torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cuda.cudnn_sdp_enabled() == process_wide
            with attention_backends(cfg(device="cpu")):
                assert torch.backends.cuda.cudnn_sdp_enabled() == process_wide
        # the process-wide switch load_model applies to a CUDA model: off unless the environment asks
        monkeypatch.delenv(CUDNN_ATTENTION_ENV, raising=False)
        assert use_cudnn_attention() is False and not torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setenv(CUDNN_ATTENTION_ENV, "1")
        assert use_cudnn_attention() is True and torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_eagle_noise_off_the_cpu_is_drawn_there_from_the_run_generator():
    """EAGLE's feature noise on a GPU comes from a generator on that device seeded by the run's
    CPU generator (drawing it on the host cost ~65 ms a step on an H100): the same run state gives
    the same noise, the run generator moves on, and on a CPU the draw is the CPU generator's own.
    The device path's calls are exercised here on the CPU device."""
    from splitspec.train.batched import _uniform, device_generator

    def draw(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        first = torch.rand(4, 3, generator=device_generator(gen, torch.device("cpu")))
        return first, torch.rand(4, 3, generator=device_generator(gen, torch.device("cpu")))

    a, b = draw(0), draw(0)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], draw(1)[0])
    like = torch.zeros(2, 5)
    torch.testing.assert_close(_uniform(like, torch.Generator().manual_seed(3)),
                               torch.rand(2, 5, generator=torch.Generator().manual_seed(3)), rtol=0, atol=0)


def test_checkpoint_over_the_size_limit_is_refused(stories):
    model, _, _ = stories
    drafter = build_drafter(DrafterJob("moa"), model.config)
    assert check_size(drafter) > 0
    with pytest.raises(CheckpointTooLarge, match="MiB"):
        check_size(drafter, limit=1024)


@pytest.mark.slow
def test_distill_data_is_deterministic_and_resumes(stories_path, tmp_path):
    from splitspec.train.distill import DistillConfig, check_heldout, distill_data, load_distilled

    convs = _conversations(20, 2)
    common = dict(target=str(stories_path), batch=2, max_new_tokens=12, temperature=1.0, top_p=0.9, heldout=2,
                  seed=7)
    distill_data(DistillConfig(out=tmp_path / "a.jsonl", limit=6, **common), convs)
    distill_data(DistillConfig(out=tmp_path / "b.jsonl", limit=2, **common), convs)
    with (tmp_path / "b.jsonl").open("a") as f:
        f.write('{"index": 2, "prompt_')  # a torn line from a killed run
    distill_data(DistillConfig(out=tmp_path / "b.jsonl", limit=6, **common), convs)
    a, b = (tmp_path / "a.jsonl").read_text(), (tmp_path / "b.jsonl").read_text()
    assert a == b and len(a.splitlines()) == 7
    cut = distill_data(DistillConfig(out=tmp_path / "cut.jsonl", limit=5, **common), convs)  # last batch of 1
    assert cut["records"] == 5 and len((tmp_path / "cut.jsonl").read_text().splitlines()) == 6
    again = distill_data(DistillConfig(out=tmp_path / "cut.jsonl", limit=5, **common), convs)
    assert again["new_answer_tokens"] == 0 and len((tmp_path / "cut.jsonl").read_text().splitlines()) == 6
    distill_data(DistillConfig(out=tmp_path / "cut.jsonl", limit=6, **common), convs)  # the cut batch made whole
    assert (tmp_path / "cut.jsonl").read_text() == a
    assert json.loads(a.splitlines()[0])["temperature"] == 1.0
    header, *records = a.splitlines(keepends=True)
    old = {k: v for k, v in json.loads(header).items()  # written before `turns` and `min_prompt_len` existed
           if k not in ("turns", "min_prompt_len")}
    assert len(old) < len(json.loads(header))
    (tmp_path / "old.jsonl").write_text(json.dumps(old) + "\n" + "".join(records[:2]))
    distill_data(DistillConfig(out=tmp_path / "old.jsonl", limit=6, **common), convs)
    assert (tmp_path / "old.jsonl").read_text().splitlines(keepends=True)[1:] == records
    other = distill_data(DistillConfig(out=tmp_path / "c.jsonl", limit=6, **{**common, "seed": 8}), convs)
    assert other["records"] == 6 and (tmp_path / "c.jsonl").read_text() != a
    # --sample-seed: other answers to the same prompts, the held-out split kept
    resampled = tmp_path / "resampled.jsonl"
    distill_data(DistillConfig(out=resampled, limit=6, sample_seed=8, **common), convs)
    same_seed = tmp_path / "same.jsonl"
    distill_data(DistillConfig(out=same_seed, limit=6, sample_seed=7, **common), convs)
    mine, theirs = ([json.loads(r) for r in f.read_text().splitlines()[1:]] for f in (resampled, tmp_path / "a.jsonl"))
    assert [r["prompt_ids"] for r in mine] == [r["prompt_ids"] for r in theirs]
    assert [r["answer_ids"] for r in mine] != [r["answer_ids"] for r in theirs]
    assert json.loads(resampled.read_text().splitlines()[0])["sample_seed"] == 8
    assert same_seed.read_text().splitlines()[1:] == a.splitlines()[1:]  # sample_seed = seed: the same answers
    check_heldout(resampled, 2, 7)
    with pytest.raises(ValueError, match=r"other settings \(seed 7 -> 8\): give the file's"):
        distill_data(DistillConfig(out=tmp_path / "a.jsonl", limit=6, **{**common, "seed": 8}), convs)
    examples = load_distilled(tmp_path / "a.jsonl", 64)
    assert examples and all(sum(e.loss_mask) > 0 for e in examples)
    # --start: a second file answers the prompts after the first file's, as one run of that batch would
    rest = distill_data(DistillConfig(out=tmp_path / "rest.jsonl", limit=6, start=4, **common), convs)
    assert rest["records"] == 2 and rest["first_index"] == 4
    rest_header, *rest_records = (tmp_path / "rest.jsonl").read_text().splitlines()
    assert json.loads(rest_header)["start"] == 4 and "start" not in json.loads(header)
    assert [json.loads(r)["index"] for r in rest_records] == [4, 5]
    assert [json.loads(r)["prompt_ids"] for r in rest_records] == [json.loads(r)["prompt_ids"] for r in records[4:]]
    with pytest.raises(ValueError, match=r"other settings \(start 4 -> 2\)"):  # a start unlike the file's
        distill_data(DistillConfig(out=tmp_path / "rest.jsonl", limit=6, start=2, **common), convs)
    with pytest.raises(ValueError, match=r"other settings \(start 0 -> 2\)"):  # the header leaves start 0 out
        distill_data(DistillConfig(out=tmp_path / "a.jsonl", limit=6, start=2, **common), convs)
    with pytest.raises(ValueError, match="start < limit"):
        DistillConfig(out=tmp_path / "x.jsonl", limit=6, start=6, **common)


def test_later_turns_give_the_deepest_history_that_fits(stories):
    """distill-data --turns later: each prompt is a conversation up to a later user turn, the
    deepest whose rendering fits; one-turn conversations give none; `first` keeps the first turn."""
    from splitspec.shared.models import encode_chat
    from splitspec.train.distill import DistillConfig, _prompts

    _, tokenizer, _ = stories
    one = _conversations(1, 3)[0]
    turn = lambda k: [{"role": "user", "content": f"question {k} " * 3},  # noqa: E731
                      {"role": "assistant", "content": f"answer {k} " * 6}]
    three = turn(1) + turn(2) + turn(3)
    full = len(encode_chat(tokenizer, three[:5]))
    second = encode_chat(tokenizer, three[:3])
    common = dict(target="t", out=Path("unused"), heldout=0, turns="later")
    assert _prompts(DistillConfig(**common, max_prompt_len=full), tokenizer, [one, three]) == [
        encode_chat(tokenizer, three[:5])]
    assert _prompts(DistillConfig(**common, max_prompt_len=full - 1), tokenizer, [three, one]) == [second]
    assert _prompts(DistillConfig(**common, max_prompt_len=len(second) - 1), tokenizer, [three]) == []
    assert _prompts(DistillConfig(**{**common, "turns": "first"}), tokenizer, [one, three]) == [
        encode_chat(tokenizer, one[:1]), encode_chat(tokenizer, three[:1])]
    first = dict(common, turns="first")
    short, long = len(encode_chat(tokenizer, one[:1])), len(encode_chat(tokenizer, three[:1]))
    assert short != long
    assert _prompts(DistillConfig(**first, min_prompt_len=max(short, long)), tokenizer, [one, three]) == [
        encode_chat(tokenizer, (one if short > long else three)[:1])]  # --min-prompt-len: the longer one only
    with pytest.raises(ValueError, match="turns"):
        DistillConfig(target="t", out=Path("x"), turns="all")
    with pytest.raises(ValueError, match="cache"):
        DistillConfig(target="t", out=Path("x"), cache="paged")
    with pytest.raises(ValueError, match="min_prompt_len"):
        DistillConfig(target="t", out=Path("x"), max_prompt_len=256, min_prompt_len=300)


def test_middle_turns_are_the_later_turns_no_other_file_answers(stories):
    """distill-data --turns middle: every user turn after the first whose history fits, but the
    deepest (which --turns later answers), several per conversation, cut at --limit exactly."""
    from splitspec.shared.models import encode_chat
    from splitspec.train.distill import DistillConfig, _prompts

    _, tokenizer, _ = stories
    turn = lambda k: [{"role": "user", "content": f"question {k} " * 3},  # noqa: E731
                      {"role": "assistant", "content": f"answer {k} " * 6}]
    four = turn(1) + turn(2) + turn(3) + turn(4)
    one = turn(9)
    upto = lambda k: encode_chat(tokenizer, four[: 2 * k - 1])  # noqa: E731  the history through user turn k
    common = dict(target="t", out=Path("unused"), heldout=0)
    fits_all = len(upto(4))
    middle = dict(common, turns="middle", max_prompt_len=fits_all)
    assert _prompts(DistillConfig(**middle), tokenizer, [one, four]) == [upto(2), upto(3)]
    assert _prompts(DistillConfig(**dict(middle, max_prompt_len=fits_all - 1)), tokenizer, [four]) == [upto(2)]
    assert _prompts(DistillConfig(**dict(middle, max_prompt_len=len(upto(3)) - 1)), tokenizer, [four]) == []
    later = _prompts(DistillConfig(**dict(common, turns="later", max_prompt_len=fits_all)), tokenizer, [one, four])
    first = _prompts(DistillConfig(**dict(common, turns="first", max_prompt_len=fits_all)), tokenizer, [one, four])
    assert later == [upto(4)]
    assert not {tuple(p) for p in later + first} & {tuple(p) for p in _prompts(DistillConfig(**middle), tokenizer,
                                                                                  [one, four])}
    assert _prompts(DistillConfig(**dict(middle, limit=1)), tokenizer, [four, four]) == [upto(2)]
    assert _prompts(DistillConfig(**dict(middle, limit=3)), tokenizer, [four, four]) == [upto(2), upto(3), upto(2)]
    assert _prompts(DistillConfig(**dict(middle, min_prompt_len=len(upto(3)))), tokenizer, [four]) == [upto(3)]


@pytest.mark.slow
def test_distill_data_with_a_static_cache(stories_path, tmp_path, monkeypatch):
    """--cache static: the same greedy answers as the growing cache (a tiny fp32 model, where rounding
    over the padded length moves no argmax), generated into one StaticCache size for every batch, the
    cache in the header, and a resume that asks for the other cache refused."""
    from transformers import GenerationMixin

    from splitspec.train.distill import DistillConfig, distill_data

    asked = []
    generate = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        asked.append((kwargs.get("cache_implementation"), kwargs.get("max_cache_len")))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    convs = _conversations(12, 3)
    common = dict(target=str(stories_path), batch=3, limit=7, max_new_tokens=16, heldout=2, max_prompt_len=64)
    distill_data(DistillConfig(out=tmp_path / "dynamic.jsonl", **common), convs)
    distill_data(DistillConfig(out=tmp_path / "static.jsonl", cache="static", **common), convs)
    (dyn_header, *dyn), (st_header, *st) = ((tmp_path / f).read_text().splitlines() for f in ("dynamic.jsonl",
                                                                                                "static.jsonl"))
    assert "cache" not in json.loads(dyn_header) and json.loads(st_header)["cache"] == "static"
    assert len(st) == 7 and st == dyn
    assert asked == [(None, None)] * 3 + [("static", 64 + 16)] * 3  # batches of 3, 3 and 1 each way
    assert any(len(json.loads(r)["answer_ids"]) > 1 for r in st)
    with pytest.raises(ValueError, match=r"other settings \(cache static -> dynamic\)"):
        distill_data(DistillConfig(out=tmp_path / "static.jsonl", **common), convs)


def test_several_distilled_files_are_pooled(tmp_path, monkeypatch):
    """train --data a.jsonl,b.jsonl trains on the examples of both files."""
    import splitspec.train.data as data
    import splitspec.train.trainer as trainer

    header = json.dumps({"splitspec_distill": 1, "heldout": 1, "seed": 0}) + "\n"
    for name, ids in (("a", [5] * 10), ("b", [7] * 12)):
        (tmp_path / f"{name}.jsonl").write_text(
            header + json.dumps({"index": 0, "prompt_ids": ids[:4], "answer_ids": ids[4:]}) + "\n")
    monkeypatch.setattr(data, "iter_sharegpt", lambda: iter([[{"role": "user", "content": f"hi {i}"}]
                                                              for i in range(3)]))
    cfg = TrainConfig(drafter="moa", target="t", out=tmp_path, heldout=1, max_tokens=10**6,
                      data=f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}")
    examples, held = trainer.load_examples(cfg, tokenizer=None)
    assert sorted(e.input_ids for e in examples) == [[5] * 10, [7] * 12] and len(held) == 1
    assert all(e.loss_mask[:4] == [0] * 4 and set(e.loss_mask[4:]) == {1} for e in examples)


def test_heldout_prompts_that_start_a_training_conversation_are_not_evaluated():
    """A drawn conversation whose first turn (whitespace aside) also starts another conversation is
    left out of training but not evaluated: the other one is training data (or drawn too), so the
    drafter may have seen the target answer that very prompt. Which conversations are drawn does
    not change with the rule, so the training set is the one distilled files were made from."""
    from splitspec.train.data import first_turn_key, split_heldout

    convs = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
             for i in range(30)]
    convs += [[{"role": "user", "content": f"  question\n{i} "}, {"role": "assistant", "content": f"other {i}"}]
              for i in range(10)]  # ShareGPT-style repeats of the first ten prompts
    train, held = split_heldout(convs, 20, seed=3)
    drawn = [c for c in convs if c not in train]
    assert len(drawn) == 20 and len(train) == 20
    repeated = {first_turn_key(c) for c in convs[30:]}
    assert held == [c for c in drawn if first_turn_key(c) not in repeated]
    assert 0 < len(held) < 20  # some drawn ones were repeats, some were not
    unique = [[{"role": "user", "content": f"q {i}"}] for i in range(40)]
    assert len(split_heldout(unique, 20, seed=3)[1]) == 20


def test_distilled_data_must_leave_out_the_runs_heldout_split(tmp_path, monkeypatch):
    """A distill-data file answers every conversation but the held-out ones of its own split; a run
    that holds out others (another --split-seed, or more of them) could be measured on prompts it
    trained on, so it is refused, whatever --seed (data order) says."""
    import splitspec.train.data as data
    import splitspec.train.trainer as trainer

    convs = [[{"role": "user", "content": f"question {i}"}] for i in range(12)]
    monkeypatch.setattr(data, "iter_sharegpt", lambda: iter(convs))
    record = json.dumps({"index": 0, "prompt_ids": [3] * 4, "answer_ids": [4] * 6}) + "\n"

    def data_file(name, header):
        path = tmp_path / name
        path.write_text(json.dumps({"splitspec_distill": 1, **header}) + "\n" + record)
        return str(path)

    made = data_file("split0.jsonl", {"heldout": 3, "seed": 0})
    for heldout, seed in ((3, 0), (2, 7)):  # same split (or a subset of it), any data order: accepted
        cfg = TrainConfig(drafter="moa", target="t", out=tmp_path, heldout=heldout, seed=seed, max_tokens=10**6,
                          data=made)
        examples, held = trainer.load_examples(cfg, tokenizer=None)
        assert len(examples) == 1 and held == data.split_heldout(convs, heldout, 0)[1]
    assert set(map(str, data.split_heldout(convs, 2, 0)[1])) <= set(map(str, data.split_heldout(convs, 3, 0)[1]))
    for heldout, split_seed in ((3, 1), (4, 0)):
        cfg = TrainConfig(drafter="moa", target="t", out=tmp_path, heldout=heldout, split_seed=split_seed,
                          max_tokens=10**6, data=made)
        with pytest.raises(ValueError, match="--split-seed 0 and --heldout <= 3"):
            trainer.load_examples(cfg, tokenizer=None)
    cfg = TrainConfig(drafter="moa", target="t", out=tmp_path, heldout=3, max_tokens=10**6,
                      data=data_file("bare.jsonl", {}))
    with pytest.raises(ValueError, match="does not say which conversations"):
        trainer.load_examples(cfg, tokenizer=None)


def test_data_entries_take_record_ranges(tmp_path, monkeypatch):
    """train --data f.jsonl[1:3],f.jsonl[4:] trains on records 1, 2 and 4 of f; a malformed range is
    refused when the config is made."""
    import splitspec.train.data as data
    import splitspec.train.trainer as trainer

    path = tmp_path / "f.jsonl"
    path.write_text(json.dumps({"splitspec_distill": 1, "heldout": 1, "seed": 0}) + "\n" + "".join(
        json.dumps({"index": i, "prompt_ids": [10 + i] * 4, "answer_ids": [20 + i] * 6}) + "\n" for i in range(5)))
    monkeypatch.setattr(data, "iter_sharegpt", lambda: iter([[{"role": "user", "content": "hi"}]] * 3))
    cfg = TrainConfig(drafter="moa", target="t", out=tmp_path, heldout=1, max_tokens=10**6,
                      data=f"{path}[1:3],{path}[4:]")
    examples, _ = trainer.load_examples(cfg, tokenizer=None)
    assert sorted(e.input_ids[0] for e in examples) == [11, 12, 14]
    packed = tmp_path / "f.jsonl.gz"  # the shipped larger files are kept gzipped
    packed.write_bytes(gzip.compress(path.read_bytes()))
    cfg = TrainConfig(drafter="moa", target="t", out=tmp_path, heldout=1, max_tokens=10**6, data=f"{packed}[1:3]")
    assert sorted(e.input_ids[0] for e in trainer.load_examples(cfg, tokenizer=None)[0]) == [11, 12]
    xz = tmp_path / "f.jsonl.xz"  # tools/gpu_prepare.sh carries them as xz (a third smaller than gzip)
    xz.write_bytes(lzma.compress(path.read_bytes()))
    cfg = TrainConfig(drafter="moa", target="t", out=tmp_path, heldout=1, max_tokens=10**6, data=f"{xz}[3:]")
    assert sorted(e.input_ids[0] for e in trainer.load_examples(cfg, tokenizer=None)[0]) == [13, 14]
    for bad in ("[a:]", "[1]", "[1:2:3]", "[-1:]"):
        with pytest.raises(ValueError, match="record range"):
            TrainConfig(drafter="moa", target="t", out=tmp_path, data=f"{path}{bad}")


def test_examples_are_cached_in_the_run_directory(tmp_path, monkeypatch):
    """--resume reads the tokenized examples back instead of rebuilding them; a changed budget,
    length limit or tokenizer rebuilds them."""
    import splitspec.train.trainer as trainer
    from splitspec.train.data import Example

    calls = []

    def fake_load(cfg, tokenizer):
        calls.append(cfg.max_tokens)
        return [Example([1, 2, 3, 4] * cfg.max_tokens, [0, 1, 1, 1] * cfg.max_tokens)], [[{"role": "user",
                                                                                          "content": "hi"}]]

    class Tok:
        name_or_path = "tok-a"

        def __len__(self):
            return 100

    monkeypatch.setattr(trainer, "load_examples", fake_load)
    cfg = TrainConfig(drafter="moa", target="t", out=tmp_path, max_tokens=2)
    first = trainer.cached_examples(cfg, Tok())
    again = trainer.cached_examples(cfg, Tok())
    assert calls == [2] and again == first and (tmp_path / trainer.EXAMPLES).exists()
    trainer.cached_examples(TrainConfig(drafter="moa", target="t", out=tmp_path, max_tokens=3), Tok())
    other = Tok()
    other.name_or_path = "tok-b"
    trainer.cached_examples(TrainConfig(drafter="moa", target="t", out=tmp_path, max_tokens=3), other)
    assert calls == [2, 3, 3]


def test_init_starts_each_drafter_from_its_checkpoint(stories, tmp_path):
    """--init: a folder of <drafter name>/ checkpoints gives each drafter its own weights and token
    count; a drafter without one starts from scratch; a checkpoint of another kind is refused."""
    from splitspec.shared.drafters.checkpoint import TargetIdentity, save_checkpoint
    from splitspec.train.trainer import initialise

    model, tokenizer, model_id = stories
    identity = TargetIdentity.of(model, tokenizer, model_id)
    torch.manual_seed(1)
    trained = build_drafter(DrafterJob("eagle2"), model.config)
    save_checkpoint(tmp_path / "eagle2", "eagle2", trained, identity, {"tokens": 100, "tokens_total": 700})
    cfg = TrainConfig(drafter="moa,eagle2", target="t", out=None, init=str(tmp_path))
    fresh = build_drafter(DrafterJob("eagle2"), model.config)
    assert initialise(cfg, DrafterJob("eagle2"), fresh, identity) == (str(tmp_path / "eagle2"), 700, "")
    for key, value in trained.state_dict().items():  # the checkpoint is stored in bf16
        torch.testing.assert_close(fresh.state_dict()[key], value.to(torch.bfloat16).float())
    moa = build_drafter(DrafterJob("moa"), model.config)
    before = {k: v.clone() for k, v in moa.state_dict().items()}
    assert initialise(cfg, DrafterJob("moa"), moa, identity) == ("", 0, "")
    assert all(torch.equal(before[k], v) for k, v in moa.state_dict().items())
    single = TrainConfig(drafter="moa", target="t", out=None, init=str(tmp_path / "eagle2"))
    with pytest.raises(ValueError, match="eagle2"):
        initialise(single, DrafterJob("moa"), moa, identity)


def test_init_names_a_checkpoint_across_tli_depths(stories, tmp_path):
    """--init NAME=PATH starts moa-tli1 from a moa tli=0 checkpoint (same shapes) and says so; the
    same checkpoint found by folder name alone, or named for another kind, is refused."""
    from splitspec.shared.drafters.checkpoint import TargetIdentity, save_checkpoint
    from splitspec.train.trainer import initialise

    model, tokenizer, model_id = stories
    identity = TargetIdentity.of(model, tokenizer, model_id)
    torch.manual_seed(2)
    tli0 = build_drafter(DrafterJob("moa"), model.config)
    save_checkpoint(tmp_path / "moa-tli0", "moa", tli0, identity, {"tokens": 50, "tokens_total": 5000})
    job = DrafterJob("moa", 1)
    tli1 = build_drafter(job, model.config)
    cfg = TrainConfig(drafter="moa:tli=1,eagle2", target="t", out=None,
                      init=f"{tmp_path},moa-tli1={tmp_path / 'moa-tli0'}")
    assert initialise(cfg, job, tli1, identity) == (str(tmp_path / "moa-tli0"), 5000, "moa tli=0")
    for key, value in tli0.state_dict().items():
        torch.testing.assert_close(tli1.state_dict()[key], value.to(torch.bfloat16).float())
    unnamed = TrainConfig(drafter="moa:tli=1", target="t", out=None, init=str(tmp_path / "moa-tli0"))
    with pytest.raises(ValueError, match="NAME=PATH"):
        initialise(unnamed, job, tli1, identity)
    other = TrainConfig(drafter="moa:tli=1,eagle2", target="t", out=None, init=f"eagle2={tmp_path / 'moa-tli0'}")
    with pytest.raises(ValueError, match="moa"):
        initialise(other, DrafterJob("eagle2"), build_drafter(DrafterJob("eagle2"), model.config), identity)
    with pytest.raises(ValueError, match="falcon"):
        initialise(TrainConfig(drafter="moa", target="t", out=None, init=f"falcon={tmp_path}"),
                   DrafterJob("moa"), tli0, identity)


def test_skip_tokens_leaves_out_the_data_already_seen(stories, tmp_path):
    from splitspec.train.trainer import load_examples

    _, tokenizer, _ = stories
    common = dict(drafter="moa", target="t", out=tmp_path, max_tokens=400, heldout=2, conversations=_conversations(40, 3))
    whole, _ = load_examples(TrainConfig(**{**common, "max_tokens": 10_000}), tokenizer)
    first, held = load_examples(TrainConfig(**common), tokenizer)
    later, held_later = load_examples(TrainConfig(**common, skip_tokens=400), tokenizer)
    assert held == held_later and first and later
    ids = lambda xs: [tuple(e.input_ids) for e in xs]  # noqa: E731
    assert not set(ids(first)) & set(ids(later))
    assert ids(whole)[: len(first)] == ids(first) and ids(whole)[len(first): len(first) + len(later)] == ids(later)


def test_learned_lsa_pooling_starts_as_the_mean_and_learns_faster(stories, stories_path, tmp_path):
    """moa:pool=learned: warm-started from a mean checkpoint it gives the same memory (zero logits
    are the mean), a learned checkpoint is not loaded as a mean one, and a run moves the logits at
    LSA_POOL_LR_SCALE times the drafter's learning rate."""
    from splitspec.shared.drafters.checkpoint import TargetIdentity, save_checkpoint
    from splitspec.train.trainer import LSA_POOL_LR_SCALE, initialise

    model, tokenizer, model_id = stories
    identity = TargetIdentity.of(model, tokenizer, model_id)
    torch.manual_seed(3)
    mean = build_drafter(DrafterJob("moa"), model.config)
    save_checkpoint(tmp_path / "moa-tli0", "moa", mean, identity, {"tokens": 10, "tokens_total": 10})
    job = DrafterJob("moa", 0, "learned")
    learned = build_drafter(job, model.config)
    cfg = TrainConfig(drafter="moa:pool=learned", target="t", out=None,
                      init=f"moa-tli0-learned={tmp_path / 'moa-tli0'}")
    assert initialise(cfg, job, learned, identity) == (str(tmp_path / "moa-tli0"), 10, "moa pool=mean")
    layer_kv = torch.randn(5, model.config.num_hidden_layers, mean.config.kv_width)
    reloaded = build_drafter(DrafterJob("moa"), model.config)
    initialise(TrainConfig(drafter="moa", target="t", out=None, init=str(tmp_path / "moa-tli0")),
               DrafterJob("moa"), reloaded, identity)
    with torch.no_grad():
        torch.testing.assert_close(learned.memory(layer_kv), reloaded.memory(layer_kv))
        learned.lsa_layer_logits[0] = 3.0  # weights that are not uniform change the memory
        assert not torch.allclose(learned.memory(layer_kv), reloaded.memory(layer_kv), atol=1e-4)
    save_checkpoint(tmp_path / "learned", "moa", learned, identity, {"tokens": 10, "tokens_total": 10})
    with pytest.raises(ValueError, match="learned LSA pooling"):
        initialise(TrainConfig(drafter="moa", target="t", out=None, init=str(tmp_path / "learned")),
                   DrafterJob("moa"), build_drafter(DrafterJob("moa"), model.config), identity)

    train(_small(stories_path, tmp_path / "run", drafter="moa:pool=learned", max_tokens=200), progress=False)
    saved = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)["trainees"]["moa-tli0-learned"]
    groups = saved["optimizer"]["param_groups"]
    assert [g["lr_scale"] for g in groups] == [1.0, LSA_POOL_LR_SCALE]
    assert groups[1]["lr"] == pytest.approx(LSA_POOL_LR_SCALE * groups[0]["lr"])
    assert saved["drafter"]["lsa_layer_logits"].abs().max() > 0


def test_draft_vocab_counts_leave_out_the_split_seeds_heldout_conversations(stories, stories_path, tmp_path):
    from splitspec.train.data import sharegpt_split
    from splitspec.train.vocab import make_counts

    _, tokenizer, _ = stories
    convs = _conversations(30, 7)
    for split_seed in (0, 4):
        result = make_counts(str(stories_path), tmp_path / f"counts{split_seed}.safetensors", heldout=5,
                             split_seed=split_seed, progress=False, conversations=convs)
        kept, held = sharegpt_split(5, split_seed, convs)
        answer_tokens = lambda cs: sum(sum(tokenize_conversation(tokenizer, c, 2048).loss_mask)  # noqa: E731
                                       for c in cs)
        assert (result["tokens"], result["heldout_tokens"]) == (answer_tokens(kept), answer_tokens(held))
        shares = list(result["coverage"].values())  # a 512-token vocabulary: below every listed size (QA 56)
        assert list(result["coverage"]) == [64, 128, 256] and 0 < shares[0] <= shares[1] <= shares[2] <= 1
    assert sharegpt_split(5, 0, convs)[1] != sharegpt_split(5, 4, convs)[1]


def test_cached_examples_follow_a_data_file_distilled_again_unless_resuming(tmp_path, monkeypatch):
    """A data file rewritten in place (same path, other answers): a new run (or --overwrite) must not
    train on the examples of the old file; a resumed run keeps its own."""
    import os

    import splitspec.train.trainer as trainer
    from splitspec.train.data import Example

    calls = []

    def fake_load(cfg, tokenizer):
        calls.append(1)
        return [Example([1, 2, 3, 4], [0, 1, 1, 1])], []

    class Tok:
        name_or_path = "tok"

        def __len__(self):
            return 100

    monkeypatch.setattr(trainer, "load_examples", fake_load)
    data = tmp_path / "answers.jsonl"
    data.write_text("first\n")
    out = tmp_path / "run"
    cfg = TrainConfig(drafter="moa", target="t", out=out, data=str(data), max_tokens=2)
    trainer.cached_examples(cfg, Tok())
    trainer.cached_examples(cfg, Tok())
    assert len(calls) == 1  # unchanged: read back
    data.write_text("second, longer\n")
    os.utime(data, ns=(1, 1))
    trainer.cached_examples(TrainConfig(drafter="moa", target="t", out=out, data=str(data), max_tokens=2,
                                        resume=True), Tok())
    assert len(calls) == 1  # resumed: the run's own examples
    trainer.cached_examples(cfg, Tok())
    assert len(calls) == 2  # a new run: built from the file as it is now
