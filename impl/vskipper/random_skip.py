"""RandomSkip: the deterministic mock skipper of vSkipper Sec. 3.4 / 4.4.

RandomSkip routes a fixed fraction ``r`` of rows around a fixed fraction ``d`` of the routed layers,
giving skip ratio ``s = r * d``. Every decision is a seeded hash of (request id, token index, layer):
a pure function, identical across arms, repetitions, batch compositions, devices and soft-reset
re-prefills. The hash is SplitMix64 evaluated in torch int64 arithmetic (vectorised, any device), with
a pure-Python twin (:func:`splitmix64`) that the tests check it against.

- A row is *selected* when ``U(seed, request, token, ROW_SALT) < r``.
- A selected row skips exactly ``k = d * n_routed`` (rounded half up) routed layers: with ``layer_choice =
  "per_row"`` (default) the k routed layers with the smallest ``U(seed, request, token, layer)``;
  with ``"fixed"`` the same k layers for every row (smallest ``U(seed, 0, 0, layer)``).

So the realised skip ratio over many rows is ``r * k / n_routed`` (= ``r * d`` when ``d * n_routed``
is an integer, as for the paper's 16 routed layers and d in {1/4, 1/2, 3/4}).
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable

import torch

from .skipper import RowMeta, Skipper, register_skipper

__all__ = ["RandomSkip", "splitmix64", "hash_uniform", "hash_uniform_py"]

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
ROW_SALT = -0x52  # a salt no layer index takes


def _s64(x: int) -> int:
    """Python int -> the signed int64 with the same 64 low bits."""
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    """Pure-Python SplitMix64 finaliser on the low 64 bits of ``x``; returns an unsigned 64-bit int."""
    z = (x + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def hash_uniform_py(seed: int, key: int, token: int, salt: int) -> float:
    """Pure-Python twin of :func:`hash_uniform` for one row: a float in [0, 1)."""
    h = splitmix64(seed & _M64)
    h = splitmix64(h ^ (key & _M64))
    h = splitmix64(h ^ (token & _M64))
    h = splitmix64(h ^ (salt & _M64))
    return (h >> 11) / float(1 << 53)


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors (two's-complement wrap-around = arithmetic mod 2^64)."""
    z = z + _s64(_GOLDEN)
    z = (z ^ _lsr(z, 30)) * _s64(_C1)
    z = (z ^ _lsr(z, 27)) * _s64(_C2)
    return z ^ _lsr(z, 31)


def hash_uniform(seed: int, keys: torch.Tensor, tokens: torch.Tensor, salt) -> torch.Tensor:
    """Seeded uniform in [0, 1) per (request key, token index, salt), vectorised.

    Args:
        seed: integer seed.
        keys: int64 request keys (:func:`impl.vskipper.skipper.request_key`), any shape.
        tokens: int64 absolute token indices, broadcastable with ``keys``.
        salt: python int or int64 tensor broadcastable with them (the layer index, or ``ROW_SALT``).

    Returns:
        float64 tensor of the broadcast shape, equal to :func:`hash_uniform_py` element-wise.
    """
    device = keys.device
    h = _mix(torch.tensor(_s64(seed), dtype=torch.long, device=device))
    h = _mix(h ^ keys.long())
    h = _mix(h ^ tokens.long())
    salt_t = salt.long() if isinstance(salt, torch.Tensor) else torch.tensor(_s64(int(salt)), device=device)
    h = _mix(h ^ salt_t)
    return _lsr(h, 11).double() / float(1 << 53)


@register_skipper("random")
class RandomSkip(Skipper):
    """Seeded-hash mock skipper: a fraction ``r`` of rows skips a fraction ``d`` of the routed layers
    (skip ratio ``s = r * d``; vSkipper Sec. 4.4, Fig. 3).

    Args:
        routed_layers: routed layer indices.
        r: fraction of rows that skip, in [0, 1].
        d: fraction of routed layers a selected row skips, in [0, 1]; rounded half up to ``k``
            of the ``n_routed`` routed layers.
        seed: hash seed.
        layer_choice: ``"per_row"`` (each selected row skips its own hashed subset of k layers) or
            ``"fixed"`` (every selected row skips the same hashed k layers).

    Raises:
        ValueError: if ``r`` or ``d`` is not a number in [0, 1], ``seed`` not an integer, or
            ``layer_choice`` unknown.
    """

    def __init__(self, routed_layers: Iterable[int], r: float, d: float, seed: int = 0, layer_choice: str = "per_row"):
        super().__init__(routed_layers)
        for key, val in (("r", r), ("d", d)):
            if isinstance(val, bool) or not isinstance(val, numbers.Real):
                raise ValueError(f"RandomSkip: {key} must be a number in [0, 1], got {val!r}")
        if not 0.0 <= float(r) <= 1.0 or not 0.0 <= float(d) <= 1.0:
            raise ValueError(f"RandomSkip needs r and d in [0, 1], got r={r}, d={d}")
        if layer_choice not in ("per_row", "fixed"):
            raise ValueError(f"layer_choice must be 'per_row' or 'fixed', got {layer_choice!r}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"RandomSkip: seed must be an integer, got {seed!r}")
        self.r, self.d, self.seed, self.layer_choice = float(r), float(d), int(seed), layer_choice
        n = len(self.routed_layers)
        self.k = int(math.floor(self.d * n + 0.5 + 1e-9))  # round half up
        self._pos = {layer: i for i, layer in enumerate(self.routed_layers)}
        self.register_buffer("_layers", torch.tensor(self.routed_layers, dtype=torch.long), persistent=False)
        if layer_choice == "fixed" and n:
            zeros = torch.zeros(n, dtype=torch.long)
            u = hash_uniform(self.seed, zeros, zeros, self._layers)
            order = sorted(range(n), key=lambda i: (float(u[i]), i))
            self._fixed_skip = frozenset(self.routed_layers[i] for i in order[: self.k])
        else:
            self._fixed_skip = frozenset()

    @property
    def skip_ratio(self) -> float:
        """Expected fraction of (row, routed layer) pairs that take Project-Only: ``r * k / n_routed``."""
        n = len(self.routed_layers)
        return self.r * self.k / n if n else 0.0

    def selected(self, meta: RowMeta) -> torch.Tensor:
        """``[n_rows]`` bool: rows that skip (``U(seed, request, token, ROW_SALT) < r``)."""
        u = hash_uniform(self.seed, meta.request_keys, meta.token_idx, ROW_SALT)
        return u < self.r

    def skips_layer(self, layer_idx: int, meta: RowMeta) -> torch.Tensor:
        """``[n_rows]`` bool: whether a selected row would skip ``layer_idx`` (one of its k layers)."""
        n_rows = len(meta)
        device = meta.token_idx.device
        if self.k == 0 or layer_idx not in self._pos:
            return torch.zeros(n_rows, dtype=torch.bool, device=device)
        if self.layer_choice == "fixed":
            return torch.full((n_rows,), layer_idx in self._fixed_skip, dtype=torch.bool, device=device)
        layers = self._layers.to(device)
        u = hash_uniform(self.seed, meta.request_keys[:, None], meta.token_idx[:, None], layers[None, :])
        j = self._pos[layer_idx]
        mine = u[:, j : j + 1]
        # rank of this layer among the row's routed layers (ties broken by layer order)
        idx = torch.arange(len(self.routed_layers), device=device)
        before = (u < mine) | ((u == mine) & (idx[None, :] < j))
        return before.sum(dim=1) < self.k

    def skip_layers(self, meta: RowMeta) -> torch.Tensor:
        """``[n_rows, n_routed]`` bool: the k routed layers each row would skip if selected (column j for
        ``routed_layers[j]``), all at once: :meth:`skips_layer` for every routed layer.

        ``per_row``: the k layers of smallest ``U(seed, request, token, layer)`` (ties by layer order: a
        stable sort gives each layer its rank); ``fixed``: the same k layers for every row.
        """
        n_rows, n = len(meta), len(self.routed_layers)
        device = meta.token_idx.device
        if self.k == 0 or n == 0:
            return torch.zeros(n_rows, n, dtype=torch.bool, device=device)
        if self.layer_choice == "fixed":
            cols = torch.tensor([layer in self._fixed_skip for layer in self.routed_layers], device=device)
            return cols[None, :].expand(n_rows, -1)
        u = hash_uniform(self.seed, meta.request_keys[:, None], meta.token_idx[:, None],
                         self._layers.to(device)[None, :])  # [n_rows, n] float64
        order = torch.sort(u, dim=1, stable=True).indices  # [n_rows, n]: layer positions by (u, index)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(n, device=device).expand(n_rows, -1))
        return rank < self.k

    def route_tape(self, meta: RowMeta) -> torch.Tensor:
        """``[n_rows, n_routed]`` bool, True = RUN: every routed layer's :meth:`route` of the step in one
        hash evaluation (the route tape, Sec. 3.1). With ``r = 0`` or ``k = 0`` no row can skip, so the
        tape is all RUN without hashing (``U < 0`` never holds)."""
        if self.r == 0.0 or self.k == 0:
            return torch.ones(len(meta), len(self.routed_layers), dtype=torch.bool, device=meta.token_idx.device)
        return ~(self.selected(meta)[:, None] & self.skip_layers(meta))

    def route(self, layer_idx: int, hidden: torch.Tensor, meta: RowMeta) -> torch.Tensor:
        """``[n_rows]`` bool, True = RUN: a row takes Project-Only iff it is selected and
        ``layer_idx`` is one of its k skipped layers. Ignores ``hidden`` (pure hash)."""
        meta = meta if meta.token_idx.device == hidden.device else meta.to(hidden.device)
        return ~(self.selected(meta) & self.skips_layer(layer_idx, meta))

    def extra_repr(self) -> str:
        return (
            f"routed_layers={self.routed_layers}, r={self.r}, d={self.d} (k={self.k}), seed={self.seed}, "
            f"layer_choice={self.layer_choice!r}"
        )
