"""Tree speculative decoding with a block drafter, a tree builder and an exact verifier (batch 1):
the DFlash + DDTree pipeline of the TEV paper (Sec. 1-2 drafter -> builder -> verifier, Sec. 4,
App. D.1 stage timing) with any verifier of :mod:`impl.tev.verify`.

One round, with committed tokens ``c_0 .. c_{n-1}`` and the target KV cache holding ``c_0 .. c_{n-2}``
(the last committed token ``c_{n-1}``, usually the previous bonus token, is not in the cache yet):

1. **draft**: the drafter's context is the target features of ``c_0 .. c_{n-2}``; it drafts the
   block ``[c_{n-1}, MASK...]`` -> ``[H, V]`` marginals;
2. **build**: DDTree best-first tree (budget B, depth <= H) or a DFlash chain, rooted at ``c_{n-1}``;
3. **target**: ONE target forward over the N tree rows against the cache, with the tree attention
   mask and position ids ``(n - 1) + depth`` (:meth:`impl.tev.tree.DraftTree.attention_mask`);
   row v gives p_v (Eq. 1) at temperature T (T = 0: one-hot argmax) and the target features of v;
4. **verify**: the verifier returns the accepted path root..V and a bonus token Y;
5. **commit**: the cache keeps the prefix plus the KV rows of the accepted path (root included; the
   path's rows are gathered when they are not contiguous, which is exact because each row's KV was
   computed attending to exactly the committed prefix and its ancestors at its true position); the
   path's features join the drafter context; ``pi(V) || Y`` is appended and Y becomes the next root.

Per round it records tau = D + 1 (tokens of the verifier's block, bonus included), the number of
tokens committed (tau, cut at ``max_new_tokens`` / EOS), the realised target coverage C_p(T) (Eq. 6;
E[tau] = 1 + C_p, Eq. 11), the tree size (non-root nodes) and the wall time of each stage.

Exactness: every verifier is an exact path verifier (Corollaries 1-2) and the tree depends only on
the committed prefix, so with T > 0 the committed sequence is distributed as target sampling at T
(Lemma 2, round-wise composition); with T = 0 it equals greedy AR decoding token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from impl.models.depth import embed, num_layers, readout_logits, run_layers
from impl.spec.ar import check_prompt_ids
from impl.spec.result import DecodeResult

from .builder import best_first_tree, chain_tree
from .exit_law import target_coverage
from .verify import VERIFIERS

STAGES = ("draft", "build", "target", "verify", "commit")
TREE_MODES = ("best_first", "chain")


@dataclass(kw_only=True)
class TEVResult(DecodeResult):
    """Output of :func:`tev_decode`: the :class:`~impl.spec.result.DecodeResult` fields plus

    Attributes:
        taus: per round, the verifier's block length L = D + 1 (accepted draft tokens plus the bonus;
            1 <= tau <= depth + 1).
        committed: per round, tokens actually appended (tau cut at max_new_tokens / EOS).
        coverages: per round, the realised tree's target coverage C_p(T) (Eq. 6) under the
            temperature-T target rows; E[tau | tree] = 1 + C_p (Eq. 11).
        tree_sizes: per round, the number of non-root tree nodes.
        stage_seconds: per stage name in :data:`STAGES`, one wall time per round (seconds; CUDA
            synchronised): draft (drafter context update + block pass), build, target (tree forward,
            readout and temperature softmax), verify (the verifier call), commit (KV gather/crop and
            feature bookkeeping).
        verifier, tree_mode, budget, depth, temperature: the settings used.
    """

    taus: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    coverages: list[float] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    stage_seconds: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    verifier: str = "tev"
    tree_mode: str = "best_first"
    budget: int = 0
    depth: int = 0
    temperature: float = 0.0

    @property
    def rounds(self) -> int:
        """Number of target verification rounds."""
        return len(self.taus)

    @property
    def mean_tau(self) -> float:
        """Micro average of tau over rounds (per round, bonus counted); nan with no rounds."""
        return sum(self.taus) / len(self.taus) if self.taus else float("nan")

    @property
    def mean_expected_tau(self) -> float:
        """Micro average of 1 + C_p over rounds (the saturated verifier's expected tau)."""
        return 1.0 + sum(self.coverages) / len(self.coverages) if self.coverages else float("nan")

    def round_rows(self) -> list[dict]:
        """One dict per round: ``tau, committed, coverage, tree_size`` and ``<stage>_s`` seconds."""
        return [{"round": i, "tau": self.taus[i], "committed": self.committed[i],
                 "coverage": self.coverages[i], "tree_size": self.tree_sizes[i],
                 **{f"{s}_s": self.stage_seconds[s][i] for s in STAGES}} for i in range(self.rounds)]


class FixedDrafter:
    """A drafter stand-in that returns given marginals (for testing builders and the decode loop
    without a trained drafter).

    Args:
        marginals: a float ``[H, V]`` tensor returned every round, or a callable
            ``fn(n_committed, last_token) -> [H, V]`` where ``n_committed`` is the number of committed
            tokens (prompt included, ``last_token`` included).
        block_size: H (needed when ``marginals`` is a callable).
        feature_layers: target depths whose features the decode loop should collect (default none).
    """

    def __init__(self, marginals: torch.Tensor | Callable[[int, int], torch.Tensor], block_size: int | None = None,
                 feature_layers: Sequence[int] = ()):
        if isinstance(marginals, torch.Tensor):
            if marginals.dim() != 2:
                raise ValueError(f"marginals must be [H, V], got {tuple(marginals.shape)}")
            self._fn = lambda n, t, m=marginals: m
            self.block_size = int(marginals.shape[0]) if block_size is None else int(block_size)
        else:
            if block_size is None:
                raise ValueError("block_size is required with a callable")
            self._fn, self.block_size = marginals, int(block_size)
        self.feature_layers = [int(d) for d in feature_layers]

    def draft(self, context_features: torch.Tensor, last_token: int) -> torch.Tensor:
        """``[H, V]`` marginals for a context of ``context_features.shape[0]`` positions."""
        return self._fn(int(context_features.shape[0]) + 1, int(last_token))


class _PlainContext:
    """Context bookkeeping for drafters that only implement ``draft(features, last_token)``."""

    def __init__(self, drafter, features: torch.Tensor):
        self.drafter, self.features = drafter, features

    def extend(self, f: torch.Tensor) -> None:
        self.features = torch.cat([self.features, f], dim=0)

    def draft(self, last_token: int) -> torch.Tensor:
        return self.drafter.draft(self.features, last_token)


class _IncrementalContext:
    """Context of a drafter with ``init_context`` / ``extend_context`` / ``draft_from_context``."""

    def __init__(self, drafter, features: torch.Tensor):
        self.drafter, self.ctx = drafter, drafter.init_context(features)

    def extend(self, f: torch.Tensor) -> None:
        self.drafter.extend_context(self.ctx, f)

    def draft(self, last_token: int) -> torch.Tensor:
        return self.drafter.draft_from_context(self.ctx, last_token)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward(target, ids: torch.Tensor, position_ids: torch.Tensor, mask, cache, feature_layers: list[int]):
    """Full-depth target forward of ``ids`` ``[1, S]``; returns (logits ``[S, V]``, features ``[S, F]``)."""
    want = {d: i for i, d in enumerate(feature_layers)}
    got: list[torch.Tensor | None] = [None] * len(want)

    def grab(depth, h):
        if depth in want:
            got[want[depth]] = h[0]

    h = run_layers(target, embed(target, ids), 0, num_layers(target), position_ids=position_ids,
                   attention_mask=mask, cache=cache, on_layer=grab if want else None)
    logits = readout_logits(target, h)[0]
    feats = torch.cat(got, dim=-1) if want else logits.new_zeros(ids.shape[1], 0)
    return logits, feats


def commit_cache(cache, prefix_len: int, n_tree: int, path: Sequence[int]) -> None:
    """Keep the cached prefix and the KV rows of the accepted ``path`` (tree node ids, root first),
    dropping the other tree rows, in every layer of a ``DynamicCache`` (DDTree's compaction; the
    commit stage of TEV App. D.1 / Table 3).

    Only the tree window is touched: the rows of the path that are not already in place (from its
    first node u with u != its index on) are gathered with one ``index_select`` per layer tensor and
    written with one ``index_copy_`` right after the in-place prefix of the path; then every layer
    tensor is cropped to ``prefix_len + len(path)`` positions by an in-place metadata change (no
    copy, no new tensor). A path that is contiguous from the root (``path == [0, 1, ..., k-1]``, e.g.
    a root-only exit) needs only the crop. The cached prefix is never copied.

    The layer tensors are modified in place (under ``torch.inference_mode``, entered if the caller has
    not, so a cache built under it can be committed from outside): another reference to them (e.g. a
    shallow copy of the cache) sees the compaction; copy a cache with ``copy.deepcopy`` before
    committing on it.

    Args:
        cache: transformers ``DynamicCache`` holding ``prefix_len + n_tree`` positions.
        prefix_len: cached committed positions before the tree rows.
        n_tree: N, the tree rows appended by the tree forward.
        path: increasing node ids, ``path[0] == 0`` (the root).

    Raises:
        ValueError: a cache of another length, or a path that is not increasing from the root.
        NotImplementedError: a layer type that cannot be gathered (sliding window, ...).
    """

    path = [int(u) for u in path]
    k = len(path)
    if not path or path[0] != 0 or path[-1] >= n_tree or any(b <= a for a, b in zip(path, path[1:])):
        raise ValueError(f"path must be increasing node ids from the root 0 within {n_tree} nodes, got {path}")
    if cache.get_seq_length() != prefix_len + n_tree:
        raise ValueError(f"cache holds {cache.get_seq_length()} positions, expected {prefix_len + n_tree}")
    if not torch.is_inference_mode_enabled():  # in-place edits of a cache built under inference mode need it
        with torch.inference_mode():
            return commit_cache(cache, prefix_len, n_tree, path)
    j = next((i for i, u in enumerate(path) if u != i), k)  # path[:j] == 0..j-1 is already in place
    layers = cache.layers
    dynamic = all(type(layer) is DynamicLayer for layer in layers)
    if j < k:
        if not dynamic and any(getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") for layer in layers):
            raise NotImplementedError("cannot gather rows of a sliding-window (or keyless) cache layer")
        idx = {}
        for layer in layers:
            for t in (layer.keys, layer.values):
                if t.device not in idx:
                    idx[t.device] = (torch.tensor([prefix_len + u for u in path[j:]], device=t.device),
                                     torch.arange(prefix_len + j, prefix_len + k, device=t.device))
                src, dst = idx[t.device]
                t.index_copy_(-2, dst, t.index_select(-2, src))
    if n_tree > k:
        if dynamic:  # crop each layer tensor in place to its first prefix_len + k positions
            keep = prefix_len + k
            for layer in layers:  # DynamicLayer tensors are [batch, heads, seq, head_dim]
                t = layer.keys
                s = t.shape
                t.as_strided_((s[0], s[1], keep, s[3]), t.stride())
                t = layer.values
                s = t.shape
                t.as_strided_((s[0], s[1], keep, s[3]), t.stride())
        else:
            cache.crop(-(n_tree - k))


@torch.no_grad()
def tev_decode(
    target,
    drafter,
    input_ids: list[int],
    max_new_tokens: int,
    *,
    budget: int,
    depth: int,
    verifier: str = "tev",
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    tree_mode: str = "best_first",
) -> TEVResult:
    """Tree speculative decoding, batch 1: drafter -> builder -> one target tree forward ->
    exact verifier -> commit (module docstring; TEV Sec. 2 pipeline, Algorithm 1 for ``"tev"``).

    Args:
        target: Hugging Face causal LM (Llama/Qwen family, eval mode).
        drafter: a :class:`impl.tev.drafter.BlockDrafter`, a :class:`FixedDrafter`, or any object
            with ``block_size``, ``feature_layers`` (1-based target depths) and
            ``draft(context_features [n, F], last_token) -> [H, V]`` (optionally the incremental
            ``init_context`` / ``extend_context`` / ``draft_from_context``).
        input_ids: prompt token ids (non-empty list of int in the vocabulary).
        max_new_tokens: tokens to generate (>= 1).
        budget: B >= 0, non-root tree nodes per round (B = 0: plain AR through the tree path).
        depth: maximum tree depth, ``1 <= depth <= drafter.block_size``; near the end of the
            generation a round drafts at most ``max_new_tokens - generated - 1`` tokens.
        verifier: a name in :data:`impl.tev.verify.VERIFIERS` (``"predraw_follow"``,
            ``"sequential_residual"``, ``"tev"``). It is always called, also at T = 0 (one-hot rows).
        temperature: 0 for greedy (one-hot argmax rows, ties to the lowest id, as ``ar_decode``);
            > 0: p_v = softmax(logits / T).
        generator: ``torch.Generator`` for the verifier (required when T > 0; probabilities are moved
            to its device). At T = 0 a CPU generator seeded 0 is used if None.
        eos_token_id: stop after committing this id (None: never).
        tree_mode: ``"best_first"`` (DDTree, budget B) or ``"chain"`` (DFlash chain of
            ``min(B, depth)`` argmax tokens).

    Returns:
        :class:`TEVResult`. With T = 0 ``tokens`` equal ``ar_decode(target, input_ids,
        max_new_tokens, eos_token_id=...)``; with T > 0 they are distributed as target sampling.

    Raises:
        ValueError: bad prompt ids, ``max_new_tokens < 1``, prompt + new tokens beyond the target
            context, unknown verifier / tree mode, ``budget < 0``, ``depth`` outside
            ``[1, block_size]``, or T > 0 without a generator.
    """

    check_prompt_ids(target, input_ids)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    ctx_len = getattr(target.config, "max_position_embeddings", None)
    if ctx_len is not None and len(input_ids) + max_new_tokens > ctx_len:
        raise ValueError(f"prompt of {len(input_ids)} tokens + {max_new_tokens} new tokens exceeds the context "
                         f"of {ctx_len}")
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r}; choose from {', '.join(VERIFIERS)}")
    if tree_mode not in TREE_MODES:
        raise ValueError(f"unknown tree_mode {tree_mode!r}; choose from {', '.join(TREE_MODES)}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    H = int(drafter.block_size)
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= H:
        raise ValueError(f"depth must be an int in [1, drafter.block_size={H}], got {depth!r}")
    if temperature > 0 and generator is None:
        raise ValueError("sampling (temperature > 0) needs a torch.Generator")
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    verify = VERIFIERS[verifier]
    device = next(target.parameters()).device
    feature_layers = [int(d) for d in drafter.feature_layers]
    out = TEVResult(verifier=verifier, tree_mode=tree_mode, budget=budget, depth=depth, temperature=float(temperature))

    # -- prefill: the prompt without its last token (that one is the first round's root) -------
    _sync(device)
    t0 = time.perf_counter()
    cache = DynamicCache(config=target.config)
    seq = list(input_ids)
    if len(seq) > 1:
        ids = torch.tensor([seq[:-1]], dtype=torch.long, device=device)
        _, feats = _forward(target, ids, torch.arange(len(seq) - 1, device=device)[None], None, cache, feature_layers)
    else:
        feats = torch.zeros(0, 0, device=device)
        if feature_layers:
            feats = torch.zeros(0, len(feature_layers) * int(target.config.hidden_size), device=device)
    ctx = (_IncrementalContext if hasattr(drafter, "init_context") else _PlainContext)(drafter, feats)
    pending = None  # features of the last accepted path, added to the drafter context at the next draft
    _sync(device)
    out.prefill_seconds = time.perf_counter() - t0

    while len(out.tokens) < max_new_tokens:
        times = {}
        prefix_len = len(seq) - 1
        d_eff = min(depth, max_new_tokens - len(out.tokens) - 1)
        n_draft = min(budget, d_eff) if tree_mode == "chain" else (budget if d_eff > 0 else 0)
        # 1. draft
        _sync(device)
        t0 = time.perf_counter()
        if pending is not None:
            ctx.extend(pending)
            pending = None
        marg = ctx.draft(seq[-1]) if n_draft > 0 else None
        _sync(device)
        times["draft"] = time.perf_counter() - t0
        # 2. build
        t0 = time.perf_counter()
        if marg is None:
            tree = best_first_tree(torch.zeros(1, 1), 0, 0, root_token=seq[-1])
        elif tree_mode == "chain":
            tree = chain_tree(marg, n_draft, root_token=seq[-1])
        else:
            tree = best_first_tree(marg, budget, d_eff, root_token=seq[-1])
        plan = tree.plan()  # the verifiers' index tables, fixed with the tree (DDTree's child maps)
        times["build"] = time.perf_counter() - t0
        # 3. one target forward over the tree
        _sync(device)
        t0 = time.perf_counter()
        logits, tree_feats = _forward(target, tree.input_ids(device), tree.position_ids(prefix_len, device),
                                      tree.attention_mask(prefix_len, device), cache, feature_layers)
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
        else:
            probs = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        probs = probs.to(generator.device)
        _sync(device)
        times["target"] = time.perf_counter() - t0
        # 4. verify
        t0 = time.perf_counter()
        # the tree was validated when built (DraftTree) and the rows are a softmax / one-hot: no re-checks
        path, bonus = verify(tree.parents, tree.tokens, probs, generator, validate=False, plan=plan)
        times["verify"] = time.perf_counter() - t0
        # 5. commit
        _sync(device)
        t0 = time.perf_counter()
        commit_cache(cache, prefix_len, len(tree), path)
        pending = tree_feats[torch.tensor(path, device=tree_feats.device)]
        block = tree.path_tokens(path[-1]) + [bonus]
        room = max_new_tokens - len(out.tokens)
        keep = block[:room]
        if eos_token_id is not None and eos_token_id in keep:
            keep = keep[:keep.index(eos_token_id) + 1]
            out.stopped_at_eos = True
        seq += keep
        out.tokens += keep
        _sync(device)
        times["commit"] = time.perf_counter() - t0

        out.taus.append(len(block))
        out.committed.append(len(keep))
        out.coverages.append(target_coverage(tree.parents, tree.tokens, probs))
        out.tree_sizes.append(len(tree) - 1)
        for s in STAGES:
            out.stage_seconds[s].append(times[s])
        if out.stopped_at_eos:
            break
    return out
