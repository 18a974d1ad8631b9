"""The skipper interface: per-row RUN / Project-Only decisions at routed layers (vSkipper Sec. 3).

A *row* holds one token's hidden state (one per sequence in decode, several per sequence in prefill).
At every routed layer a skipper decides, for each row of the current batch, one of two whole-layer
actions (Sec. 3, Sec. 3.1 "Project-Only path"):

- ``RUN``: the row goes through the layer's attention read and MLP as usual;
- ``PROJECT_ONLY``: the row still writes this layer's own K/V into the cache (Invariant 1, Sec. 3.2)
  but skips the attention read and the MLP, and its hidden state goes through the skipper's
  projector instead (identity when the skipper plugs none).

A skipper is a :class:`Skipper` subclass that implements :meth:`Skipper.route`; it may plug a
projector per routed layer (:meth:`Skipper.set_projector`). Policies are registered by name
(:func:`register_skipper`, :func:`build_skipper`), and :func:`validate_skipper` is the start-up check
that rejects any policy whose actions fall outside {RUN, PROJECT_ONLY} or that names layers outside
the model (Sec. 3.4). :class:`StaticDepthSkipper` is the worked plugin example (App. A).

Writing a policy (the whole plugin)::

    @register_skipper("every-other")
    class EveryOther(Skipper):
        def route(self, layer_idx, hidden, meta):
            # hidden: [n_rows, H]; meta: RowMeta with n_rows entries; return bool [n_rows], True = RUN
            return (meta.token_idx + layer_idx) % 2 == 0

    skipper = build_skipper("every-other", routed_layers=range(8, 16))
    validate_skipper(skipper, num_layers=16, hidden_size=4096)

Routes should be a pure function of the row (its hidden state, request id, token index and the
layer): the engine may re-prefill a request after a soft reset, and routes that depend on batch
composition or on time would then change the computation mid-request (DESIGN.md, last section).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from ..registry import Registry

__all__ = [
    "Action",
    "Phase",
    "RowMeta",
    "Skipper",
    "StaticDepthSkipper",
    "SKIPPERS",
    "register_skipper",
    "build_skipper",
    "registered_skippers",
    "validate_skipper",
    "as_run_mask",
    "check_route_tape",
    "request_key",
]


class Action(IntEnum):
    """The whole-layer actions of the skipper interface (Sec. 3). ``RUN == 1`` so that a boolean route
    mask (True = RUN) and an integer action tensor mean the same thing."""

    PROJECT_ONLY = 0
    RUN = 1


class Phase(IntEnum):
    """Row phase. A row is PREFILL when its token is a prompt token (token index < prompt length) and
    DECODE when it is a generated token; this is a pure function of the row, so a re-prefilled
    request keeps its rows' phases."""

    PREFILL = 0
    DECODE = 1


@functools.lru_cache(maxsize=1 << 16)
def request_key(request_id: str) -> int:
    """Stable 63-bit integer key of a request id (blake2b, 8-byte digest, top bit cleared).

    The key is the same across processes, runs and machines (unlike ``hash(str)``), so policies that
    hash the request (RandomSkip, Sec. 4.4) are reproducible. Padding rows use key ``-1``.
    """
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True, eq=False)
class RowMeta:
    """Metadata of the ``n_rows`` rows a routed layer sees, in row order.

    Attributes:
        request_ids: ``n_rows`` request ids (``None`` marks an engine padding row).
        token_idx: ``[n_rows]`` int64, the absolute position of each row's token in its request.
        phase: ``[n_rows]`` int64 :class:`Phase` values.
        routed: ``[n_rows]`` bool; False marks a dense row (a dense-mode request mixed into a routed
            batch, or a padding row), which always takes RUN whatever the policy says (Sec. 3
            "Vocabulary"). ``None`` means every row is routed.
        request_keys: ``[n_rows]`` int64 :func:`request_key` of each request id (``-1`` for padding),
            filled automatically.

    Raises:
        ValueError: if the lengths disagree or a tensor has the wrong rank.
    """

    request_ids: tuple
    token_idx: torch.Tensor
    phase: torch.Tensor
    routed: torch.Tensor | None = None
    request_keys: torch.Tensor | None = None

    def __post_init__(self):
        n = len(self.request_ids)
        object.__setattr__(self, "request_ids", tuple(self.request_ids))
        tok = torch.as_tensor(self.token_idx, dtype=torch.long)
        device = tok.device
        phase = torch.as_tensor(self.phase, dtype=torch.long, device=device)
        for name, t in (("token_idx", tok), ("phase", phase)):
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"RowMeta.{name} must have shape [{n}] (one per request id), got {tuple(t.shape)}")
        object.__setattr__(self, "token_idx", tok)
        object.__setattr__(self, "phase", phase)
        if self.routed is not None:
            routed = torch.as_tensor(self.routed, dtype=torch.bool, device=device)
            if routed.dim() != 1 or routed.shape[0] != n:
                raise ValueError(f"RowMeta.routed must have shape [{n}], got {tuple(routed.shape)}")
            object.__setattr__(self, "routed", routed)
        if self.request_keys is None:
            keys = [(-1 if r is None else request_key(str(r))) for r in self.request_ids]
            object.__setattr__(self, "request_keys", torch.tensor(keys, dtype=torch.long, device=device))

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def n_rows(self) -> int:
        """Number of rows."""
        return len(self.request_ids)

    @property
    def is_padding(self) -> torch.Tensor:
        """``[n_rows]`` bool, True for engine padding rows (request id None)."""
        return self.request_keys < 0

    @functools.cached_property
    def routed_mask(self) -> torch.Tensor:
        """``[n_rows]`` bool: rows the policy decides for (routed and not padding). Computed once per
        instance (the metadata is immutable; the batch's context and its route tape both read it)."""
        m = ~self.is_padding
        return m if self.routed is None else m & self.routed

    def to(self, device) -> "RowMeta":
        """Copy of the metadata with its tensors on ``device``."""
        return RowMeta(
            self.request_ids,
            self.token_idx.to(device),
            self.phase.to(device),
            None if self.routed is None else self.routed.to(device),
            self.request_keys.to(device),
        )

    def select(self, idx: torch.Tensor) -> "RowMeta":
        """Rows ``idx`` (``[k]`` int64 indices) as a new :class:`RowMeta` of length k."""
        idx_list = idx.tolist()
        return RowMeta(
            tuple(self.request_ids[i] for i in idx_list),
            self.token_idx[idx],
            self.phase[idx],
            None if self.routed is None else self.routed[idx],
            self.request_keys[idx],
        )

    def pad_to(self, n_rows: int, token_idx: torch.Tensor | None = None) -> "RowMeta":
        """Extend with padding rows up to ``n_rows`` (engines pad batches for static shapes).

        Args:
            n_rows: target length, ``>= len(self)``.
            token_idx: optional ``[n_rows - len(self)]`` positions for the padding rows (default 0).

        Raises:
            ValueError: if ``n_rows < len(self)``.
        """
        extra = n_rows - len(self)
        if extra < 0:
            raise ValueError(f"cannot pad {len(self)} rows down to {n_rows}")
        if extra == 0:
            return self
        dev = self.token_idx.device
        tok = torch.zeros(extra, dtype=torch.long, device=dev) if token_idx is None else token_idx.long().to(dev)
        routed = torch.ones(len(self), dtype=torch.bool, device=dev) if self.routed is None else self.routed
        return RowMeta(
            self.request_ids + (None,) * extra,
            torch.cat([self.token_idx, tok]),
            torch.cat([self.phase, torch.full((extra,), int(Phase.DECODE), dtype=torch.long, device=dev)]),
            torch.cat([routed, torch.zeros(extra, dtype=torch.bool, device=dev)]),
            torch.cat([self.request_keys, torch.full((extra,), -1, dtype=torch.long, device=dev)]),
        )

    @classmethod
    def for_sequence(
        cls, request_id: str, start: int, length: int, prompt_len: int, *, routed: bool = True, device=None
    ) -> "RowMeta":
        """Rows of ``length`` consecutive tokens of one request starting at absolute position ``start``.

        Args:
            request_id: the request id.
            start: position of the first row's token.
            length: number of rows.
            prompt_len: the request's prompt length (rows with position < prompt_len are PREFILL).
            routed: False to mark every row dense (always RUN).
            device: device of the tensors.
        """
        tok = torch.arange(start, start + length, dtype=torch.long, device=device)
        phase = (tok >= prompt_len).long()
        return cls((request_id,) * length, tok, phase, torch.full((length,), routed, dtype=torch.bool, device=device))

    @classmethod
    def concat(cls, parts: Sequence["RowMeta"]) -> "RowMeta":
        """Concatenate row metadata in order (e.g. one part per request of a packed batch)."""
        if not parts:
            return cls((), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        dev = parts[0].token_idx.device
        routed = [p.routed if p.routed is not None else torch.ones(len(p), dtype=torch.bool, device=dev) for p in parts]
        return cls(
            sum((p.request_ids for p in parts), ()),
            torch.cat([p.token_idx for p in parts]),
            torch.cat([p.phase for p in parts]),
            torch.cat(routed),
            torch.cat([p.request_keys for p in parts]),
        )


def as_run_mask(actions, n_rows: int, *, layer_idx: int | None = None, who: str = "skipper") -> torch.Tensor:
    """Normalise a route result to a ``[n_rows]`` bool mask (True = RUN).

    Args:
        actions: what ``route`` returned: a bool tensor, or an integer tensor of :class:`Action` values.
        n_rows: the expected number of rows.
        layer_idx, who: used in the error message.

    Returns:
        ``[n_rows]`` torch.bool mask on the actions' device.

    Raises:
        ValueError: if ``actions`` is not a tensor, has the wrong shape, is a floating/complex tensor, or
            holds integer values outside {PROJECT_ONLY=0, RUN=1} (Sec. 3.4: the runtime rejects any
            action outside the whole-layer set).
    """
    where = f"{who}.route(layer {layer_idx})" if layer_idx is not None else f"{who}.route"
    if not isinstance(actions, torch.Tensor):
        raise ValueError(f"{where} must return a torch.Tensor of per-row actions, got {type(actions).__name__}")
    if tuple(actions.shape) != (n_rows,):
        raise ValueError(f"{where} must return shape [{n_rows}] (one action per row), got {tuple(actions.shape)}")
    if actions.dtype == torch.bool:
        return actions
    if actions.is_floating_point() or actions.is_complex():
        raise ValueError(
            f"{where} returned a {actions.dtype} tensor: actions must be bool (True = RUN) or integers in "
            "{PROJECT_ONLY=0, RUN=1}"
        )
    bad = (actions != int(Action.RUN)) & (actions != int(Action.PROJECT_ONLY))
    if bool(bad.any()):
        values = sorted(set(actions[bad].tolist()))[:5]
        raise ValueError(
            f"{where} returned actions {values} outside the whole-layer set {{PROJECT_ONLY=0, RUN=1}}"
        )
    return actions == int(Action.RUN)


def check_route_tape(tape, n_rows: int, n_routed: int, *, who: str = "skipper") -> torch.Tensor:
    """Check a :meth:`Skipper.route_tape` result: a ``[n_rows, n_routed]`` torch.bool tensor.

    Returns:
        ``tape`` unchanged.

    Raises:
        ValueError: if it is not a tensor, not bool, or of another shape.
    """
    if not isinstance(tape, torch.Tensor) or tape.dtype != torch.bool:
        what = tape.dtype if isinstance(tape, torch.Tensor) else type(tape).__name__
        raise ValueError(f"{who}.route_tape must return a torch.bool tensor (True = RUN), got {what}")
    if tuple(tape.shape) != (n_rows, n_routed):
        raise ValueError(f"{who}.route_tape must return shape [{n_rows}, {n_routed}] (rows x routed layers), got "
                         f"{tuple(tape.shape)}")
    return tape


class Skipper(nn.Module):
    """Base class of skip policies (the skipper interface, Sec. 3).

    Subclasses implement :meth:`route`. A skipper is an ``nn.Module`` so that trained gates and
    projectors move with ``.to(device)`` and load from state dicts.

    Args:
        routed_layers: the decoder layer indices (0-based) the skipper routes; the other layers always
            run dense. Kept as a sorted tuple in ``self.routed_layers``.

    Attributes:
        prefix_shareable: whether two requests with the same token prefix always get the same routes
            on it (True for policies that depend only on hidden states / positions, False when routes
            hash the request id). The engine binding refuses prefix-block sharing otherwise.
    """

    prefix_shareable: bool = False
    #: True when a RUN row's output is the unmodified layer's output (``run_epilogue`` is the identity).
    #: A policy whose epilogue rescales RUN rows (FlexiDepth: ``h + attn + w * mlp``) sets False, and the
    #: routed layer then never takes the all-RUN fast path on routed rows (it would skip the epilogue).
    identity_run: bool = True

    def __init__(self, routed_layers: Iterable[int]):
        super().__init__()
        layers = list(routed_layers)
        self.routed_layers: tuple[int, ...] = tuple(sorted(int(x) for x in layers)) if layers else ()
        self._declared_layers = layers
        self.projectors = nn.ModuleDict()

    # -- the policy ------------------------------------------------------------------------------------
    def route(self, layer_idx: int, hidden: torch.Tensor, meta: RowMeta) -> torch.Tensor:
        """Decide RUN / PROJECT_ONLY for every row at one routed layer.

        Args:
            layer_idx: the 0-based decoder layer index (one of ``self.routed_layers``).
            hidden: ``[n_rows, H]`` hidden states entering the layer (model dtype), rows in batch order.
            meta: the rows' :class:`RowMeta` (request ids, absolute token indices, phases).

        Returns:
            ``[n_rows]`` torch.bool mask, True = RUN (an integer tensor of :class:`Action` values is
            also accepted).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement route(layer_idx, hidden, meta)")

    def route_tape(self, meta: RowMeta) -> torch.Tensor | None:
        """Every routed layer's route of one engine step at once: the *route tape* (Sec. 3.1).

        A policy whose decisions do not depend on hidden states (request-hash policies such as
        RandomSkip, static depth) computes the whole step's masks once; the routed layers then read
        their column instead of calling :meth:`route` per layer, and a layer whose column is all RUN
        takes the dense path with no per-row work. Hidden-state policies (FlexiDepth) return None
        (default) and are asked per layer, as they must be.

        Args:
            meta: the step's :class:`RowMeta` (``n_rows`` rows, padding included).

        Returns:
            ``[n_rows, n_routed]`` torch.bool (True = RUN), column ``j`` for ``routed_layers[j]``, equal
            to ``route(routed_layers[j], hidden, meta)`` for any ``hidden``; or None.
        """
        return None

    # -- the Project-Only path ------------------------------------------------------------------------
    def projector(self, layer_idx: int) -> nn.Module | None:
        """The projector plugged at ``layer_idx``, or None (Project-Only rows keep their hidden state)."""
        key = str(int(layer_idx))
        return self.projectors[key] if key in self.projectors else None

    def set_projector(self, layer_idx: int, module: nn.Module | None) -> None:
        """Plug ``module`` (``[k, H] -> [k, H]``) as the projector of ``layer_idx``; None removes it."""
        key = str(int(layer_idx))
        if module is None:
            if key in self.projectors:
                del self.projectors[key]
        else:
            self.projectors[key] = module

    def project(self, layer_idx: int, hidden: torch.Tensor, meta: RowMeta) -> torch.Tensor:
        """Output of the Project-Only rows at ``layer_idx`` (Sec. 3.1).

        Args:
            hidden: ``[k, H]`` hidden states of the k Project-Only rows entering the layer.
            meta: their :class:`RowMeta`.

        Returns:
            ``[k, H]``: ``projector(hidden)`` when a projector is plugged, else ``hidden`` unchanged.
            Override to mix the projector with a router weight (FlexiDepth).
        """
        proj = self.projector(layer_idx)
        return hidden if proj is None else proj(hidden)

    def run_epilogue(
        self,
        layer_idx: int,
        hidden_in: torch.Tensor,
        hidden_out: torch.Tensor,
        meta: RowMeta,
        *,
        hidden_mid: torch.Tensor | None = None,
        mlp_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hook on the RUN cohort's output before it is scattered back (the "weighted scatter" epilogue,
        Sec. 3.1). Default: ``hidden_out`` unchanged.

        The routed layer calls it for the *routed* RUN rows only: dense rows (``RowMeta.routed`` False)
        keep the unmodified layer's output, so a dense row in a mixed batch computes exactly what dense
        mode computes (Sec. 3 "Vocabulary"). Set :attr:`identity_run` False when overriding it.

        Args:
            hidden_in: ``[k, H]`` the RUN rows' hidden states entering the layer.
            hidden_out: ``[k, H]`` their outputs of the full layer
                (``hidden_out = hidden_mid + mlp_out``).
            meta: their :class:`RowMeta`.
            hidden_mid: ``[k, H]`` the attention residual ``hidden_in + attention_out`` (the MLP's input
                before its norm), passed by :class:`~impl.vskipper.routed.RoutedDecoderLayer`.
            mlp_out: ``[k, H]`` the MLP's residual contribution.
        """
        return hidden_out

    def extra_repr(self) -> str:
        return f"routed_layers={self.routed_layers}"


# -- registry -----------------------------------------------------------------------------------------
#: the skip policies by name (:class:`impl.registry.Registry`; classes or factories of a Skipper)
SKIPPERS: Registry[Callable[..., Skipper]] = Registry("skipper", base=Skipper)
# the built-in policies, lazily (their modules register the same objects again when imported)
SKIPPERS.register("random", "impl.vskipper.random_skip:RandomSkip", aliases=("randomskip", "random_skip", "random-skip"))
SKIPPERS.register("flexidepth", "impl.vskipper.flexidepth:flexidepth_factory")


def register_skipper(name: str, *, aliases: Sequence[str] = ()):
    """Class (or factory) decorator registering a skip policy under ``name`` (and ``aliases``) in
    :data:`SKIPPERS`, for :func:`build_skipper` and the skipper-spec grammar (:mod:`impl.vskipper.spec`).

    Raises:
        ValueError: if ``name`` is empty or already registered to a different object.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("a skipper name must be a non-empty string")
    return SKIPPERS.register(name, aliases=tuple(aliases))


def registered_skippers() -> list[str]:
    """Sorted names of the registered skip policies."""
    return sorted(SKIPPERS.names())


def build_skipper(name: str, **kwargs) -> Skipper:
    """Instantiate the policy registered as ``name`` with ``kwargs``.

    Raises:
        ValueError: for an unknown name (the message lists the registered ones) or when the factory
            does not return a :class:`Skipper`.
    """
    skipper = SKIPPERS.build(name, **kwargs)
    if not isinstance(skipper, Skipper):
        raise ValueError(f"skipper factory {name!r} returned {type(skipper).__name__}, not a Skipper")
    return skipper


# -- start-up validation ------------------------------------------------------------------------------
def validate_skipper(
    skipper: Skipper,
    num_layers: int,
    *,
    hidden_size: int | None = None,
    probe_rows: int = 8,
    device=None,
    dtype: torch.dtype | None = None,
) -> None:
    """Start-up check of a skip policy (Sec. 3.4: "the runtime rejects any policy whose actions fall
    outside the whole-layer {RUN, Project-Only} set").

    It checks the routed layers against the model, then probes ``route`` and ``project`` at every
    routed layer on a seeded batch of ``probe_rows`` rows from two requests in both phases.

    Args:
        skipper: the policy.
        num_layers: the model's number of decoder layers L.
        hidden_size: H of the probe hidden states (default: ``skipper.hidden_size`` if set, else 16).
        probe_rows: number of probe rows (>= 2).
        device, dtype: of the probe hidden states (default: the skipper's parameters', else CPU fp32).

    Raises:
        ValueError: if ``skipper`` is not a :class:`Skipper`; if it routes no layer, a duplicated
            layer, or a layer outside ``[0, num_layers)``; if a projector is plugged at a layer it does
            not route; if ``route`` returns anything but a ``[n_rows]`` bool / {0, 1} integer tensor,
            returns different actions for the same rows twice (routes must be pure), or raises; if
            ``project`` does not return ``[k, H]``.
    """
    if not isinstance(skipper, Skipper):
        raise ValueError(f"a skipper must subclass impl.vskipper.Skipper, got {type(skipper).__name__}")
    name = type(skipper).__name__
    declared = list(getattr(skipper, "_declared_layers", skipper.routed_layers))
    if not skipper.routed_layers:
        raise ValueError(f"{name} routes no layer (routed_layers is empty)")
    if len(set(skipper.routed_layers)) != len(skipper.routed_layers) or len(declared) != len(skipper.routed_layers):
        raise ValueError(f"{name} lists a routed layer twice: {declared}")
    outside = [x for x in skipper.routed_layers if not 0 <= x < num_layers]
    if outside:
        raise ValueError(
            f"{name} routes layers {outside} outside the model's layers [0, {num_layers}) "
            f"(routed_layers={skipper.routed_layers})"
        )
    stray = sorted(int(k) for k in skipper.projectors.keys() if int(k) not in skipper.routed_layers)
    if stray:
        raise ValueError(f"{name} plugs projectors at layers {stray} outside its routed layers {skipper.routed_layers}")

    params = list(skipper.parameters())
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    if dtype is None:
        dtype = params[0].dtype if params and params[0].is_floating_point() else torch.float32
    hidden_size = int(hidden_size or getattr(skipper, "hidden_size", None) or 16)
    probe_rows = max(2, int(probe_rows))

    gen = torch.Generator().manual_seed(1234)
    hidden = torch.randn(probe_rows, hidden_size, generator=gen).to(device=device, dtype=dtype)
    half = probe_rows // 2
    meta = RowMeta.concat(
        [
            RowMeta.for_sequence("__probe_a__", 0, half, prompt_len=max(1, half - 1), device=device),
            RowMeta.for_sequence("__probe_b__", 7, probe_rows - half, prompt_len=9, device=device),
        ]
    )
    was_training = skipper.training
    skipper.eval()
    try:
        with torch.no_grad():
            try:
                tape = skipper.route_tape(meta)
            except Exception as exc:  # noqa: BLE001 - re-raised with context
                raise ValueError(f"{name}.route_tape failed on the start-up probe: {exc!r}") from exc
            if tape is not None:
                tape = check_route_tape(tape, probe_rows, len(skipper.routed_layers), who=name)
            for layer in skipper.routed_layers:
                try:
                    first = skipper.route(layer, hidden, meta)
                    second = skipper.route(layer, hidden.clone(), meta)
                except Exception as exc:  # noqa: BLE001 - re-raised with context
                    raise ValueError(f"{name}.route(layer {layer}) failed on the start-up probe: {exc!r}") from exc
                m1 = as_run_mask(first, probe_rows, layer_idx=layer, who=name)
                m2 = as_run_mask(second, probe_rows, layer_idx=layer, who=name)
                if not torch.equal(m1, m2):
                    raise ValueError(
                        f"{name}.route(layer {layer}) is not deterministic: the same rows got different actions"
                    )
                if tape is not None and not torch.equal(tape[:, skipper.routed_layers.index(layer)], m1):
                    raise ValueError(f"{name}.route_tape disagrees with {name}.route(layer {layer}) on the start-up "
                                     "probe: the tape must hold every routed layer's route")
                idx = torch.arange(2, device=device)
                try:
                    out = skipper.project(layer, hidden[:2], meta.select(idx))
                except Exception as exc:  # noqa: BLE001
                    raise ValueError(f"{name}.project(layer {layer}) failed on the start-up probe: {exc!r}") from exc
                if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, hidden_size):
                    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise ValueError(f"{name}.project(layer {layer}) must return [k, {hidden_size}], got {shape}")
    finally:
        skipper.train(was_training)


# -- the worked plugin example (App. A) ---------------------------------------------------------------
@register_skipper("static-depth", aliases=("static", "static_depth"))
class StaticDepthSkipper(Skipper):
    """Static-depth policy (vSkipper App. A, the plugin example): every row RUNs the first ``n_run``
    routed layers and takes Project-Only on the remaining ones (no projector: identity).

    Args:
        routed_layers: routed layer indices.
        n_run: how many of the routed layers (in increasing order) every row runs, ``0 <= n_run <=
            len(routed_layers)``.

    Raises:
        ValueError: if ``n_run`` is out of range.
    """

    prefix_shareable = True

    def __init__(self, routed_layers: Iterable[int], n_run: int):
        super().__init__(routed_layers)
        if not 0 <= int(n_run) <= len(self.routed_layers):
            raise ValueError(f"n_run={n_run} must lie in [0, {len(self.routed_layers)}] (the number of routed layers)")
        self.n_run = int(n_run)
        self._run_layers = frozenset(self.routed_layers[: self.n_run])

    def route(self, layer_idx: int, hidden: torch.Tensor, meta: RowMeta) -> torch.Tensor:
        """All rows RUN at the first ``n_run`` routed layers, Project-Only after; ``[n_rows]`` bool."""
        return torch.full((hidden.shape[0],), layer_idx in self._run_layers, dtype=torch.bool, device=hidden.device)

    def route_tape(self, meta: RowMeta) -> torch.Tensor:
        """``[n_rows, n_routed]`` bool: column j is RUN iff j < ``n_run`` (the same for every row)."""
        cols = torch.arange(len(self.routed_layers), device=meta.token_idx.device) < self.n_run
        return cols[None, :].expand(len(meta), -1)

    def extra_repr(self) -> str:
        return f"routed_layers={self.routed_layers}, n_run={self.n_run}"
