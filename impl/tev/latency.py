"""Verifier-stage latency on realized draft trees (TEV paper, App. D.1 and Table 3).

Table 3 holds the drafter, the builder and the realized trees fixed across verifiers and times only
the verifier decision and the cache commit that follows from its accepted path, excluding the shared
target tree forward. :func:`verifier_latency` reproduces that protocol:

1. for every budget B it runs real decoding rounds (drafter -> DDTree best-first builder -> ONE
   target forward over the tree, exactly as :func:`impl.tev.decode.tev_decode`), keeping each
   realized tree, its per-node target rows p_v (float32 ``[N, V]``, temperature applied) and the
   KV cache holding ``prefix + N`` rows; these are shared by every verifier;
2. on each tree it times every verifier (``validate=False``: the tree was validated when it was
   built and the rows are a softmax; ``plan=tree.plan()``: the tree's index tables, built with the
   tree as DDTree's builder returns its child maps, so outside the timed stage for every verifier)
   plus :func:`impl.tev.decode.commit_cache` of its accepted path on a fresh copy of that cache,
   interleaved: ``warmup + repeats`` passes over the verifiers, each pass in a fresh seeded random order (so that no verifier always follows the same one), the
   warm-up passes discarded, the copies made before the first pass, the garbage collector paused
   and everything under ``torch.inference_mode`` (as DDTree's generation loop runs); reference arms
   named ``isolated`` (DDTree's ``torch.multinomial`` predraw, which streams megabytes of
   temporaries through the caches) are timed in passes of their own after the interleaved ones;
3. with ``law_draws > 0``, every interleaved verifier then makes ``law_draws`` untimed calls on the
   tree from its own generator: the tau-law sample (step 2's ``repeats`` calls per tree are too few
   to test Eq. 11 sharply);
4. the round then commits one exact path (TEV's, untimed) to the real cache and decoding continues.

Per (budget, verifier) it reports the per-tree median latency (median and mean over trees, plus the
decision and commit parts), the ratio to the baseline verifier (median of the per-tree ratios and
ratio of the means) and the mean output-block length tau = D + 1 (bonus counted, micro average over
every timed call) against 1 + mean C_p(T) of the same trees (Eq. 11: E[tau | T] = 1 + C_p(T) for
every exact verifier), with its standard error, and the same over the untimed law sample
(``law_*`` columns), for the tau-agreement check. Timing is wall-clock
on the calling thread: compare arms only within one call, as ratios (DESIGN.md "Timing").

How the ratio moves with the vocabulary V (``vocab_sizes``): on each realized tree every verifier is
also timed on the same tree's verification problem restricted to V' < V columns
(:func:`restrict_vocab`: the tree's tokens plus the columns of largest probability, rows
renormalised), so the trees, the paths' structure and the commit are shared and only the width of
the p_v rows differs. Predraw draws one token per node over all V columns (O(N V)); TEV reads
p_v only along the path it walks (TEV Sec. 4), so its ratio to predraw falls as V grows.
"""

from __future__ import annotations

import copy
import functools
import gc
import random
import statistics
import time
from typing import Callable, Mapping, Sequence

import torch
from transformers import DynamicCache

from .schema import min_restricted_vocab

from impl.spec.ar import check_prompt_ids

from .builder import best_first_tree
from .decode import FixedDrafter, _forward, _IncrementalContext, _PlainContext, _sync, commit_cache
from .exit_law import target_coverage
from .tree import DraftTree
from .verify import VERIFIERS

#: the verifiers timed by default and the baseline the ratios refer to (DDTree's predraw)
DEFAULT_VERIFIERS = ("predraw_follow", "sequential_residual", "tev")
BASELINE = "predraw_follow"


def _clone_cache(cache):
    return copy.deepcopy(cache)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def restrict_vocab(tree: DraftTree, probs: torch.Tensor, vocab: int) -> tuple[DraftTree, torch.Tensor]:
    """The tree's verification problem over ``vocab`` columns of the vocabulary (the latency
    benchmark's V sweep; module docstring): the columns are the tree's draft tokens plus the
    columns of largest probability (by their largest p_v over the tree's rows, so every row's mode is
    kept when ``vocab >= 2 N - 1``), in ascending token order; the rows are renormalised and the tree's
    tokens renumbered to their column.

    Args:
        tree: a realized tree (N nodes; ``tree.tokens[1:]`` index ``probs``' columns).
        probs: float ``[N, V]`` target rows p_v (each sums to 1).
        vocab: V' columns to keep, ``2 N - 1 <= V' <= V`` (room for the draft tokens and every row's mode).

    Returns:
        ``(tree', probs')``: the renumbered tree (root token -1) and float ``[N, V']`` rows, contiguous.
        ``V' == V`` returns the inputs unchanged.

    Raises:
        ValueError: ``vocab`` outside ``[2 N - 1, V]``.
    """
    n, V = probs.shape
    if not 2 * n - 1 <= vocab <= V:
        raise ValueError(f"vocab must be in [2 N - 1 = {2 * n - 1}, V = {V}] for a tree of {n} nodes, got {vocab}")
    if vocab == V:
        return tree, probs
    drafted = torch.tensor(tree.tokens[1:], dtype=torch.long, device=probs.device)  # [N - 1]
    score = probs.amax(0).clone()  # [V]
    score[drafted] = float("inf")
    cols = torch.topk(score, vocab).indices.sort().values  # [V']
    col_of = torch.full((V,), -1, dtype=torch.long, device=probs.device)
    col_of[cols] = torch.arange(vocab, device=probs.device)
    sub = probs.index_select(1, cols)  # [N, V']
    sub = (sub / sub.sum(-1, keepdim=True)).contiguous()
    return DraftTree(list(tree.parents), [-1] + col_of[drafted].tolist()), sub


def _resolve(verifiers) -> dict[str, Callable]:
    if verifiers is None:
        return {name: VERIFIERS[name] for name in DEFAULT_VERIFIERS}
    if isinstance(verifiers, Mapping):
        out = dict(verifiers)
    else:
        out = {}
        for name in verifiers:
            if name not in VERIFIERS:
                raise ValueError(f"unknown verifier {name!r}; choose from {', '.join(VERIFIERS)} or pass a mapping")
            out[name] = VERIFIERS[name]
    if not out or not all(callable(f) for f in out.values()):
        raise ValueError("verifiers must name at least one callable verifier")
    return out


def _time_tree(arms: dict[str, Callable], gens: dict[str, torch.Generator], tree, probs, cache,
               prefix_len: int, repeats: int, warmup: int, order_seed: str,
               isolated: Sequence[str] = ()) -> dict[str, list[tuple[float, float, int]]]:
    """``warmup + repeats`` interleaved passes over the arms on one tree; returns per arm the timed
    ``(decision_s, commit_s, tau)`` of the non-warm-up passes. All cache copies are made before the
    first pass, so no copy (and no large allocation) runs between timed calls. Each pass visits the
    arms in a fresh random order (``random.Random(order_seed)``): a rotation would keep every arm's
    predecessor fixed. The arms named in ``isolated`` (reference arms that stream large temporaries
    through the caches, e.g. DDTree's ``torch.multinomial`` predraw, ~50x the others' time) are left
    out of the interleaving and timed afterwards in passes of their own on the same tree, so they
    cannot evict the caches of the arms compared in the interleaved passes."""
    rng = random.Random(order_seed)
    parents, tokens, plan = tree.parents, tree.tokens, tree.plan()  # the plan is built with the tree
    n = len(parents)
    mixed = [name for name in arms if name not in isolated]
    passes = [rng.sample(mixed, len(mixed)) for _ in range(warmup + repeats)]
    passes += [[name] for name in arms if name in isolated for _ in range(warmup + repeats)]
    out: dict[str, list[tuple[float, float, int]]] = {name: [] for name in arms}
    copies = [[_clone_cache(cache) for _ in order] for order in passes]
    seen: dict[str, int] = {name: 0 for name in arms}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for order, cs in zip(passes, copies):
            for name, c in zip(order, cs):
                _sync(probs.device)
                t0 = time.perf_counter()
                path, _ = arms[name](parents, tokens, probs, gens[name], validate=False, plan=plan)
                _sync(probs.device)
                t1 = time.perf_counter()
                commit_cache(c, prefix_len, n, path)
                _sync(probs.device)
                t2 = time.perf_counter()
                if seen[name] >= warmup:
                    out[name].append((t1 - t0, t2 - t1, len(path)))
                seen[name] += 1
    finally:
        if gc_was_enabled:
            gc.enable()
    return out


@torch.inference_mode()
def verifier_latency(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    budgets: Sequence[int] = (32, 64, 128),
    depth: int = 8,
    temperature: float = 1.0,
    *,
    n_trees: int = 32,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    verifiers: Sequence[str] | Mapping[str, Callable] | None = None,
    baseline: str = BASELINE,
    rounds_per_prompt: int = 8,
    isolated: Sequence[str] = (),
    vocab_sizes: Sequence[int] = (),
    law_draws: int = 0,
) -> list[dict]:
    """Time verifier decision + cache commit per realized tree, interleaved across verifiers
    (TEV App. D.1, Table 3; protocol in the module docstring).

    Args:
        target: Hugging Face causal LM (eval mode).
        drafter: a :class:`impl.tev.drafter.BlockDrafter`, a :class:`impl.tev.decode.FixedDrafter`
            (e.g. :func:`bigram_drafter`) or any drafter :func:`impl.tev.decode.tev_decode` accepts;
            a drafter with a ``draft_tokens(committed_ids) -> [H, V]`` method (e.g.
            :class:`TargetChainDrafter`) is given the committed token ids instead.
        prompts: prompt token-id lists, used in turn (cyclically) for ``rounds_per_prompt`` rounds each.
        budgets: tree budgets B (non-root nodes, DDTree best-first builder).
        depth: maximum tree depth, ``1 <= depth <= drafter.block_size``.
        temperature: T > 0 for p_v = softmax(logits / T); 0 gives one-hot argmax rows.
        n_trees: realized trees per budget.
        repeats: timed calls of every verifier per tree (the per-tree latency is their median).
        warmup: untimed leading passes per tree.
        seed: seeds the decoding generator (``seed``), one generator per verifier (``seed + 1 + i``)
            and the per-tree pass orders, so runs are reproducible up to timing.
        verifiers: names in :data:`impl.tev.verify.VERIFIERS`, or a mapping name -> callable with the
            verifier signature plus a ``validate`` keyword (e.g. a ``functools.partial`` selecting a
            sampler); default :data:`DEFAULT_VERIFIERS`.
        baseline: the verifier the ratios refer to (must be among ``verifiers``).
        rounds_per_prompt: decoding rounds (trees) taken from one prompt before moving on.
        isolated: verifier names timed in passes of their own after the interleaved ones (same
            trees, same cache copies protocol), for reference arms that would evict the others'
            caches (see :func:`_time_tree`); must be among ``verifiers`` and not the baseline.
        vocab_sizes: V' values below the target's V at which every verifier is also timed on the
            same trees (:func:`restrict_vocab`; values >= V are skipped); each needs
            ``V' >= 2 * max(budgets) + 1``.
        law_draws: untimed calls per tree of every interleaved (not ``isolated``) verifier after its
            timed ones, from its own generator: the sample of the tau-law columns (Cor. 1, TEV's and
            predraw's mean tau both 1 + C_p on the same trees). The timed calls alone (``repeats`` per
            tree) are too few to test the law sharply; 0: no law sample (the law columns are NaN).

    Memory: each tree holds ``(warmup + repeats) * len(verifiers)`` deep copies of the KV cache.

    Returns:
        One dict per (budget, vocabulary width, verifier), budgets in the given order, the full V first
        and then the ``vocab_sizes`` below it in ascending order, verifiers in the given order:
        ``budget, vocab_size`` (the width V' of the timed rows), ``restricted`` (V' < V),
        ``verifier, baseline, depth, temperature, n_trees, repeats, n_calls`` (timed calls),
        ``timing`` (``"interleaved"`` or ``"isolated"``),
        ``median_us`` / ``mean_us`` (median / mean over trees of the per-tree median of decision +
        commit, microseconds), ``decision_median_us`` / ``commit_median_us`` (median over trees of
        the per-tree medians of each part), ``ratio_median`` (median over trees of per-tree median /
        baseline's), ``ratio_of_means`` (``mean_us`` / baseline's), ``decision_ratio_median`` (as
        ``ratio_median`` for the decision alone), ``mean_tau`` (micro average of tau = len(path) = D + 1 over the
        timed calls), ``tau_se`` (standard error of mean tau - (1 + C_p), from the per-call
        deviations tau - 1 - C_p(tree)), ``expected_tau`` (1 + mean C_p of the trees), ``mean_cp``,
        ``mean_tree_size`` (non-root nodes), ``tree_us`` (the per-tree median latencies, in tree
        order, for other pairings), and the tau-law sample's ``law_n_calls`` (``law_draws`` x trees,
        0 for isolated verifiers), ``law_mean_tau`` and ``law_tau_se`` (as ``mean_tau`` / ``tau_se``,
        over those untimed calls).

    Raises:
        ValueError: no prompts, a bad prompt, ``depth`` outside ``[1, block_size]``, a budget < 1,
            ``n_trees`` / ``repeats`` < 1, ``warmup`` / ``law_draws`` < 0, T < 0, unknown verifiers or a baseline
            not among them, a ``vocab_sizes`` entry below ``2 * max(budgets) + 1``, or a prompt too
            long for ``rounds_per_prompt`` rounds in the context.
    """
    arms = _resolve(verifiers)
    _check_latency_args(target, drafter, prompts, arms, baseline, isolated, budgets, depth, temperature,
                        n_trees, repeats, warmup, rounds_per_prompt, vocab_sizes)
    if isinstance(law_draws, bool) or not isinstance(law_draws, int) or law_draws < 0:
        raise ValueError(f"law_draws must be an int >= 0, got {law_draws!r}")
    device = next(target.parameters()).device
    rows: list[dict] = []
    for budget in budgets:
        gen = torch.Generator(device=device).manual_seed(seed)
        accs: dict[int, _BudgetTimings] = {}  # V' -> timings; the full V first
        gens: dict[int, dict[str, torch.Generator]] = {}  # V' -> one generator per verifier
        for tree, probs, cache, prefix_len in _realized_trees(target, drafter, prompts, budget, depth, temperature,
                                                              n_trees, rounds_per_prompt, gen):
            V = probs.shape[-1]
            for width in [V] + sorted({int(v) for v in vocab_sizes if v < V}):
                t, p = restrict_vocab(tree, probs, width)
                acc = accs.setdefault(width, _BudgetTimings(arms))
                g = gens.setdefault(width, {name: torch.Generator(device=device).manual_seed(seed + 1 + i)
                                            for i, name in enumerate(arms)})
                tag = "" if width == V else f":V{width}"
                timed = _time_tree(arms, g, t, p, cache, prefix_len, repeats, warmup,
                                   order_seed=f"{seed}:{budget}:{len(acc.cps)}{tag}", isolated=isolated)
                law = _law_sample({n: f for n, f in arms.items() if n not in isolated}, g, t, p, law_draws)
                acc.add(timed, target_coverage(t.parents, t.tokens, p), len(t) - 1, law)
        full = max(accs)
        for width, acc in accs.items():
            rows += [{"vocab_size": width, "restricted": width < full, **r}
                     for r in acc.rows(budget=budget, baseline=baseline, depth=depth, temperature=temperature,
                                       repeats=repeats, isolated=isolated)]
    return rows


def _check_latency_args(target, drafter, prompts, arms, baseline, isolated, budgets, depth, temperature, n_trees,
                        repeats, warmup, rounds_per_prompt, vocab_sizes) -> None:
    """:func:`verifier_latency`'s argument checks (its ValueErrors), before any forward."""

    if baseline not in arms:
        raise ValueError(f"baseline {baseline!r} is not among the verifiers {list(arms)}")
    if any(name not in arms or name == baseline for name in isolated):
        raise ValueError(f"isolated arms {list(isolated)} must be verifiers other than the baseline {baseline!r}")
    if not prompts:
        raise ValueError("need at least one prompt")
    H = int(drafter.block_size)
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= H:
        raise ValueError(f"depth must be an int in [1, drafter.block_size={H}], got {depth!r}")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets) or not budgets:
        raise ValueError(f"budgets must be ints >= 1, got {list(budgets)}")
    if n_trees < 1 or repeats < 1 or warmup < 0 or rounds_per_prompt < 1:
        raise ValueError("need n_trees >= 1, repeats >= 1, warmup >= 0 and rounds_per_prompt >= 1")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    least = min_restricted_vocab(budgets)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < least for v in vocab_sizes):
        raise ValueError(f"vocab_sizes must be ints >= 2 * max(budgets) + 1 = {least}, got {list(vocab_sizes)}")
    ctx_len = getattr(target.config, "max_position_embeddings", None)
    for p in prompts:
        check_prompt_ids(target, list(p))
        if ctx_len is not None and len(p) + rounds_per_prompt * (depth + 1) + max(budgets) + 1 > ctx_len:
            raise ValueError(f"a prompt of {len(p)} tokens leaves no room for {rounds_per_prompt} rounds of depth "
                             f"{depth} and budget {max(budgets)} in the context of {ctx_len}")


def _law_sample(arms: Mapping[str, Callable], gens: Mapping[str, torch.Generator], tree, probs,
                draws: int) -> dict[str, list[int]]:
    """``draws`` untimed calls of every arm on one tree, each from its own generator: per arm the
    accepted lengths tau = len(path) (the tau-law sample of :func:`verifier_latency`)."""
    plan = tree.plan()
    return {name: [len(f(tree.parents, tree.tokens, probs, gens[name], validate=False, plan=plan)[0])
                   for _ in range(draws)] for name, f in arms.items()}


def _realized_trees(target, drafter, prompts, budget: int, depth: int, temperature: float, n_trees: int,
                    rounds_per_prompt: int, gen: torch.Generator):
    """Yield ``n_trees`` realized trees of real decoding rounds (step 1 of the module docstring):
    ``(tree, probs [N, V] float32, cache holding prefix + N rows, prefix_len)``. When the consumer asks
    for the next tree, the round first commits TEV's exact path (drawn with ``gen``, untimed) to the
    cache and decoding continues; prompts are used in turn, ``rounds_per_prompt`` rounds each."""

    device = next(target.parameters()).device
    feature_layers = [int(d) for d in drafter.feature_layers]
    produced = 0
    prompt_i = 0
    while produced < n_trees:
        seq = list(prompts[prompt_i % len(prompts)])
        prompt_i += 1
        cache = DynamicCache(config=target.config)
        if len(seq) > 1:
            ids = torch.tensor([seq[:-1]], dtype=torch.long, device=device)
            _, feats = _forward(target, ids, torch.arange(len(seq) - 1, device=device)[None], None, cache,
                                feature_layers)
        else:
            width = len(feature_layers) * int(target.config.hidden_size)
            feats = torch.zeros(0, width, device=device)
        ctx = (_IncrementalContext if hasattr(drafter, "init_context") else _PlainContext)(drafter, feats)
        pending = None
        for _ in range(rounds_per_prompt):
            if produced >= n_trees:
                break
            prefix_len = len(seq) - 1
            if pending is not None:
                ctx.extend(pending)
            marg = drafter.draft_tokens(seq) if hasattr(drafter, "draft_tokens") else ctx.draft(seq[-1])
            tree = best_first_tree(marg, budget, depth, root_token=seq[-1])
            logits, tree_feats = _forward(target, tree.input_ids(device), tree.position_ids(prefix_len, device),
                                          tree.attention_mask(prefix_len, device), cache, feature_layers)
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
            else:
                probs = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
            yield tree, probs, cache, prefix_len
            produced += 1
            # continue decoding along one exact path (untimed)
            path, bonus = VERIFIERS["tev"](tree.parents, tree.tokens, probs, gen, validate=False, plan=tree.plan())
            commit_cache(cache, prefix_len, len(tree), path)
            pending = tree_feats[torch.tensor(path, device=tree_feats.device)]
            seq += tree.path_tokens(path[-1]) + [bonus]


class _BudgetTimings:
    """The timed calls of one budget, per verifier, and the trees' coverages C_p and sizes; :meth:`rows`
    gives :func:`verifier_latency`'s rows of that budget."""

    def __init__(self, arms: Mapping[str, Callable]):
        self.names = list(arms)
        self.calls: dict[str, list[tuple[float, float, int]]] = {n: [] for n in self.names}
        self.per_tree: dict[str, list[float]] = {n: [] for n in self.names}  # median decision + commit [s]
        self.per_tree_dec: dict[str, list[float]] = {n: [] for n in self.names}  # median decision [s]
        self.per_tree_com: dict[str, list[float]] = {n: [] for n in self.names}  # median commit [s]
        self.dev: dict[str, list[float]] = {n: [] for n in self.names}  # tau - 1 - C_p(tree) per call
        self.law_taus: dict[str, list[int]] = {n: [] for n in self.names}  # untimed calls' tau
        self.law_dev: dict[str, list[float]] = {n: [] for n in self.names}  # their tau - 1 - C_p(tree)
        self.cps: list[float] = []
        self.sizes: list[int] = []

    def add(self, timed: Mapping[str, list[tuple[float, float, int]]], cp: float, size: int,
            law: Mapping[str, list[int]] | None = None) -> None:
        """One tree's ``(decision_s, commit_s, tau)`` calls per verifier, its C_p, its non-root size and
        the untimed law sample's tau per verifier (:func:`_law_sample`)."""
        for name, taus in (law or {}).items():
            self.law_taus[name] += taus
            self.law_dev[name] += [tau - 1.0 - cp for tau in taus]
        for name, got in timed.items():
            self.calls[name] += got
            self.per_tree[name].append(_median([a + b for a, b, _ in got]))
            self.per_tree_dec[name].append(_median([a for a, _, _ in got]))
            self.per_tree_com[name].append(_median([b for _, b, _ in got]))
            self.dev[name] += [tau - 1.0 - cp for _, _, tau in got]
        self.cps.append(cp)
        self.sizes.append(size)

    def rows(self, *, budget: int, baseline: str, depth: int, temperature: float, repeats: int,
             isolated: Sequence[str]) -> list[dict]:
        """One row per verifier (columns: :func:`verifier_latency`'s Returns)."""
        base_trees = self.per_tree[baseline]
        base_mean = _mean(base_trees)
        out = []
        for name in self.names:
            taus = [tau for _, _, tau in self.calls[name]]
            dev = self.dev[name]
            sd = statistics.stdev(dev) if len(dev) > 1 else float("nan")
            out.append({
                "budget": budget,
                "verifier": name,
                "baseline": baseline,
                "depth": depth,
                "temperature": float(temperature),
                "n_trees": len(self.cps),
                "repeats": repeats,
                "n_calls": len(self.calls[name]),
                "timing": "isolated" if name in isolated else "interleaved",
                "median_us": 1e6 * _median(self.per_tree[name]),
                "mean_us": 1e6 * _mean(self.per_tree[name]),
                "decision_median_us": 1e6 * _median(self.per_tree_dec[name]),
                "commit_median_us": 1e6 * _median(self.per_tree_com[name]),
                "ratio_median": _median([a / b for a, b in zip(self.per_tree[name], base_trees)]),
                "ratio_of_means": _mean(self.per_tree[name]) / base_mean,
                "decision_ratio_median": _median([a / b for a, b in zip(self.per_tree_dec[name],
                                                                        self.per_tree_dec[baseline])]),
                "mean_tau": _mean(taus),
                "tau_se": sd / len(dev) ** 0.5 if dev else float("nan"),
                "expected_tau": 1.0 + _mean(self.cps),
                "mean_cp": _mean(self.cps),
                "mean_tree_size": _mean(self.sizes),
                "tree_us": [1e6 * t for t in self.per_tree[name]],
                **_law_columns(self.law_taus[name], self.law_dev[name]),
            })
        return out


def _law_columns(taus: Sequence[int], dev: Sequence[float]) -> dict:
    """``law_n_calls``, ``law_mean_tau`` and ``law_tau_se`` of one verifier's untimed sample (NaN when
    it has fewer than two calls)."""
    n = len(taus)
    return {"law_n_calls": n, "law_mean_tau": _mean(taus) if n else float("nan"),
            "law_tau_se": statistics.stdev(dev) / n ** 0.5 if n > 1 else float("nan")}


def bigram_drafter(target, block_size: int = 8, sharpen: float = 1.0) -> FixedDrafter:
    """A stand-in drafter with realistic, peaked, context-dependent marginals, for latency runs
    without a trained drafter: row 0 is the target's own next-token log-distribution after the last
    committed token alone (a one-token context), and row k the same after the argmax of row k - 1
    (a greedy bigram chain of the target), scaled by ``sharpen`` (> 1 sharper).

    Rows are computed lazily, one single-token target forward per new token, and cached.

    Args:
        target: Hugging Face causal LM.
        block_size: H, the number of drafted rows.
        sharpen: multiplier of the log-probabilities (> 0).

    Returns:
        :class:`impl.tev.decode.FixedDrafter` (no feature layers).

    Raises:
        ValueError: ``block_size < 1`` or ``sharpen <= 0``.
    """
    if block_size < 1 or not sharpen > 0:
        raise ValueError(f"need block_size >= 1 and sharpen > 0, got {block_size}, {sharpen}")
    device = next(target.parameters()).device

    @functools.lru_cache(maxsize=None)
    def row(tok: int) -> torch.Tensor:
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([[tok]], device=device)).logits[0, -1].float()
        return torch.log_softmax(logits, -1).cpu() * sharpen

    def marginals(n: int, last: int) -> torch.Tensor:
        out, tok = [], int(last)
        for _ in range(block_size):
            r = row(tok)
            out.append(r)
            tok = int(r.argmax())
        return torch.stack(out)

    return FixedDrafter(marginals, block_size=block_size)


class TargetChainDrafter:
    """A stand-in drafter whose marginals are the target's own: row k is the target's next-token
    log-distribution (at ``draft_temperature``) after the committed tokens plus the target's greedy
    continuation of length k. Peaked where the target is, so best-first trees and accepted paths
    have realistic shapes without a trained drafter (for verifier-latency runs only: drafting costs
    H target steps, and :func:`impl.tev.decode.tev_decode` does not call ``draft_tokens``).

    Args:
        target: Hugging Face causal LM.
        block_size: H, the number of drafted rows.
        draft_temperature: divides the target logits (> 0; above 1 flattens the marginals).

    Raises:
        ValueError: ``block_size < 1`` or ``draft_temperature <= 0``.
    """

    feature_layers: list[int] = []

    def __init__(self, target, block_size: int = 8, draft_temperature: float = 1.0):
        if block_size < 1 or not draft_temperature > 0:
            raise ValueError(f"need block_size >= 1 and draft_temperature > 0, got {block_size}, {draft_temperature}")
        self.target, self.block_size, self.draft_temperature = target, int(block_size), float(draft_temperature)
        self.feature_layers = []

    @torch.no_grad()
    def draft_tokens(self, committed: Sequence[int]) -> torch.Tensor:
        """``[H, V]`` log-marginals for the continuation of ``committed`` (its greedy target chain)."""

        device = next(self.target.parameters()).device
        cache = DynamicCache(config=self.target.config)
        ids = torch.tensor([list(committed)], dtype=torch.long, device=device)
        rows = []
        for _ in range(self.block_size):
            logits = self.target(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].float()
            rows.append(torch.log_softmax(logits / self.draft_temperature, -1).cpu())
            ids = logits.argmax().view(1, 1)
        return torch.stack(rows)

    def draft(self, context_features: torch.Tensor, last_token: int) -> torch.Tensor:
        """Not available: this drafter needs the committed token ids (:meth:`draft_tokens`)."""
        raise NotImplementedError("TargetChainDrafter drafts from token ids: use draft_tokens")
