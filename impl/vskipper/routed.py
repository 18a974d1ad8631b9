"""Routed execution of one decoder layer: RUN / Project-Only per row (vSkipper Sec. 3.1-3.2).

:class:`RoutedDecoderLayer` wraps an original Llama- or Qwen3-family decoder layer and runs it for a
batch of rows ``[1, T, H]`` whose actions a :class:`~impl.vskipper.skipper.Skipper` decides:

1. every row computes this layer's own K and V (input norm, ``k_proj``/``v_proj``, the family's
   ``k_norm`` where it has one, as Qwen3 does, and rotary) and all of them are written to the cache at
   their slots with ONE ``cache.update`` call (Invariant 1: Project-Only rows still write their K/V);
2. the RUN rows are gathered into one contiguous cohort: their queries attend to the full K/V (the
   packed mask's RUN rows are selected for sdpa/eager), then the MLP runs on the cohort only, the
   skipper's ``run_epilogue`` rescales the routed RUN rows (FlexiDepth: ``h + attn + w * mlp``;
   identity by default; dense rows keep the unmodified output) and the results are scattered back;
3. the Project-Only rows skip the attention read and the MLP and take the skipper's projector
   (identity by default);
4. when no row skips (all RUN) and the skipper's RUN output is the unmodified layer's
   (``Skipper.identity_run``), the original layer is called unchanged (the all-RUN fast path); a
   batch whose rows are all dense (mode switch, :mod:`impl.vskipper.mode`) runs the original layer
   without consulting the router.

**The route tape** (Sec. 3.1). The row metadata is checked against the batch and padded once per
forward, at the first routed layer (:meth:`RowContext.step_rows`). A request-hash policy (RandomSkip,
static depth: :meth:`~impl.vskipper.skipper.Skipper.route_tape`) then computes every routed layer's
masks once per step (:class:`RouteTape`, one host copy for all layers' all-RUN flags and counts), and
each layer reads its column: an all-RUN layer calls the original layer with no per-row work. A
hidden-state policy (FlexiDepth) has no tape and is asked per layer, as it must be.

The same layer serves two callers:

- a plain PyTorch forward: ``[1, S, H]`` with a cache of the model's own kind (``DynamicCache``), the
  mask being None (causal) or a 4D mask;
- transformers' continuous-batching engine: packed rows ``[1, total_tokens, H]`` with the paged cache
  and the kwargs ``cu_seq_lens_q/k``, ``read_index``, ``write_index``, ``logits_indices`` and a packed
  ``[1, 1, T, K]`` additive mask (sdpa / paged|eager).

Request identity is not in the layer kwargs, so rows are described by a side channel: a
:class:`RowContext` shared by all routed layers of a model, holding the current batch's
:class:`~impl.vskipper.skipper.RowMeta`. The engine binding (:mod:`impl.vskipper.engine`) fills it
where the engine prepares each batch; plain-PyTorch callers fill it with :meth:`RowContext.rows`.
Every row-to-memory map (RUN / Project-Only indices, selected mask rows, cache slots) is derived from
the current call's kwargs and route mask and never cached across steps (Invariant 2); the layer also
checks the side channel against the batch's ``position_ids`` and refuses stale metadata.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from typing import Iterator, Mapping

import torch
from torch import nn
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .skipper import RowMeta, Skipper, as_run_mask, check_route_tape

__all__ = [
    "RouteTape",
    "RowContext",
    "profile_sections",
    "RoutedDecoderLayer",
    "install_routed_layers",
    "remove_routed_layers",
    "routed_context",
    "plain_forward",
    "plain_greedy",
]

_CONTEXT_ATTR = "_vskipper_context"
_UNSET = object()
_SECTIONS = False  # label the routed path's sections for torch.profiler (profile_sections)


@contextmanager
def profile_sections(on: bool = True) -> Iterator[None]:
    """Inside the block, the routed layers label their sections for :mod:`torch.profiler` as
    ``record_function("vsk::<section>")``: ``route`` (router or route tape), ``kv`` (input norm, K/V
    projections, rotary, cache update: every row), ``gather`` (the RUN cohort's rows, rotary and mask
    rows), ``q_proj``, ``attention``, ``o_proj``, ``mlp`` (post-attention norm, MLP, residuals),
    ``scatter`` (output copy and index_copy back), ``project`` (Project-Only rows). Off by default: no
    labels, no cost."""
    global _SECTIONS
    prev, _SECTIONS = _SECTIONS, bool(on)
    try:
        yield
    finally:
        _SECTIONS = prev


def _section(name: str):
    return torch.profiler.record_function(f"vsk::{name}") if _SECTIONS else nullcontext()


class RouteTape:
    """One engine step's routes at every routed layer (vSkipper Sec. 3.1), built once per step from a
    request-hash policy's :meth:`~impl.vskipper.skipper.Skipper.route_tape` by :meth:`RowContext.tape`.

    Attributes:
        all_run: per routed layer (column order), whether every row RUNs: such a layer takes the dense
            path with no per-row work.
        any_routed: whether any row is routed (not dense, not padding).
        column: routed layer index -> column of :attr:`run`.
    """

    __slots__ = ("all_run", "any_routed", "column", "_raw", "_routed", "_run")

    def __init__(self, raw: torch.Tensor, routed: torch.Tensor, all_run: tuple[bool, ...], any_routed: bool,
                 column: Mapping[int, int]):
        self.all_run, self.any_routed, self.column = all_run, any_routed, column
        self._raw, self._routed, self._run = raw, routed, None

    @property
    def run(self) -> torch.Tensor:
        """``[n_rows, n_routed]`` torch.bool on the rows' device, True = RUN; dense and padding rows are
        RUN. Made at the first read (a step whose layers all take the dense path never reads it)."""
        if self._run is None:
            self._run = self._raw | ~self._routed[:, None]
        return self._run


class RowContext:
    """Side channel carrying the current batch's row metadata to the routed layers.

    Attributes:
        meta: the :class:`RowMeta` of the batch being computed, or None between batches.
        dense: when True, routed layers run the original layer without consulting the router (dense
            mode, Sec. 3 "Vocabulary"): the engine runs unmodified.
        batch_dense: True when the current batch has rows but none of them is routed (every request
            of the batch is in dense mode): the routed layers then run the original layer without
            consulting the router, as in dense mode. Derived from ``meta`` whenever it is set.
        planner: optional callable ``planner(meta, context) -> RowMeta`` that assigns each row its
            mode (``RowMeta.routed``) before the batch runs; the engine binding applies it through
            :meth:`plan` (the mode switch, :mod:`impl.vskipper.mode`). None: every row is routed.
        batches: how many batches were described so far.
        record_stats: when True (default), the per-phase RUN and Project-Only row counts of every
            routed layer call go to ``counts`` (a request-hash policy's route tape records the whole
            step's in its one host sync; a per-layer policy costs one sync per layer: turn off on
            accelerators).
        counts: ``{(layer_idx, phase): [n_run, n_project_only]}`` over routed (non-dense, non-padding)
            rows.
    """

    def __init__(self, record_stats: bool = True):
        self._meta: RowMeta | None = None
        self.batch_dense = False
        self.planner = None
        self.dense = False
        self.batches = 0
        self.record_stats = record_stats
        self.counts: dict[tuple[int, int], list[int]] = {}
        self._step: tuple | None = None  # (n_rows, device, checked and padded RowMeta) of this forward
        self._tape = _UNSET  # this forward's RouteTape, None (per-layer policy) or _UNSET (not built)

    @property
    def meta(self) -> RowMeta | None:
        """The :class:`RowMeta` of the batch being computed (None between batches)."""
        return self._meta

    @meta.setter
    def meta(self, meta: RowMeta | None) -> None:
        self._meta = meta
        self._step, self._tape = None, _UNSET
        # one host sync per batch, not per layer
        self.batch_dense = meta is not None and meta.routed is not None and len(meta) > 0 and not bool(
            meta.routed_mask.any())

    def set_rows(self, meta: RowMeta | None) -> None:
        """Describe the rows of the next batch (None clears)."""
        self.meta = meta
        if meta is not None:
            self.batches += 1

    def plan(self, meta: RowMeta) -> RowMeta:
        """Apply the :attr:`planner` (if any) to a batch's rows: returns the rows with their modes."""
        return meta if self.planner is None else self.planner(meta, self)

    def clear(self) -> None:
        """Forget the current batch's rows."""
        self.meta = None

    @contextmanager
    def rows(self, meta: RowMeta) -> Iterator["RowContext"]:
        """Context manager: ``meta`` describes the rows of the forwards run inside it."""
        prev = self.meta
        self.set_rows(meta)
        try:
            yield self
        finally:
            self.meta = prev

    @contextmanager
    def dense_mode(self, dense: bool = True) -> Iterator["RowContext"]:
        """Context manager: run every routed layer dense (no router) inside it."""
        prev = self.dense
        self.dense = dense
        try:
            yield self
        finally:
            self.dense = prev

    def reset_stats(self) -> None:
        """Zero the RUN / Project-Only counters."""
        self.counts = {}

    def skip_ratio(self, phase: int | None = None) -> float:
        """Realised Project-Only fraction over the recorded (row, routed layer) pairs, optionally of one
        :class:`~impl.vskipper.skipper.Phase` (NaN when nothing was recorded)."""
        run = po = 0
        for (_, ph), (r, p) in self.counts.items():
            if phase is None or ph == int(phase):
                run, po = run + r, po + p
        return po / (run + po) if run + po else float("nan")

    def step_rows(self, layer_idx: int, first_layer: int, hidden_states: torch.Tensor,
                  position_ids: torch.Tensor | None) -> RowMeta:
        """The current forward's rows, checked against the batch and padded to its ``n_rows`` once per
        forward: the first routed layer (``first_layer``) checks and pads :attr:`meta`, later layers of
        the same forward reuse it.

        Args:
            layer_idx: the calling routed layer.
            first_layer: the model's first routed layer (a new forward starts there).
            hidden_states: ``[1, n_rows, H]`` the layer's input.
            position_ids: the batch's ``[1, n_rows]`` positions, or None.

        Returns:
            the :class:`RowMeta` of ``n_rows`` rows on the hidden states' device (padding rows RUN).

        Raises:
            RuntimeError: no row metadata, or stale metadata (more rows than the batch, or token indices
                that disagree with ``position_ids``: Invariant 2).
        """
        n_rows, device = hidden_states.shape[1], hidden_states.device
        st = self._step
        if layer_idx != first_layer and st is not None and st[0] == n_rows and st[1] == device:
            return st[2]
        meta = self.meta
        if meta is None:
            raise RuntimeError(
                f"routed layer {layer_idx}: no row metadata for this batch; describe the rows with "
                "RowContext.rows(RowMeta(...)) or run through impl.vskipper.engine"
            )
        n_meta = len(meta)
        if n_meta > n_rows:
            raise RuntimeError(
                f"routed layer {layer_idx}: stale row metadata ({n_meta} rows described, batch has {n_rows})"
            )
        if meta.token_idx.device != device:
            meta = meta.to(device)
        if position_ids is not None:
            pos = position_ids.reshape(-1)[:n_meta].to(torch.long)
            if not torch.equal(pos, meta.token_idx):
                raise RuntimeError(
                    f"routed layer {layer_idx}: stale row metadata: token indices {meta.token_idx.tolist()[:8]}"
                    f" disagree with the batch's position_ids {pos.tolist()[:8]} (Invariant 2)"
                )
        if n_meta < n_rows:  # engine padding rows: always RUN
            pad_pos = None if position_ids is None else position_ids.reshape(-1)[n_meta:]
            meta = meta.pad_to(n_rows, pad_pos)
        self._step, self._tape = (n_rows, device, meta), _UNSET
        return meta

    def tape(self, skipper: Skipper, meta: RowMeta) -> RouteTape | None:
        """This forward's :class:`RouteTape` of ``skipper`` over ``meta`` (the rows of
        :meth:`step_rows`), built at the first call of the forward: one ``skipper.route_tape`` call and
        one device-to-host copy of the tape and the rows' modes and phases, from which every layer's
        all-RUN flag (and, with :attr:`record_stats`, every layer's counts) is computed on the host with
        numpy: a handful of torch ops per step instead of one per flag and count, which on a CPU decode
        step of a few tens of ms is the difference between 2% and 0.5% of routing overhead. None when
        the policy routes per layer (hidden-state policies).

        Raises:
            ValueError: the policy's tape is not a ``[n_rows, n_routed]`` bool tensor.
        """
        if self._tape is not _UNSET:
            return self._tape
        raw = skipper.route_tape(meta)
        if raw is None:
            self._tape = None
            return None
        layers = skipper.routed_layers
        n_rows, n = len(meta), len(layers)
        raw = check_route_tape(raw, n_rows, n, who=type(skipper).__name__)
        routed = meta.routed_mask  # [n_rows]
        # the step's one host copy: [raw (n_rows * n) | routed (n_rows) | phase (n_rows)] as uint8
        host = torch.cat([raw.reshape(-1), routed, meta.phase.to(torch.bool)]).cpu().numpy()
        raw_h = host[: n_rows * n].reshape(n_rows, n)
        routed_h, decode_h = host[n_rows * n: n_rows * (n + 1)], host[n_rows * (n + 1):]
        run_h = raw_h | ~routed_h[:, None]  # [n_rows, n]: dense and padding rows RUN
        all_run = tuple(bool(x) for x in run_h.all(axis=0))
        any_routed = bool(routed_h.any())
        tape = RouteTape(raw, routed, all_run, any_routed, {layer: j for j, layer in enumerate(layers)})
        if self.record_stats and any_routed:
            for ph, sel in ((0, routed_h & ~decode_h), (1, routed_h & decode_h)):
                n_sel = int(sel.sum())
                if n_sel:
                    n_run = run_h[sel].sum(axis=0)
                    for j, layer in enumerate(layers):
                        c = self.counts.setdefault((layer, ph), [0, 0])
                        c[0] += int(n_run[j])
                        c[1] += n_sel - int(n_run[j])
        self._tape = tape
        return tape

    def record(self, layer_idx: int, run: torch.Tensor, meta: RowMeta) -> None:
        """Add one routed layer's RUN / Project-Only counts per phase (``run`` ``[n_rows]`` bool over
        ``meta``'s rows) to :attr:`counts`, for policies that route per layer (the route tape counts
        a request-hash policy's whole step in :meth:`tape`)."""
        routed = meta.routed_mask
        for ph in (0, 1):
            sel = routed & (meta.phase == ph)
            n = int(sel.sum())
            if n:
                n_run = int((run & sel).sum())
                c = self.counts.setdefault((layer_idx, ph), [0, 0])
                c[0] += n_run
                c[1] += n - n_run


def _check_layer(layer: nn.Module, layer_idx: int) -> None:
    attn = getattr(layer, "self_attn", None)
    missing = [n for n in ("input_layernorm", "post_attention_layernorm", "mlp") if not hasattr(layer, n)]
    if attn is None:
        missing.append("self_attn")
    else:
        missing += [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
                    if not hasattr(attn, n)]
    if missing:
        raise ValueError(
            f"layer {layer_idx} ({type(layer).__name__}) is not a Llama/Qwen3-family decoder layer: missing "
            f"{', '.join(missing)}"
        )
    if getattr(attn, "sliding_window", None) is not None:
        raise ValueError(f"layer {layer_idx}: sliding-window attention layers are not supported by routed execution")
    if getattr(attn, "layer_idx", layer_idx) != layer_idx:
        raise ValueError(f"layer {layer_idx}: its attention says layer_idx={attn.layer_idx}")


def _is_flash(impl: str | None) -> bool:
    return bool(impl) and "flash" in impl


class RoutedDecoderLayer(nn.Module):
    """A decoder layer with per-row RUN / Project-Only execution (Sec. 3.1).

    Args:
        layer: the original decoder layer (Llama / Qwen3 family), kept as ``self.layer`` and called
            unchanged on the all-RUN fast path and in dense mode.
        layer_idx: its 0-based index (must be one of ``skipper.routed_layers``).
        skipper: the policy (not registered as a submodule: it is shared by all routed layers).
        context: the shared :class:`RowContext`.
        fast_path: call the original layer when every row RUNs (default True); False forces the
            cohort path, which tests use to check it against the dense layer.

    Raises:
        ValueError: if the layer is not a supported family, uses sliding-window attention, or
            ``layer_idx`` is not routed by ``skipper``.
    """

    def __init__(self, layer: nn.Module, layer_idx: int, skipper: Skipper, context: RowContext, fast_path: bool = True):
        super().__init__()
        _check_layer(layer, layer_idx)
        if layer_idx not in skipper.routed_layers:
            raise ValueError(f"layer {layer_idx} is not routed by {type(skipper).__name__} ({skipper.routed_layers})")
        self.layer = layer
        self.layer_idx = int(layer_idx)
        self.fast_path = fast_path
        object.__setattr__(self, "skipper", skipper)  # shared, not a submodule of every layer
        object.__setattr__(self, "context", context)
        if hasattr(layer, "attention_type"):
            self.attention_type = layer.attention_type
        attn = layer.self_attn
        mod = sys.modules[type(attn).__module__]
        self._rope = getattr(mod, "apply_rotary_pos_emb", None)
        if self._rope is None:
            raise ValueError(f"layer {layer_idx}: no apply_rotary_pos_emb in {type(attn).__module__}")
        self._rotate_half = getattr(mod, "rotate_half", None)

    # ------------------------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Run the layer on ``hidden_states`` ``[1, T, H]`` (same arguments as the wrapped layer).

        Returns:
            ``[1, T, H]`` hidden states after the layer: RUN rows as the original layer computes them
            (attending to every cached K/V, Project-Only rows' included), routed RUN rows then passed
            through ``skipper.run_epilogue`` (identity by default), Project-Only rows as
            ``skipper.project(input)``; a dense row (``RowMeta.routed`` False) always RUNs unmodified,
            and a batch of dense rows only runs the original layer.

        Raises:
            RuntimeError: when no row metadata describes the batch, or it is stale (more rows than the
                batch, or token indices that disagree with ``position_ids``: Invariant 2).
            ValueError: for a batch dimension other than 1, or a route of the wrong shape / values.
            NotImplementedError: for flash attention or the engine's block-table decode path with
                mixed rows.
        """
        if cache is None and "past_key_values" in kwargs:
            cache = kwargs.pop("past_key_values")
        layer_kwargs = dict(
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        ctx = self.context
        if ctx.dense or ctx.batch_dense:
            return self.layer(hidden_states, **layer_kwargs)
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
            raise ValueError(
                f"routed layer {self.layer_idx}: expects packed rows [1, T, H], got {tuple(hidden_states.shape)}"
            )
        with _section("route"):
            meta = ctx.step_rows(self.layer_idx, self.skipper.routed_layers[0], hidden_states, position_ids)
            tape = ctx.tape(self.skipper, meta)
        if tape is not None:
            # a request-hash policy: this layer's column of the step's route tape, no per-row work here
            j = tape.column[self.layer_idx]
            if self.fast_path and tape.all_run[j] and (self.skipper.identity_run or not tape.any_routed):
                return self.layer(hidden_states, **layer_kwargs)
            run = tape.run[:, j]
        else:
            n_rows = hidden_states.shape[1]
            with _section("route"):
                run = as_run_mask(self.skipper.route(self.layer_idx, hidden_states[0], meta), n_rows,
                                  layer_idx=self.layer_idx, who=type(self.skipper).__name__)
                routed = meta.routed_mask
                run = run | ~routed
                if ctx.record_stats:
                    ctx.record(self.layer_idx, run, meta)
            if self.fast_path and bool(run.all()) and (self.skipper.identity_run or not bool(routed.any())):
                return self.layer(hidden_states, **layer_kwargs)
        return self._cohort_forward(hidden_states, run, meta, attention_mask, position_ids, cache, use_cache,
                                    position_embeddings, kwargs)

    # ------------------------------------------------------------------------------------------------
    def _cohort_forward(self, hidden_states, run, meta, attention_mask, position_ids, cache, use_cache,
                        position_embeddings, kwargs):
        layer, attn = self.layer, self.layer.self_attn
        impl = getattr(attn.config, "_attn_implementation", None)
        if _is_flash(impl):
            raise NotImplementedError(
                f"routed layer {self.layer_idx}: mixed RUN/Project-Only rows need sdpa or eager attention "
                f"(got {impl!r}); flash varlen would need rebuilt cu_seq_lens_q"
            )
        if kwargs.get("block_table") is not None:
            raise NotImplementedError(
                f"routed layer {self.layer_idx}: the block-table decode fast path is not supported with mixed rows "
                "(set max_blocks_per_request=0)"
            )
        if position_embeddings is None:
            raise ValueError(f"routed layer {self.layer_idx}: position_embeddings (cos, sin) are required")
        T = hidden_states.shape[1]
        head_dim = attn.head_dim
        with _section("gather"):
            run_idx = run.nonzero().squeeze(1)  # [n_run] int64, derived from this call's route (Invariant 2)
            po_idx = (~run).nonzero().squeeze(1)
        cos, sin = position_embeddings

        # (i) every row: this layer's own K and V, one cache update (Invariant 1)
        with _section("kv"):
            normed = layer.input_layernorm(hidden_states)  # [1, T, H]
            k = attn.k_proj(normed).view(1, T, -1, head_dim)
            if hasattr(attn, "k_norm"):
                k = attn.k_norm(k)
            k = k.transpose(1, 2)  # [1, kvh, T, d]
            v = attn.v_proj(normed).view(1, T, -1, head_dim).transpose(1, 2)
            k = self._rotary(k, cos, sin)
            attn_kwargs = dict(kwargs, position_ids=position_ids, use_cache=use_cache)
            if cache is not None:
                update_kwargs = dict(attn_kwargs)  # the paged cache edits the dict it gets
                k_all, v_all = cache.update(k, v, attn.layer_idx, kwargs=update_kwargs)
                attn_kwargs = update_kwargs
            else:
                k_all, v_all = k, v

        with _section("scatter"):
            out = hidden_states[0].clone()  # [T, H]
        n_run = run_idx.numel()
        if n_run:
            # (ii) the RUN cohort: queries against the full K/V, then the MLP, scattered back
            every = n_run == T  # every row RUNs (an epilogue policy's all-RUN layer): no gather, no scatter
            with _section("gather"):
                mask = _rows_of_mask(attention_mask, run_idx, T, k_all.shape[2], normed.dtype, self.layer_idx)
                if every:
                    normed_run, cos_run, sin_run, h_in = normed, cos, sin, hidden_states[0]
                else:
                    # index_select, not advanced indexing: the same rows, several times faster on CPU
                    normed_run = normed.index_select(1, run_idx)  # [1, n_run, H]
                    cos_run, sin_run = cos.index_select(1, run_idx), sin.index_select(1, run_idx)
                    h_in = hidden_states[0].index_select(0, run_idx)  # [n_run, H]
            with _section("q_proj"):
                q = attn.q_proj(normed_run).view(1, n_run, -1, head_dim)
                if hasattr(attn, "q_norm"):
                    q = attn.q_norm(q)
                q = q.transpose(1, 2)  # [1, heads, n_run, d]
                q = self._rotary(q, cos_run, sin_run)
            with _section("attention"):
                interface = ALL_ATTENTION_FUNCTIONS.get_interface(impl, _eager_attention(attn))
                extra = {"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else {}
                attn_out, _ = interface(
                    attn, q, k_all, v_all, mask, dropout=0.0, scaling=attn.scaling, **extra, **attn_kwargs
                )
            with _section("o_proj"):
                attn_out = attn.o_proj(attn_out.reshape(1, n_run, -1).contiguous())
            with _section("mlp"):
                h_mid = h_in + attn_out[0]
                mlp_out = layer.mlp(layer.post_attention_layernorm(h_mid))
                h = h_mid + mlp_out
            with _section("scatter"):
                out = h.to(out.dtype) if every else out.index_copy(0, run_idx, h.to(out.dtype))
            if not self.skipper.identity_run:
                # the epilogue applies to routed RUN rows only: dense rows keep the unmodified output
                sel = meta.routed_mask[run_idx].nonzero().squeeze(1)
                if sel.numel():
                    rows = run_idx[sel]
                    h_ep = self.skipper.run_epilogue(self.layer_idx, h_in[sel], h[sel], meta.select(rows),
                                                     hidden_mid=h_mid[sel], mlp_out=mlp_out[sel])
                    out = out.index_copy(0, rows, h_ep.to(out.dtype))
        if po_idx.numel() and not self._identity_project():
            # (iii) Project-Only rows: no attention read, no MLP; the projector (identity: their rows of
            # ``out`` already hold their input, nothing to do)
            with _section("project"):
                proj = self.skipper.project(self.layer_idx, hidden_states[0].index_select(0, po_idx), meta.select(po_idx))
                out = out.index_copy(0, po_idx, proj.to(out.dtype))
        return out.unsqueeze(0)

    def _rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of one tensor ``x`` ``[1, heads, n, d]`` with ``cos`` / ``sin`` ``[1, n, d]``:
        the model's own ``apply_rotary_pos_emb`` formula, ``x cos + rotate_half(x) sin``, applied to ``x``
        alone (the library function rotates a query and a key together: calling it with one tensor twice
        would do the work twice)."""
        if self._rotate_half is None:
            return self._rope(x, x, cos, sin)[0]
        return (x * cos.unsqueeze(1)) + (self._rotate_half(x) * sin.unsqueeze(1))

    def _identity_project(self) -> bool:
        """True when Project-Only rows keep their hidden state: no projector plugged at this layer and
        ``project`` not overridden."""
        sk = self.skipper
        return getattr(sk.project, "__func__", None) is Skipper.project and sk.projector(self.layer_idx) is None

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, skipper={type(self.skipper).__name__}, fast_path={self.fast_path}"


def _eager_attention(attn):
    mod = sys.modules[type(attn).__module__]
    return getattr(mod, "eager_attention_forward")


def _rows_of_mask(attention_mask, run_idx, T, K, dtype, layer_idx):
    """The attention mask of the RUN rows ``run_idx`` (sorted, unique): ``[1, h, n_run, K]``.

    With a 4D mask (the engine's packed mask, or a prepared plain mask) its RUN rows are selected (the
    mask itself when every row RUNs: no copy); with
    None (plain causal attention over a cache of K - T past tokens and T new ones) a lower-right
    aligned causal additive mask is built for the RUN rows.
    """
    if attention_mask is None:
        q_pos = (K - T) + run_idx  # [n_run]
        allowed = torch.arange(K, device=run_idx.device)[None, :] <= q_pos[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=run_idx.device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
        return mask[None, None]
    if isinstance(attention_mask, dict):
        raise ValueError(f"routed layer {layer_idx}: got a per-layer-type mask dict; expected this layer's mask")
    if attention_mask.dim() != 4 or attention_mask.shape[0] != 1 or attention_mask.shape[-2] != T:
        raise ValueError(
            f"routed layer {layer_idx}: expected a [1, h, {T}, K] attention mask, got {tuple(attention_mask.shape)}"
        )
    return attention_mask if run_idx.numel() == T else attention_mask.index_select(2, run_idx)


# -- installing ---------------------------------------------------------------------------------------
def _layers(model) -> nn.ModuleList:
    backbone = getattr(model, "model", model)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no .model.layers: routed execution needs a Llama/Qwen3-family LM")
    return layers


def routed_context(model) -> RowContext | None:
    """The :class:`RowContext` of a model with routed layers installed, else None."""
    return getattr(model, _CONTEXT_ATTR, None)


def install_routed_layers(model, skipper: Skipper, *, fast_path: bool = True, record_stats: bool = True) -> RowContext:
    """Replace the routed decoder layers of ``model`` by :class:`RoutedDecoderLayer` (in place).

    Args:
        model: a Llama / Qwen3-family causal LM (``model.model.layers``).
        skipper: the policy; its routed layers are wrapped, the others stay as they are.
        fast_path, record_stats: see :class:`RoutedDecoderLayer` and :class:`RowContext`.

    Returns:
        The model's shared :class:`RowContext` (also ``routed_context(model)``).

    Raises:
        ValueError: if routed layers are already installed, the model is not a supported family, or a
            routed layer index is out of range.
    """
    if routed_context(model) is not None:
        raise ValueError("routed layers are already installed on this model; remove_routed_layers(model) first")
    layers = _layers(model)
    bad = [i for i in skipper.routed_layers if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"routed layers {bad} outside the model's {len(layers)} layers")
    ctx = RowContext(record_stats=record_stats)
    wrapped = {i: RoutedDecoderLayer(layers[i], i, skipper, ctx, fast_path=fast_path) for i in skipper.routed_layers}
    for i, w in wrapped.items():
        layers[i] = w
    object.__setattr__(model, _CONTEXT_ATTR, ctx)
    return ctx


def remove_routed_layers(model) -> None:
    """Put the original decoder layers back (inverse of :func:`install_routed_layers`; no-op if none)."""
    layers = _layers(model)
    for i, layer in enumerate(layers):
        if isinstance(layer, RoutedDecoderLayer):
            layers[i] = layer.layer
    if _CONTEXT_ATTR in model.__dict__:
        object.__delattr__(model, _CONTEXT_ATTR)


# -- plain PyTorch execution --------------------------------------------------------------------------
@torch.no_grad()
def plain_forward(model, input_ids: torch.Tensor, cache, *, request_id: str, prompt_len: int,
                  routed: bool = True) -> torch.Tensor:
    """One plain forward of ``input_ids`` ``[1, S]`` (int64) continuing ``cache`` (a ``DynamicCache``),
    with the rows described to the routed layers (if any) as request ``request_id``; ``routed=False``
    marks the rows dense (the request is in dense mode: the layers run unmodified).

    Returns:
        ``[1, S, V]`` float logits.

    Raises:
        ValueError: for a batch dimension other than 1.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"plain_forward takes one sequence [1, S], got {tuple(input_ids.shape)}")
    start = cache.get_seq_length() if cache is not None else 0
    S = input_ids.shape[1]
    position_ids = torch.arange(start, start + S, device=input_ids.device)[None]
    ctx = routed_context(model)
    if ctx is None:
        return model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True).logits
    meta = RowMeta.for_sequence(request_id, start, S, prompt_len, routed=routed, device=input_ids.device)
    with ctx.rows(meta):
        return model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True).logits


@torch.no_grad()
def plain_greedy(
    model,
    prompt_ids: list[int],
    *,
    request_id: str,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    return_logits: bool = False,
    prefill_routed: bool = True,
    decode_routed=True,
):
    """Greedy decoding of one request in plain PyTorch (one prefill forward, then one forward per token)
    with a ``DynamicCache``; routed layers (if installed) see rows of request ``request_id``.

    The request's modes (Sec. 3.3) can be given to replay what a mode switch decided in the engine:
    ``prefill_routed`` for the prompt rows, ``decode_routed`` for the generated-token rows (a bool, or
    a callable ``token_idx -> bool`` of the row's absolute position, e.g. a promotion point).

    Args:
        model: a causal LM (routed or not).
        prompt_ids: the prompt token ids (non-empty).
        request_id: the id the routes hash (must equal the engine's id to compare with it).
        max_new_tokens: number of tokens to generate (fewer if ``eos_token_id`` is produced).
        eos_token_id: optional stop token (included in the output).
        return_logits: also return the ``[V]`` float logits of each generated step.

    Returns:
        the generated token ids, or ``(ids, logits)`` with ``logits`` a list of ``[V]`` tensors.

    Raises:
        ValueError: for an empty prompt.
    """
    if not prompt_ids:
        raise ValueError("empty prompt")
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    out: list[int] = []
    all_logits = []
    logits = plain_forward(model, ids, cache, request_id=request_id, prompt_len=len(prompt_ids),
                           routed=bool(prefill_routed))[0, -1]
    while True:
        tok = int(logits.argmax())
        out.append(tok)
        all_logits.append(logits.float())
        if len(out) >= max_new_tokens or (eos_token_id is not None and tok == eos_token_id):
            break
        step = torch.tensor([[tok]], dtype=torch.long, device=device)
        pos = len(prompt_ids) + len(out) - 1
        routed = decode_routed(pos) if callable(decode_routed) else decode_routed
        logits = plain_forward(model, step, cache, request_id=request_id, prompt_len=len(prompt_ids),
                               routed=bool(routed))[0, -1]
    return (out, all_logits) if return_logits else out
