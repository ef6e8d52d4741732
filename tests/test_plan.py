"""plan_step decides what one Verify call sends from the answer and the server's view alone: small
hand-written cases, no verifier and no model."""
from __future__ import annotations

import torch

from splitspec.client.answer import Answer, EventKind, Provenance
from splitspec.client.plan import ServerView, StepLimits, plan_step
from splitspec.shared.acceptance import SparseProbs
from splitspec.shared.tree import ROOT, DraftTree

PROMPT = [1, 2, 3]
GREEDY = StepLimits(max_tree_depth=4, max_tree_nodes=8, sampled=False)
SAMPLED = StepLimits(max_tree_depth=4, max_tree_nodes=8, sampled=True)


def _answer(*runs: tuple[list[int], Provenance], budget: int = 16, rows=None, events=None) -> Answer:
    """The prompt, then each (tokens, provenance) run appended in turn; events go to `events`."""
    answer = Answer(PROMPT, budget, eos={0}, privacy=None, emit=(events if events is not None else []).append)
    for tokens, source in runs:
        answer.append(tokens, source, rows if source == Provenance.OFFLINE else None)
    return answer


def _row(token: int) -> SparseProbs:
    return SparseProbs(torch.tensor([token]), torch.tensor([1.0]))


def test_online_the_drafter_proposes_below_the_pending_token():
    answer = _answer(([7], Provenance.TARGET))  # the open call's first token, pending on the server
    plan = plan_step(answer, ServerView(cached=3, pending=7), GREEDY)
    assert plan.forced == () and plan.tree is None


def test_a_finished_answer_with_nothing_to_hand_over_needs_no_call():
    answer = _answer(([7, 8], Provenance.TARGET), budget=2)
    assert plan_step(answer, ServerView(cached=4, pending=8), GREEDY) is None


def test_offline_tokens_are_verified_as_a_chain_capped_by_the_tree_limits():
    answer = _answer(([7], Provenance.TARGET), ([10, 11, 12, 13, 14, 15], Provenance.OFFLINE))
    plan = plan_step(answer, ServerView(cached=3, pending=7), GREEDY)
    assert plan.forced == () and plan.tree == DraftTree.chain([10, 11, 12, 13]) and plan.draft_probs == {}
    narrow = plan_step(answer, ServerView(3, 7), StepLimits(max_tree_depth=8, max_tree_nodes=2, sampled=False))
    assert narrow.tree == DraftTree.chain([10, 11])


def test_sampled_offline_tokens_travel_with_their_rows_only_when_every_row_is_known():
    rows = [_row(10), _row(11)]
    answer = _answer(([7], Provenance.TARGET), ([10, 11], Provenance.OFFLINE), rows=rows)
    plan = plan_step(answer, ServerView(3, 7), SAMPLED)
    assert set(plan.draft_probs) == {ROOT, 0} and plan.draft_probs[ROOT] is rows[0]
    assert plan_step(answer, ServerView(3, 7), GREEDY).draft_probs == {}
    partly = _answer(([7], Provenance.TARGET), ([10, 11], Provenance.OFFLINE), rows=[_row(10), None])
    assert plan_step(partly, ServerView(3, 7), SAMPLED).draft_probs == {}  # one-hot rows on the server


def test_offline_rows_that_name_private_text_are_not_sent():
    """The drafter wrote an offline row after the private prompt token 2 giving weight to 3 (the
    private bigram 2 -> 3): the chain goes with no rows (one-hot proposals on the server, exact all
    the same); without that entry its rows travel."""
    from splitspec.client.privacy import PrivacyGuard

    guard = PrivacyGuard(tuple(PROMPT), (False, True, True), placeholder=99, ngram=2)

    def answer_with(second_row: SparseProbs) -> Answer:
        answer = Answer(PROMPT, 16, eos={0}, privacy=guard, emit=[].append)
        answer.append([7], Provenance.TARGET)
        answer.append([2, 5], Provenance.OFFLINE, [_row(2), second_row])
        return answer

    naming = answer_with(SparseProbs(torch.tensor([5, 3]), torch.tensor([0.5, 0.5])))
    assert plan_step(naming, ServerView(3, 7), SAMPLED).draft_probs == {}
    public = answer_with(_row(5))
    assert set(plan_step(public, ServerView(3, 7), SAMPLED).draft_probs) == {ROOT, 0}


def test_kept_tokens_replace_the_pending_token_as_forced_tokens():
    answer = _answer(([7], Provenance.TARGET), ([20, 21], Provenance.KEPT))
    plan = plan_step(answer, ServerView(cached=3, pending=7), GREEDY)
    assert plan.forced == (7, 20, 21) and plan.tree is None  # the drafter proposes below the last kept token
    done = _answer(([7], Provenance.TARGET), ([20, 21], Provenance.KEPT), budget=3)
    assert plan_step(done, ServerView(3, 7), GREEDY).tree == DraftTree.empty()  # only the hand-over left


def test_a_token_the_server_does_not_hold_is_forced():
    answer = _answer(([9], Provenance.KEPT))  # the client kept 9 where the server's pending token is 7
    plan = plan_step(answer, ServerView(cached=3, pending=7), GREEDY)
    assert plan.forced == (9,) and plan.tree is None


def test_the_answer_reports_every_change_as_an_event():
    events = []
    answer = _answer(([7], Provenance.TARGET), ([10, 11, 12], Provenance.OFFLINE), events=events)
    answer.relabel(4, 5, Provenance.TARGET)
    answer.retract(5)
    assert [(e.kind, e.start) for e in events] == [(EventKind.TOKENS, 0), (EventKind.TOKENS, 1),
                                                          (EventKind.VERIFIED, 1), (EventKind.RETRACT, 2)]
    assert answer.new_tokens == [7, 10] and answer.retracted == 2 and answer.first_unverified() == len(answer)
