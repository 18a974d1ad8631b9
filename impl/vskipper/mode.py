"""Profitability-aware mode switching (vSkipper Sec. 3.3) and the profile that sets its thresholds.

**Modes.** Each request has a mode per phase (Sec. 3 "Vocabulary"): *dense* runs the unmodified
engine forward without consulting the router, *routed* lets the skipper decide RUN / Project-Only per
row. A batch that mixes modes runs the routed path with the dense rows taking RUN
(``RowMeta.routed = False``); a batch whose rows are all dense runs the original layers.

**The switch** (:class:`ModeSwitch` is the configuration, :class:`ModeController` the host-side state
machine that the engine calls once per batch as the row context's planner):

- *Prefill* mode is fixed at admission. A batch that admits new requests (their first prompt rows)
  routes them when it holds at least ``min_prefill_tokens`` prompt rows and the estimated Project-Only
  share exceeds ``min_skip_share``; later chunks of a request keep its mode. The share is *probed*:
  the first eligible admission batch, and then the first eligible one at least ``probe_every``
  admitted batches after the previous probe, runs routed and its realised prefill Project-Only share
  (from the routed layers' counters) becomes the estimate. Paper profile values: 1536 tokens, 0.35,
  every 64 admitted batches.
- *Decode* mode is set when a request's first decode row is scheduled: routed iff the decode load
  (the number of requests with decode rows in the batch, i.e. running decode requests) is at least
  ``enter_threshold``. A dense request is *promoted* once to routed in the first batch whose load
  reaches ``enter_threshold``; a routed request never reverts.
- Overrides: ``always_route`` (the switch disabled: every phase routed), ``never_route`` (every phase
  dense). Mechanism ablations (Sec. 4.2, Table 3): ``route_prefill=False`` (decode-only routing),
  ``route_decode=False`` (prefill-only routing), ``promote=False`` (no promotion); see
  :meth:`ModeSwitch.ablation`.

Routes stay a pure function of the row *within* a mode; a request's mode is recorded by request id,
so a re-prefill after a soft reset keeps it, and the mode keys prefix reuse (block sharing must be
off while the switch runs).

**The threshold rule** (:func:`derive_thresholds`). :func:`profile_routed_cost` measures, on the current
device, a dense step, a routed step in which no row skips (every row RUNs through the cohort path and
the skipper's router still runs: the routed mode's fixed cost), and a routed step in which every row
skips every routed layer, for a few batch sizes per phase (packed plain-PyTorch forwards shaped like
the engine's batches). It fits, per phase,

    fixed(n)  = t_routed,0-skip(n) - t_dense(n)              ~ a + b n          (seconds per step)
    saving(n) = t_routed,0-skip(n) - t_routed,all-skip(n)    ~ c n n_routed     (c: s per row per layer)

so a routed step with Project-Only share s is predicted at ``t_dense + a + b n - c n_routed s n``.
Routing pays iff ``c n_routed s n > a + b n``. The rule takes the share guard as a fixed fraction of
the policy's profiled share, ``S = share_slack * s_policy`` (default 0.7: with FlexiDepth's ~0.5
share on its 16 routed layers this is the paper's 0.35), and the size threshold as the break-even size
at that guard, ``N = ceil(margin * a / (c n_routed S - margin * b))``, so that every batch with at
least N rows and share at least S is predicted profitable (the two conditions are jointly sufficient,
as Sec. 3.3 states). N is ``min_prefill_tokens`` for prefill (rows = prompt tokens) and
``enter_threshold`` for decode (rows = running decode requests at the profiled context length). When
``c n_routed S <= margin * b`` no size pays and the phase stays dense (threshold None / infinity).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from transformers import DynamicCache

from ..sections import strict_value
from .engine import bind_skipper, generate_greedy, unbind_skipper
from .routed import RoutedDecoderLayer, routed_context
from .skipper import Phase, RowMeta, Skipper

__all__ = [
    "ModeSwitch",
    "ModeController",
    "ABLATIONS",
    "generate_with_switch",
    "profile_routed_cost",
    "derive_thresholds",
    "packed_forward",
]

#: names accepted by :meth:`ModeSwitch.ablation` (the served hybrid and the mechanism ablations)
ABLATIONS = ("served", "always-route", "never-route", "prefill-only", "decode-only", "no-promotion")


#: the thresholds that may be ``math.inf`` (None in JSON)
_INF_FIELDS = ("min_prefill_tokens", "enter_threshold")


def _finite_or_none(x):
    return None if x is None or (isinstance(x, float) and math.isinf(x)) else x


@dataclass(frozen=True)
class ModeSwitch:
    """Configuration of the profitability-aware mode switch (Sec. 3.3). Thresholds may be ``math.inf``
    (never reached).

    Attributes:
        min_prefill_tokens: prompt rows a batch needs for its admissions to prefill routed (paper: 1536).
        min_skip_share: estimated prefill Project-Only share a batch needs, strictly exceeded (0.35).
        probe_every: admitted batches between share probes (64).
        enter_threshold: decode load (running decode requests in the batch) at which decode is routed
            and dense requests are promoted. Device- and policy-specific: derive it with
            :func:`derive_thresholds` (the default 32 is a placeholder, not a paper value).
        initial_share: prior share estimate; None: the first eligible admission batch probes.
        always_route: route every phase of every request (the switch disabled).
        never_route: never route (dense everywhere).
        route_prefill: False: prefill always dense (decode-only routing ablation).
        route_decode: False: decode always dense (prefill-only routing ablation).
        promote: False: no dense -> routed promotion in decode (the mode set after prefill stays).

    Raises:
        ValueError: for ``always_route`` with ``never_route``, ``probe_every < 1``, shares outside
            [0, 1] or negative thresholds.
    """

    min_prefill_tokens: float = 1536
    min_skip_share: float = 0.35
    probe_every: int = 64
    enter_threshold: float = 32
    initial_share: float | None = None
    always_route: bool = False
    never_route: bool = False
    route_prefill: bool = True
    route_decode: bool = True
    promote: bool = True

    def __post_init__(self):
        if self.always_route and self.never_route:
            raise ValueError("ModeSwitch: always_route and never_route exclude each other")
        if int(self.probe_every) < 1:
            raise ValueError(f"ModeSwitch.probe_every must be >= 1, got {self.probe_every}")
        if not 0.0 <= float(self.min_skip_share) <= 1.0:
            raise ValueError(f"ModeSwitch.min_skip_share must lie in [0, 1], got {self.min_skip_share}")
        if self.initial_share is not None and not 0.0 <= float(self.initial_share) <= 1.0:
            raise ValueError(f"ModeSwitch.initial_share must lie in [0, 1], got {self.initial_share}")
        if float(self.min_prefill_tokens) < 0 or float(self.enter_threshold) < 0:
            raise ValueError("ModeSwitch thresholds must be >= 0")

    @classmethod
    def paper(cls, **overrides) -> "ModeSwitch":
        """The paper's prefill profile values (1536 tokens, share 0.35, probe every 64); pass
        ``enter_threshold`` (device-specific) and any other field as overrides."""
        return cls(**{**dict(min_prefill_tokens=1536, min_skip_share=0.35, probe_every=64), **overrides})

    @classmethod
    def from_thresholds(cls, derived: dict, **overrides) -> "ModeSwitch":
        """A switch from :func:`derive_thresholds`' output (None thresholds become ``math.inf``: the phase
        never routes under the switch); ``overrides`` set the flags or any field."""
        kw = dict(
            min_prefill_tokens=math.inf if derived.get("min_prefill_tokens") is None else derived["min_prefill_tokens"],
            min_skip_share=float(derived["min_skip_share"]),
            probe_every=int(derived.get("probe_every", 64)),
            enter_threshold=math.inf if derived.get("enter_threshold") is None else derived["enter_threshold"],
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> "ModeSwitch":
        """A switch from its JSON form (:meth:`to_dict`, or any subset of the fields): a None threshold
        (``min_prefill_tokens``, ``enter_threshold``) becomes ``math.inf``, so an infinite threshold
        round-trips through JSON.

        Raises:
            ValueError: for a field the switch does not have, a value of the wrong JSON type (pydantic,
                strict: ``"8"`` is not an int, ``1`` is not a bool) or out of range, naming the field.
        """
        types = {f.name: f.type for f in dataclass_fields(cls)}
        unknown = sorted(set(fields) - set(types))
        if unknown:
            raise ValueError(f"ModeSwitch has no field {', '.join(map(repr, unknown))}")
        values = {k: (math.inf if v is None and k in _INF_FIELDS else v) for k, v in fields.items()}
        for k, v in values.items():
            strict_value(types[k], v, f"ModeSwitch.{k}")
        return cls(**values)

    @classmethod
    def from_profile(cls, path: str | os.PathLike, **overrides) -> "ModeSwitch":
        """The switch a thresholds file selects: profile-mode's JSON (its ``thresholds`` entry, the
        output of :func:`derive_thresholds`) or a bare :func:`derive_thresholds` output; see
        :meth:`from_thresholds` (None thresholds become ``math.inf``). ``overrides`` set any field.

        Raises:
            ValueError: naming the file, when it cannot be read, is not JSON or has no thresholds.
        """
        try:
            doc = json.loads(Path(path).read_text())
            derived = doc["thresholds"] if isinstance(doc, dict) and isinstance(doc.get("thresholds"), dict) else doc
            if not isinstance(derived, dict) or "min_skip_share" not in derived:
                raise KeyError("thresholds (profile-mode JSON) or min_skip_share (derive_thresholds output)")
            return cls.from_thresholds(derived, **overrides)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"thresholds file {path}: {type(e).__name__}: {e}") from e

    def ablation(self, name: str) -> "ModeSwitch":
        """This switch under a named mechanism setting (Sec. 4.2, Table 3).

        Args:
            name: one of :data:`ABLATIONS`: ``served`` (unchanged), ``always-route``, ``never-route``,
                ``prefill-only`` (decode dense), ``decode-only`` (prefill dense), ``no-promotion``.

        Raises:
            ValueError: for an unknown name.
        """
        flags = {
            "served": {},
            "always-route": dict(always_route=True, never_route=False),
            "never-route": dict(never_route=True, always_route=False),
            "prefill-only": dict(route_decode=False),
            "decode-only": dict(route_prefill=False),
            "no-promotion": dict(promote=False),
        }
        if name not in flags:
            raise ValueError(f"unknown mode-switch setting {name!r}; choose from {', '.join(ABLATIONS)}")
        return replace(self, **flags[name])

    def to_dict(self) -> dict:
        """JSON-able fields (infinite thresholds as None), for result rows."""
        return {k: _finite_or_none(v) for k, v in asdict(self).items()}


def _prefill_counts(ctx) -> tuple[int, int]:
    run = po = 0
    for (_, ph), (r, p) in ctx.counts.items():
        if ph == int(Phase.PREFILL):
            run, po = run + r, po + p
    return run, po


class ModeController:
    """Host-side state machine of a :class:`ModeSwitch` (Sec. 3.3): assigns each row of each batch its
    request's mode. It is the engine's planner: ``controller(meta, context) -> RowMeta`` (see
    :meth:`RowContext.plan <impl.vskipper.routed.RowContext.plan>` and
    :func:`impl.vskipper.engine.generate_greedy`'s ``planner``), and :meth:`plan` can be driven by
    hand with :meth:`observe_share` for the probes.

    Args:
        switch: the configuration.

    Attributes:
        prefill_mode: request id -> True (routed) / False (dense), fixed at admission.
        decode_mode: request id -> current decode mode (False -> True at most once).
        routed_from: request id -> absolute token index of its first routed decode row (absent: decode
            never routed). Replays a request's modes: ``decode_routed(tok) = tok >= routed_from[rid]``.
        promoted: request id -> batch index of its promotion.
        share: current Project-Only share estimate (None before the first probe).
        probes: one dict per probe: admitted-batch index, batch index, prompt rows, observed share.
        events: the decisions in order (dicts with ``kind`` in {"admit", "decode_set", "promote",
            "share"}).
        rows: ``{"prefill": [routed, dense], "decode": [routed, dense]}`` row counts.
        requests: ``{"prefill": [routed, dense], "decode": [routed, dense]}`` request counts since the
            start (a promoted request moves from dense to routed decode); unlike the per-request dicts,
            which a server empties as requests are released, these only grow.
        n_promoted: promotions since the start.
    """

    def __init__(self, switch: ModeSwitch | None = None):
        self.switch = switch if switch is not None else ModeSwitch()
        self.prefill_mode: dict[str, bool] = {}
        self.decode_mode: dict[str, bool] = {}
        self.routed_from: dict[str, int] = {}
        self.promoted: dict[str, int] = {}
        self.share: float | None = self.switch.initial_share
        self.next_probe_at = 0 if self.share is None else int(self.switch.probe_every)
        self.admitted_batches = 0
        self.batches = 0
        self.probes: list[dict] = []
        self.events: list[dict] = []
        self.rows = {"prefill": [0, 0], "decode": [0, 0]}
        # requests whose mode was set, [routed, dense] per phase, and promotions: cumulative, unlike the
        # per-request dicts above, which a server empties when a request is released
        self.requests = {"prefill": [0, 0], "decode": [0, 0]}
        self.n_promoted = 0
        self._pending: dict | None = None
        self._probe_started = False

    # -- the planner protocol -----------------------------------------------------------------------
    def __call__(self, meta: RowMeta, ctx=None) -> RowMeta:
        """Planner entry point: collect a finished probe's share from ``ctx``'s counters, then
        :meth:`plan` the batch (and snapshot the counters if it starts a probe).

        Raises:
            RuntimeError: if a probe starts and ``ctx`` does not record route statistics.
        """
        self.collect(ctx)
        out = self.plan(meta)
        if self._probe_started and ctx is not None:
            if not ctx.record_stats:
                raise RuntimeError("the mode switch probes the Project-Only share from the routed layers' "
                                   "counters: bind the skipper with record_stats=True")
            self._pending["snapshot"] = _prefill_counts(ctx)
        return out

    def collect(self, ctx) -> None:
        """If a probe batch has run, read its realised prefill Project-Only share from ``ctx``'s
        counters and make it the estimate (no-op otherwise)."""
        pend = self._pending
        if pend is None or ctx is None or "snapshot" not in pend:
            return
        run, po = _prefill_counts(ctx)
        d_run, d_po = run - pend["snapshot"][0], po - pend["snapshot"][1]
        if d_run + d_po > 0:
            self.observe_share(d_po / (d_run + d_po))

    def observe_share(self, share: float) -> None:
        """Set the share estimate (a probe's realised prefill Project-Only share).

        Raises:
            ValueError: for a share outside [0, 1].
        """
        share = float(share)
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"a Project-Only share lies in [0, 1], got {share}")
        self.share = share
        if self._pending is not None:
            self.probes.append({k: v for k, v in self._pending.items() if k != "snapshot"} | {"share": share})
            self._pending = None
        self.events.append({"kind": "share", "batch": self.batches, "share": share})

    # -- decisions ----------------------------------------------------------------------------------
    def plan(self, meta: RowMeta, *, decode_load: int | None = None) -> RowMeta:
        """Assign the rows of one batch their modes (in the order the engine packed them).

        Args:
            meta: the batch's rows (request ids, token indices, phases); rows already marked dense
                (``routed`` False) stay dense, padding rows stay dense.
            decode_load: the decode load; default: the number of distinct requests with decode rows in
                this batch.

        Returns:
            a :class:`RowMeta` with ``routed`` set per row: PREFILL rows take their request's prefill
            mode, DECODE rows its decode mode.
        """
        self._probe_started = False
        phases = meta.phase.tolist()
        toks = meta.token_idx.tolist()
        order: list[str] = []
        seen: set = set()
        prefill_reqs: set = set()
        first_decode: dict[str, int] = {}
        n_prompt = 0
        for rid, ph, tok in zip(meta.request_ids, phases, toks):
            if rid is None:
                continue
            if rid not in seen:
                seen.add(rid)
                order.append(rid)
            if ph == int(Phase.PREFILL):
                prefill_reqs.add(rid)
                n_prompt += 1
            else:
                first_decode[rid] = min(tok, first_decode.get(rid, tok))
        new = [r for r in order if r in prefill_reqs and r not in self.prefill_mode]
        if new:
            decision = self._admit(n_prompt, new)
            for r in new:
                self.prefill_mode[r] = decision
            self.requests["prefill"][0 if decision else 1] += len(new)
        load = len(first_decode) if decode_load is None else int(decode_load)
        for r in order:
            if r in first_decode:
                self._decode(r, load, first_decode[r])
        routed = []
        for rid, ph in zip(meta.request_ids, phases):
            if rid is None:
                routed.append(False)
                continue
            key = "prefill" if ph == int(Phase.PREFILL) else "decode"
            m = self.prefill_mode.get(rid, False) if key == "prefill" else self.decode_mode.get(rid, False)
            routed.append(m)
            self.rows[key][0 if m else 1] += 1
        flags = torch.tensor(routed, dtype=torch.bool, device=meta.token_idx.device)
        if meta.routed is not None:
            flags = flags & meta.routed
        self.batches += 1
        return RowMeta(meta.request_ids, meta.token_idx, meta.phase, flags, meta.request_keys)

    def _admit(self, n_prompt: int, new: list) -> bool:
        sw = self.switch
        idx = self.admitted_batches
        self.admitted_batches += 1
        probe = False
        if sw.never_route or not sw.route_prefill:
            routed, why = False, "prefill routing off"
        elif sw.always_route:
            routed, why = True, "always-route"
        elif n_prompt < sw.min_prefill_tokens:
            routed, why = False, "below min_prefill_tokens"
        elif self.share is None or idx >= self.next_probe_at:
            routed, probe, why = True, True, "probe"
            self.next_probe_at = idx + int(sw.probe_every)
            self._pending = {"admitted_batch": idx, "batch": self.batches, "n_prompt_tokens": n_prompt}
            self._probe_started = True
        else:
            routed = self.share > sw.min_skip_share
            why = "share above min_skip_share" if routed else "share not above min_skip_share"
        self.events.append({"kind": "admit", "batch": self.batches, "admitted_batch": idx, "requests": list(new),
                            "n_prompt_tokens": n_prompt, "routed": routed, "probe": probe, "why": why})
        return routed

    def _decode(self, rid: str, load: int, tok: int) -> None:
        sw = self.switch
        can = sw.route_decode and not sw.never_route
        if rid not in self.decode_mode:
            m = can and (sw.always_route or load >= sw.enter_threshold)
            self.decode_mode[rid] = m
            self.requests["decode"][0 if m else 1] += 1
            if m:
                self.routed_from[rid] = tok
            self.events.append({"kind": "decode_set", "batch": self.batches, "request": rid, "routed": m,
                                "load": load, "token_idx": tok})
        elif not self.decode_mode[rid] and can and sw.promote and load >= sw.enter_threshold:
            self.decode_mode[rid] = True
            self.promoted[rid] = self.batches
            self.requests["decode"][0] += 1
            self.requests["decode"][1] -= 1
            self.n_promoted += 1
            self.routed_from[rid] = tok
            self.events.append({"kind": "promote", "batch": self.batches, "request": rid, "load": load,
                                "token_idx": tok})

    # -- replay and reporting -----------------------------------------------------------------------
    def decode_routed(self, request_id: str):
        """``token_idx -> bool``: whether the request's decode row at that position was routed (for
        :func:`~impl.vskipper.routed.plain_greedy`'s ``decode_routed``)."""
        start = self.routed_from.get(request_id)
        return lambda tok: start is not None and tok >= start

    def summary(self) -> dict:
        """JSON-able counts since the start: admitted batches, probes, share estimate, routed / dense
        requests and rows per phase, promotions, and the switch's configuration."""
        return {
            "switch": self.switch.to_dict(),
            "batches": self.batches,
            "admitted_batches": self.admitted_batches,
            "probes": list(self.probes),
            "share_estimate": self.share,
            "prefill_routed_requests": self.requests["prefill"][0],
            "prefill_dense_requests": self.requests["prefill"][1],
            "decode_routed_requests": self.requests["decode"][0],
            "decode_dense_requests": self.requests["decode"][1],
            "promotions": self.n_promoted,
            "rows": {k: {"routed": v[0], "dense": v[1]} for k, v in self.rows.items()},
        }


def generate_with_switch(model, prompts: Sequence[Sequence[int]], switch: ModeSwitch | ModeController, **kwargs):
    """Greedy generation through the continuous-batching engine under the mode switch.

    Args:
        model: a model bound with :func:`~impl.vskipper.engine.bind_skipper` (``record_stats=True`` when
            the switch probes).
        prompts: token-id prompts.
        switch: a :class:`ModeSwitch` (a fresh controller is made) or a :class:`ModeController` (its
            state carries over, e.g. across calls).
        **kwargs: :func:`~impl.vskipper.engine.generate_greedy` arguments (``max_new_tokens``,
            ``request_ids``, ``cb_config``, ...); ``mode`` and ``planner`` are set here.

    Returns:
        ``(tokens, controller)``: the generated ids per request and the controller (decisions,
        events, probes).

    Raises:
        ValueError / RuntimeError: as :func:`~impl.vskipper.engine.generate_greedy`.
    """

    controller = switch if isinstance(switch, ModeController) else ModeController(switch)
    out = generate_greedy(model, prompts, mode="routed", planner=controller, **kwargs)
    controller.collect(routed_context(model))
    return out, controller


# ======================================================================================================
# Profiling the routed mode's cost and deriving the thresholds
# ======================================================================================================
def _block_mask(q_blocks: list[tuple[int, int]], k_len: int, q_pos_in_k: list[int], dtype, device) -> torch.Tensor:
    """Additive ``[1, 1, Tq, K]`` mask: query row i may attend keys in its request's key range that are
    at or before its own key column."""
    Tq = len(q_pos_in_k)
    lo = torch.tensor([b[0] for b in q_blocks], device=device)
    col = torch.arange(k_len, device=device)[None, :]
    own = torch.tensor(q_pos_in_k, device=device)[:, None]
    allowed = (col >= lo[:, None]) & (col <= own)
    extra = [b[1] for b in q_blocks]  # allowed extra column (decode rows: their own new column)
    for i, e in enumerate(extra):
        if e is not None:
            allowed[i, e] = True
    mask = torch.zeros(Tq, k_len, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@torch.no_grad()
def packed_forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                   meta: RowMeta | None, cache=None) -> torch.Tensor:
    """One forward of packed rows ``[1, T]`` from several requests (the engine's batch layout) with a
    prepared 4D additive mask, describing the rows to the routed layers when ``meta`` is given.

    Args:
        model: a causal LM (routed layers installed or not).
        input_ids: ``[1, T]`` int64.
        position_ids: ``[1, T]`` int64 absolute positions.
        attention_mask: ``[1, 1, T, K]`` additive mask (model dtype).
        meta: the rows' :class:`RowMeta` (required when routed layers are installed and not dense).
        cache: a ``DynamicCache`` holding the K - T earlier key columns, or None.

    Returns:
        ``[1, T, V]`` logits.
    """

    ctx = routed_context(model)
    kw = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
              use_cache=cache is not None)
    if ctx is None or meta is None:
        return model(**kw).logits
    with ctx.rows(meta):
        return model(**kw).logits


class _Forced(Skipper):
    """Wrapper that pays the inner policy's routing cost and then forces every row to RUN (``run=True``)
    or to Project-Only (``run=False``)."""

    def __init__(self, inner: Skipper, run: bool):
        super().__init__(inner.routed_layers)
        object.__setattr__(self, "inner", inner)
        self.run = bool(run)
        self.identity_run = inner.identity_run
        self.projectors = inner.projectors  # the inner policy's Project-Only path, shared
        if getattr(inner.project, "__func__", None) is not Skipper.project:
            self.project = inner.project

    def route(self, layer_idx, hidden, meta):
        self.inner.route(layer_idx, hidden, meta)  # the router's cost is part of routed mode
        return torch.full((hidden.shape[0],), self.run, dtype=torch.bool, device=hidden.device)

    def route_tape(self, meta):
        tape = self.inner.route_tape(meta)  # a tape policy pays its cost once per step, forced or not
        return None if tape is None else torch.full(tuple(tape.shape), self.run, dtype=torch.bool, device=tape.device)

    def run_epilogue(self, layer_idx, hidden_in, hidden_out, meta, **kw):
        return self.inner.run_epilogue(layer_idx, hidden_in, hidden_out, meta, **kw)


@contextmanager
def _forced(model, skipper: Skipper, run: bool):
    wrapper = _Forced(skipper, run)
    saved = []
    for layer in model.model.layers:
        if isinstance(layer, RoutedDecoderLayer):
            saved.append((layer, layer.skipper, layer.fast_path))
            object.__setattr__(layer, "skipper", wrapper)
            layer.fast_path = False  # the zero-skip step must go through the cohort machinery
    try:
        yield
    finally:
        for layer, sk, fp in saved:
            object.__setattr__(layer, "skipper", sk)
            layer.fast_path = fp


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fit_phase(points: list[dict], n_routed: int) -> dict:
    ns = [float(p["n_rows"]) for p in points]
    fixed = [p["t_routed_zero_s"] - p["t_dense_s"] for p in points]
    save = [p["t_routed_zero_s"] - p["t_routed_all_skip_s"] for p in points]
    # least squares fixed = a + b n with a, b >= 0 (a cost cannot be negative; timing noise can make the
    # unconstrained fit so): refit through the origin when a < 0, as a constant when b < 0
    mf = sum(fixed) / len(fixed)
    if len(ns) >= 2 and max(ns) > min(ns):
        mn = sum(ns) / len(ns)
        b = sum((n - mn) * (f - mf) for n, f in zip(ns, fixed)) / sum((n - mn) ** 2 for n in ns)
        a = mf - b * mn
    else:
        a, b = mf, 0.0
    if a < 0:
        a, b = 0.0, sum(n * f for n, f in zip(ns, fixed)) / sum(n * n for n in ns)
    if b < 0:
        a, b = max(0.0, mf), 0.0
    c = sum(n * s for n, s in zip(ns, save)) / sum(n * n for n in ns) / max(1, n_routed)
    return {"points": points, "fixed_cost_s": a, "fixed_cost_per_row_s": b, "saving_per_row_layer_s": c}


def profile_routed_cost(
    model,
    skipper: Skipper,
    *,
    prefill_tokens: Sequence[int] = (256, 1024),
    prefill_prompt_len: int = 128,
    decode_requests: Sequence[int] = (8, 32),
    decode_context: int = 128,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> dict:
    """Measure routed mode's fixed cost and per-row saving on the current device (Sec. 3.3, the
    inputs of :func:`derive_thresholds`).

    For each batch size it times, interleaved ``repeats`` times (median, after ``warmup`` rounds), three
    packed plain-PyTorch forwards shaped like the continuous-batching engine's batches (several
    requests packed in one row dimension, block-diagonal additive mask as the engine's sdpa/eager
    path uses):

    - ``t_dense_s``: dense mode (the unmodified layers, router not consulted);
    - ``t_routed_zero_s``: routed mode where the skipper's router runs but every row RUNs through the
      cohort path (fast path off): routed mode's cost with zero skipped rows;
    - ``t_routed_all_skip_s``: routed mode where every row takes Project-Only at every routed layer.

    Prefill batches hold ``n / prefill_prompt_len`` prompts of ``prefill_prompt_len`` tokens (n prompt
    rows, no cache); decode batches hold one row per request, each request with ``decode_context``
    cached tokens (random K/V: only the shapes matter for time). Route statistics are off while
    timing.

    Args:
        model: a Llama / Qwen3-family causal LM, unbound (the skipper is bound for the measurement and
            unbound after) or already bound to ``skipper``.
        skipper: the policy (its router cost is included).
        prefill_tokens: prefill batch sizes in prompt tokens (>= ``prefill_prompt_len`` each).
        prefill_prompt_len: tokens per packed prompt.
        decode_requests: decode batch sizes (running requests).
        decode_context: cached tokens per decode request.
        repeats, warmup: timing rounds.
        seed: seed of the token ids.

    Returns:
        JSON-able dict: ``device``, ``dtype``, ``n_routed_layers``, ``num_layers``, ``repeats``,
        ``method``, and per phase (``prefill``, ``decode``) ``points`` (``n_rows`` and the three times
        in seconds) with the fitted ``fixed_cost_s`` (a), ``fixed_cost_per_row_s`` (b) and
        ``saving_per_row_layer_s`` (c) of the module docstring's cost model, plus ``unit`` (what a
        row counts) and ``context`` (decode). a and b are a least-squares fit constrained to be
        non-negative; c is fitted through the origin (so with attention cost superlinear in the
        rows, c is dominated by the largest batch: profile at the sizes where the threshold falls).

    Raises:
        ValueError: if the model is bound to another skipper or a batch size is too small.
    """

    bound = getattr(model, "_vskipper_skipper", None)
    if bound is not None and bound is not skipper:
        raise ValueError("the model is bound to another skipper; unbind it or pass that skipper")
    if any(int(n) < prefill_prompt_len for n in prefill_tokens) or any(int(n) < 1 for n in decode_requests):
        raise ValueError("prefill_tokens must be >= prefill_prompt_len and decode_requests >= 1")
    if bound is None:
        bind_skipper(model, skipper)
    ctx = routed_context(model)
    prev_stats = ctx.record_stats
    ctx.record_stats = False
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    gen = torch.Generator().manual_seed(seed)
    vocab = int(cfg.vocab_size)
    try:
        phases = {}
        # -- prefill ------------------------------------------------------------------------------
        points = []
        for n in prefill_tokens:
            n_req = max(1, int(n) // prefill_prompt_len)
            P = prefill_prompt_len
            T = n_req * P
            ids = torch.randint(vocab, (1, T), generator=gen).to(device)
            pos = torch.arange(P, device=device).repeat(n_req)[None]
            blocks = [(r * P, None) for r in range(n_req) for _ in range(P)]
            mask = _block_mask(blocks, T, list(range(T)), dtype, device)
            meta = RowMeta.concat([RowMeta.for_sequence(f"prof{r}", 0, P, prompt_len=P, device=device)
                                   for r in range(n_req)])

            def step(mask=mask, ids=ids, pos=pos, meta=meta):
                packed_forward(model, ids, pos, mask, meta)

            points.append(dict(n_rows=T, requests=n_req, **_time_arms(model, ctx, skipper, step, repeats, warmup,
                                                                      device)))
        phases["prefill"] = dict(_fit_phase(points, len(skipper.routed_layers)), unit="prompt tokens",
                                 prompt_len=prefill_prompt_len)
        # -- decode -------------------------------------------------------------------------------
        points = []

        kvh = int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        for n in decode_requests:
            n = int(n)
            C = int(decode_context)
            K0 = n * C
            cache = DynamicCache(config=model.config)
            for li in range(int(cfg.num_hidden_layers)):
                k = torch.randn(1, kvh, K0, head_dim, generator=gen).to(device=device, dtype=dtype)
                v = torch.randn(1, kvh, K0, head_dim, generator=gen).to(device=device, dtype=dtype)
                cache.update(k, v, li)
            ids = torch.randint(vocab, (1, n), generator=gen).to(device)
            pos = torch.full((1, n), C, dtype=torch.long, device=device)
            blocks = [(r * C, K0 + r) for r in range(n)]
            mask = _block_mask(blocks, K0 + n, [r * C + C - 1 for r in range(n)], dtype, device)
            meta = RowMeta.concat([RowMeta.for_sequence(f"prof{r}", C, 1, prompt_len=C, device=device)
                                   for r in range(n)])

            def step(mask=mask, ids=ids, pos=pos, meta=meta, cache=cache, n=n):
                packed_forward(model, ids, pos, mask, meta, cache=cache)
                cache.crop(-n)

            points.append(dict(n_rows=n, requests=n, **_time_arms(model, ctx, skipper, step, repeats, warmup,
                                                                  device)))
        phases["decode"] = dict(_fit_phase(points, len(skipper.routed_layers)), unit="running decode requests",
                                context=int(decode_context))
    finally:
        ctx.record_stats = prev_stats
        if bound is None:
            unbind_skipper(model)
    return {
        "method": "packed plain-PyTorch forwards (engine batch layout), median of interleaved repeats",
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "skipper": type(skipper).__name__,
        "n_routed_layers": len(skipper.routed_layers),
        "num_layers": int(cfg.num_hidden_layers),
        "repeats": int(repeats),
        **phases,
    }


def _time_arms(model, ctx, skipper, step, repeats: int, warmup: int, device) -> dict:
    def dense():
        with ctx.dense_mode(True):
            step()

    def zero():
        with _forced(model, skipper, True):
            step()

    def all_skip():
        with _forced(model, skipper, False):
            step()

    arms = {"t_dense_s": dense, "t_routed_zero_s": zero, "t_routed_all_skip_s": all_skip}
    for _ in range(max(0, warmup)):
        for fn in arms.values():
            fn()
    times = {k: [] for k in arms}
    for _ in range(max(1, repeats)):
        for k, fn in arms.items():
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def derive_thresholds(profile: dict, skip_share, *, share_slack: float = 0.7, margin: float = 1.0,
                      probe_every: int = 64) -> dict:
    """The documented threshold rule (module docstring) for a device profile and a policy's share.

    Args:
        profile: :func:`profile_routed_cost`'s output, or any dict with ``n_routed_layers`` and per phase
            (``prefill``, ``decode``) ``fixed_cost_s`` (a, s), ``fixed_cost_per_row_s`` (b, s/row) and
            ``saving_per_row_layer_s`` (c, s per row per skipped layer).
        skip_share: the policy's Project-Only share over (row, routed layer) pairs, in [0, 1]: one float
            for both phases or ``{"prefill": s_p, "decode": s_d}``.
        share_slack: the share guard is ``share_slack * skip_share`` (in (0, 1]; 0.7 by default).
        margin: safety factor (>= 1 demands savings exceeding the fixed cost by that factor).
        probe_every: copied into the result (the paper's 64).

    Returns:
        JSON-able dict: ``min_prefill_tokens`` (int, or None when no prefill batch size pays),
        ``min_skip_share`` (the prefill share guard), ``enter_threshold`` (decode load in running
        requests, or None), ``decode_min_skip_share``, ``prefill_profitable`` / ``decode_profitable``,
        ``break_even_share`` per phase (``margin * b / (c n_routed)``: below it no size pays),
        ``probe_every``, the inputs and the rule's text. Thresholds are non-increasing in the share and
        in c, non-decreasing in a, b and margin.

    Raises:
        ValueError: for shares outside [0, 1], ``share_slack`` outside (0, 1], ``margin <= 0`` or a
            profile without the needed fields.
    """
    if isinstance(skip_share, dict):
        shares = {"prefill": float(skip_share["prefill"]), "decode": float(skip_share["decode"])}
    else:
        shares = {"prefill": float(skip_share), "decode": float(skip_share)}
    if any(not 0.0 <= s <= 1.0 for s in shares.values()):
        raise ValueError(f"skip shares must lie in [0, 1], got {shares}")
    if not 0.0 < share_slack <= 1.0 or margin <= 0:
        raise ValueError(f"share_slack must lie in (0, 1] and margin > 0, got {share_slack}, {margin}")
    try:
        n_routed = int(profile["n_routed_layers"])
        coeffs = {ph: (float(profile[ph]["fixed_cost_s"]), float(profile[ph]["fixed_cost_per_row_s"]),
                       float(profile[ph]["saving_per_row_layer_s"])) for ph in ("prefill", "decode")}
    except (KeyError, TypeError) as exc:
        raise ValueError(f"profile lacks a field derive_thresholds needs: {exc!r}") from exc

    def rule(ph: str):
        a, b, c = coeffs[ph]
        guard = share_slack * shares[ph]
        gain = c * n_routed * guard - margin * b  # net saving per row at the guard share
        if guard <= 0 or gain <= 0:
            n = None
        else:
            n = max(1, math.ceil(margin * max(a, 0.0) / gain - 1e-12))
        be = margin * b / (c * n_routed) if c > 0 and n_routed > 0 else math.inf
        return n, guard, be

    n_p, g_p, be_p = rule("prefill")
    n_d, g_d, be_d = rule("decode")
    return {
        "rule": ("guard S = share_slack * skip_share; N = ceil(margin * a / (c * n_routed * S - margin * b)) rows, "
                 "None when c * n_routed * S <= margin * b; prefill rows = prompt tokens of a batch, decode rows = "
                 "running decode requests; a batch with >= N rows and share >= S is predicted profitable"),
        "skip_share": shares,
        "share_slack": share_slack,
        "margin": margin,
        "probe_every": int(probe_every),
        "min_prefill_tokens": n_p,
        "min_skip_share": g_p,
        "prefill_profitable": n_p is not None,
        "enter_threshold": n_d,
        "decode_min_skip_share": g_d,
        "decode_profitable": n_d is not None,
        "break_even_share": {"prefill": _finite_or_none(be_p), "decode": _finite_or_none(be_d)},
        "inputs": {"n_routed_layers": n_routed,
                   **{f"{ph}_{k}": v for ph, (a, b, c) in coeffs.items()
                      for k, v in (("fixed_cost_s", a), ("fixed_cost_per_row_s", b),
                                   ("saving_per_row_layer_s", c))}},
    }
