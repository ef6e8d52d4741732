"""The target runner: prefill, one-forward tree verification, KV commit, feature extraction.

It wraps a transformers causal LM (no copied modeling code): a tree forward passes a 4-D additive
attention mask and explicit position ids together with the session's `DynamicCache`.
Model work here is synchronous; the gRPC service runs it on a single worker thread.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from splitspec.shared import kv
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.shared.drafters.moa import lsa_autocast, stack_layer_kv
from splitspec.shared.acceptance import AcceptResult, SparseProbs, accept_greedy, accept_sampling
from splitspec.shared.sampling import (SamplingParams, Stream, apply_contextual_penalty, make_generator, sample,
                                      warp_probs)
from splitspec.shared.tree import ROOT, DraftTree, tree_buffers

from . import graphs, ragged

log = logging.getLogger(__name__)


@dataclass
class TargetSession:
    """One client's state: its KV cache holds every committed token except the pending one."""

    sampling: SamplingParams
    features: FeatureRequest
    cache: object
    pending_token: int
    generator: torch.Generator
    step: int = 0  # last verified step
    history: list[int] = field(default_factory=list)  # contextual penalty: the text's last tokens before the pending one


@dataclass
class Prefill:
    """A prompt [P] being prefilled in chunks (`TargetRunner.prefill_chunk`): positions [0, done)
    are in `cache`, with their features in `batches` and the forward time so far in `forward_ms`."""

    prompt_ids: list[int]
    features: FeatureRequest
    cache: object
    done: int = 0
    batches: list[FeatureBatch] = field(default_factory=list)
    forward_ms: float = 0.0
    last_logits: torch.Tensor | None = None  # [V] of the last position run

    @property
    def left(self) -> int:
        """Prompt positions no chunk has run yet."""
        return len(self.prompt_ids) - self.done


@dataclass(frozen=True)
class StepOutput:
    """Result of one verification: accepted path, bonus token, features, forward time (ms)."""

    accept: AcceptResult
    accepted_tokens: tuple[int, ...]
    features: FeatureBatch
    forward_ms: float


def context_length(config) -> int:
    """The longest context of a model with this transformers config, in tokens: its
    `max_position_embeddings` (2048 without one)."""
    return int(getattr(config, "max_position_embeddings", 2048))


class TargetRunner:
    """Runs the target model for sessions. Not thread-safe: call from one thread."""

    def __init__(self, model, tokenizer, model_id: str, lsa_modules: dict | None = None,
                 use_graphs: bool = False) -> None:
        """`lsa_modules`: MoA drafters (by checkpoint id) whose Layer Self-Attention this runner may
        compute for clients that place LSA on the server. `use_graphs`: one-session verify steps of up
        to `graphs.MAX_ROWS` rows run as fixed-shape forwards (server/graphs.py), replayed from CUDA
        graphs on a GPU; on a CPU the fixed-shape forward runs eagerly (slower: it attends over the
        whole storage), which is for tests.

        Raises:
            kv.UnsupportedCache: attention kinds the verifier cannot serve (chunked, linear, state-space
                layers), refused here, at load, rather than mid-session.
            ValueError: `use_graphs` with dynamic rotary scaling (server/graphs.py).
        """
        self.lsa_modules = dict(lsa_modules or {})
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.config = model.config
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.num_layers = model.config.num_hidden_layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.windows = kv.attention_windows(model.config)  # raises UnsupportedCache at load, not mid-session
        self.per_layer_type = getattr(model.config, "layer_types", None) is not None
        self.layer_kinds = (list(model.config.layer_types) if self.per_layer_type
                            else [next(iter(self.windows))] * self.num_layers)
        # batches are scored raggedly (server/ragged.py) where the attention is SDPA's, else padded
        self.ragged = ragged.enable(model)
        self.static = graphs.StaticSteps(model, self.windows, self.per_layer_type) if use_graphs else None

    @property
    def max_positions(self) -> int:
        """The longest context in tokens (`context_length`)."""
        return context_length(self.config)

    def _elapsed_ms(self, start: float) -> float:
        """Milliseconds since `start` (a perf_counter time) of the model work queued since: on CUDA
        after a synchronize, so eager forwards (whose kernels are still queued when the call returns)
        and graph replays (which return at once) report the same quantity, the kernels included. The
        acceptance right after waits on the logits anyway, so the sync costs nothing extra."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - start) * 1e3

    def step_bytes(self, session: TargetSession) -> int:
        """Memory a session holds beside its KV cache for fixed-shape verify steps (server/graphs.py
        `held_bytes`: their inputs, masks and captured outputs), in bytes; 0 without `use_graphs`."""
        return graphs.held_bytes(session.cache)

    def start_prefill(self, prompt_ids: list[int], features: FeatureRequest) -> Prefill:
        """A prefill of `prompt_ids` [P] that no chunk has run yet (no model work: an empty cache).
        Run it with `prefill_chunk`, finish it with `open(..., prefill=...)`."""
        return Prefill(list(prompt_ids), features, kv.new_cache(self.config))

    @torch.inference_mode()
    def prefill_chunk(self, prefill: Prefill, max_tokens: int) -> None:
        """Run the next at most `max_tokens` prompt positions of `prefill` through the target.

        Chunked prefill (vLLM's and transformers' `prefill_chunk_size`): a long prompt is prefilled
        as several forwards over the growing cache, so the service can score other sessions' verify
        steps between them and a departed client's prompt stops at the next chunk. Each chunk's
        features are kept (`FeatureBatch.concat` joins them in `open`). In fp32 the result equals
        the one-forward prefill up to rounding (the matmul shapes differ), as the target's own
        `generate()` with `prefill_chunk_size` does.

        Raises:
            ValueError: `max_tokens` < 1, or no prompt position left.
        """
        if max_tokens < 1 or not prefill.left:
            raise ValueError(f"a prefill chunk needs max_tokens >= 1 and positions left, got {max_tokens} "
                             f"at {prefill.done} of {len(prefill.prompt_ids)}")
        start_pos, stop = prefill.done, min(prefill.done + max_tokens, len(prefill.prompt_ids))
        ids = torch.tensor([prefill.prompt_ids[start_pos:stop]], device=self.device)
        spec = prefill.features
        start = time.perf_counter()
        out = self.model(input_ids=ids, cache=prefill.cache, use_cache=True,
                         position_ids=torch.arange(start_pos, stop, device=self.device)[None],
                         output_hidden_states=bool(spec.hidden_layers), logits_to_keep=1)
        prefill.forward_ms += self._elapsed_ms(start)
        prefill.last_logits = out.logits[0, -1]  # [V]
        prefill.batches.append(self._features(spec, prefill.cache, out.hidden_states,
                                              list(range(stop - start_pos)), start_pos))
        prefill.done = stop

    @torch.inference_mode()
    def open(self, prompt_ids: list[int], sampling: SamplingParams, features: FeatureRequest,
             prefill: Prefill | None = None) -> tuple[TargetSession, FeatureBatch, float]:
        """Prefill the prompt [P] (its positions `prefill` has not run yet, in one forward) and draw
        the first token.

        Expects what the service checks first (server/validation.py `check_open`; not re-checked
        here): a non-empty prompt shorter than `max_positions`, token ids < `vocab_size`, and
        `features.lsa_id` empty or one of `lsa_modules` (else KeyError after the prefill).
        `prefill`: from `start_prefill(prompt_ids, features)`, some chunks already run.

        Returns:
            (session, features of positions [0, P), forward time in ms of every chunk)
        """
        if prefill is None:
            prefill = self.start_prefill(prompt_ids, features)
        if prefill.left:
            self.prefill_chunk(prefill, prefill.left)
        generator = make_generator(sampling.seed, Stream.TARGET, position=len(prompt_ids))  # a re-open: fresh draws
        last = prefill.last_logits
        history = list(prompt_ids[-sampling.penalty_window:]) if sampling.penalized else []
        if sampling.penalized:
            last = apply_contextual_penalty(last[None].float(), [history], sampling.penalty)[0]
        first = int(last.argmax()) if sampling.greedy else sample(warp_probs(last, sampling), generator)
        session = TargetSession(sampling, features, prefill.cache, first, generator, history=history)
        return session, FeatureBatch.concat(prefill.batches), prefill.forward_ms

    @torch.inference_mode()
    def verify(self, session: TargetSession, tree: DraftTree,
               draft_probs: dict[int, SparseProbs] | None = None, forced_tokens: tuple[int, ...] = ()) -> StepOutput:
        """Score the pending token plus the tree [N] in one forward, accept, and commit the KV.

        The cache ends holding the prefix, the pending token and the accepted nodes; the bonus token
        becomes the new pending token. `forced_tokens` [F] (client-committed, unverified) replace the
        pending token: they are committed as they are, and the tree hangs off the last of them. Their
        features come back first (`accepted_tokens` holds only accepted draft tokens).

        Acceptance: greedy sessions `accept_greedy`, else `accept_sampling` (shared/acceptance.py:
        Leviathan et al. 2023 §2.3, over siblings as SpecInfer §4.3), with `draft_probs` keyed by
        parent node (-1 = root), each SparseProbs [S], as `check_draft_probs` admits them.

        Returns:
            StepOutput: the accepted path and its tokens, the bonus token, the features of the newly
            committed positions, and the forward time in ms.
        """
        prefix_len, chain, buffers, row_ids = _step_inputs(session, tree, forced_tokens)
        hidden = bool(session.features.hidden_layers)
        if self.static is not None:
            fixed = self._fixed_shape_forward(session, prefix_len, buffers, row_ids, hidden)
            if fixed is not None:
                logits, hidden_states, forward_ms, padded = fixed
                try:
                    return self._accept_and_commit(session, tree, draft_probs, chain, prefix_len, logits,
                                                   hidden_states, forward_ms)
                finally:
                    graphs.clear_past(session.cache, prefix_len + padded)
        ids = torch.tensor([row_ids], device=self.device)  # [1, F + N]
        start = time.perf_counter()
        out = self.model(input_ids=ids, cache=session.cache, use_cache=True,
                         attention_mask=self._tree_mask(buffers, prefix_len),
                         position_ids=buffers.position_ids(prefix_len).to(self.device),
                         output_hidden_states=hidden)
        forward_ms = self._elapsed_ms(start)
        return self._accept_and_commit(session, tree, draft_probs, chain, prefix_len, out.logits[0], out.hidden_states,
                                       forward_ms)

    def _fixed_shape_forward(self, session: TargetSession, prefix_len: int, buffers, row_ids: list[int],
                             hidden: bool):
        """The step as a fixed-shape forward (server/graphs.py): (logits [M, V], hidden states or
        None, ms, padded rows), or None where it runs eagerly (too many rows). Running out of memory
        sends this session alone to eager steps; any other failure (a capture the model does not
        allow) switches this runner to eager steps for good, with a log line. Either way the
        session's cache still ends where it did before the step."""
        start = time.perf_counter()
        try:
            step = self.static.step(session.cache, len(row_ids), hidden)
            if step is None:
                return None
            logits, hidden_states = step.run(prefix_len, row_ids, buffers)
            forward_ms = self._elapsed_ms(start)  # on CUDA a sync: a replay's failure shows here
        except torch.OutOfMemoryError:  # this session's step did not fit: it alone goes eager
            log.warning("fixed-shape verify ran out of memory; this session verifies eagerly from now on")
            graphs.forget(session.cache, eager=True)
            return None
        except Exception:  # noqa: BLE001 - any failure here has the eager forward to fall back on
            log.exception("fixed-shape verify failed; this runner verifies eagerly from now on")
            self.static = None
            graphs.forget(session.cache)  # other sessions' steps go with their sessions
            return None
        graphs.commit_views(session.cache, prefix_len + len(row_ids))
        self.static.runs += 1
        return logits, hidden_states, forward_ms, step.rows

    @torch.inference_mode()
    def verify_batch(self, items: list[tuple[TargetSession, DraftTree, dict[int, SparseProbs] | None,
                                             tuple[int, ...]]]) -> list[StepOutput | Exception]:
        """`verify` for several sessions in one target forward: (session, tree, draft_probs,
        forced_tokens) each, results in the same order, each equal to verifying it alone (up to
        float rounding of the larger matmuls).

        Ragged where the model allows (`_verify_ragged`): the trees laid end to end in one
        sequence, attention per session against its own cache. Otherwise padded: the sessions'
        caches are copied into one cache of B rows, each prefix padded to the longest (masked
        out); each row's tree follows at the same offset with its own tree mask and position ids;
        query rows past a tree's size are padding that sees only itself, and after the forward each
        session takes its rows back into its own cache. Either way a session's cache is as it was
        if the forward fails: that error is raised (every session can be verified alone instead);
        an error in one session's commit after it is returned in that session's place (its cache
        may be half-updated).
        """
        if len(items) == 1:
            return [self.verify(*items[0])]
        if self.ragged:
            return self._verify_ragged(items)
        preps = [_step_inputs(session, tree, forced) for session, tree, _, forced in items]
        batch, longest, width = len(items), max(p[0] for p in preps), max(len(p[3]) for p in preps)
        cache = DynamicCache()
        for layer in range(self.num_layers):
            first = items[0][0].cache.layers[layer].keys
            keys = first.new_zeros(batch, first.shape[1], longest, first.shape[3])
            values = keys.clone()
            for b, (session, *_rest) in enumerate(items):
                entry, prefix = session.cache.layers[layer], preps[b][0]
                keys[b, :, :prefix], values[b, :, :prefix] = entry.keys[0, :, :prefix], entry.values[0, :, :prefix]
            cache.update(keys, values, layer)
        ids = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        positions = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        lowest = torch.finfo(self.dtype).min
        masks = {kind: torch.full((batch, 1, width, longest + width), lowest, dtype=self.dtype, device=self.device)
                 for kind in self.windows}
        for b, (prefix, _, buffers, row_ids) in enumerate(preps):
            rows = len(row_ids)
            ids[b, :rows] = torch.tensor(row_ids, device=self.device)
            positions[b, :rows] = buffers.position_ids(prefix)[0].to(self.device)
            positions[b, rows:] = prefix
            for kind, window in self.windows.items():
                own = buffers.attention_mask(prefix, self.dtype, self.device, window)[0, 0]  # [rows, prefix + rows]
                masks[kind][b, 0, :rows, :prefix] = own[:, :prefix]
                masks[kind][b, 0, :rows, longest: longest + rows] = own[:, prefix:]
                pad = torch.arange(rows, width, device=self.device)
                masks[kind][b, 0, pad, longest + pad] = 0  # padding rows see themselves only
        mask = masks if self.per_layer_type else next(iter(masks.values()))
        hidden = any(session.features.hidden_layers for session, *_ in items)
        start = time.perf_counter()
        out = self.model(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask,
                         position_ids=positions, output_hidden_states=hidden)
        forward_ms = self._elapsed_ms(start)
        results: list[StepOutput | Exception] = []
        for b, ((session, tree, draft_probs, _), (prefix, chain, _, row_ids)) in enumerate(zip(items, preps)):
            rows = len(row_ids)
            try:
                for layer in range(self.num_layers):
                    entry = cache.layers[layer]
                    session.cache.update(entry.keys[b:b + 1, :, longest: longest + rows],
                                         entry.values[b:b + 1, :, longest: longest + rows], layer)
                hidden_states = tuple(h[b:b + 1] for h in out.hidden_states) if hidden else None
                results.append(self._accept_and_commit(session, tree, draft_probs, chain, prefix,
                                                       out.logits[b, :rows], hidden_states, forward_ms))
            except Exception as err:  # noqa: BLE001 - this session's own failure, reported in its place
                results.append(err)
        return results

    def _verify_ragged(self, items) -> list[StepOutput | Exception]:
        """`verify_batch` as one ragged forward (server/ragged.py): input [1, N1 + N2 + ...], each
        session's rows appended to its own cache during the forward and cropped back if it fails."""
        preps = [_step_inputs(session, tree, forced) for session, tree, _, forced in items]
        ids = [token for *_, row_ids in preps for token in row_ids]
        positions = [buffers.position_ids(prefix)[0] for prefix, _, buffers, _ in preps]
        masks = {kind: [buffers.attention_mask(prefix, self.dtype, self.device, window)
                        for prefix, _, buffers, _ in preps] for kind, window in self.windows.items()}
        rows = [len(row_ids) for *_, row_ids in preps]
        cache = ragged.RaggedCache([session.cache for session, *_ in items], rows, masks, self.layer_kinds)
        # a 4-D mask makes transformers build none; ragged attention reads each session's own instead
        unused = torch.zeros(1, 1, len(ids), 1, dtype=self.dtype, device=self.device)
        mask = {kind: unused for kind in self.windows} if self.per_layer_type else unused
        hidden = any(session.features.hidden_layers for session, *_ in items)
        start = time.perf_counter()
        try:
            out = self.model(input_ids=torch.tensor([ids], device=self.device), cache=cache, use_cache=True,
                             attention_mask=mask, position_ids=torch.cat(positions)[None].to(self.device),
                             output_hidden_states=hidden)
        except Exception:
            for (session, *_), (prefix, *_rest) in zip(items, preps):
                kv.truncate(session.cache, prefix)
            raise
        forward_ms = self._elapsed_ms(start)
        results: list[StepOutput | Exception] = []
        offset = 0
        for (session, tree, draft_probs, _), (prefix, chain, _, row_ids) in zip(items, preps):
            part = slice(offset, offset + len(row_ids))
            offset += len(row_ids)
            try:
                hidden_states = tuple(h[:, part] for h in out.hidden_states) if hidden else None
                results.append(self._accept_and_commit(session, tree, draft_probs, chain, prefix, out.logits[0, part],
                                                       hidden_states, forward_ms))
            except Exception as err:  # noqa: BLE001 - this session's own failure, reported in its place
                results.append(err)
        return results

    def _accept_and_commit(self, session: TargetSession, tree: DraftTree, draft_probs, chain: list[int],
                           prefix_len: int, row_logits, hidden_states, forward_ms: float) -> StepOutput:
        """Acceptance over the forward's rows [F + N, V], KV commit, features (verify's tail)."""
        root = len(chain) - 1  # the forward row of the tree's root
        sampling = session.sampling
        if sampling.greedy and not sampling.penalized:
            # argmax where the logits are: only the N + 1 chosen ids leave the target's device
            # (bf16 -> fp32 is exact, so the choice is the one the fp32 copy would give)
            result = accept_greedy(tree, row_logits[root:])
        else:
            result = self._accept_on_host(session, tree, draft_probs, chain, row_logits[root:])
        return self._commit(session, tree, chain, prefix_len, result, hidden_states, forward_ms)

    def _accept_on_host(self, session: TargetSession, tree: DraftTree, draft_probs, chain: list[int],
                        tree_logits) -> AcceptResult:
        """Acceptance over the rows [N + 1, V] of the root and the nodes, as fp32 on the host: the
        penalty and sampling paths (they draw from the session's host generator)."""
        logits = tree_logits.float().cpu()  # [N + 1, V]
        sampling = session.sampling
        if sampling.penalized:  # row 0 follows the chain, row 1 + n node n's path
            text = session.history + chain
            paths = tree_paths(tree)
            windows = [text[-sampling.penalty_window:]] + [(text + p)[-sampling.penalty_window:] for p in paths]
            logits = apply_contextual_penalty(logits, windows, sampling.penalty)
        if sampling.greedy:
            return accept_greedy(tree, logits)
        return accept_sampling(tree, logits, sampling, draft_probs or {}, session.generator)

    def _commit(self, session: TargetSession, tree: DraftTree, chain: list[int], prefix_len: int,
                result: AcceptResult, hidden_states, forward_ms: float) -> StepOutput:
        """The KV commit of an accepted path, its features and the new pending token."""
        root = len(chain) - 1
        sampling = session.sampling
        rows = list(range(len(chain))) + [root + 1 + node for node in result.accepted_nodes]
        kv.keep_rows(session.cache, prefix_len, rows)
        features = self._features(session.features, session.cache, hidden_states, rows, prefix_len)
        session.pending_token = result.bonus_token
        accepted_tokens = tuple(tree.tokens[n] for n in result.accepted_nodes)
        if sampling.penalized:
            session.history = (session.history + chain + list(accepted_tokens))[-sampling.penalty_window:]
        return StepOutput(result, accepted_tokens, features, forward_ms)

    def _tree_mask(self, buffers, prefix_len: int):
        """The tree's additive mask [1, 1, M, prefix_len + M], windowed for sliding-window layers;
        a {layer type: mask} mapping for models that name a kind per layer (transformers builds no
        mask of its own when handed one)."""
        masks = {kind: buffers.attention_mask(prefix_len, self.dtype, self.device, window)
                 for kind, window in self.windows.items()}
        return masks if self.per_layer_type else next(iter(masks.values()))

    def _features(self, spec: FeatureRequest, cache, hidden_states, rows: list[int], start: int) -> FeatureBatch:
        """Features `spec` of the committed positions [start, start + len(rows)); `rows` index the
        forward's query positions. Called after the cache has been compacted."""
        batch = FeatureBatch(start, len(rows))
        if spec.hidden_layers:
            index = torch.tensor(rows, device=self.device)
            for layer in spec.hidden_layers:
                batch.hidden[layer] = hidden_states[layer][0].index_select(0, index).cpu()
        for layer in spec.kv_layers:
            keys, values = kv.layer_kv(cache, layer, start, start + len(rows))
            batch.keys[layer], batch.values[layer] = keys.cpu(), values.cpu()
        if spec.lsa_id:
            module = self.lsa_modules[spec.lsa_id]
            per_layer = [kv.layer_kv(cache, layer, start, start + len(rows)) for layer in range(self.num_layers)]
            layer_kv = stack_layer_kv([k for k, _ in per_layer], [v for _, v in per_layer])
            dtype = next(module.parameters()).dtype
            with lsa_autocast(len(rows), dtype, layer_kv.device):  # a prompt's LSA in bf16 where faster
                batch.lsa = module.memory(layer_kv.to(dtype)).float().cpu()
        return batch


def tree_paths(tree: DraftTree) -> list[list[int]]:
    """The tokens from the root's child down to node n, for each node n [N]."""
    paths: list[list[int]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append((paths[parent] if parent != ROOT else []) + [token])
    return paths


def _step_inputs(session: TargetSession, tree: DraftTree, forced_tokens: tuple[int, ...]):
    """What one verify step feeds the forward: (the session's cached length, the chain [F] (forced
    tokens, else the pending token), the tree buffers of the chain with the tree below its last
    token, and the row ids [F + N]: the chain's first token, then every node's)."""
    chain = list(forced_tokens) or [session.pending_token]
    full = _hang_tree(chain, tree)
    return kv.cache_length(session.cache), chain, tree_buffers(full.parents), [chain[0], *full.tokens]


def _hang_tree(chain: list[int], tree: DraftTree) -> DraftTree:
    """`chain[1:]` as a path of nodes with the tree below its last one; the forward's root row is
    `chain[0]` (the pending position)."""
    links = len(chain) - 1
    if links == 0:
        return tree
    parents = [ROOT] + list(range(links - 1))
    parents += [links - 1 if p == ROOT else p + links for p in tree.parents]
    return DraftTree(tuple(chain[1:]) + tuple(tree.tokens), tuple(parents))
