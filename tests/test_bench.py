"""The bench: metrics and report on synthetic records, then the command end to end on stories260K
behind the emulated lan link (a real server process, every answer exact)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from splitspec.bench.bench import ArrivalClock, BenchConfig, decoding_text, open_link
from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.bench.metrics import (ALL, BenchRecord, GroupKey, aggregate, feature_bytes, goals, paired_comparisons,
                                     quantile, speedup, token_gaps_ms, vs_remote_ar, vs_single_device_ar)
from splitspec.bench.report import PLOTS, client_server_table, render_markdown, write_plots
from splitspec.cli.main import build_parser, main
from splitspec.shared.reference import target_sampled
from splitspec.shared.sampling import SamplingParams

META = {"target": "tiny", "commit": "abc123", "machine": "test box", "seed": 0, "max_new_tokens": 8}


def record(mode, method, profile, category="writing", *, tokens=8, calls=8, elapsed=1.0, up=0, down=0,
           open_up=0, open_down=0, server_ms=None, itl=(), quant=None, lsa=None, exact=True) -> BenchRecord:
    return BenchRecord.from_json({**META, "mode": mode, "method": method, "profile": profile, "category": category, "id": category,
            "new_tokens": tokens, "target_calls": calls, "elapsed_s": elapsed, "bytes_sent": up,
            "bytes_received": down, "open_bytes_sent": open_up, "open_bytes_received": open_down, "server_ms": server_ms, "itl_ms": list(itl), "ttft_ms": 50.0,
            "quant": quant, "lsa": lsa, "exact": exact, "backend": "relay" if mode == "split" else None})


def synthetic_run(moa_elapsed: float = 0.4, moa_calls: int = 2) -> list[BenchRecord]:
    """generate() and two profiles; on 4g remote AR does 8 tokens/s, eagle2 16, moa 8 / moa_elapsed."""
    rows = [record("local", "generate()", None, elapsed=0.5), record("local", "moa", None, calls=3, elapsed=0.4)]
    for profile, scale in (("lan", 0.5), ("4g", 1.0)):
        rows += [record("split", "none", profile, elapsed=1.0 * scale, up=240, down=320, server_ms=400 * scale),
                 record("split", "eagle2", profile, calls=4, elapsed=0.5 * scale, up=350 + 50, down=7000 + 2048,
                        open_up=50, open_down=2048, server_ms=200 * scale, quant="fp16"),
                 record("split", "moa", profile, calls=moa_calls, elapsed=moa_elapsed * scale, up=350 + 50,
                        down=3500 + 2048, open_up=50, open_down=2048, server_ms=150 * scale, quant="fp16", lsa="server"),
                 record("split", "moa;quant=int8", profile, calls=moa_calls, elapsed=moa_elapsed * scale, up=350 + 50,
                        down=1750 + 1024, open_up=50, open_down=1024, server_ms=150 * scale, quant="int8",
                        lsa="server")]
    return rows


# --- metrics -------------------------------------------------------------------------------------

def test_token_gaps_ms_are_per_token_with_zeros_inside_a_commit():
    # commits of 2, 3 and 1 tokens at 0.1 s, 0.3 s, 0.5 s after a start at 1.0 s
    ttft, gaps = token_gaps_ms(1.0, [1.1, 1.1, 1.3, 1.3, 1.3, 1.5])
    assert ttft == pytest.approx(100.0)
    assert gaps == pytest.approx([0.0, 200.0, 0.0, 0.0, 200.0])
    with pytest.raises(ValueError):
        token_gaps_ms(0.0, [])
    with pytest.raises(ValueError):
        token_gaps_ms(0.0, [0.2, 0.1])
    with pytest.raises(ValueError):
        token_gaps_ms(1.0, [0.5])


def test_quantile_interpolates_and_rejects_bad_q():
    assert quantile([0.0, 10.0], 0.5) == pytest.approx(5.0)
    assert quantile(range(101), 0.99) == pytest.approx(99.0)
    assert quantile([0, 0, 0, 200], 0.5) == 0.0
    assert math.isnan(quantile([], 0.5))
    with pytest.raises(ValueError):
        quantile([1.0], 1.5)


def test_arrival_clock_skips_the_prompt_as_a_streamer_and_counts_every_token():
    clock = ArrivalClock(streamer=True)
    clock.put(torch.tensor([[1, 2, 3, 4]]))  # transformers first hands over the prompt
    clock.put(torch.tensor([7]))
    clock.put(torch.tensor([8]))
    assert len(clock.arrivals) == 2
    loop_clock = ArrivalClock()
    loop_clock([5, 6, 7])
    lat = loop_clock.latencies()
    assert lat["itl_ms"] == [0.0, 0.0] and lat["ttft_ms"] >= 0


def test_aggregate_pools_answers_per_group_and_over_categories():
    rows = [record("split", "moa", "4g", "writing", tokens=10, calls=4, elapsed=2.0, up=100, down=1000,
                   open_up=10, open_down=1000 - 9 * 80, server_ms=500.0, itl=[0, 0, 100, 300]),
            record("split", "moa", "4g", "humaneval", tokens=6, calls=2, elapsed=1.0, up=60, down=600,
                   open_up=10, open_down=600 - 5 * 80, server_ms=250.0, itl=[0, 200])]
    groups = aggregate(rows)
    g = groups[GroupKey("split", "moa", "4g", ALL)]
    assert (g.answers, g.new_tokens, g.target_calls) == (2, 16, 6)
    assert g.tokens_per_s == pytest.approx(16 / 3.0)
    assert g.tau == pytest.approx((16 - 2) / (6 - 2))  # the open call verifies nothing
    assert g.tau_ci95 == (3.0, 5.0)  # bootstrap over the two answers: their own taus (9/3, 5/1) bound it
    assert g.calls_per_token == pytest.approx(6 / 16)
    # decoding phase: verify-call bytes over the 9 + 5 tokens the verify calls produced
    assert (g.bytes_up_per_token, g.bytes_down_per_token) == pytest.approx((140 / 14, 80.0))
    assert g.open_kib_down == pytest.approx((280 + 200) / 2 / 1024)
    assert g.server_share == pytest.approx(0.25)
    # pooled gaps sorted: 0 0 0 100 200 300; p99 sits at rank 4.95 -> 200 + 0.95 x 100
    assert g.itl_p50_ms == pytest.approx(50.0) and g.itl_p99_ms == pytest.approx(295.0)
    only_writing = groups[GroupKey("split", "moa", "4g", "writing")]
    assert only_writing.tau == pytest.approx(3.0) and only_writing.answers == 1
    assert all(math.isnan(x) for x in only_writing.tau_ci95)  # one answer: no interval
    assert math.isnan(aggregate([record("local", "generate()", None)])[GroupKey("local", "generate()", None, ALL)]
                      .server_share)


def test_speedups_compare_with_remote_ar_of_the_same_profile_and_with_generate():
    groups = aggregate(synthetic_run())
    moa_4g = GroupKey("split", "moa", "4g", ALL)
    assert vs_remote_ar(moa_4g) == GroupKey("split", "none", "4g", ALL)
    assert speedup(groups, moa_4g, vs_remote_ar(moa_4g)) == pytest.approx(2.5)
    assert speedup(groups, moa_4g, vs_single_device_ar(moa_4g)) == pytest.approx(0.5 / 0.4)
    assert math.isnan(speedup(groups, moa_4g, GroupKey("split", "none", "5g", ALL)))


def test_goal_lines_say_met_or_missed_by_how_much():
    lines = [g.line() for g in goals(aggregate(synthetic_run()), "4g")]
    moa = [line for line in lines if line.startswith("moa ")]
    assert moa[0].endswith("goal >= 1.5x, measured 2.50x -> met")  # vs remote AR: 20 / 8 tokens/s
    assert moa[1].endswith("goal >= 1.2x, measured 1.25x -> met")  # vs eagle2: 20 / 16
    assert moa[2].endswith("goal <= 0.4, measured 0.25 -> met")  # 2 calls for 8 tokens
    assert moa[3] == "moa single-device tokens/s vs generate(): goal >= 1.5x, measured 1.25x -> missed by 17%"
    slow = [g for g in goals(aggregate(synthetic_run(moa_elapsed=2.0, moa_calls=4)), "4g") if g.text.startswith("moa ")]
    assert [g.verdict() for g in slow] == ["missed by 67%", "missed by 79%", "missed by 25%", "missed by 17%"]
    missing = goals(aggregate(synthetic_run()), "5g")
    assert [g.verdict() for g in missing] == ["not measured"] * 3 + ["missed by 17%"]  # single-device needs no link


def test_goal_lines_carry_a_paired_interval_and_say_when_it_crosses_the_bound():
    """With the run's answers each goal gets its 95% bootstrap interval over prompts: a speed-up
    paired with its reference arm prompt by prompt, calls per token over moa's own answers. Every
    prompt here gives moa 2.0x remote AR except one at 1.0x, so the pooled ratio meets 1.5x only
    with the interval crossing it; a constant 2.0x resolves it."""
    def run(slow_prompts):
        rows = []
        for i, category in enumerate(("writing", "math", "qa", "coding", "stem", "rag")):
            moa_elapsed = 1.0 if i < slow_prompts else 0.5
            rows += [record("split", "none", "4g", category, tokens=8, calls=8, elapsed=1.0),
                     record("split", "eagle2", "4g", category, tokens=8, calls=3, elapsed=0.5),
                     record("split", "moa", "4g", category, tokens=8, calls=2 + i % 2, elapsed=moa_elapsed)]
        return rows
    crossing = goals(aggregate(run(1)), "4g", run(1))
    assert crossing[0].measured == pytest.approx(6 / 3.5) and crossing[0].met
    low, high = crossing[0].interval
    assert low < 1.5 < high and crossing[0].resolved is False
    assert crossing[0].line().endswith("-> met (not resolved: the interval crosses the bound)")
    assert "(95% CI " in crossing[0].line()
    steady = goals(aggregate(run(0)), "4g", run(0))
    assert steady[0].interval == (pytest.approx(2.0), pytest.approx(2.0)) and steady[0].resolved is True
    assert steady[0].line() == ("moa split tokens/s vs remote AR (4g): goal >= 1.5x, measured 2.00x "
                                "(95% CI 2.00x to 2.00x) -> met")
    calls = steady[2]  # 2 or 3 calls for 8 tokens: 15 / 48 pooled, every resample between 0.25 and 0.375
    assert calls.measured == pytest.approx(15 / 48) and 0.25 <= calls.interval[0] <= calls.interval[1] <= 0.375
    assert calls.resolved is True and calls.line().endswith("-> met")
    assert steady[1].resolved is True and not steady[1].met  # moa ties eagle2 on every prompt: 1.0x, missed
    assert goals(aggregate(run(0)), "4g")[0].interval is None  # without the answers: no interval, as before


def test_feature_bytes_one_row_per_quantization():
    rows = feature_bytes(synthetic_run(), "4g")
    assert [(m, lsa, quant, g.bytes_up_per_token, g.bytes_down_per_token, g.open_kib_down) for m, lsa, quant, g in rows] \
        == [("eagle2", "-", "fp16", 50.0, 1000.0, 2.0), ("moa", "server", "fp16", 50.0, 500.0, 2.0),
            ("moa;quant=int8", "server", "int8", 50.0, 250.0, 1.0)]


def test_paired_comparisons_pair_variants_with_their_kind_and_kinds_with_the_first_drafter():
    """generate() and none are left out; moa;tree=... and moa:DIR go against moa, eagle2 against
    moa (the run's first drafter); only prompts both arms answered count."""
    rows = []
    for category, hard in (("writing", 0), ("math", 6), ("qa", 12)):
        rows += [record("local", "generate()", None, category, tokens=25, calls=25),
                 record("local", "moa", None, category, tokens=25, calls=9 + hard // 2, elapsed=1.0),
                 record("local", "moa;tree=3x2x6", None, category, tokens=25, calls=7 + hard // 2, elapsed=1.0),
                 record("local", "eagle2", None, category, tokens=25, calls=9 + hard // 2, elapsed=0.5)]
    rows.append(record("local", "moa:out/x", None, "writing", tokens=25, calls=5))  # one prompt only
    got = {(c.method, c.base): c for c in paired_comparisons(rows)}
    assert set(got) == {("moa;tree=3x2x6", "moa"), ("eagle2", "moa"), ("moa:out/x", "moa")}
    tree = got[("moa;tree=3x2x6", "moa")]
    assert tree.prompts == 3 and tree.tau_difference > 0 and tree.tau_difference_ci95[0] > 0  # 2 calls fewer on each
    eagle = got[("eagle2", "moa")]
    assert eagle.tau_difference == 0 and eagle.tau_difference_ci95 == (0.0, 0.0)
    assert eagle.speed_ratio == pytest.approx(2.0) and eagle.speed_ratio_ci95 == (pytest.approx(2.0), pytest.approx(2.0))
    one = got[("moa:out/x", "moa")]
    assert one.prompts == 1 and all(math.isnan(x) for x in one.tau_difference_ci95)
    md = render_markdown(rows, META)
    assert "| local | - | moa;tree=3x2x6 | moa | 3 |" in md and "| local | - | moa:out/x | moa | 1 |" in md


# --- report --------------------------------------------------------------------------------------

def test_markdown_has_the_seed_table_shape_and_the_goals():
    md = render_markdown(synthetic_run(), META)
    table = client_server_table(aggregate(synthetic_run()), ["lan", "4g"]).splitlines()
    header = table[2]
    assert header.count("|") - 1 == 1 + 4 * 2
    assert "lan tokens/s | lan tau | lan calls/token | lan vs remote AR" in header
    body = [line for line in table[4:]]
    assert [line.split("|")[1].strip() for line in body] == ["none (remote AR)", "eagle2", "moa", "moa;quant=int8"]
    assert all(line.count("|") - 1 == 9 for line in body)
    assert "| moa | 40.0 | 7.00 | 0.25 | 2.50x | 20.0 | 7.00 | 0.25 | 2.50x |" in table
    assert "### Single-device reference" in md and "| generate() | 16.0 |" in md
    assert "| method | tokens/s | tau | tau 95% CI | calls/token |" in md
    assert "- moa split tokens/s vs remote AR (4g): goal >= 1.5x, measured 2.50x -> met" in md
    assert "| moa;quant=int8 | server | int8 | 50 | 250 | 0.0 | 1.0 |" in md
    assert "#### 4g: tokens/s by category" in md
    with pytest.raises(ValueError, match="baseline"):
        render_markdown([r for r in synthetic_run() if r.method != "generate()"], META)


def test_plots_are_written_as_png(tmp_path):
    paths = write_plots(synthetic_run(), tmp_path)
    assert [p.name for p in paths] == list(PLOTS)
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert write_plots([record("local", "generate()", None)], tmp_path / "none") == []


# --- configuration -------------------------------------------------------------------------------

def test_method_options_and_config_errors():
    assert DrafterSpec.parse("moa:tli=1;quant=int8", lsa="server") == DrafterSpec("moa", tli=1, lsa="server",
                                                                                  quant="int8")
    assert DrafterSpec.parse("eagle2;vocab=0;tree=4x2x8", quant="fp8") == DrafterSpec(
        "eagle2", quant="fp8", vocab=0, tree=TreeConfig(depth=4, top_b=2, max_nodes=8))
    for bad in ("moa;speed=2", "moa;quant=int4", "moa;lsa", "moa;vocab=many", "moa;vocab=-2", "moa;tree=4x2",
                "moa;tree=0x2x8", "moa;tree=axbxc"):
        with pytest.raises(ValueError):
            DrafterSpec.parse(bad, lsa="server")
    parser = build_parser()
    with pytest.raises(ValueError, match="single-device"):
        BenchConfig.from_args(parser.parse_args(["bench", "--local-methods", "moa;quant=int8"]))
    local = BenchConfig.from_args(parser.parse_args(["bench", "--local-methods", "moa;tree=3x2x6;vocab=0"]))
    assert local.local_methods == ("moa;tree=3x2x6;vocab=0",)
    cfg = BenchConfig.from_args(parser.parse_args(["bench", "--profiles", "lan,4g", "--threads", "1"]))
    assert cfg.profiles == ("lan", "4g") and "--profiles lan,4g" in cfg.command()
    # features travel int8 unless a method or the user says otherwise (half fp16's bytes, session 44)
    assert cfg.feature_quant == DrafterSpec("moa").quant == "int8" == cfg.split_spec("moa").quant
    assert cfg.split_spec("moa;quant=fp16").quant == "fp16"
    from splitspec.client.cli import client_config

    client = client_config(build_parser().parse_args(["generate", "--prompt", "x", "--drafter", "moa"]))
    assert client.drafter.quant == "int8"  # --feature-quant's default, left unset (None) on the flag
    assert {"none", "ngram", "eagle2", "moa", "moa:tli=1"} <= set(cfg.methods) and cfg.local_methods == ("moa",)
    assert any(m.startswith("draft-model:") for m in cfg.methods)
    with pytest.raises(ValueError, match="backend"):
        with open_link("carrier-pigeon", None, ("127.0.0.1", 1)):
            pass


def test_sampled_bench_settings_reach_the_config_the_command_and_the_report():
    """--temperature > 0 samples (answer i seeded seed + i), says so in the command and the header,
    and the exact column reads 'sampled' (answers are not compared); bad settings are refused."""
    parser = build_parser()
    greedy = BenchConfig.from_args(parser.parse_args(["bench"]))
    assert greedy.sampling.greedy and "--temperature" not in greedy.command()
    cfg = BenchConfig.from_args(parser.parse_args(["bench", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3"]))
    assert (cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k, cfg.sampling.seed) == (0.7, 0.9, 0, 3)
    assert "--temperature 0.7 --top-p 0.9 --top-k 0" in cfg.command()
    for bad in (["--top-p", "0"], ["--temperature", "-1"], ["--top-k", "-2"]):
        with pytest.raises(ValueError):
            BenchConfig.from_args(parser.parse_args(["bench", "--temperature", "1", *bad]))
    rows = [replace(r, exact=None) for r in synthetic_run()]
    assert aggregate(rows)[GroupKey("local", "moa", None, ALL)].exact is None
    md = render_markdown(rows, {**META, "decoding": decoding_text(cfg.sampling)})
    assert "target tiny, sampled (temperature 0.7, top-p 0.9, answer i seeded 3 + i)," in md
    assert "| sampled |" in md and "/1 |" not in md
    assert "| 1/1 |" in render_markdown(synthetic_run(), META)
    # the goals' heading reads the records, not the meta's words
    assert "### Goals (sampled," in render_markdown(rows, META)
    assert "### Goals (greedy," in render_markdown(synthetic_run(), {**META, "decoding": "sampled (x)"})


def test_target_sampled_is_seeded_and_leaves_the_global_rng_alone(stories):
    model, tokenizer, _ = stories
    prompt, eos = tokenizer.encode("Once upon a time"), [tokenizer.eos_token_id]
    hot = SamplingParams(temperature=1.5, seed=1)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = target_sampled(model, prompt, 24, eos, hot)
    assert torch.equal(torch.rand(1), before)  # the caller's random stream did not move
    assert a == target_sampled(model, prompt, 24, eos, hot)
    assert a != target_sampled(model, prompt, 24, eos, replace(hot, seed=2))
    assert 0 < len(a) <= 24
    with pytest.raises(ValueError, match="temperature > 0"):
        target_sampled(model, prompt, 4, eos, SamplingParams())


def test_bench_refuses_bad_input_with_a_clear_error(capsys):
    assert main(["bench", "--methods", "moa;colour=red"]) == 2
    assert "unknown drafter options" in capsys.readouterr().err
    assert main(["bench", "--profiles", "lan,6g"]) == 2
    assert "unknown link profile '6g'" in capsys.readouterr().err


# --- end to end ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_small_behind_lan_link(stories_path, tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "--target", str(stories_path), "--methods", "none,ngram", "--local-methods", "none",
                 "--profiles", "lan", "--datasets", "humaneval", "--limit", "1", "--max-new-tokens", "8",
                 "--threads", "1", "--out", str(out)])
    assert code == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["mode"], r["method"], r["profile"]) for r in rows} == {
        ("local", "generate()", None), ("local", "none", None), ("split", "none", "lan"), ("split", "ngram", "lan")}
    assert all(r["exact"] for r in rows)
    assert all(r["commit"] and r["machine"] and r["seed"] == 0 for r in rows)
    split_rows = [r for r in rows if r["mode"] == "split"]
    assert all(r["backend"] == "relay" and r["link"]["name"] == "lan" for r in split_rows)
    assert all(r["bytes_sent"] > 0 and r["bytes_received"] > 0 and r["server_ms"] > 0 for r in split_rows)
    assert all(len(r["itl_ms"]) == r["new_tokens"] - 1 for r in rows)
    remote_ar = next(r for r in split_rows if r["method"] == "none")
    assert remote_ar["target_calls"] == remote_ar["new_tokens"]  # one call per token
    table = (out / "table.md").read_text()
    assert "| lan tokens/s | lan tau | lan calls/token | lan vs remote AR |" in table
    assert "| none (remote AR) |" in table and "### Goals" in table
    assert sorted(p.name for p in out.glob("*.png")) == sorted(PLOTS)
    assert "bench" in capsys.readouterr().err  # the progress bar


def test_bench_sampled_single_device(stories_path, tmp_path):
    """A sampled run end to end: every method samples, nothing is compared per answer, and the
    table says so; the same command gives the same answers (seeded: the answers' token ids, by
    their digests), and another --seed other answers."""
    runs = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        out = tmp_path / name
        assert main(["bench", "--target", str(stories_path), "--methods", "", "--local-methods", "none,ngram",
                     "--datasets", "humaneval", "--limit", "2", "--max-new-tokens", "12", "--threads", "1",
                     "--temperature", "0.9", "--top-p", "0.95", "--seed", str(seed), "--out", str(out)]) == 0
        runs.append([json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()])
    rows = runs[0]
    assert {r["method"] for r in rows} == {"generate()", "none", "ngram"}
    assert all(r["exact"] is None for r in rows)  # generate()'s sample is no reference either
    assert all(0 < r["new_tokens"] <= 12 for r in rows)
    digests = [[(r["method"], r["id"], r["answer_digest"]) for r in run] for run in runs]
    assert digests[0] == digests[1]
    assert digests[0] != digests[2]  # the seed reaches the answers
    table = (tmp_path / "a" / "table.md").read_text()
    assert "sampled (temperature 0.9, top-p 0.95, answer i seeded 0 + i)" in table and "| sampled |" in table
    assert "/2 |" not in table and "### Goals (sampled," in table


def test_a_method_profile_or_batch_given_twice_is_refused(capsys):
    """`--methods none,ngram,ngram` ran two arms with one drafter and pooled their answers into one
    row; `serve-bench --max-batch 8,8` shares one "vs 1 client" base: both are refused."""
    parser = build_parser()
    for flag, value in (("--methods", "none,ngram,ngram"), ("--local-methods", "moa,moa"), ("--profiles", "lan,lan"),
                        ("--categories", "writing,writing")):
        with pytest.raises(ValueError, match=f"{flag} lists .* more than once"):
            BenchConfig.from_args(parser.parse_args(["bench", flag, value]))
    for argv in (["--max-batch", "8,8"], ["--max-batch", "8,8:ragged"], ["--clients", "1,1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve-bench", *argv])
        assert "given twice" in capsys.readouterr().err
    assert parser.parse_args(["serve-bench", "--max-batch", "8,8:padded"]).max_batch == [(8, "ragged"), (8, "padded")]


def test_the_calls_per_token_plot_draws_the_goal_of_the_table():
    """The plot's goal line said 0.3 where the table's goal (metrics.goals) and the README say 0.4."""
    from splitspec.bench.report import CALLS_GOAL

    bounds = {g.bound for g in goals(aggregate(synthetic_run()), "4g") if "server calls per generated token" in g.text}
    assert bounds == {CALLS_GOAL} == {0.4}
