"""Private spans: prompt text that never leaves the device.

A prompt can mark spans private (chat: `<private>...</private>`; API: segments with
`private=True`). Every token overlapping a private span is replaced, in all that is sent to the
server, by one placeholder token id, so positions stay aligned and the drafter (which sees the
real text) can use the target's features of the other positions. Draft nodes whose token
completes an n-gram (n = `ngram`, 2 by default) of private tokens are never sent; when the
drafter's own best continuation reproduces private text, the client writes those tokens itself
and the server sees placeholders for them too (client/loop.py).

Draft-probability rows (sampled trees, offline chains) follow the same rule: a row giving weight
to a token that completes a private n-gram is not sent (`names_private`).

What the server can learn: the number and positions of private tokens (one placeholder each), the
target's reaction to placeholders, the drafter's other next-token probabilities in a private
context, and, with n >= 2, single tokens of a private span that the drafter proposed on its own,
one per draft node (n = 1 withholds every private token id). It never receives the span's token ids
as a run of n or more, embeddings or activations computed from them: the server computes
activations of the placeholder only. The rules compare token ids: the same words tokenized
otherwise (another case, a leading space) are not recognised.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from splitspec.shared.models import encode_rendered
from splitspec.shared.tree import ROOT, DraftTree

from .drafters.base import Proposal

PRIVATE_TAG = re.compile(r"<private>(.*?)</private>", re.DOTALL)
PLACEHOLDER_TEXT = " _"


@dataclass(frozen=True)
class Segment:
    text: str
    private: bool = False


def parse_private_tags(text: str, strict: bool = True) -> list[Segment]:
    """Split chat text on `<private>...</private>` tags.

    `strict` False (an assistant message: the model may write a tag as text) keeps an unmatched tag
    as text; a private segment holding a nested tag stays private, tag text included.

    Raises:
        ValueError: an unmatched or nested tag, when `strict`.
    """
    segments, last = [], 0
    for match in PRIVATE_TAG.finditer(text):
        segments.append(Segment(text[last:match.start()]))
        segments.append(Segment(match.group(1), private=True))
        last = match.end()
    segments.append(Segment(text[last:]))
    if strict and any("<private>" in s.text or "</private>" in s.text for s in segments):
        raise ValueError("unmatched or nested <private> tag")
    return [s for s in segments if s.text]


@dataclass(frozen=True)
class PrivacyGuard:
    """The private positions of one prompt and the rules applied to everything sent.

    `mask`: [P] True for prompt tokens that are private; `placeholder`: the id the server sees in
    their place; `ngram`: drafts completing a run of this many private tokens are withheld.
    """

    prompt_ids: tuple[int, ...]
    mask: tuple[bool, ...]
    placeholder: int
    ngram: int = 2

    def __post_init__(self) -> None:
        if len(self.mask) != len(self.prompt_ids):
            raise ValueError(f"private mask has {len(self.mask)} entries for {len(self.prompt_ids)} prompt tokens")
        if self.ngram < 1:
            raise ValueError("ngram must be >= 1")
        runs, run = [], []
        for token, private in zip(self.prompt_ids, self.mask):
            if private:
                run.append(token)
            elif run:
                runs.append(run)
                run = []
        if run:
            runs.append(run)
        grams = {tuple(r[i:i + self.ngram]) for r in runs for i in range(len(r) - self.ngram + 1)}
        object.__setattr__(self, "_grams", frozenset(grams))
        object.__setattr__(self, "_heads", frozenset(g[:-1] for g in grams))  # what a row's context must end with

    @property
    def active(self) -> bool:
        return any(self.mask)

    def completes(self, tokens: Sequence[int]) -> bool:
        """True when the last `ngram` of `tokens` are a run of private prompt tokens."""
        return len(tokens) >= self.ngram and tuple(tokens[-self.ngram:]) in self._grams

    def _tail(self, context: Sequence[int]) -> list[int]:
        """The committed tokens an n-gram ending in a draft's first token can start with."""
        return list(context[-(self.ngram - 1):]) if self.ngram > 1 else []

    def private_run(self, context: Sequence[int], path: Sequence[int]) -> int:
        """How many leading tokens of the drafter's best path `path` to write locally: > 0 when the
        path reproduces private text starting with its first token (an n-gram completed within
        its first `ngram` tokens), then through the end of that run of completed n-grams."""
        tail = self._tail(context)
        seq = tail + list(path)
        hits = [self.completes(seq[: len(tail) + i + 1]) for i in range(len(path))]
        first = next((i for i, hit in enumerate(hits) if hit), None)
        if first is None or first >= self.ngram:
            return 0
        end = first
        while end + 1 < len(path) and hits[end + 1]:
            end += 1
        return end + 1

    def names_private(self, sequence: Sequence[int], row) -> bool:
        """Whether the draft-probability row `row` (shared/acceptance.py SparseProbs: the drafter's
        next-token distribution after `sequence`) gives weight to a token that would complete a
        private n-gram after `sequence`: such a row names the private text's next token (a row
        after "qu" holding "ack" at p 0.9 spelled a private "Quackenbush")."""
        head = tuple(sequence[len(sequence) - (self.ngram - 1):]) if self.ngram > 1 else ()
        if len(head) != self.ngram - 1 or head not in self._heads:
            return False
        support = row.token_ids[row.probs > 0].tolist()
        return any(head + (token,) in self._grams for token in support)

    def rows_leak(self, context: Sequence[int], tree: DraftTree, rows: dict) -> bool:
        """Whether any row of `rows` (node -> SparseProbs; ROOT: after `context`) names private text
        (`names_private`)."""
        tail = self._tail(context)
        return any(self.names_private(tail + _path(tree, r), row) for r, row in rows.items())

    def prune(self, context: Sequence[int], proposal: Proposal) -> Proposal:
        """Drop every node completing a private n-gram, its subtree, and its later siblings (a
        sampled sibling set must stay a prefix of its drawing order for lossless verification).
        A sampled tree's draft-probability rows obey the same rule: a row naming a private
        continuation (`names_private`) is dropped with every child drawn from it (their subtrees:
        the node becomes a leaf, which keeps verification lossless), and rows of nodes left with no
        children are not sent (the server has no use for them; they too were computed from the
        private text)."""
        tree, rows = proposal.tree, proposal.draft_probs
        tail = self._tail(context)
        cut = {r for r, row in rows.items() if self.names_private(tail + _path(tree, r), row)}
        drop: set[int] = set()
        for node in range(tree.size):
            parent = tree.parents[node]
            if parent in drop or parent in cut:
                drop.add(node)
                continue
            if self.completes(tail + _path(tree, node)):
                drop.add(node)
                drop.update(s for s in range(node + 1, tree.size) if tree.parents[s] == parent)
        keep = [n for n in range(tree.size) if n not in drop]
        parents = {tree.parents[n] for n in keep}
        if not drop and all(r in parents for r in rows):
            return proposal
        index = {old: new for new, old in enumerate(keep)}
        pruned = DraftTree(tuple(tree.tokens[n] for n in keep),
                           tuple(ROOT if tree.parents[n] == ROOT else index[tree.parents[n]] for n in keep))
        rows = {ROOT if r == ROOT else index[r]: row for r, row in rows.items() if r in parents}
        drafted = None if proposal.drafted is None else sum(n < proposal.drafted for n in keep)
        return Proposal(pruned, rows, drafted)


def _path(tree: DraftTree, node: int) -> list[int]:
    """The tokens from the root's child down to `node` ([] for ROOT)."""
    path = []
    while node != ROOT:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


def best_path(proposal: Proposal) -> tuple[list[int], list]:
    """The drafter's own continuation: from the root, each node's first child (siblings are
    ordered by drafter probability when greedy, by drawing order when sampled, so this is the
    drafter's greedy decode or one sample from it). Returns (tokens, the draft-probability row each
    token was drawn from, None when greedy)."""
    tree, tokens, rows = proposal.tree, [], []
    parent = ROOT
    while True:
        child = next((n for n in range(tree.size) if tree.parents[n] == parent), None)
        if child is None:
            return tokens, rows
        tokens.append(tree.tokens[child])
        rows.append(proposal.draft_probs.get(parent))
        parent = child


def with_private_tags(text: str, spans: Sequence[tuple[int, int]]) -> str:
    """`text` with `<private>` tags around the character spans [start, end) `spans` (in order,
    non-overlapping), the form chat histories keep and `encode_private_chat` reads."""
    for start, end in reversed(list(spans)):
        text = f"{text[:start]}<private>{text[start:end]}</private>{text[end:]}"
    return text


def private_answer_spans(tokenizer, tokens: Sequence[int], sources: Sequence[str], text: str | None = None
                         ) -> list[tuple[int, int]]:
    """The character spans [start, end) of an answer's text that the client wrote from private
    prompt spans (source "private": client/loop.py writes the drafter's reproduction of private text
    itself). A later turn sends the answer back as part of its prompt, so these spans must be marked
    private there too, or the words go to the server in clear.

    `tokens`, `sources`: [N] the answer's ids and who wrote each; `text`: the answer as shown, the
    decoded tokens (skip_special_tokens) or a prefix of them (a stop string cut it); default the
    decoded tokens. Spans are clipped to `text`. When prefixes of the tokens do not decode to prefixes
    of the text (a tokenizer that decodes context-dependently), the whole text is one span: the
    answer stays on the device rather than risk a misplaced span.
    """
    if len(tokens) != len(sources):
        raise ValueError(f"{len(sources)} sources for {len(tokens)} tokens")
    if "private" not in sources:  # the common case: nothing to decode
        return []
    full = tokenizer.decode(list(tokens), skip_special_tokens=True)
    text = full if text is None else text
    if not text:
        return []
    if not full.startswith(text):
        return [(0, len(text))]
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(tokens):
        if sources[i] != "private":
            i += 1
            continue
        j = i
        while j < len(tokens) and sources[j] == "private":
            j += 1
        before = tokenizer.decode(list(tokens[:i]), skip_special_tokens=True)
        through = tokenizer.decode(list(tokens[:j]), skip_special_tokens=True)
        if not (full.startswith(before) and full.startswith(through)):
            return [(0, len(text))]
        start, end = len(before), min(len(through), len(text))
        if start < end:
            if spans and spans[-1][1] >= start:
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((start, end))
        i = j
    return spans


def tag_private_answer(tokenizer, tokens: Sequence[int], sources: Sequence[str], text: str | None = None) -> str:
    """The answer's text (`private_answer_spans`' arguments) with `<private>` tags around what the
    client wrote from private prompt spans: what a chat history keeps for the next turn's prompt."""
    shown = tokenizer.decode(list(tokens), skip_special_tokens=True) if text is None else text
    return with_private_tags(shown, private_answer_spans(tokenizer, tokens, sources, shown))


NOT_VERBATIM = "this chat template does not copy message contents verbatim; cannot place private spans"


def _content_starts(tokenizer, messages: list[dict], rendered: str, which: list[int]) -> dict[int, int]:
    """Where the content of each message in `which` starts in `rendered` (the chat's template
    output), found by rendering it again with unique markers around those contents.

    Raises:
        ValueError: the template does not copy those contents verbatim.
    """
    if not which:
        return {}
    used = rendered + "".join(m["content"] for m in messages)
    salt = 0
    while True:  # markers that occur nowhere else (private-use characters, a counter if need be)
        marks = {k: (f"\ue000{salt}:{k}\ue001", f"\ue002{salt}:{k}\ue003") for k in which}
        if not any(a in used or b in used for a, b in marks.values()):
            break
        salt += 1
    marked = [{**m, "content": f"{marks[k][0]}{m['content']}{marks[k][1]}"} if k in marks else m
              for k, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    starts, removed = {}, 0
    for k in sorted(which, key=lambda k: text.find(marks[k][0])):
        begin, end = marks[k]
        at = text.find(begin)
        if at < 0 or text.count(begin) != 1 or text.count(end) != 1:
            raise ValueError(NOT_VERBATIM)
        starts[k] = at - removed
        removed += len(begin) + len(end)
    for begin, end in marks.values():
        text = text.replace(begin, "").replace(end, "")
    if text != rendered or any(rendered[starts[k]: starts[k] + len(messages[k]["content"])] != messages[k]["content"]
                               for k in which):
        raise ValueError(NOT_VERBATIM)
    return starts


def placeholder_token(tokenizer) -> int:
    """The single token id the server sees for every private token."""
    ids = tokenizer.encode(PLACEHOLDER_TEXT, add_special_tokens=False)
    return int(ids[-1])


def encode_private_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Render a chat whose message contents may hold `<private>` tags; return (prompt ids [P],
    private mask [P]). A token is private when it overlaps a private character span (fast
    tokenizers' offset mapping).

    Each message with private spans is found in the rendered prompt by rendering the chat once more
    with a marker around that message's content, not by searching for its text: the same text can
    come earlier (a role name, the template's default system prompt, an earlier message), and a
    search would then mark those and send the private words in clear.

    Raises:
        ValueError: unmatched tags (outside assistant messages), a chat template that does not copy message contents verbatim
            (where private spans cannot be placed), or a tokenizer without offset mapping while tags
            are present.
    """
    spans_by_message, clean = [], []
    for message in messages:
        # an answer's tags are the client's own (tag_private_answer) around text the model may have
        # written with a literal tag in it: such a tag is text, not a refusal of the next turn
        segments = parse_private_tags(message["content"], strict=message["role"] != "assistant")
        spans, text = [], ""
        for segment in segments:
            if segment.private:
                spans.append((len(text), len(text) + len(segment.text)))
            text += segment.text
        spans_by_message.append((text, spans))
        clean.append({**message, "content": text})
    rendered = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
    char_spans = []
    for k, start in _content_starts(tokenizer, clean, rendered,
                                    [k for k, (_, spans) in enumerate(spans_by_message) if spans]).items():
        char_spans += [(start + a, start + b) for a, b in spans_by_message[k][1]]
    full = encode_rendered(tokenizer, rendered)
    if not char_spans:
        return full, [False] * len(full)
    enc = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if not ids or ids != full[-len(ids):]:
        raise ValueError("the tokenizer renders this chat inconsistently; cannot place private spans")
    mask = [any(s < b and a < e for a, b in char_spans) for s, e in enc["offset_mapping"]]
    return full, [False] * (len(full) - len(ids)) + mask  # BOS the template did not write: public
