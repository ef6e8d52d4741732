"""Offline continuation: the drafter writes alone while the link is down; back online the text is
verified (heal: the final answer equals an uninterrupted greedy run) or kept; sessions lost to a
server restart are re-opened; every token is delivered exactly once."""
from __future__ import annotations

import threading

import pytest

from splitspec.client.drafters import DraftModelDrafter, NgramDrafter
from splitspec.client.loop import KEPT, OFFLINE, TARGET, OfflinePolicy, SpeculativeDecoder
from splitspec.client.transport import RemoteVerifier
from splitspec.shared.verifier import LinkDown
from splitspec.server.runner import TargetRunner
from splitspec.shared.config import TreeConfig
from splitspec.shared.models import load_model

from .helpers import FAST, EventLog, FlakyVerifier, reference_greedy

N_NEW = 48


@pytest.fixture(scope="module")
def setup(stories, stories_path):
    model, tokenizer, model_id = stories
    prompt = tokenizer("Once upon a time, there was a little dog named Max. Max liked to")["input_ids"]
    draft, _, _ = load_model(f"{stories_path}@layers=3")
    return model, TargetRunner(model, tokenizer, model_id), prompt, reference_greedy(model, prompt, N_NEW), draft


def _drafter(draft):
    return DraftModelDrafter(draft, TreeConfig(depth=4, top_b=2, max_nodes=8))


# {3: "before"} and the two-failure case take the longest (30-50 s each on a 2-core CPU): slow tier
@pytest.mark.parametrize("fail", [{3: "after"}, pytest.param({3: "before"}, marks=pytest.mark.slow),
                                  pytest.param({2: "after", 6: "before"}, marks=pytest.mark.slow), {4: "lost"}])
def test_heal_equals_uninterrupted_greedy(setup, fail):
    model, runner, prompt, ref, draft = setup
    log = EventLog()  # the link returns only once the drafter has written 3 tokens alone
    verifier = FlakyVerifier(runner, fail, gate=lambda: log.sources.count(OFFLINE) >= 3)
    gen = SpeculativeDecoder(verifier, _drafter(draft), FAST).generate(prompt, N_NEW, stop_on_eos=False,
                                                                       on_event=log)
    assert gen.tokens == ref
    assert gen.verified and log.tokens == gen.tokens and log.sources == [TARGET] * N_NEW
    if "lost" in fail.values():
        assert gen.stats.reopened_sessions == 1
    else:
        assert gen.stats.disconnects == len(fail) and gen.stats.offline_tokens > 0
        assert verifier.replays == sum(v == "after" for v in fail.values())


def test_keep_leaves_offline_text_and_continues_from_it(setup):
    model, runner, prompt, ref, draft = setup
    log = EventLog()
    policy = OfflinePolicy(on_reconnect="keep", backoff_initial_s=0.01, backoff_max_s=0.05)
    # the link returns once 8 offline tokens exist, so kept text and a verified tail both fit the budget
    verifier = FlakyVerifier(runner, {2: "before"}, down_probes=0, gate=lambda: log.sources.count(OFFLINE) >= 8)
    gen = SpeculativeDecoder(verifier, _drafter(draft), policy).generate(prompt, N_NEW, stop_on_eos=False,
                                                                         on_event=log)
    assert log.tokens == gen.tokens and log.sources == gen.sources and len(gen.tokens) == N_NEW
    assert "retract" not in log.kinds
    first_kept = gen.sources.index(KEPT)  # the 3-layer drafter disagrees with the target quickly
    assert gen.tokens[:first_kept] == ref[:first_kept]
    last_kept = len(gen.sources) - 1 - gen.sources[::-1].index(KEPT)
    tail = gen.tokens[last_kept + 1:]
    assert tail and set(gen.sources[last_kept + 1:]) == {TARGET}
    # after the kept text the target continues from it, exactly as greedy decoding would
    assert tail == reference_greedy(model, prompt + gen.tokens[:last_kept + 1], len(tail))
    # tau counts what verify calls produced: the kept tokens were written by the drafter alone
    kept = gen.sources.count(KEPT)
    assert gen.stats.unverified_tokens == kept and gen.stats.as_dict()["unverified_tokens"] == kept
    assert gen.stats.tau == (len(gen.tokens) - 1 - kept) / (gen.stats.target_calls - 1)
    assert f"({kept} unverified" in gen.stats.summary()


def test_a_server_down_at_the_first_open_is_waited_for(setup):
    """qa-ops F8: a server restarting between the client's start and its first OpenSession failed
    the answer at once (nothing to continue from); the client now waits for the link, as at an
    offline answer's end, and the answer is the target's."""
    model, runner, prompt, ref, draft = setup

    class DownAtFirst(FlakyVerifier):
        opens = 0

        def open(self, prompt_ids, sampling, features, **kwargs):
            self.opens += 1
            if self.opens == 1:
                self.probes_left = 3
                raise LinkDown("connection refused")
            return super().open(prompt_ids, sampling, features, **kwargs)

    policy = OfflinePolicy(backoff_initial_s=0.01, backoff_max_s=0.05)
    verifier = DownAtFirst(runner, {})
    gen = SpeculativeDecoder(verifier, _drafter(draft), policy).generate(prompt, N_NEW, stop_on_eos=False)
    assert gen.tokens == ref and verifier.opens == 2 and gen.stats.disconnects == 1
    # with offline continuation off, or the link down for good, LinkDown propagates as before
    with pytest.raises(LinkDown):
        SpeculativeDecoder(DownAtFirst(runner, {}), _drafter(draft), OfflinePolicy(enabled=False)).generate(
            prompt, N_NEW, stop_on_eos=False)
    never = DownAtFirst(runner, {})
    never.probe = lambda timeout_s=1.0: False
    with pytest.raises(LinkDown, match="stayed unreachable"):
        SpeculativeDecoder(never, _drafter(draft), OfflinePolicy(final_wait_s=0.3, backoff_initial_s=0.01,
                                                                 backoff_max_s=0.05)).generate(prompt, 4)


def test_disabled_offline_raises(setup, monkeypatch):
    """--no-offline: the answer fails at the lost step, without a CloseSession over the dead link
    (which waited out its 5 s deadline, and failed anyway: QA 57)."""
    from . import helpers

    model, runner, prompt, ref, draft = setup
    closed = []
    monkeypatch.setattr(helpers._FlakySession, "close", lambda self: closed.append(self))
    decoder = SpeculativeDecoder(FlakyVerifier(runner, {2: "before"}), _drafter(draft), OfflinePolicy(enabled=False))
    with pytest.raises(LinkDown):
        decoder.generate(prompt, N_NEW, stop_on_eos=False)
    assert not closed


def test_drafter_that_cannot_write_alone_waits_for_the_link(setup):
    model, runner, prompt, ref, draft = setup
    verifier = FlakyVerifier(runner, {3: "after"}, down_probes=2)
    gen = SpeculativeDecoder(verifier, NgramDrafter(), FAST).generate(prompt, N_NEW, stop_on_eos=False)
    assert gen.tokens == ref and gen.stats.disconnects == 1


def test_real_server_cut_and_restart(setup, serve):
    """Over gRPC: the link is cut mid-answer (relay), then the server is replaced by a new one on
    the same port (sessions gone). Greedy + heal: the answer equals the uninterrupted one."""
    from splitspec.netsim import PRESETS, RelayThread

    model, runner, prompt, ref, draft = setup
    first = serve(runner)
    with RelayThread(PRESETS["lan"], ("127.0.0.1", first.port)) as link:
        verifier = RemoteVerifier(f"127.0.0.1:{link.port}", timeout_s=30.0, step_timeout_s=1.0)
        state = {"cut": False, "restarted": False, "offline": 0}

        def on_event(event):
            if event.kind != "tokens":
                return
            if event.source == OFFLINE:
                state["offline"] += len(event.tokens)
            if not state["cut"] and event.start >= 10:
                state["cut"] = True
                link.cut()
            elif state["cut"] and not state["restarted"] and state["offline"] >= 6:
                state["restarted"] = True  # a new server on the same port, then the link returns
                port = first.port
                first.stop()
                serve(runner, address=f"127.0.0.1:{port}")
                threading.Timer(0.2, link.restore).start()

        policy = OfflinePolicy(backoff_initial_s=0.05, backoff_max_s=0.3, final_wait_s=30)
        gen = SpeculativeDecoder(verifier, _drafter(draft), policy).generate(prompt, N_NEW, stop_on_eos=False,
                                                                             on_event=on_event)
        verifier.close()
    assert state["restarted"]
    assert gen.tokens == ref and gen.verified
    assert gen.stats.disconnects >= 1 and gen.stats.reopened_sessions >= 1


def test_link_that_never_returns_with_a_drafter_that_cannot_write_alone(setup):
    from splitspec.client.drafters import NoDrafter

    model, runner, prompt, ref, draft = setup
    verifier = FlakyVerifier(runner, {3: "before"}, gate=lambda: False)
    policy = OfflinePolicy(backoff_initial_s=0.01, backoff_max_s=0.05, final_wait_s=0.5)
    with pytest.raises(LinkDown, match="cannot write alone"):
        SpeculativeDecoder(verifier, NoDrafter(), policy).generate(prompt, N_NEW, stop_on_eos=False)


@pytest.mark.parametrize("stopped", [False, True], ids=["while writing offline", "while waiting for the link"])
def test_a_cancelled_answer_ends_at_once_while_the_link_is_down(setup, stopped):
    """A listener that went away (`cancelled`) ends the answer as it stands: no wait for a link that
    stays down (final_wait_s is long here) and no CloseSession over it. `stopped`: the answer was
    already complete (the caller's stop string) and the loop waits for the link when the cancel comes."""
    import time

    model, runner, prompt, ref, draft = setup
    log, closed, asked = EventLog(), [], []
    offline = lambda: log.sources.count(OFFLINE) >= 3  # noqa: E731
    delay = 0.3 if stopped else 0.0

    def cancelled() -> bool:
        if not asked and offline():
            asked.append(time.perf_counter() + delay)
        return bool(asked) and time.perf_counter() >= asked[0]

    verifier = FlakyVerifier(runner, {3: "before"}, gate=lambda: False)
    opened = verifier.open

    def open_spied(*args, **kwargs):
        session, reply = opened(*args, **kwargs)
        session.close = lambda: closed.append(True)
        return session, reply

    verifier.open = open_spied
    policy = OfflinePolicy(backoff_initial_s=0.01, backoff_max_s=0.05, final_wait_s=60.0)
    gen = SpeculativeDecoder(verifier, _drafter(draft), policy).generate(
        prompt, N_NEW, stop_on_eos=False, on_event=log, should_stop=offline if stopped else None, cancelled=cancelled)
    assert time.perf_counter() - asked[0] < 5.0  # not final_wait_s (60 s), nor a 5 s close
    assert OFFLINE in gen.sources and len(gen.tokens) < N_NEW and not closed
