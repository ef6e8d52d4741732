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
activations of the placeholder only.

The n-gram rule compares token ids: the same words tokenized otherwise (another case, a leading
space: " Hunter" for a private "hunter2", " ZOR" for "Zorblax") are other ids. Given the
tokenizer's `decode` (the CLI and the daemon pass it), the guard adds a text rule. Its private
phrases: each private n-gram's text, case-folded and stripped, and for an n-gram starting inside a
word, the text from that word's start through the n-gram ("h"+"u"+"nt": "hunt"), each holding at
least `MIN_PHRASE_CHARS` letters or digits (", a" of "Müller, Apt" is no phrase). A draft token
completes an occurrence of a phrase when the occurrence, in the decoded, case-folded text, reaches
into that token's characters (the text before it may be committed context) and starts a word: the
character before it is no letter or digit, or the phrase's own first character is none (any
character of a script written without spaces, CJK or Thai, may start a word). Such a token counts
as completing private text in pruned nodes (`prune`), withheld rows (`names_private`, `rows_leak`)
and offline writing (`completes`). Text the context already holds does not block what follows it;
the same phrase written again does.

The best path written locally (`private_run`) follows the id rule alone. What it writes is the
drafter's, unverified: a match there makes the answer depart from the target's, and phrases also
match public text wherever a private span holds common words ("code" of a private "sort code
20-00-00" in "the code"). Measured on 300 of SmolLM2's own answers (/work/notes/fix-privtext2.md),
the text rule in `private_run` made 1.9 in 1,000 public answer positions lossy beyond the id rule
when the private spans were phrases of other answers (1.2 with `MIN_PHRASE_CHARS` 5; 0.03 for
names, addresses, e-mails and passwords): over the 0.1 allowed. A variant the text rule catches is
pruned at its completing token instead (lossless). In `prune` and rows a false match only makes the
tree smaller. Offline, `completes` marks a few public tokens private (0.02 in 1,000 answer tokens
for names, addresses, e-mails and passwords; 1.3 for spans of common words): they go to the server
as placeholders and get `<private>` tags in the history, but no token of the answer changes
(offline tokens are unverified either way), and a variant of a private word written offline stays
off the server.

Its limits: a phrase must be spelled the same modulo case and surrounding whitespace (not
"hunter 2", "hunt3r2", a translation or another spacing inside it) and start a word (a private
"hunter2" written "ishunter2" is not caught), words whose n-grams make no phrase (a single-token
private word with n >= 2: " Patel" of "Rajesh Patel") are caught only as part of a longer phrase,
and the characters of a variant before its completing token can still be drafted (as the first
n - 1 tokens of a private n-gram can). Rows are screened by each token's own text (`_may_complete`,
which ignores the word-start condition: it may pass a token the full check clears, never the
reverse) before their tokens are decoded in context, which keeps the cost per step below a
millisecond for a 24-node tree with rows of 64 tokens.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

from splitspec.shared.models import encode_rendered
from splitspec.shared.tree import ROOT, DraftTree

from .drafters.base import Proposal

# a tag as people type it: any case, spaces inside the brackets (`<PRIVATE>`, `< /private >`); read
# strictly, these were text and the span went to the server in clear (QA 57)
_TAG = re.compile(r"<\s*(/?)\s*private\s*>", re.IGNORECASE)
PLACEHOLDER_TEXT = " _"
MIN_PHRASE_CHARS = 3  # letters or digits a phrase needs (fewer: too many public words hold it); 4 would miss
# the first 3 characters of a private word (" ZOR" of "Zorblax") and, measured, removes false matches only for
# private spans of common words, where they cost pruned nodes (lossless) and offline tokens marked private
# letters or digits a run of private tokens needs before `private_run` writes it locally (unverified);
# shorter runs (a digit gram of a private number matching a public " 1") are pruned instead
MIN_RUN_CHARS = 4
_WORD_TOKENS = 32  # a private word's start this many tokens before a gram inside it, at most (`_word_phrases`)
_TEXT_CACHE_MAX = 8192  # decoded windows (and token texts) a guard keeps; a step adds about one per node


@dataclass(frozen=True)
class Segment:
    text: str
    private: bool = False


def parse_private_tags(text: str, strict: bool = True, spans: Sequence[tuple[int, int]] = ()) -> list[Segment]:
    """Split chat text on `<private>...</private>` tags (the tags are markup, not text).

    `spans`: character ranges [start, end) of `text` (tags included in the count) that are private
    too, beside the tags (the daemon's `private_spans`); in order and non-overlapping.

    Tags are matched in any case and with spaces inside the brackets (`<Private>`, `</ private >`).
    `strict` True (what a user typed) refuses an unmatched or nested tag. `strict` False (an
    assistant message, a whole-private message: text that may hold a tag written as text) fails
    closed, so that no tag can end a span early and send the rest in clear: an unmatched
    `<private>` makes the rest of the text private, a `</private>` with no span open makes the text
    since the previous tag (or the start) private, and a nested tag is markup inside its span.

    Raises:
        ValueError: an unmatched or nested tag, when `strict`.
    """
    private = bytearray(len(text))  # 1: a private character; markup characters are left out below
    markup = bytearray(len(text))
    for start, end in spans:
        private[start:end] = b"\x01" * (end - start)
    depth, boundary = 0, 0  # open spans; where the text since the previous tag begins
    for match in _TAG.finditer(text):
        markup[match.start():match.end()] = b"\x01" * (match.end() - match.start())
        opening = not match.group(1)
        if strict and (depth if opening else not depth):
            raise ValueError("unmatched or nested <private> tag")
        if depth or not opening:  # inside a span, or before a closing tag with none open (fail closed)
            private[boundary:match.start()] = b"\x01" * (match.start() - boundary)
        depth = depth + 1 if opening else max(depth - 1, 0)
        boundary = match.end()
    if depth:
        if strict:
            raise ValueError("unmatched or nested <private> tag")
        private[boundary:] = b"\x01" * (len(text) - boundary)
    kept = ((ch, private[i]) for i, ch in enumerate(text) if not markup[i])
    return [Segment("".join(ch for ch, _ in run), bool(flag))
            for flag, run in itertools.groupby(kept, key=lambda pair: pair[1])]


def untagged(text: str, strict: bool = True, spans: Sequence[tuple[int, int]] = ()
             ) -> tuple[str, list[tuple[int, int]]]:
    """`parse_private_tags` as (the text without tags, its private character spans [start, end))."""
    clean, out = "", []
    for segment in parse_private_tags(text, strict, spans):
        if segment.private:
            out.append((len(clean), len(clean) + len(segment.text)))
        clean += segment.text
    return clean, out


@dataclass(frozen=True)
class PrivacyGuard:
    """The private positions of one prompt and the rules applied to everything sent.

    `mask`: [P] True for prompt tokens that are private; `placeholder`: the id the server sees in
    their place; `ngram`: drafts completing a run of this many private tokens are withheld;
    `decode`: the tokenizer's decode (token ids -> text), which adds the text rule (the module's
    docstring); None: the id rule alone.
    """

    prompt_ids: tuple[int, ...]
    mask: tuple[bool, ...]
    placeholder: int
    ngram: int = 2
    decode: Callable[[list[int]], str] | None = field(default=None, compare=False, repr=False)

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
        phrases: set[str] = set()
        if self.decode is not None:
            for gram in grams:
                # a gram cutting a character in two decodes to U+FFFD there: its whole characters only
                text = _fold(self.decode(list(gram))).strip().strip("\ufffd").strip()
                if _alnum(text) >= MIN_PHRASE_CHARS and "\ufffd" not in text:
                    phrases.add(text)
            for run in runs:  # a gram starting inside a word: also the word's text from its start
                phrases.update(self._word_phrases(run))
        object.__setattr__(self, "_phrases", tuple(sorted(phrases, key=len)))
        # every phrase starting at each position, the longest first (it ends furthest)
        object.__setattr__(self, "_finder", _finder(phrases))
        longest = max(map(len, phrases), default=0)
        object.__setattr__(self, "_longest", longest)
        # context tokens an occurrence ending in a draft token can start in, at most: each token holds
        # at least one byte of the text, a character at most 4 (UTF-8), and case folding never
        # shortens text (`_tail` takes fewer where their text is long enough)
        object.__setattr__(self, "_window", 4 * longest)
        object.__setattr__(self, "_texts", {})  # token ids -> their decoded, case-folded text
        # rows' screen (`_may_complete`): the phrases without whitespace, each token's own text
        squeezed = {_squeeze(p) for p in phrases}
        object.__setattr__(self, "_squeezed", max(map(len, squeezed), default=0))
        object.__setattr__(self, "_squeezed_phrases", tuple(squeezed))
        object.__setattr__(self, "_squeezed_finder", _finder(squeezed))
        object.__setattr__(self, "_pieces", {})

    def _word_phrases(self, run: list[int]) -> set[str]:
        """For each n-gram of the private run `run` that starts inside a word, the case-folded text
        from that word's start through the gram's end: an occurrence counts only where it starts a
        word (`_starts_word`), and a tokenizer with short tokens makes few grams that do ("h"+"u"+"nt"
        of "hunter2": "hunt", "hunter", "hunter2"). None for a word starting more than
        `_WORD_TOKENS` tokens before the gram, or where a cut character hides where the gram starts."""
        found = set()
        for i in range(1, len(run) - self.ngram + 1):
            low = max(0, i - _WORD_TOKENS)
            before = _fold(self.decode(list(run[low:i])))
            text = _fold(self.decode(list(run[low:i + self.ngram])))
            at = len(before)
            if not text.startswith(before) or at >= len(text) or not _inside_word(text, at):
                continue  # a cut character, or the gram starts a word or with no letter or digit
            begin = at
            while _inside_word(text, begin):
                begin -= 1
            phrase = text[begin:].strip().strip("\ufffd").strip()
            if (begin > 0 or low == 0) and "\ufffd" not in phrase and _alnum(phrase) >= MIN_PHRASE_CHARS:
                found.add(phrase)
        return found

    @property
    def active(self) -> bool:
        return any(self.mask)

    def completes(self, tokens: Sequence[int]) -> bool:
        """True when the last `ngram` of `tokens` are a run of private prompt tokens, or (text rule)
        the last token completes an occurrence of a private phrase."""
        return self._completes_ids(tokens) or self._text_hit(tokens, max(0, len(tokens) - self._window - 1))

    def _completes_ids(self, tokens: Sequence[int]) -> bool:
        return len(tokens) >= self.ngram and tuple(tokens[-self.ngram:]) in self._grams

    def _hit(self, seq: Sequence[int]) -> bool:
        """`completes` for `seq` = `_tail(context)` + a draft path, its text decoded from the tail's
        start (so that the decodes of a tree's nodes share their cache entries)."""
        return self._completes_ids(seq) or self._text_hit(seq, 0)

    def _text(self, tokens: tuple[int, ...]) -> str:
        texts = self._texts
        text = texts.get(tokens)
        if text is None:
            if len(texts) >= _TEXT_CACHE_MAX:
                texts.clear()
            text = texts[tokens] = _fold(self.decode(list(tokens)))
        return text

    def _text_hit(self, seq: Sequence[int], start: int) -> bool:
        """Whether the last token of `seq` completes an occurrence of a private phrase in the text of
        seq[start:]: one that is not wholly within the text of seq[start:-1] (the text both share),
        and that starts a word (`_starts_word`)."""
        if not self._phrases or len(seq) <= start:
            return False
        seq = tuple(seq[start:])
        new, old = self._text(seq), self._text(seq[:-1])
        shared = len(old) if new.startswith(old) else _common_prefix(old, new)
        if shared >= len(new):
            return False
        return any(m.end(1) > shared and _starts_word(new, m.start(1))
                   for m in self._finder.finditer(new, max(0, shared - self._longest + 1)))

    def _tail(self, context: Sequence[int]) -> list[int]:
        """The committed tokens an n-gram or a phrase ending in a draft's first token can start with:
        for phrases, the fewest last tokens (doubling from the longest phrase's length + 1, at most
        `_window`) whose text has more characters than the longest phrase."""
        keep = self.ngram - 1
        if self._phrases:
            k = self._longest + 1
            while k < min(len(context), self._window) and len(self._text(tuple(context[-k:]))) <= self._longest:
                k *= 2
            keep = max(keep, min(k, self._window))
        return list(context[-keep:]) if keep else []

    def private_run(self, context: Sequence[int], path: Sequence[int]) -> int:
        """How many leading tokens of the drafter's best path `path` to write locally: > 0 when the
        path reproduces private tokens starting with its first token (a private n-gram completed
        within its first `ngram` tokens), then through the end of that run of completions. The id
        rule alone: what this writes is unverified, and the text rule's phrases also match public
        answers too often for that (the module's docstring); `prune` cuts a text match instead.
        With `decode`, a run whose text holds fewer than MIN_RUN_CHARS letters and digits is not
        written (0; `prune` cuts it instead, which is lossless): a private number's digit grams,
        (" ", "1") of a private " 12345678", matched public numbers at 8-11 places per 1,000 answer
        tokens, each written unverified (`tools/privacy_rates.py`: 300 of the target's answers, session 55)."""
        tail = list(context[len(context) - (self.ngram - 1):]) if self.ngram > 1 else []
        seq = tail + list(path)
        hits = [self._completes_ids(seq[: len(tail) + i + 1]) for i in range(len(path))]
        first = next((i for i, hit in enumerate(hits) if hit), None)
        if first is None or first >= self.ngram:
            return 0
        end = first
        while end + 1 < len(path) and hits[end + 1]:
            end += 1
        if self.decode is not None and _alnum(self.decode(list(path[:end + 1]))) < MIN_RUN_CHARS:
            return 0
        return end + 1

    def names_private(self, sequence: Sequence[int], row) -> bool:
        """Whether the draft-probability row `row` (shared/acceptance.py SparseProbs: the drafter's
        next-token distribution after `sequence`) gives weight to a token that would complete a
        private n-gram or phrase after `sequence`: such a row names the private text's next token (a
        row after "qu" holding "ack" at p 0.9 spelled a private "Quackenbush")."""
        return self._names_private(sequence, row, None)

    def _names_private(self, sequence: Sequence[int], row, start: int | None) -> bool:
        """`names_private`, the text decoded from `start` (None: the window `completes` decodes)."""
        head = tuple(sequence[len(sequence) - (self.ngram - 1):]) if self.ngram > 1 else ()
        headed = len(head) == self.ngram - 1 and head in self._heads
        if not headed and not self._phrases:
            return False
        support = row.token_ids[row.probs > 0].tolist()
        if headed and any(head + (token,) in self._grams for token in support):
            return True
        if not self._phrases:
            return False
        seq = list(sequence)
        start = max(0, len(seq) - self._window) if start is None else start
        # a row holds up to hundreds of tokens: decode after `sequence` only those whose own text could
        # complete a phrase (all of them after a cut character: the next token can change its text)
        old = self._text(tuple(seq[start:]))
        if old.endswith("\ufffd"):
            return any(self._text_hit(seq + [token], start) for token in support)
        before = _squeeze(old)[-(self._squeezed - 1):]
        return any(self._text_hit(seq + [token], start) for token in support if self._may_complete(before, token))

    def _ends(self, token: int) -> tuple[bool, tuple[str, ...]] | None:
        """What lets `token` complete a phrase, whitespace aside: (a phrase lies within its text,
        the phrase starts that text must follow), from the case-folded text it adds after the
        placeholder without whitespace; None where that is no token's own text (nothing, or a cut
        character)."""
        ends = self._pieces
        if token not in ends:
            if len(ends) >= _TEXT_CACHE_MAX:
                ends.clear()
            before, after = _fold(self.decode([self.placeholder])), _fold(self.decode([self.placeholder, token]))
            piece = _squeeze(after[len(before):]) if after.startswith(before) else ""
            if not piece or "\ufffd" in piece:
                ends[token] = None
            else:
                inside = self._squeezed_finder.search(piece) is not None
                starts = {p[:len(p) - j] for p in self._squeezed_phrases
                          for j in range(1, min(len(p), len(piece)) + 1) if p.endswith(piece[:j])}
                ends[token] = (inside or "" in starts, tuple(starts - {""}))
        return ends[token]

    def _may_complete(self, before: str, token: int) -> bool:
        """False only when `token` completes no phrase after text ending in `before` (its last
        characters, whitespace removed): whitespace aside, a phrase must lie within the token's text
        or start in `before` and end in the token's text (`_ends`). A screen that holds where a
        token's text after any context is its text after the placeholder up to whitespace (byte-level
        BPE and SentencePiece tokenizers: those of the supported model families; the cleanup of
        tokenization spaces only removes spaces)."""
        ends = self._ends(token)
        if ends is None:
            return True
        inside, starts = ends
        return inside or (bool(starts) and before.endswith(starts))

    def rows_leak(self, context: Sequence[int], tree: DraftTree, rows: dict) -> bool:
        """Whether any row of `rows` (node -> SparseProbs; ROOT: after `context`) names private text
        (`names_private`)."""
        tail = self._tail(context)
        return any(self._names_private(tail + _path(tree, r), row, 0) for r, row in rows.items())

    def prune(self, context: Sequence[int], proposal: Proposal) -> Proposal:
        """Drop every node completing a private n-gram or phrase, its subtree, and its later siblings
        (a sampled sibling set must stay a prefix of its drawing order for lossless verification).
        A sampled tree's draft-probability rows obey the same rule: a row naming a private
        continuation (`names_private`) is dropped with every child drawn from it (their subtrees:
        the node becomes a leaf, which keeps verification lossless), and rows of nodes left with no
        children are not sent (the server has no use for them; they too were computed from the
        private text)."""
        tree, rows = proposal.tree, proposal.draft_probs
        tail = self._tail(context)
        cut = {r for r, row in rows.items() if self._names_private(tail + _path(tree, r), row, 0)}
        drop: set[int] = set()
        for node in range(tree.size):
            parent = tree.parents[node]
            if parent in drop or parent in cut:
                drop.add(node)
                continue
            if self._hit(tail + _path(tree, node)):
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


def _fold(text: str) -> str:
    return text.casefold()


def _finder(phrases) -> re.Pattern | None:
    """A pattern matching, at every position, the longest of `phrases` starting there (group 1;
    a lookahead, so overlapping occurrences are all found); None for no phrase."""
    if not phrases:
        return None
    return re.compile("(?=(" + "|".join(re.escape(p) for p in sorted(phrases, key=len, reverse=True)) + "))")


def _alnum(text: str) -> int:
    """How many letters and digits `text` holds."""
    return sum(map(str.isalnum, text))


_WHITESPACE = re.compile(r"\s+")


def _squeeze(text: str) -> str:
    """`text` without whitespace."""
    return _WHITESPACE.sub("", text)


# scripts written without spaces between words (Thai, Lao, Myanmar, Khmer, kana, CJK ideographs): any
# of their characters may start a word
_NO_SPACES = re.compile("[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
                        "\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003134f]")


def _inside_word(text: str, at: int) -> bool:
    """Whether `text[at]` continues the word of `text[at - 1]`: both are letters or digits, of a
    script that separates words by spaces."""
    return (at > 0 and text[at].isalnum() and text[at - 1].isalnum()
            and not _NO_SPACES.match(text[at]) and not _NO_SPACES.match(text[at - 1]))


def _starts_word(text: str, at: int) -> bool:
    """Whether an occurrence of a phrase at `text[at:]` starts a word: its first character is no
    letter or digit, or the character before it is none (or either is of a script without spaces).
    At the text's first character it does: the text starts the sequence, or it starts a decoded
    window whose character before is unknown (the side that keeps private text back; `_tail` and
    `completes` decode enough tokens that an occurrence reaching into the window's last token
    cannot start there)."""
    return not _inside_word(text, at)


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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


def private_answer_spans(tokenizer, tokens: Sequence[int], sources: Sequence[str], text: str | None = None,
                         decode: Callable[[list[int]], str] | None = None) -> list[tuple[int, int]]:
    """The character spans [start, end) of an answer's text that the client wrote from private
    prompt spans (source "private": client/loop.py writes the drafter's reproduction of private text
    itself). A later turn sends the answer back as part of its prompt, so these spans must be marked
    private there too, or the words go to the server in clear.

    `tokens`, `sources`: [N] the answer's ids and who wrote each; `text`: the answer as shown, the
    decoded tokens (skip_special_tokens) or a prefix of them (a stop string cut it); default the
    decoded tokens. Spans are clipped to `text`. When prefixes of the tokens do not decode to prefixes
    of the text (a tokenizer that decodes context-dependently), the whole text is one span: the
    answer stays on the device rather than risk a misplaced span. `decode(ids)`: how the text was
    decoded from the tokens (default: alone, skip_special_tokens; a text completion's answer is
    decoded after the prompt, client/daemon/text.py `AnswerText.decode`).
    """
    if len(tokens) != len(sources):
        raise ValueError(f"{len(sources)} sources for {len(tokens)} tokens")
    if "private" not in sources:  # the common case: nothing to decode
        return []
    if decode is None:
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    full = decode(list(tokens))
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
        before, through = decode(list(tokens[:i])), decode(list(tokens[:j]))
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
    tokenizers' offset mapping). A message with a "private_spans" key ([(start, end)] character
    ranges of its content) is taken as untagged text with those spans (`untagged`'s output).

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
        if "private_spans" in message:  # untagged already, its spans given (the daemon's schema)
            text, spans = message["content"], [tuple(span) for span in message["private_spans"]]
        else:
            # an answer's tags are the client's own (tag_private_answer) around text the model may
            # have written a tag in: no refusal of the next turn, and failing closed (parse_private_tags)
            text, spans = untagged(message["content"], strict=message["role"] != "assistant")
        spans_by_message.append((text, spans))
        clean.append({**{k: v for k, v in message.items() if k != "private_spans"}, "content": text})
    rendered = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
    char_spans = []
    for k, start in _content_starts(tokenizer, clean, rendered,
                                    [k for k, (_, spans) in enumerate(spans_by_message) if spans]).items():
        char_spans += [(start + a, start + b) for a, b in spans_by_message[k][1]]
    return encode_private_text(tokenizer, rendered, char_spans)


def encode_private_text(tokenizer, text: str, char_spans: Sequence[tuple[int, int]], rendered: bool = True
                        ) -> tuple[list[int], list[bool]]:
    """(prompt ids [P], private mask [P]) of `text`, a token private when it overlaps a character
    span [start, end) of `char_spans` (indices of the str: Unicode code points). `rendered`: a
    chat the template rendered (shared/models.py `encode_rendered`: special tokens kept, BOS added
    where the text lacks it); else a raw completion prompt, encoded as the tokenizer does by itself
    (its own special tokens, such as a BOS its config asks for; SmolLM2's names <|im_start|> its BOS
    but adds none, and a raw prompt given one read as a chat turn, QA 58).

    Raises:
        ValueError: the tokenizer has no offset mapping or tokenizes `text` inconsistently while
            spans are given.
    """
    full = encode_rendered(tokenizer, text) if rendered else tokenizer(text, add_special_tokens=True)["input_ids"]
    if not char_spans:
        return full, [False] * len(full)
    try:
        enc = tokenizer(text, add_special_tokens=not rendered, return_offsets_mapping=True)
    except NotImplementedError:  # a slow tokenizer: no offsets, so no token can be told private
        raise ValueError("this tokenizer gives no character offsets; cannot place private spans") from None
    ids = list(enc["input_ids"])
    if not ids or ids != full[-len(ids):]:
        raise ValueError("the tokenizer renders this text inconsistently; cannot place private spans")
    mask = [any(s < b and a < e for a, b in char_spans) for s, e in enc["offset_mapping"]]
    return full, [False] * (len(full) - len(ids)) + mask  # BOS the text did not write: public
