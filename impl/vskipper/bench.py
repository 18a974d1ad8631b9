"""Per-step timing benchmark of the vSkipper arms against FLOP accounting (vSkipper engine issue,
performance section).

What is timed. One *step* is one packed forward laid out as the continuous-batching engine lays out a
batch (several requests packed in the row dimension, a ``[1, 1, T, K]`` additive block mask as the
engine's sdpa/eager path uses, logits only at each request's last row as the engine's
``logits_indices``), the same machinery :func:`impl.vskipper.mode.profile_routed_cost` times:

- a *prefill* cell: ``T`` prompt rows (``T // P`` prompts of ``P`` tokens, no cache, ``K = T`` key
  columns, the kernel reads them all: the engine's dense packed attention);
- a *decode* cell with ``n`` running requests: one row per request, each with ``C`` cached tokens
  (random K/V in a ``DynamicCache``: only shapes matter for time), ``K = n C + n`` key columns.

Arms, timed in rounds (each round a fresh seeded order of the arms, an ``upstream`` step before the
first arm and after every arm), per arm the median over rounds of its paired ratio:

- ``upstream``: the unmodified decoder layers (no wrapper, no router);
- ``upstream_aa``: the same unmodified layers timed as an arm (an A/A control): its ratio is what the
  design measures for no change at all, so it shows the noise and any bias of the pairing itself;
- ``all_run``: routed layers installed with a policy under which every row RUNs (RandomSkip r = 0: the
  router runs, then the all-RUN fast path calls the original layer);
- ``random_r{r}_d{d}``: RandomSkip at each (r, d) of the grid (routed path, every row routed);
- ``flexidepth``: a FlexiDepth skipper (when given; its own routed layers);
- ``hybrid_*``: the same policy under the mode switch (:class:`~impl.vskipper.mode.ModeController`)
  with thresholds from :func:`~impl.vskipper.mode.derive_thresholds` on a routed-cost profile of this
  device: the planner runs inside the timed step and keeps the batch dense when the accounting
  predicts no profit.

Route statistics are off while timing; the first (untimed, always run) warm-up round records each
arm's realised Project-Only share (``RowContext.counts``) and the hybrid's decision.

FLOP accounting (what ``flop_pred_ratio`` predicts). With hidden size ``H``, MLP width ``I``, ``nh``
query heads, ``kvh`` K/V heads of dimension ``hd``, ``L`` layers, vocabulary ``V``, ``T`` query rows,
``K`` key columns each row's attention reads, ``G`` logits rows (one per request), per row and layer

    f_kv   = 4 H kvh hd                      (k_proj + v_proj: paid by every row, Project-Only too)
    f_skip = 4 H nh hd + 4 nh hd K + 6 H I   (q_proj + o_proj, QK^T + PV over K columns, 3-matrix MLP)

and per step

    F_full   = T L (f_kv + f_skip) + 2 H V G     (embedding lookup: 0 FLOPs; norms, rotary, softmax
                                                  and other elementwise work neglected)
    F_routed = F_full - N_po f_skip              (N_po: realised Project-Only (row, layer) pairs)
    flop_pred_ratio = F_routed / F_full.

The measured ratio is the median over rounds of ``t_arm / mean(t_upstream before, t_upstream after)``:
each arm against the upstream steps timed next to it, so the machine's slow drift cancels (an earlier
design, one rotating order with medians of raw times, biased the arms timed late in a round by up to
+-5% on this VM); ``ratio_ci95`` is the t interval of the mean paired ratio. ``wide_model`` builds the wider randomly
initialised model these timings are meant for (timings only: its outputs mean nothing).
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache, LlamaForCausalLM

from impl.models.tiny import TinyArch
from impl.stats import one_sample

from .mode import ModeController, ModeSwitch, _block_mask, derive_thresholds, profile_routed_cost
from .random_skip import RandomSkip
from .routed import RoutedDecoderLayer, RowContext, profile_sections
from .skipper import Phase, RowMeta, Skipper, StaticDepthSkipper

__all__ = [
    "WIDE_ARCH",
    "wide_model",
    "arch_of",
    "flop_costs",
    "flop_pred_ratio",
    "make_cell",
    "step_benchmark",
    "decode_profile",
    "check_targets",
    "DEFAULT_GRID",
]

#: default wide architecture: the tiny models' Llama (12 layers, tied embeddings, 4096 vocabulary,
#: MLP width 2.75 h, sdpa), twice as wide with 64-wide heads
WIDE_ARCH = dict(hidden_size=256, intermediate_size=704, num_layers=12, num_heads=4, vocab_size=4096,
                 max_position_embeddings=4096)
DEFAULT_GRID = tuple((r, d) for r in (0.25, 0.5, 0.75) for d in (0.25, 0.5, 0.75))


def wide_model(*, hidden_size: int = 256, intermediate_size: int = 704, num_layers: int = 12, num_heads: int = 4,
               vocab_size: int = 4096, max_position_embeddings: int = 4096, seed: int = 0,
               dtype: torch.dtype = torch.float32):
    """A randomly initialised Llama of the tiny models' architecture, wider (timings only).

    Deterministic: the weights are a function of the arguments and ``seed`` (``torch.manual_seed``
    around the construction; the caller's global RNG state is restored).

    Returns:
        a ``LlamaForCausalLM`` in eval mode (sdpa attention, tied embeddings).
    """

    arch = TinyArch(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                    intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings)
    cfg = arch.to_hf_config(vocab_size=vocab_size, eos_token_id=0)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype).eval()


def arch_of(model) -> dict:
    """The dimensions the FLOP accounting needs, read from a model's config."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    nh = int(cfg.num_attention_heads)
    return dict(H=int(cfg.hidden_size), I=int(cfg.intermediate_size), L=int(cfg.num_hidden_layers), nh=nh,
                kvh=int(getattr(cfg, "num_key_value_heads", None) or nh),
                hd=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // nh), V=int(cfg.vocab_size))


def flop_costs(arch: dict, *, T: int, K: int, G: int) -> dict:
    """Per-step FLOP terms of the module docstring's accounting.

    Args:
        arch: :func:`arch_of`'s dict (H, I, L, nh, kvh, hd, V).
        T: query rows of the step; K: key columns each row's attention reads; G: logits rows.

    Returns:
        ``f_kv`` and ``f_skip`` (per row per layer), ``lm_head`` and ``F_full`` (per step).
    """
    H, I, L, nh, kvh, hd, V = (arch[k] for k in ("H", "I", "L", "nh", "kvh", "hd", "V"))
    f_kv = 4 * H * kvh * hd
    f_skip = 4 * H * nh * hd + 4 * nh * hd * K + 6 * H * I
    lm_head = 2 * H * V * G
    return dict(f_kv=f_kv, f_skip=f_skip, lm_head=lm_head, F_full=T * L * (f_kv + f_skip) + lm_head)


def flop_pred_ratio(arch: dict, *, T: int, K: int, G: int, n_po: int) -> float:
    """``F_routed / F_full`` = ``1 - n_po f_skip / F_full`` (module docstring)."""
    c = flop_costs(arch, T=T, K=K, G=G)
    return 1.0 - n_po * c["f_skip"] / c["F_full"]


# ----------------------------------------------------------------------------------------------------
# cells: one engine-shaped step each
# ----------------------------------------------------------------------------------------------------
class _Cell:
    """Inputs of one engine-shaped step (see :func:`make_cell`)."""

    def __init__(self, name, phase, ids, pos, mask, meta, logits_idx, T, K, G, cache=None, n_new=0, **info):
        self.name, self.phase, self.ids, self.pos, self.mask, self.meta = name, phase, ids, pos, mask, meta
        self.logits_idx, self.T, self.K, self.G, self.cache, self.n_new = logits_idx, T, K, G, cache, n_new
        self.info = info


def make_cell(model, phase: str, *, tokens: int = 2048, prompt_len: int = 256, requests: int = 32,
              context: int = 128, seed: int = 0) -> _Cell:
    """Build the inputs of one cell.

    Args:
        phase: ``"prefill"`` (``tokens // prompt_len`` prompts of ``prompt_len`` tokens packed) or
            ``"decode"`` (``requests`` rows, each request with ``context`` cached tokens).

    Raises:
        ValueError: for an unknown phase or sizes < 1.
    """
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    a = arch_of(model)
    gen = torch.Generator().manual_seed(seed)
    if phase == "prefill":
        P = int(prompt_len)
        n_req = int(tokens) // P
        if P < 1 or n_req < 1:
            raise ValueError(f"prefill cell needs tokens >= prompt_len >= 1, got {tokens}, {prompt_len}")
        T = n_req * P
        ids = torch.randint(a["V"], (1, T), generator=gen).to(device)
        pos = torch.arange(P, device=device).repeat(n_req)[None]
        mask = _block_mask([(r * P, None) for r in range(n_req) for _ in range(P)], T, list(range(T)), dtype, device)
        meta = RowMeta.concat([RowMeta.for_sequence(f"b{r}", 0, P, prompt_len=P, device=device) for r in range(n_req)])
        idx = torch.tensor([r * P + P - 1 for r in range(n_req)], device=device)
        return _Cell(f"prefill_{T}", "prefill", ids, pos, mask, meta, idx, T, T, n_req, requests=n_req,
                     prompt_len=P, tokens=T)
    if phase == "decode":
        n, C = int(requests), int(context)
        if n < 1 or C < 1:
            raise ValueError(f"decode cell needs requests >= 1 and context >= 1, got {n}, {C}")
        K0 = n * C
        cache = DynamicCache(config=model.config)
        for li in range(a["L"]):
            k = torch.randn(1, a["kvh"], K0, a["hd"], generator=gen).to(device=device, dtype=dtype)
            v = torch.randn(1, a["kvh"], K0, a["hd"], generator=gen).to(device=device, dtype=dtype)
            cache.update(k, v, li)
        ids = torch.randint(a["V"], (1, n), generator=gen).to(device)
        pos = torch.full((1, n), C, dtype=torch.long, device=device)
        mask = _block_mask([(r * C, K0 + r) for r in range(n)], K0 + n, [r * C + C - 1 for r in range(n)], dtype,
                           device)
        meta = RowMeta.concat([RowMeta.for_sequence(f"b{r}", C, 1, prompt_len=C, device=device) for r in range(n)])
        idx = torch.arange(n, device=device)
        return _Cell(f"decode_{n}", "decode", ids, pos, mask, meta, idx, n, K0 + n, n, cache=cache, n_new=n,
                     requests=n, context=C, tokens=n)
    raise ValueError(f"unknown phase {phase!r} (prefill or decode)")


@torch.no_grad()
def _run_step(model, cell: _Cell, ctx: RowContext | None, planner=None) -> None:
    kw = dict(input_ids=cell.ids, position_ids=cell.pos, attention_mask=cell.mask, logits_to_keep=cell.logits_idx)
    if cell.cache is not None:
        kw.update(cache=cell.cache, use_cache=True)
    try:
        if ctx is None:
            model(**kw)
        else:
            meta = cell.meta if planner is None else planner(cell.meta, ctx)
            with ctx.rows(meta):
                model(**kw)
        if cell.ids.device.type == "cuda":  # the step's time includes its kernels
            torch.cuda.synchronize(cell.ids.device)
    finally:
        if cell.cache is not None:
            cell.cache.crop(-cell.n_new)


# ----------------------------------------------------------------------------------------------------
# arms: layer sets swapped in and out of the model between timed steps
# ----------------------------------------------------------------------------------------------------
class _Arm:
    def __init__(self, name, kind, layers, ctx=None, skipper=None, planner_factory=None, **info):
        self.name, self.kind, self.layers, self.ctx, self.skipper = name, kind, layers, ctx, skipper
        self.planner_factory, self.info = planner_factory, info
        self.planner = None


def _wrap(orig: Sequence, skipper: Skipper, ctx: RowContext) -> list:
    return [RoutedDecoderLayer(m, i, skipper, ctx) if i in skipper.routed_layers else m for i, m in enumerate(orig)]


@contextmanager
def _layers_of(model, layers: Sequence):
    ml = model.model.layers
    saved = list(ml)
    try:
        for i, m in enumerate(layers):
            ml[i] = m
        yield
    finally:
        for i, m in enumerate(saved):
            ml[i] = m


@torch.no_grad()
def route_bookkeeping(model, cell: _Cell, layers: Sequence, ctx: RowContext, *, steps: int = 3) -> float:
    """Seconds per step the routed wrappers add around the layers they wrap (the routing bookkeeping of
    an arm: row checks, the route tape, cohort gathers and scatters), measured with forward hooks:
    the sum over routed layers of (wrapper span - wrapped layer span), median over ``steps`` steps.

    Unlike the step ratio, this does not difference two noisy step times: on the all-RUN arm it is the
    overhead the all-RUN target bounds (vSkipper Sec. 3.1: an all-RUN layer takes the dense path), to
    within the hooks' own few microseconds per layer.

    Args:
        cell: the step's inputs (:func:`make_cell`).
        layers: the arm's layer list (its :class:`RoutedDecoderLayer` entries are measured).
        ctx: the arm's :class:`RowContext`.

    Returns:
        seconds per step (0.0 when the arm has no routed layer).
    """
    wrappers = [m for m in layers if isinstance(m, RoutedDecoderLayer)]
    if not wrappers:
        return 0.0
    acc: dict[str, float] = {}
    handles = _time_spans(acc, [(w, "outer") for w in wrappers] + [(w.layer, "inner") for w in wrappers])
    per_step = []
    try:
        with _layers_of(model, layers):
            for _ in range(max(1, steps)):
                acc.clear()
                _run_step(model, cell, ctx)
                per_step.append(acc.get("outer", 0.0) - acc.get("inner", 0.0))
    finally:
        for h in handles:
            h.remove()
    return statistics.median(per_step)


def _time_spans(acc: dict[str, float], spans: Iterable[tuple[torch.nn.Module, str]]) -> list:
    """Forward pre / post hooks that add each call's wall time [s] of every ``(module, key)`` of ``spans``
    to ``acc[key]``; returns the hook handles (the caller removes them)."""
    t0: dict[int, float] = {}
    handles = []
    for mod, key in spans:
        def pre(m, args):
            t0[id(m)] = time.perf_counter()

        def post(m, args, out, key=key):
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0[id(m)]
        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


def _mean_ci(xs: Sequence[float], level: float = 0.95) -> list[float] | None:
    """Student-t interval of the mean of ``xs`` (:func:`impl.stats.one_sample`; None with fewer than two
    values)."""
    if len(xs) < 2:
        return None
    res = one_sample(list(xs), confidence=level)
    return [res.ci_low, res.ci_high]


def _share(ctx: RowContext, phase: int) -> tuple[int, int]:
    run = po = 0
    for (_, ph), (r, p) in ctx.counts.items():
        if ph == phase:
            run, po = run + r, po + p
    return run, po


def step_benchmark(
    model,
    cells: Iterable[dict],
    *,
    routed_layers: Sequence[int] | None = None,
    grid: Sequence[tuple[float, float]] = DEFAULT_GRID,
    skipper_factory: Callable[[Sequence[int], float, float], Skipper] | None = None,
    flexidepth: Skipper | None = None,
    hybrid: bool = True,
    thresholds: dict | None = None,
    profile_kw: dict | None = None,
    repeats: int = 5,
    warmup: int = 1,
    cell_budget_s: float = 0.0,
    max_repeats: int = 50,
    target_budget_s: float = 0.0,
    target_max_repeats: int = 40,
    seed: int = 0,
    label: str = "",
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Time engine-shaped steps of every arm in every cell (module docstring).

    Args:
        model: a Llama / Qwen3-family causal LM with sdpa or eager attention, no skipper bound.
        cells: dicts ``{"phase": "prefill", "tokens": T, "prompt_len": P}`` or
            ``{"phase": "decode", "requests": n, "context": C}``.
        routed_layers: the RandomSkip routed layers (default: the last half, as FlexiDepth routes).
        grid: RandomSkip (r, d) pairs.
        skipper_factory: ``(routed_layers, r, d) -> Skipper`` (default: ``RandomSkip(.., seed=seed)``).
        flexidepth: optional FlexiDepth skipper (its own routed layers), timed as arm ``flexidepth``
            (and ``hybrid_flexidepth``; its share for the switch is the realised one of the cell).
        hybrid: also time the mode-switch arms.
        thresholds: a routed-cost profile (:func:`profile_routed_cost`'s output) to derive the switch's
            thresholds from; default: profile here with ``profile_kw``.
        repeats, warmup: timed rounds (median) and untimed warm-up rounds (the first, which records the
            shares, always runs); rounds are paired (module docstring).
        cell_budget_s: seconds of timed steps per cell: after ``repeats`` rounds, rounds go on until the
            cell's timed steps add up to this (short decode steps get many rounds, a long prefill step
            ``repeats``), at most ``max_repeats`` rounds; 0: exactly ``repeats``.
        target_budget_s, target_max_repeats: after those rounds, further paired rounds of the all-RUN arm and
            the A/A control alone (``U A U C U``), until their timed steps add up to ``target_budget_s``
            seconds or ``target_max_repeats`` rounds: the all-RUN target's tolerance (2%) is tighter than a
            round of every arm can resolve on a long prefill step (0: none). Their paired ratios join the
            arms' (``focus_repeats`` counts them).
        seed: seed of the inputs and of the default RandomSkip.
        label: copied into every row (e.g. the model's name).
        log: optional progress callback.

    Returns:
        one plain dict per (cell, arm): ``label``, ``cell``, ``phase``, ``arm``, ``kind``, ``r``, ``d``,
        sizes (``T``, ``K``, ``G``, ``requests``, ``context``/``prompt_len``), ``t_step_s`` (median),
        ``t_steps_s`` (all), ``t_upstream_s``, ``measured_ratio`` (median paired ratio), ``paired_ratios``,
        ``ratio_ci95``, ``skip_share`` (realised Project-Only
        share over routed (row, routed layer) pairs; NaN when none was routed), ``routed_rows_share``,
        ``n_po`` (Project-Only (row, layer) pairs per step), ``flop_pred_ratio``, ``abs_gap``
        (|measured - predicted|), ``hybrid_routed`` (hybrid arms), ``policy_share`` (expected share);
        the ``all_run`` rows also ``route_bookkeeping_s`` / ``route_bookkeeping_share`` (what the
        wrappers add per step, :func:`route_bookkeeping`, and its share of the upstream step).
    """
    say = log or (lambda s: None)
    L = int(arch_of(model)["L"])
    layers = list(routed_layers) if routed_layers is not None else list(range(L // 2, L))
    factory = skipper_factory or (lambda rl, r, d: RandomSkip(rl, r=r, d=d, seed=seed))
    param = next(model.parameters())
    a = arch_of(model)
    cells = [dict(c) for c in cells]

    profile = thresholds
    if hybrid and profile is None:
        pk = dict(profile_kw or {})
        prof_sk = factory(layers, 0.5, 0.5)
        say("profiling routed cost for the switch thresholds")
        profile = profile_routed_cost(model, prof_sk, seed=seed, **pk)

    orig = list(model.model.layers)
    arms: list[_Arm] = [_Arm("upstream", "upstream", orig), _Arm("upstream_aa", "control", orig)]
    ctx0 = RowContext(record_stats=False)
    arms.append(_Arm("all_run", "all_run", _wrap(orig, factory(layers, 0.0, 0.0), ctx0), ctx0, r=0.0, d=0.0,
                     policy_share=0.0))
    policies = []
    for r, d in grid:
        sk = factory(layers, float(r), float(d)).to(device=param.device)
        policies.append((f"random_r{r:g}_d{d:g}", sk, dict(r=float(r), d=float(d),
                                                            policy_share=float(getattr(sk, "skip_ratio", r * d)))))
    if flexidepth is not None:
        policies.append(("flexidepth", flexidepth.to(device=param.device, dtype=param.dtype).eval(), {}))
    for name, sk, info in policies:
        c = RowContext(record_stats=False)
        arms.append(_Arm(name, "routed", _wrap(orig, sk, c), c, sk, **info))
    if hybrid:
        for name, sk, info in policies:
            c = RowContext(record_stats=False)
            arms.append(_Arm(f"hybrid_{name}", "hybrid", _wrap(orig, sk, c), c, sk, base=name, **info))

    rows: list[dict] = []
    try:
        for spec in cells:
            cell = make_cell(model, seed=seed, **spec)
            ph = int(Phase.PREFILL if cell.phase == "prefill" else Phase.DECODE)
            say(f"cell {cell.name}: T={cell.T} K={cell.K}")
            # first warm-up round (untimed, always run): realised shares and the hybrid's decision
            shares = {}
            for arm in arms:
                if arm.kind == "hybrid":
                    base = shares[arm.info["base"]]
                    pol = base["share"] if math.isfinite(base["share"]) else 0.0
                    thr = derive_thresholds(profile, {"prefill": pol, "decode": pol})
                    arm.planner = ModeController(ModeSwitch.from_thresholds(thr, initial_share=pol))
                    arm.info["thresholds"] = {k: thr[k] for k in ("min_prefill_tokens", "min_skip_share",
                                                                  "enter_threshold", "decode_min_skip_share")}
                with _layers_of(model, arm.layers):
                    if arm.ctx is None:
                        _run_step(model, cell, None)
                        shares[arm.name] = dict(share=float("nan"), n_po=0, routed_rows=0.0)
                        continue
                    arm.ctx.record_stats = True
                    arm.ctx.reset_stats()
                    meta = cell.meta if arm.planner is None else arm.planner.plan(cell.meta)
                    with arm.ctx.rows(meta):
                        _run_step(model, cell, None)
                    arm.ctx.record_stats = False
                    run, po = _share(arm.ctx, ph)
                    n_layers = max(1, sum(isinstance(m, RoutedDecoderLayer) for m in arm.layers))
                    shares[arm.name] = dict(share=po / (run + po) if run + po else float("nan"), n_po=po,
                                            routed_rows=(run + po) / n_layers / cell.T)
                    if arm.planner is not None:  # a fresh controller, same decision, for the timed steps
                        arm.planner = ModeController(arm.planner.switch)
            # timed rounds, paired: each round times the arms in a fresh seeded order with an upstream
            # step before the first arm and after every arm (U A U B U ...); an arm's ratio in the round
            # is its time over the mean of the two upstream steps around it, so slow drift of the
            # machine (other tenants, frequency) cancels instead of biasing the arms timed late in a round
            others = [arm for arm in arms if arm.kind != "upstream"]
            up_arm = arms[0]
            times = {arm.name: [] for arm in arms}
            paired = {arm.name: [] for arm in others}
            order_gen = torch.Generator().manual_seed(seed + 7919 * len(rows))
            extra_warmup = max(0, warmup - 1)  # the stats round above is the first warm-up round

            def timed(arm) -> float:
                with _layers_of(model, arm.layers):
                    t0 = time.perf_counter()
                    _run_step(model, cell, arm.ctx, arm.planner)
                    return time.perf_counter() - t0

            def paired_round(group, keep: bool) -> float:
                """One round U g1 U g2 U ... over ``group`` in a seeded random order; each arm's step is
                paired with the mean of its two upstream neighbours. Returns the counted seconds (0 when
                not kept: a warm-up round)."""
                spent_r = 0.0
                t_prev = timed(up_arm)
                if keep:
                    times[up_arm.name].append(t_prev)
                for j in torch.randperm(len(group), generator=order_gen).tolist():
                    arm = group[j]
                    dt = timed(arm)
                    t_next = timed(up_arm)
                    if keep:
                        spent_r += dt + t_next
                        times[arm.name].append(dt)
                        times[up_arm.name].append(t_next)
                        paired[arm.name].append(dt / (0.5 * (t_prev + t_next)))
                    t_prev = t_next
                return spent_r

            spent, n_rounds = 0.0, 0
            for rnd in range(extra_warmup + max(1, repeats, int(max_repeats))):
                if rnd >= extra_warmup + max(1, repeats) and spent >= cell_budget_s:
                    break
                keep = rnd >= extra_warmup
                n_rounds += keep
                spent += paired_round(others, keep)
            # precision rounds for the 2% targets: the all-RUN arm and the A/A control alone, paired as above
            focus = [arm for arm in others if arm.kind in ("all_run", "control")]
            spent_f, n_focus = 0.0, 0
            while focus and spent_f < target_budget_s and n_focus < target_max_repeats:
                spent_f += paired_round(focus, True)
                n_focus += 1
            t_up = statistics.median(times["upstream"])
            bookkeeping = {arm.name: route_bookkeeping(model, cell, arm.layers, arm.ctx) for arm in arms
                           if arm.kind == "all_run"}
            for arm in arms:
                t = statistics.median(times[arm.name])
                sh = shares[arm.name]
                pred = flop_pred_ratio(a, T=cell.T, K=cell.K, G=cell.G, n_po=sh["n_po"])
                ratios = paired.get(arm.name) or [1.0]
                meas = statistics.median(ratios)
                row = dict(label=label, cell=cell.name, phase=cell.phase, arm=arm.name, kind=arm.kind,
                           r=arm.info.get("r"), d=arm.info.get("d"), policy_share=arm.info.get("policy_share"),
                           T=cell.T, K=cell.K, G=cell.G, **cell.info, n_routed_layers=len(layers),
                           t_step_s=t, t_steps_s=times[arm.name], t_upstream_s=t_up, measured_ratio=meas,
                           paired_ratios=ratios if arm.kind != "upstream" else [],
                           ratio_ci95=_mean_ci(ratios) if arm.kind != "upstream" else None,
                           skip_share=sh["share"], routed_rows_share=sh["routed_rows"], n_po=sh["n_po"],
                           flop_pred_ratio=pred, abs_gap=abs(meas - pred), repeats=n_rounds,
                           focus_repeats=n_focus if arm in focus else 0, threads=torch.get_num_threads())
                if arm.name in bookkeeping:
                    row.update(route_bookkeeping_s=bookkeeping[arm.name],
                               route_bookkeeping_share=bookkeeping[arm.name] / t_up)
                if arm.kind == "hybrid":
                    row.update(hybrid_routed=sh["routed_rows"] > 0, base=arm.info["base"],
                               thresholds=arm.info["thresholds"])
                rows.append(row)
            say(f"  {cell.name}: " + ", ".join(f"{r['arm']}={r['measured_ratio']:.3f}/{r['flop_pred_ratio']:.3f}"
                                                for r in rows if r["cell"] == cell.name))
    finally:
        for i, m in enumerate(orig):
            model.model.layers[i] = m
    return rows


# ----------------------------------------------------------------------------------------------------
# where decode time goes
# ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def decode_profile(model, *, requests: int = 32, context: int = 128, routed_layers: Sequence[int] | None = None,
                   arms: Sequence[tuple[float, float]] = ((0.0, 0.0), (0.5, 0.5), (0.75, 0.75)), steps: int = 3,
                   seed: int = 0, label: str = "") -> list[dict]:
    """Coarse split of a decode step's time (forward hooks with wall-clock timers; separate from the
    headline timings because the hooks add a little overhead).

    Categories per step (seconds, median over ``steps``): ``kv_proj`` (k_proj + v_proj), ``qo_proj``
    (q_proj + o_proj), ``mlp``, ``cache_update`` (the cache's ``update``: the K/V write, which for the
    ``DynamicCache`` concatenates, i.e. copies, the whole cache per layer), ``attention_other`` (rest of
    the decoder layers: sdpa over the packed K columns, rotary, norms, routing, cohort gather /
    scatter), ``lm_head``, ``other`` (embedding, final norm, mask handling, Python).

    Args:
        arms: RandomSkip (r, d) pairs; (0, 0) is the routed all-RUN arm; ``upstream`` is always added.

    Returns:
        one dict per arm with the categories, ``total_s`` and ``shares`` (fractions of total).
    """
    L = int(arch_of(model)["L"])
    layers = list(routed_layers) if routed_layers is not None else list(range(L // 2, L))
    cell = make_cell(model, "decode", requests=requests, context=context, seed=seed)
    orig = list(model.model.layers)
    acc: dict[str, float] = {}
    spans = [(model.lm_head, "lm_head")]
    for m in orig:
        at = m.self_attn
        spans += [(at.k_proj, "kv_proj"), (at.v_proj, "kv_proj"), (at.q_proj, "qo_proj"), (at.o_proj, "qo_proj"),
                  (m.mlp, "mlp")]
    handles = _time_spans(acc, spans)
    cache = cell.cache
    orig_update = cache.update

    def timed_update(*a, **k):
        t = time.perf_counter()
        try:
            return orig_update(*a, **k)
        finally:
            acc["cache_update"] = acc.get("cache_update", 0.0) + time.perf_counter() - t

    arm_list = [("upstream", orig, None)]
    for r, d in arms:
        c = RowContext(record_stats=False)
        arm_list.append((f"random_r{r:g}_d{d:g}" if r > 0 else "all_run",
                         _wrap(orig, RandomSkip(layers, r=r, d=d, seed=seed), c), c))
    out = []
    try:
        cache.update = timed_update
        for name, lay, c in arm_list:
            per = []
            with _layers_of(model, lay):
                # layer totals: hook the modules in the layer slots (wrapper or original)
                lh = _time_spans(acc, [(m, "layers") for m in model.model.layers])
                try:
                    for s in range(steps + 1):
                        acc.clear()
                        t = time.perf_counter()
                        _run_step(model, cell, c)
                        tot = time.perf_counter() - t
                        if s:
                            per.append(dict(acc, total=tot))
                finally:
                    for h in lh:
                        h.remove()
            med = {k: statistics.median(p.get(k, 0.0) for p in per) for k in per[0]}
            known = med.get("kv_proj", 0) + med.get("qo_proj", 0) + med.get("mlp", 0) + med.get("cache_update", 0)
            cats = dict(kv_proj=med.get("kv_proj", 0.0), qo_proj=med.get("qo_proj", 0.0), mlp=med.get("mlp", 0.0),
                        cache_update=med.get("cache_update", 0.0),
                        attention_other=max(0.0, med.get("layers", 0.0) - known), lm_head=med.get("lm_head", 0.0))
            cats["other"] = max(0.0, med["total"] - med.get("layers", 0.0) - cats["lm_head"])
            out.append(dict(label=label, cell=cell.name, arm=name, requests=int(requests), context=int(context),
                            K=cell.K, total_s=med["total"], **{f"{k}_s": v for k, v in cats.items()},
                            shares={k: v / med["total"] for k, v in cats.items()},
                            method="forward hooks (wall clock), median of steps"))
    finally:
        for h in handles:
            h.remove()
        del cache.update
        for i, m in enumerate(orig):
            model.model.layers[i] = m
    return out


# ----------------------------------------------------------------------------------------------------
# where routed prefill time goes (torch profiler)
# ----------------------------------------------------------------------------------------------------
#: operator -> category of :func:`prefill_profile` (self CPU time; an operator not listed is
#: ``elementwise`` when it is an aten operator, ``other`` otherwise)
OP_CATEGORIES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"),
    "attention": ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_attention_math", "aten::_softmax", "aten::softmax"),
    "gather_scatter": ("aten::index", "aten::index_select", "aten::index_copy", "aten::index_copy_",
                       "aten::nonzero", "aten::masked_select", "aten::gather", "aten::scatter_", "aten::index_put_"),
    "copies": ("aten::copy_", "aten::clone", "aten::cat", "aten::contiguous", "aten::_to_copy", "aten::to",
               "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::resize_", "aten::fill_", "aten::zero_"),
}
_OP_CATEGORY = {op: cat for cat, ops in OP_CATEGORIES.items() for op in ops}
#: the routed layer's section labels (:func:`impl.vskipper.routed.profile_sections`)
SECTIONS = ("route", "kv", "gather", "q_proj", "attention", "o_proj", "mlp", "scatter", "project")


def _op_category(name: str) -> str:
    return _OP_CATEGORY.get(name, "elementwise" if name.startswith("aten::") else "other")


@torch.no_grad()
def prefill_profile(model, *, tokens: int = 2048, prompt_len: int = 256, routed_layers: Sequence[int] | None = None,
                    arms: Sequence[tuple[float, float]] = ((0.5, 0.5),), steps: int = 2, seed: int = 0,
                    label: str = "") -> list[dict]:
    """Where a packed prefill step's time goes, dense vs routed (vSkipper Sec. 3.1; torch profiler).

    Arms: ``upstream`` (the original layers), ``cohort_all_run`` (every row RUNs through the cohort path:
    what gathering, masking and scattering cost with nothing skipped) and RandomSkip ``(r, d)`` arms.
    Each arm runs one untimed step, then ``steps`` steps under :class:`torch.profiler.profile` (CPU
    activity) with the routed sections labelled (:func:`~impl.vskipper.routed.profile_sections`).

    Returns:
        one dict per arm: ``wall_s`` (mean step wall time, profiler on), ``ops_ms`` (self CPU ms per step
        by operator category: ``matmul``, ``attention``, ``gather_scatter``, ``copies``, ``elementwise``,
        ``other``), ``sections_ms`` (inclusive CPU ms per step of each routed section summed over the
        routed layers; empty for upstream), ``top_ops`` (the 12 operators of most self time, ms per
        step), the FLOP prediction ``flop_pred_ratio`` and the realised ``skip_share``.
    """

    a = arch_of(model)
    L = int(a["L"])
    layers = list(routed_layers) if routed_layers is not None else list(range(L // 2, L))
    cell = make_cell(model, "prefill", tokens=tokens, prompt_len=prompt_len, seed=seed)
    orig = list(model.model.layers)
    arm_list: list[tuple[str, list, RowContext | None, Skipper | None]] = [("upstream", orig, None, None)]
    c0 = RowContext(record_stats=False)
    cohort = [RoutedDecoderLayer(m, i, StaticDepthSkipper(layers, n_run=len(layers)), c0, fast_path=False)
              if i in layers else m for i, m in enumerate(orig)]
    arm_list.append(("cohort_all_run", cohort, c0, None))
    for r, d in arms:
        c = RowContext(record_stats=False)
        sk = RandomSkip(layers, r=float(r), d=float(d), seed=seed)
        arm_list.append((f"random_r{r:g}_d{d:g}", _wrap(orig, sk, c), c, sk))
    out = []
    try:
        for name, lay, ctx, sk in arm_list:
            with _layers_of(model, lay):
                n_po = 0
                if ctx is not None:  # the realised share, from one recorded step
                    ctx.record_stats = True
                    ctx.reset_stats()
                    _run_step(model, cell, ctx)
                    ctx.record_stats = False
                    n_po = _share(ctx, int(Phase.PREFILL))[1]
                    share = ctx.skip_ratio(int(Phase.PREFILL))
                else:
                    _run_step(model, cell, None)
                    share = float("nan")
                with profile(activities=[ProfilerActivity.CPU]) as prof, profile_sections():
                    t = time.perf_counter()
                    for _ in range(steps):
                        _run_step(model, cell, ctx)
                    wall = (time.perf_counter() - t) / steps
            ops: dict[str, float] = {}
            secs: dict[str, float] = {}
            per_op = []
            for ev in prof.key_averages():
                if ev.key.startswith("vsk::"):
                    secs[ev.key[5:]] = secs.get(ev.key[5:], 0.0) + ev.cpu_time_total / 1e3 / steps
                    continue
                ms = ev.self_cpu_time_total / 1e3 / steps
                cat = _op_category(ev.key)
                ops[cat] = ops.get(cat, 0.0) + ms
                per_op.append((ms, ev.key))
            per_op.sort(reverse=True)
            out.append(dict(label=label, cell=cell.name, arm=name, T=cell.T, prompt_len=int(prompt_len),
                            n_routed_layers=len(layers), wall_s=wall, steps=int(steps),
                            ops_ms={k: round(v, 3) for k, v in sorted(ops.items())},
                            sections_ms={k: round(secs[k], 3) for k in SECTIONS if k in secs},
                            top_ops=[{"op": k, "ms": round(v, 3)} for v, k in per_op[:12]],
                            skip_share=share, n_po=n_po,
                            flop_pred_ratio=flop_pred_ratio(a, T=cell.T, K=cell.K, G=cell.G, n_po=n_po),
                            threads=torch.get_num_threads(), method="torch.profiler (CPU), self time per operator"))
        up = out[0]["wall_s"]
        for row in out:
            row["measured_ratio"] = row["wall_s"] / up
    finally:
        for i, m in enumerate(orig):
            model.model.layers[i] = m
    return out


# ----------------------------------------------------------------------------------------------------
# targets
# ----------------------------------------------------------------------------------------------------
def check_targets(rows: Sequence[dict], *, all_run_tol: float = 0.02, prefill_gap: float = 0.05,
                  hybrid_tol: float = 0.02, min_prefill_tokens: int = 2048) -> dict:
    """The issue's targets over the rows of one model, as PASS / FAIL fields, each with what the rows'
    95% intervals (``ratio_ci95``) resolve.

    - ``all_run``: every cell's ``all_run`` measured ratio <= 1 + ``all_run_tol``;
    - ``prefill_flop``: in every prefill cell with >= ``min_prefill_tokens`` rows, every RandomSkip arm's
      |measured - FLOP prediction| <= ``prefill_gap`` (NA when there is no such cell);
    - ``hybrid_dense``: every hybrid arm the switch kept dense (no routed row) has measured ratio
      <= 1 + ``hybrid_tol`` (NA when the switch routed every hybrid arm).

    Returns:
        dict with ``<target>`` ("PASS" / "FAIL" / "NA", from the medians), ``<target>_worst`` (the worst
        value), ``<target>_n`` (how many rows were checked) and ``<target>_ci``: "within" when every row's
        interval lies inside the tolerance, "outside" when some row's interval lies wholly outside it,
        "unresolved" otherwise (or when a row has no interval), None for NA; ``aa_control_worst``: the
        A/A control's ratio - 1 farthest from 0 (what "no change" measured), ``aa_control_n``;
        ``all_run_bookkeeping_worst``: the all-RUN arm's largest routing-bookkeeping share of a step.
    """
    out: dict = {}

    def verdict(name, sel, value, lo_hi, ok):
        vals = [value(r) for r in sel]
        out[f"{name}_n"] = len(vals)
        out[f"{name}_worst"] = max(vals) if vals else None
        out[name] = "NA" if not vals else ("PASS" if ok(max(vals)) else "FAIL")
        if not vals:
            out[f"{name}_ci"] = None
            return
        bounds = [lo_hi(r) if r.get("ratio_ci95") else None for r in sel]
        if any(b is not None and b[0] > 0 for b in bounds):  # wholly outside the tolerance band
            out[f"{name}_ci"] = "outside"
        elif all(b is not None and b[1] <= 0 for b in bounds):
            out[f"{name}_ci"] = "within"
        else:
            out[f"{name}_ci"] = "unresolved"

    # each lo_hi maps a row's interval to (distance past the tolerance at its nearest end, at its farthest end)
    def over(tol):  # a ratio bounded above by 1 + tol
        return lambda r: (r["ratio_ci95"][0] - 1 - tol, r["ratio_ci95"][1] - 1 - tol)

    def gap_bounds(r):  # |ratio - prediction| bounded by prefill_gap
        lo, hi = (x - r["flop_pred_ratio"] for x in r["ratio_ci95"])
        return max(lo - prefill_gap, -prefill_gap - hi), max(abs(lo), abs(hi)) - prefill_gap

    all_run = [r for r in rows if r["arm"] == "all_run"]
    verdict("all_run", all_run, lambda r: r["measured_ratio"] - 1, over(all_run_tol), lambda w: w <= all_run_tol)
    pre = [r for r in rows if r["phase"] == "prefill" and r["kind"] == "routed" and r.get("r") is not None
           and r["T"] >= min_prefill_tokens]
    verdict("prefill_flop", pre, lambda r: r["abs_gap"], gap_bounds, lambda w: w <= prefill_gap)
    dense = [r for r in rows if r["kind"] == "hybrid" and not r["hybrid_routed"]]
    verdict("hybrid_dense", dense, lambda r: r["measured_ratio"] - 1, over(hybrid_tol), lambda w: w <= hybrid_tol)
    book = [r["route_bookkeeping_share"] for r in all_run if r.get("route_bookkeeping_share") is not None]
    out["all_run_bookkeeping_worst"] = max(book) if book else None
    aa = [r for r in rows if r["kind"] == "control"]  # the A/A control: no verdict, its worst ratio
    out["aa_control_n"] = len(aa)
    out["aa_control_worst"] = max((r["measured_ratio"] - 1 for r in aa), key=abs, default=None)
    out["targets"] = dict(all_run_tol=all_run_tol, prefill_gap=prefill_gap, hybrid_tol=hybrid_tol,
                          min_prefill_tokens=min_prefill_tokens)
    return out
