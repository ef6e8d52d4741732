"""SWIFT: on-the-fly self-speculative decoding by layer skipping (seed 000; Xia et al. 2024,
"SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference Acceleration").

The drafter is the target itself with a set of its decoder layers skipped. It needs the target's
weights where it drafts (single-device mode, or split mode with the weights also on the client)
and the target's keys/values of every verified position, which the verifier returns as features
(all layers' K/V, as MoA with LSA on the client asks for): the drafter's cache of verified
positions is the target's own (§4.1.2, "the cached key-value pairs of the target LLM are reused").

Two phases per stream of answers (§4.1, Figure 3):

- **Context-based layer set optimisation (§4.1).** Drafting starts from a uniform skip set at
  ratio r. Once `window` target-generated tokens have been verified, each proposal is preceded by
  one optimisation step: a candidate skip set is proposed (random search, and every `bo_every`-th
  step Gaussian-process Bayesian optimisation with expected improvement, scikit-learn's GP), and
  scored by its *matchness*: the share of the last `window` verified tokens that the skipped model
  predicts in one parallel forward over them (§4.1.2, Eq. 3-4). The best set drafts. Optimisation
  stops after `max_steps` steps, after `patience` steps without a better set, or once the best
  matchness reaches `stop_matchness`; it carries over from answer to answer (the paper's input
  stream), so later answers draft with the set found on earlier ones.
- **Confidence-aware drafting (§4.2).** The skipped model drafts a chain of top-1 tokens and stops
  when the top-1 probability falls below `epsilon` (or at the depth / node budget); at each depth
  the top-k tokens are proposed as siblings, k chosen by the confidence band of that depth's
  top-1 probability (paper: 10 / 5 / 3 / 1 for (0, 0.5], (0.5, 0.8], (0.8, 0.95], (0.95, 1]).
  The siblings are chosen deterministically, so no draft probabilities travel: under sampling the
  verifier treats each as a one-hot proposal, which keeps the output lossless.

Departures, said plainly: layers are skipped whole (attention and MLP of a decoder layer
together, through transformers' own layer forward, so every family the verifier serves works),
where the paper skips attention and MLP sub-layers independently; the first and last decoder layers
are never skipped (the search covers the L - 2 in between); the defaults are sized for a 30-layer
135M target on a CPU (see `SwiftConfig`).
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import nn

from splitspec.shared import kv
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import ROOT, DraftTree
from splitspec.v1 import verify_pb2 as pb

from .base import DraftLimits, Drafter, Proposal, check_contiguous


PAPER_BANDS = ((0.5, 10), (0.8, 5), (0.95, 3), (1.0, 1))  # §4.2: top-k by confidence band


@dataclass(frozen=True)
class SwiftConfig:
    """SWIFT's settings (paper defaults in ../shared/docs/ANCHORS.md, "SWIFT").

    ratio: share of the decoder layers skipped while drafting (paper 0.45-0.5 for 13B-70B models; a
        30-layer 135M model has less to spare, see docs/methods.md, "SWIFT", for the measurement).
    window: verified target-generated tokens the matchness is computed over (paper 32-50).
    bo_every: every this many optimisation steps is a Bayesian-optimisation step (paper 25); the
        others are random search.
    max_steps, patience, stop_matchness: when optimisation stops (paper: 300 steps without gain, or
        matchness > 0.93-0.95); shorter here because a 135M target's answers are short and each
        step costs a forward of `window` positions on the CPU.
    epsilon: drafting stops below this top-1 probability (paper 0.8; 0.6 drafted deeper at no loss
        of speed on SmolLM2-135M).
    max_depth, max_nodes: draft length and node budget (paper 25 tokens; the CPU verify's cost
        grows with the positions scored, so fewer here).
    bands: ((upper bound of top-1 probability, k), ...) in increasing order; the paper's are
        PAPER_BANDS, narrowed here to 3 / 2 / 2 / 1 for the same reason as max_nodes.
    seed: the optimiser's random stream (random search and the candidates BO scores).

    Raises:
        ValueError: a ratio outside [0, 1), a window below 2, or bo_every / max_depth / max_nodes below 1.
    """

    ratio: float = 0.2
    window: int = 32
    bo_every: int = 5
    max_steps: int = 50
    patience: int = 20
    stop_matchness: float = 0.95
    epsilon: float = 0.6
    max_depth: int = 6
    max_nodes: int = 6
    bands: tuple[tuple[float, int], ...] = ((0.5, 3), (0.8, 2), (0.95, 2), (1.0, 1))
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"SWIFT skip ratio must lie in [0, 1), got {self.ratio}")
        if self.window < 2 or self.bo_every < 1 or self.max_depth < 1 or self.max_nodes < 1:
            raise ValueError("SWIFT window >= 2, bo_every, max_depth and max_nodes >= 1")

    def top_k(self, confidence: float) -> int:
        """Siblings to propose at a depth whose top-1 probability is `confidence` (§4.2)."""
        for upper, k in self.bands:
            if confidence <= upper:
                return k
        return self.bands[-1][1]


@dataclass
class SkipSetSearch:
    """Context-based layer set optimisation (§4.1.2): proposes candidate skip sets and keeps the one
    with the best matchness. Deterministic under `config.seed`.

    `layers`: the decoder layers that may be skipped; `n_skip` of them are skipped at a time.
    `history`: (optimisation step, skip set, matchness) of every candidate scored.
    """

    layers: tuple[int, ...]
    n_skip: int
    config: SwiftConfig
    best: tuple[int, ...] = ()
    best_matchness: float = -1.0
    steps: int = 0
    since_gain: int = 0
    history: list[tuple[int, tuple[int, ...], float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.config.seed)
        if not self.best:
            self.best = uniform_skip_set(self.layers, self.n_skip)

    @property
    def done(self) -> bool:
        cfg = self.config
        return (self.n_skip == 0 or self.steps >= cfg.max_steps or self.since_gain >= cfg.patience
                or self.best_matchness >= cfg.stop_matchness)

    def propose(self) -> tuple[int, ...]:
        """The next candidate: the uniform set first, then BO every `bo_every` steps, else random."""
        if not self.history:
            return self.best
        if (self.steps + 1) % self.config.bo_every == 0 and len(self.history) >= 3:
            return self._bayesian()
        return self._random()

    def record(self, skip: tuple[int, ...], matchness: float) -> None:
        self.steps += 1
        self.history.append((self.steps, skip, matchness))
        if matchness > self.best_matchness:
            self.best, self.best_matchness, self.since_gain = skip, matchness, 0
        else:
            self.since_gain += 1

    def _random(self) -> tuple[int, ...]:
        return tuple(sorted(int(i) for i in self.rng.choice(self.layers, self.n_skip, replace=False)))

    def _encode(self, skip: Sequence[int]) -> np.ndarray:
        return np.isin(np.array(self.layers), np.array(skip, dtype=int)).astype(float)

    def _bayesian(self) -> tuple[int, ...]:
        """Expected improvement of a Gaussian process (Matern 5/2 + noise) fitted on every scored
        set, maximised over random sets and single swaps of the best one."""
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel
        from scipy.stats import norm
        from sklearn.exceptions import ConvergenceWarning

        x = np.stack([self._encode(s) for _, s, _ in self.history])
        y = np.array([m for _, _, m in self.history])
        kernel = (ConstantKernel(1.0, (1e-2, 1e2)) * Matern(length_scale=2.0, length_scale_bounds=(0.5, 50.0), nu=2.5)
                  + WhiteKernel(1e-2, (1e-4, 1.0)))
        gp = GaussianProcessRegressor(kernel, normalize_y=True, random_state=int(self.rng.integers(2**31)))
        with warnings.catch_warnings():  # a few noisy points often put a bound on the optimum: harmless
            warnings.simplefilter("ignore", ConvergenceWarning)
            gp.fit(x, y)
        seen = {s for _, s, _ in self.history}
        candidates = {self._random() for _ in range(256)} | set(self._swaps(self.best))
        candidates = sorted(candidates - seen) or sorted(candidates)
        mean, std = gp.predict(np.stack([self._encode(c) for c in candidates]), return_std=True)
        gain = mean - y.max() - 0.01
        z = gain / np.maximum(std, 1e-9)
        ei = gain * norm.cdf(z) + std * norm.pdf(z)
        return candidates[int(np.argmax(ei))]

    def _swaps(self, skip: tuple[int, ...]) -> list[tuple[int, ...]]:
        kept = [i for i in self.layers if i not in skip]
        return [tuple(sorted((set(skip) - {s}) | {k})) for s in skip for k in kept]


def uniform_skip_set(layers: Sequence[int], n_skip: int) -> tuple[int, ...]:
    """`n_skip` of `layers` spread evenly (SWIFT's starting point, §4.1.1).

    Raises:
        ValueError: `n_skip` > len(layers).
    """
    if n_skip <= 0:
        return ()
    if n_skip > len(layers):
        raise ValueError(f"cannot skip {n_skip} of {len(layers)} layers")
    return tuple(layers[int((i + 0.5) * len(layers) / n_skip)] for i in range(n_skip))


class SwiftDrafter(Drafter):
    """SWIFT over a transformers causal LM (the target, with its weights shared, not copied).

    Features: every decoder layer's keys/values of each verified position ([Hkv, count, D] per
    layer), fp16 on the wire by default (`quantization`).

    Raises:
        ValueError: (construction) a model without a decoder layer list at `.model.layers`.
    """

    name = "swift"

    def __init__(self, model, config: SwiftConfig = SwiftConfig(), *, quantization: int = pb.QUANTIZATION_NONE
                 ) -> None:
        self.model = model
        self.config = config
        self.num_layers = model.config.num_hidden_layers
        self.decoder = _decoder(model)
        self.all_layers = list(self.decoder.layers)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.feature_request = FeatureRequest(kv_layers=tuple(range(self.num_layers)), quantization=quantization)
        searchable = tuple(range(1, self.num_layers - 1))
        self.search = SkipSetSearch(searchable, min(round(config.ratio * self.num_layers), len(searchable)), config)
        self.reset((), FeatureBatch(0, 0))

    # -- the sequence's state: the target's K/V of the verified positions ------------------------

    def reset(self, prompt_ids, features: FeatureBatch) -> None:
        self.cache = kv.SessionCache()  # the target's K/V of every layer, appended in place
        self.verified = 0
        self.generated_from = len(prompt_ids)  # positions before this are the prompt
        self.tokens: list[int] = list(prompt_ids)
        if features.count:
            self.commit((), features)

    @torch.inference_mode()
    def commit(self, new_tokens, features: FeatureBatch) -> None:
        check_contiguous(features, self.verified)
        kv.truncate(self.cache, self.verified)
        for layer in range(self.num_layers):
            self.cache.update(features.keys[layer][None].to(self.device, self.dtype),
                              features.values[layer][None].to(self.device, self.dtype), layer)
        self.verified += features.count

    def rollback(self, length: int) -> None:
        self.tokens = self.tokens[:length]

    def report(self) -> dict:
        """The search so far: {"layers", "n_skip", "best", "best_matchness", "steps", "done",
        "history": [[step, skip set, matchness], ...]}."""
        search = self.search
        return {"layers": self.num_layers, "n_skip": search.n_skip, "best": list(search.best),
                "best_matchness": search.best_matchness, "steps": search.steps, "done": search.done,
                "history": [[step, list(skip), m] for step, skip, m in search.history]}

    # -- the skipped model -----------------------------------------------------------------------

    def _forward(self, skip: tuple[int, ...], tokens: list[int], positions: list[int], mask: torch.Tensor
                 ) -> torch.Tensor:
        """Run `tokens` at `positions` through the target without the layers in `skip`, appending
        their K/V to the kept layers' cache. `mask`: additive [q, kv] over the kept layers' cache
        after the append. Returns logits [q, V] (fp32)."""
        skipped = set(skip)
        kept = nn.ModuleList(layer for i, layer in enumerate(self.all_layers) if i not in skipped)
        decoder = copy.copy(self.decoder)  # the target's modules and weights, its own layer list
        decoder._modules = dict(decoder._modules)
        decoder.layers = kept
        ids = torch.tensor([tokens], device=self.device)
        out = decoder(input_ids=ids, position_ids=torch.tensor([positions], device=self.device),
                      attention_mask=mask[None, None].to(self.device, self.dtype), cache=self.cache,
                      use_cache=True)
        return self.model.get_output_embeddings()(out.last_hidden_state[0]).float()

    def _kept_length(self, skip: tuple[int, ...]) -> int:
        return self.cache.get_seq_length(min(set(range(self.num_layers)) - set(skip)))

    def _mask(self, visible: torch.Tensor, rows: int) -> torch.Tensor:
        """Additive mask [rows, len(visible) + rows]: each row sees the `visible` cache slots (bool)
        and the new rows up to itself."""
        see = torch.cat([visible[None].expand(rows, -1), torch.ones(rows, rows, dtype=torch.bool).tril()], 1)
        return torch.zeros(see.shape, dtype=self.dtype).masked_fill(~see, torch.finfo(self.dtype).min)

    @torch.inference_mode()
    def matchness(self, skip: tuple[int, ...]) -> float | None:
        """Share of the last `window` verified target-generated tokens the skipped model predicts
        (§4.1.2, Eq. 4), each from the target's K/V of everything before the window plus its own
        K/V of the window's earlier tokens: one parallel forward. None while fewer are verified."""
        window = self.config.window
        end = min(self.verified, len(self.tokens))
        start = end - window
        if start < max(self.generated_from, 1):
            return None
        cached = self._kept_length(skip)
        visible = torch.zeros(cached, dtype=torch.bool)
        visible[: start - 1] = True
        inputs = self.tokens[start - 1: end - 1]
        logits = self._forward(skip, inputs, list(range(start - 1, end - 1)), self._mask(visible, len(inputs)))
        kv.truncate(self.cache, self.verified)  # the kept layers' draft rows go
        predicted = logits.argmax(-1).tolist()
        return sum(p == t for p, t in zip(predicted, self.tokens[start:end])) / window

    # -- drafting ------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, context: Sequence[int], limits: DraftLimits, sampling: SamplingParams) -> Proposal:
        """One optimisation step (while the search runs and enough context is verified), then a
        confidence-aware draft with the best skip set. Tokens after the verified positions (the
        pending token, offline text) run through the skipped model first."""
        self.tokens = list(context)
        pending = len(context) - 1
        if self.verified > pending:
            raise RuntimeError(f"{self.verified} positions verified but the pending token is at {pending}")
        if not self.search.done:
            candidate = self.search.propose()
            score = self.matchness(candidate)
            if score is not None:
                self.search.record(candidate, score)
        skip = self.search.best
        depth_limit = min(self.config.max_depth, limits.max_depth)
        node_limit = min(self.config.max_nodes, limits.max_nodes)
        new = list(context[self.verified:])
        visible = torch.ones(self.verified, dtype=torch.bool)
        logits = self._forward(skip, new, list(range(self.verified, len(context))), self._mask(visible, len(new)))[-1]
        tokens: list[int] = []
        parents: list[int] = []
        chain_parent = ROOT
        for depth in range(1, depth_limit + 1):
            probs = torch.softmax(logits, -1)
            confidence, _ = probs.max(-1)
            k = min(self.config.top_k(float(confidence)), node_limit - len(tokens))
            if k < 1:
                break
            top = torch.topk(probs, k).indices.tolist()
            first = len(tokens)
            tokens += top
            parents += [chain_parent] * k
            chain_parent = first
            if float(confidence) < self.config.epsilon or depth == depth_limit or len(tokens) >= node_limit:
                break
            cached = self._kept_length(skip)
            logits = self._forward(skip, [top[0]], [pending + depth], self._mask(torch.ones(cached, dtype=torch.bool),
                                                                                    1))[-1]
        kv.truncate(self.cache, self.verified)  # the kept layers' draft rows go
        return Proposal(DraftTree(tuple(tokens), tuple(parents)))


def _decoder(model):
    """The decoder stack (`model.model` for transformers' *ForCausalLM) holding `.layers`."""
    decoder = getattr(model, "model", None)
    if decoder is None or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layer list at .model.layers; SWIFT cannot skip "
                         "its layers")
    return decoder
