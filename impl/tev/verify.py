"""Exact fixed-tree verifiers (TEV paper, Sec. 2 "Two representative exact verifiers", App. A.4, and
Sec. 4 / App. B, Algorithm 1).

Every verifier has the signature ``f(parents, tokens, probs, generator) -> (path, bonus)``:

* ``parents``, ``tokens``: the draft tree (see :mod:`impl.tev.tree`; N nodes, root 0);
* ``probs``: floating ``[N, V]``, row v = p_v, the target next-token distribution at node v after
  temperature (and any truncation) has been applied by the caller; rows must sum to 1 (1e-4);
* ``generator``: the ``torch.Generator`` (on ``probs.device``) that supplies all randomness;
* ``path``: ``list[int]``, the accepted node ids from the root (included) to the exit node V, so
  D = len(path) - 1 draft tokens are accepted;
* ``bonus``: ``int``, the bonus token Y drawn after pi(V); the round commits
  ``pi(V) || Y`` = ``[tokens[u] for u in path[1:]] + [bonus]`` (L = D + 1 tokens).

All three are exact and saturated (Corollaries 1 and 2): (V, Y) has law w(v) p_v^res(y), so the
committed block is distributed as target sampling token by token, and E[L] = 1 + C_p(T). With
one-hot rows (T = 0) each returns the argmax-follow path of :func:`greedy_follow`, whatever the
generator's state.

Hot-path options (keywords, same law): ``validate=False`` skips the tree and row checks for trees
validated when they were built (:class:`impl.tev.tree.DraftTree`) and rows valid by construction (a
softmax), as :func:`impl.tev.decode.tev_decode` does; ``sampler`` picks the categorical primitive,
``"cdf"`` (default: an exact float64 inverse CDF, one uniform per draw; batched over rows by
:func:`inverse_cdf_rows`) or ``"multinomial"`` (``torch.multinomial``, the exponential race that
DDTree's ``sample`` calls, one exponential variate per entry). No verifier copies ``probs`` to
float64: predraw reads every row (its block sums, batched), sequential residual converts the rows
it visits, TEV reads the N - 1 edge probabilities and the exit node's row (block sums plus one
block; :func:`_residual_draw`). The verifiers run under ``torch.inference_mode`` (they return Python
ints only).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from typing import Callable

import numpy as np
import torch

from ..registry import Registry
from .exit_law import (
    PROB_ATOL,
    RHO_RECHECK,
    check_target_probs,
    edge_probs,
    exit_cdf,
    host_view,
    law_from_edges,
    unchecked_exit_cdf,
)
from .plan import TreePlan, tree_plan
from .parents import IntSeq, path_to, validate_tree

Verifier = Callable[..., tuple[list[int], int]]

#: sampling primitives: ``"cdf"`` (exact float64 inverse CDF, one uniform per draw; default) or
#: ``"multinomial"`` (``torch.multinomial``, the exponential race DDTree's ``sample`` calls)
SAMPLERS = ("cdf", "multinomial")
#: predraw modes: ``"all"`` (DDTree: one token pre-drawn at every node, one batched draw) or
#: ``"visited"`` (a token drawn only at the nodes the walk reaches; same law, fewer draws)
PREDRAW_MODES = ("all", "visited")


def _inference_mode(fn: Callable) -> Callable:
    """Run ``fn`` under ``torch.inference_mode``, entering it only when the caller has not (the
    decode loop and the latency benchmark already run under it; entering costs ~1 us a call).
    Applied alike to every verifier."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper


def _check_generator(generator) -> None:
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def _child_index(par: list[int], tok: list[int]) -> list[dict[int, int]]:
    """Per node, a map from child token to child id (children in ascending id order)."""
    kids: list[dict[int, int]] = [{} for _ in par]
    for u in range(1, len(par)):
        kids[par[u]][tok[u]] = u
    return kids


def _lists(parents: IntSeq, tokens: IntSeq) -> tuple[list[int], list[int]]:
    """Plain int lists of an already validated tree (no checks)."""
    par = parents.tolist() if isinstance(parents, torch.Tensor) else parents
    tok = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return par, tok


def _checked(parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, atol: float):
    """Validate the tree and the rows cheaply (no float64 copy of ``probs``).

    Returns ``(parents, tokens, row_sums)``: two ``list[int]`` and the ``[N]`` row sums. Any failure
    is re-diagnosed by :func:`impl.tev.exit_law.check_target_probs`, which raises the precise error.
    """
    par, tok, _ = validate_tree(parents, tokens)
    ok = (isinstance(probs, torch.Tensor) and probs.dtype.is_floating_point and probs.dim() == 2
          and probs.shape[0] == len(par) and probs.shape[1] >= 1 and max(tok[1:], default=0) < probs.shape[1])
    if ok:
        s = probs.detach().sum(-1)
        # a non-finite entry makes its row sum non-finite (or the minimum negative): one pass each
        ok = bool(torch.isfinite(s).all()) and float(probs.min()) >= 0 and float((s - 1).abs().max()) <= atol
        if ok:
            return par, tok, s
    check_target_probs(par, tok, probs, atol)  # raises the specific error
    raise ValueError("probs failed validation (non-finite row sum)")  # pragma: no cover - overflow only


def _plan(parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, atol: float, validate: bool,
          plan: TreePlan | None) -> tuple[TreePlan, np.ndarray | None]:
    """The tree plan a verifier works from, and the float64 row sums when validating (else None).

    With ``validate`` the tree and rows are checked (:func:`_checked`) and a given plan must describe
    the same tree; without it a given plan is trusted (only its size is compared) and a missing one
    is built (:func:`impl.tev.plan.tree_plan`, which validates the tree)."""
    if plan is not None and not isinstance(plan, TreePlan):
        raise ValueError(f"plan must be an impl.tev.plan.TreePlan (tree.plan()), got {type(plan).__name__}")
    row_sums = None
    if validate:
        par, tok, s = _checked(parents, tokens, probs, atol)
        row_sums = s.to(device="cpu", dtype=torch.float64).numpy()
        if plan is not None and (plan.parents != par or plan.tokens != tok):
            raise ValueError("plan does not describe the tree (parents, tokens) it was passed with")
        return (plan if plan is not None else tree_plan(par, tok)), row_sums
    if plan is None:
        return tree_plan(*_lists(parents, tokens)), None
    if len(plan) != len(parents):
        raise ValueError(f"plan has {len(plan)} nodes but the tree has {len(parents)}")
    return plan, None


# --- sampling primitives -------------------------------------------------------------------------

def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> int:
    """Index i with C(i-1) <= u C(V-1) < C(i), C the float64 cumulative sum of the 1-D non-negative
    ``weights`` (positive total), for a float64 uniform ``u`` of shape [1]; a zero-weight index is
    never returned."""
    c = weights.cumsum(0, dtype=torch.float64)
    i = int(torch.searchsorted(c, u * c[-1:], right=True))
    if i >= c.numel():  # u * total rounded up to the total, or a zero / non-finite total
        total = float(c[-1])
        if not 0 < total < float("inf"):
            raise ValueError(f"cannot sample from weights with total {total}")
        i = int(torch.nonzero(weights > 0).flatten()[-1])
    return i


def _inverse_cdf_at(weights: torch.Tensor, u: float) -> int:
    """As :func:`_inverse_cdf` for a float64 1-D tensor ``weights`` and a Python float uniform ``u``
    (the same float64 target ``u * total``, passed to ``searchsorted`` as a scalar)."""
    c = weights.cumsum(0)
    total = float(c[-1])
    i = int(torch.searchsorted(c, u * total, right=True))
    if i >= c.numel():  # u * total rounded up to the total, or a zero / non-finite total
        if not 0 < total < float("inf"):
            raise ValueError(f"cannot sample from weights with total {total}")
        i = int(torch.nonzero(weights > 0).flatten()[-1])
    return i


#: below this many weights the inverse CDF runs on Python floats (fewer tensor dispatches)
_SMALL = 512


def _categorical(weights: torch.Tensor, generator: torch.Generator, sampler: str = "cdf") -> int:
    """One draw from the categorical law proportional to the 1-D non-negative ``weights``
    (``"cdf"``: one float64 uniform, exact inverse CDF; ``"multinomial"``: ``torch.multinomial``)."""
    if sampler == "multinomial":
        return int(torch.multinomial(weights, 1, generator=generator))
    u = torch.rand(1, dtype=torch.float64, generator=generator, device=weights.device)
    if weights.numel() > _SMALL:
        return _inverse_cdf(weights, u)
    w = weights.tolist()
    c = list(itertools.accumulate(w))  # the same sequential float64 sums as cumsum
    total = c[-1]
    i = bisect.bisect_right(c, float(u) * total)
    if i >= len(c):  # u * total rounded up to the total, or a zero / non-finite total
        if not 0 < total < float("inf"):
            raise ValueError(f"cannot sample from weights with total {total}")
        i = max(k for k, x in enumerate(w) if x > 0)
    return i


def _block(v_size: int) -> int:
    b = 1
    while b * b < v_size:
        b *= 2
    return b


@functools.lru_cache(maxsize=None)
def _blocks(v_size: int) -> tuple[int, int, int, int]:
    """``(blk, shift, n_full_blocks, full)`` of the two-level search over a row of ``v_size``:
    power-of-two blocks of ~sqrt(V) entries, token a in block ``a >> shift``, ``full`` the entries
    covered by whole blocks (a shorter tail block follows when ``full < v_size``)."""
    blk = _block(v_size)
    sh = blk.bit_length() - 1
    nb = v_size >> sh
    return blk, sh, nb, nb << sh


def inverse_cdf_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per row of ``probs`` for given uniforms: a two-level (block, then
    within-block) search that reads the ``[N, V]`` matrix once.

    Row r returns the index i with C_r(i-1) <= u_r C_r(V-1) < C_r(i), C_r the cumulative sum of row r:
    block sums of ~sqrt(V) entries (accumulated in the dtype of ``probs``) locate the block through
    a float64 cumulative sum, then a float64 cumulative sum inside that block locates the token. A
    row where rounding between the two levels would land on a zero-probability index (at a block
    edge; probability ~1e-7 per row) is redrawn with the same uniform by the exact one-level float64
    search, so a zero-probability token is never returned.

    Args:
        probs: floating ``[N, V]``, non-negative rows with positive sums (not necessarily normalised).
        u: float64 ``[N]`` uniforms in [0, 1).

    Returns:
        int64 ``[N]`` token ids.
    """
    n, v_size = probs.shape
    blk = _block(v_size)
    nb = -(-v_size // blk)
    x = probs if nb * blk == v_size else torch.nn.functional.pad(probs, (0, nb * blk - v_size))
    xb = x.reshape(n, nb, blk)
    bsum = xb.sum(-1).to(torch.float64)  # [N, nb] block masses
    cb = bsum.cumsum(-1)
    t = (u * cb[:, -1]).unsqueeze(1)  # [N, 1] target mass
    b = torch.searchsorted(cb, t, right=True).clamp_max_(nb - 1)  # [N, 1] block
    rows = xb.gather(1, b.unsqueeze(2).expand(n, 1, blk)).squeeze(1)  # [N, blk]
    j = torch.searchsorted(rows.cumsum(-1, dtype=torch.float64), t - (cb - bsum).gather(1, b),
                           right=True).clamp_max_(blk - 1)
    idx = (b * blk + j).squeeze(1)
    bad = rows.gather(1, j) <= 0
    if bool(bad.any()):  # rounding at a block edge: exact one-level search with the same uniform
        for r in torch.nonzero(bad.squeeze(1)).flatten().tolist():
            idx[r] = _inverse_cdf(probs[r], u[r:r + 1])
    return idx


def _categorical_rows(probs: torch.Tensor, generator: torch.Generator, sampler: str = "cdf") -> list[int]:
    """One independent draw per row of ``probs`` ``[N, V]`` in one batched operation."""
    if sampler == "multinomial":
        return torch.multinomial(probs, 1, generator=generator).flatten().tolist()
    u = torch.rand(probs.shape[0], dtype=torch.float64, generator=generator, device=probs.device)
    return inverse_cdf_rows(probs, u).tolist()


# --- verifiers -----------------------------------------------------------------------------------

@_inference_mode
def predraw_follow(
    parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, generator: torch.Generator, atol: float = PROB_ATOL,
    *, validate: bool = True, sampler: str = "cdf", draws: str = "all", plan: TreePlan | None = None,
) -> tuple[list[int], int]:
    """DDTree's predraw-and-follow verifier (TEV Sec. 2; App. A.4.1, Eqs. 42-44).

    One target token R_v ~ p_v is pre-drawn independently at every node (one batched draw over the
    N rows, as DDTree samples every tree row of the target forward before following). Starting at
    the root, the verifier moves to the child u with x_u = R_v while one exists; at the first node v
    without such a child it stops, and R_v is the bonus token. The child lookup is the tree plan's
    dict keyed by (parent, token) (DDTree's builder returns the same child maps with the tree).

    Args:
        parents: N parent indices; tokens: N incoming tokens (see module docstring).
        probs: floating ``[N, V]`` target distributions p_v (each row's law is the row over its sum).
        generator: ``torch.Generator`` on ``probs.device``.
        atol: row-sum tolerance of ``probs``.
        validate: check the tree and rows (default). Pass False only for a tree validated at build
            time (:class:`impl.tev.tree.DraftTree`) and rows that are valid by construction (softmax).
        sampler: ``"cdf"`` (one uniform per node, exact float64 inverse CDF through
            :func:`inverse_cdf_rows`) or ``"multinomial"`` (``torch.multinomial`` over the ``[N, V]``
            rows, the exponential race DDTree's ``sample`` uses; on CPU it costs one exponential
            variate per entry).
        draws: ``"all"`` (DDTree) or ``"visited"`` (draw R_v only at the nodes the walk reaches: the
            same law, since the other draws are never read).
        plan: the tree's :class:`impl.tev.plan.TreePlan` (``tree.plan()``), built when the tree was
            fixed; None builds it here (validating the tree).

    Returns:
        ``(path, bonus)``: accepted node ids root..V (``list[int]``) and the bonus token id (int).

    Raises:
        ValueError: invalid tree or ``probs`` (see :func:`impl.tev.exit_law.check_target_probs`), a
            ``generator`` that is not a ``torch.Generator``, or an unknown ``sampler`` / ``draws``.
    """
    _check_generator(generator)
    _check_choice("sampler", sampler, SAMPLERS)
    _check_choice("draws", draws, PREDRAW_MODES)
    plan = _plan(parents, tokens, probs, atol, validate, plan)[0]
    kids = plan.child_map
    path = [0]
    if draws == "all":
        drawn = _categorical_rows(probs, generator, sampler)  # R_v for every v
        while (path[-1], drawn[path[-1]]) in kids:
            path.append(kids[(path[-1], drawn[path[-1]])])
        return path, drawn[path[-1]]
    while True:
        r = _categorical(probs[path[-1]], generator, sampler)
        u = kids.get((path[-1], r))
        if u is None:
            return path, r
        path.append(u)


@_inference_mode
def sequential_residual(
    parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, generator: torch.Generator, atol: float = PROB_ATOL,
    *, validate: bool = True, sampler: str = "cdf", plan: TreePlan | None = None,
) -> tuple[list[int], int]:
    """EAGLE-style exact sequential residual verification (TEV Sec. 2; App. A.4.2, Eqs. 45-53).

    At the current node v the drafted children u_1, ..., u_k are tested in ascending id order with
    the residual g (g^(0) = p_v): child u_j is accepted with probability g^(j-1)(x_j) (the
    SpecInfer/EAGLE ratio min(1, g/q) for a deterministic draft, q = point mass on x_j); on
    rejection x_j is removed from g and g is renormalised (Eq. 46). An accepted child becomes the
    new current node; if all children are rejected (or v is a leaf) the bonus token is drawn from
    the final residual g^(k) = p_v^res (Eq. 53).

    The residual is kept unnormalised in float64 (only the visited rows are converted) with its
    mass tracked alongside, so a test costs O(1) instead of a pass over the vocabulary; the mass is
    re-summed exactly when it falls below 1e-6 of the row, so a child carrying all the remaining
    mass is accepted with probability exactly 1.

    Args:
        parents: N parent indices; tokens: N incoming tokens (see module docstring).
        probs: floating ``[N, V]`` target distributions p_v.
        generator: ``torch.Generator`` on ``probs.device`` (one uniform per child test, one
            categorical draw for the bonus).
        atol: row-sum tolerance of ``probs``.
        validate: as :func:`predraw_follow`.
        sampler: primitive of the bonus draw, as :func:`predraw_follow`.
        plan: as :func:`predraw_follow` (its ``children`` lists).

    Returns:
        ``(path, bonus)``: accepted node ids root..V (``list[int]``) and the bonus token id (int).

    Raises:
        ValueError: invalid tree, ``probs``, ``generator`` or ``sampler`` (as :func:`predraw_follow`).
    """
    _check_generator(generator)
    _check_choice("sampler", sampler, SAMPLERS)
    plan = _plan(parents, tokens, probs, atol, validate, plan)[0]
    kids, tok = plan.children, plan.tokens
    path = [0]
    while True:
        v = path[-1]
        g = probs[v].to(torch.float64, copy=True)
        row_mass = mass = float(g.sum())
        accepted = None
        for u in kids[v]:
            x = tok[u]
            gx = float(g[x])
            r = float(torch.rand((), dtype=torch.float64, generator=generator, device=g.device))
            if r * mass < gx:  # accept with probability g(x) / mass
                accepted = u
                break
            g[x] = 0.0
            mass -= gx
            if mass < 1e-6 * row_mass:
                mass = float(g.sum())
            if not mass > 0:  # unreachable: a rejection has probability 1 - a > 0 only if mass remains
                raise RuntimeError(f"node {v}: empty residual after rejecting token {x}")
        if accepted is None:
            return path, _categorical(g, generator, sampler)
        path.append(accepted)


def _residual_draw(probs: torch.Tensor, v: int, drafted: np.ndarray, u: float, host: np.ndarray | None) -> int:
    """Y ~ p_v^res for the uniform ``u``: exact inverse CDF of row v with the ``drafted`` tokens A(v)
    (int64 numpy ``[k]``, as :attr:`impl.tev.plan.TreePlan.child_tokens`) removed.

    On the host view: a float64 copy of row v with A(v) zeroed, then a two-level search: sums of
    ~sqrt(V)-sized blocks (one vectorised reduction) locate the block on their cumulative sums, and
    the cumulative sums of that block's entries locate the token. If rounding between the levels
    lands past the block or on a zero entry (probability ~1e-16), and always without a host view
    (another device or dtype), the exact one-level float64 search over the zeroed row is used with
    the same uniform, so a drafted or zero-probability token is never returned; on rows whose
    partial sums are exact (e.g. on a 2^-24 grid) both levels return the one-level index exactly.
    """
    if host is not None:
        res = host[v].astype(np.float64)
        if len(drafted):
            res[drafted] = 0.0
        blk, sh, nb, full = _blocks(len(res))
        sums = res[:full].reshape(nb, blk).sum(1)
        if full < len(res):
            sums = np.append(sums, res[full:].sum())
        c = np.cumsum(sums, out=sums)
        target = u * c[-1]
        b = int(c.searchsorted(target, "right"))
        if b < len(c):
            lo = b << sh
            within = res[lo:lo + blk]
            j = int(np.cumsum(within).searchsorted(target - (c[b - 1] if b else 0.0), "right"))
            if j < len(within) and within[j] > 0:
                return lo + j
        return _inverse_cdf_at(torch.from_numpy(res), u)
    res = probs[v].to(torch.float64, copy=True)  # exact one-level path (inference mode: nothing recorded)
    if len(drafted):
        res[torch.from_numpy(drafted).to(res.device)] = 0.0
    return _inverse_cdf_at(res, u)


def _search_cdf(c: np.ndarray, u: float) -> int:
    """Inverse CDF on cumulative sums ``c`` (float64 ``[N]``, non-decreasing) for a Python float
    uniform: the index i with c[i-1] <= u c[-1] < c[i] (so its weight is positive), as
    :func:`_inverse_cdf`."""
    total = float(c[-1])
    i = int(c.searchsorted(u * total, "right"))
    if i >= len(c):  # u * total rounded up to the total, or a zero / non-finite total
        if not 0 < total < float("inf"):
            raise ValueError(f"cannot sample from weights with total {total}")
        i = int(np.flatnonzero(np.diff(c, prepend=0.0) > 0)[-1])
    return i


@_inference_mode
def tev(
    parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, generator: torch.Generator, atol: float = PROB_ATOL,
    *, validate: bool = True, sampler: str = "cdf", plan: TreePlan | None = None,
) -> tuple[list[int], int]:
    """Tree Exit Verification (TEV Sec. 4; App. B, Algorithm 1; exactness in Corollary 2).

    Reads the N - 1 edge probabilities q(u) = p_{pa(u)}(x_u) (:func:`impl.tev.exit_law.edge_probs`),
    forms the canonical exit law w = P rho from them, as its cumulative sums (Algorithm 1, lines
    3-7, level-parallel over the tree plan's ancestor table: :func:`impl.tev.exit_law.exit_cdf`),
    draws the exit node V ~ Categorical(w) (line 8) and one bonus token Y ~ p_V^res, i.e. p_V with
    V's drafted child tokens removed (p_V itself at a leaf; line 9), reading row V once
    (:func:`_residual_draw`). The accepted path is the root path of V. Nothing of size N x V is
    touched: N - 1 entries, one row, and O(N D) float64 work in whole-array operations; no float64
    copy of ``probs`` and no per-node Python loop.

    Args:
        parents: N parent indices; tokens: N incoming tokens (see module docstring); lists or 1-D
            integer tensors.
        probs: floating ``[N, V]`` target distributions p_v.
        generator: ``torch.Generator`` on ``probs.device``: with ``sampler="cdf"`` one call draws the
            two float64 uniforms (exit, then bonus); with ``"multinomial"`` two ``torch.multinomial``.
        atol: row-sum tolerance of ``probs``.
        validate: as :func:`predraw_follow`; with False the rows are also taken to be normalised (a
            float32 softmax is, to ~1e-7) and are not re-summed; with True the edge probabilities
            are divided by the row sums of the validation pass.
        sampler: primitive of the two draws, as :func:`predraw_follow`.
        plan: as :func:`predraw_follow` (its edge indices, ancestor table and child tokens).

    Returns:
        ``(path, bonus)``: accepted node ids root..V (``list[int]``) and the bonus token id (int).

    Raises:
        ValueError: invalid tree, ``probs``, ``generator``, ``sampler`` or ``plan`` (as
            :func:`predraw_follow`).
    """
    _check_generator(generator)
    _check_choice("sampler", sampler, SAMPLERS)
    plan, row_sums = _plan(parents, tokens, probs, atol, validate, plan)
    host = host_view(probs)
    e = edge_probs(plan, probs, host, row_sums)
    if sampler == "cdf":
        cdf, rho = unchecked_exit_cdf(plan, e)
        u_exit, u_bonus = torch.rand(2, dtype=torch.float64, generator=generator, device=probs.device).tolist()
        v = _search_cdf(cdf, u_exit)
        if rho[v] < RHO_RECHECK:  # rare: confirm on the law with exactly recomputed small rho
            v = _search_cdf(exit_cdf(plan, e, probs), u_exit)
        return path_to(plan.parents, v), _residual_draw(probs, v, plan.child_tokens[v], u_bonus, host)
    _, _, w = law_from_edges(plan, e, probs)
    v = int(torch.multinomial(torch.from_numpy(w).to(probs.device), 1, generator=generator))
    res = probs[v].detach().to(torch.float64, copy=True)
    if len(plan.child_tokens[v]):
        res[torch.from_numpy(plan.child_tokens[v]).to(res.device)] = 0.0
    return path_to(plan.parents, v), _categorical(res, generator, sampler)


def greedy_follow(parents: IntSeq, tokens: IntSeq, argmax_ids: IntSeq) -> tuple[list[int], int]:
    """Greedy (T = 0) verification: follow the child carrying the target argmax while one exists.

    This is the common deterministic output of all three verifiers on one-hot rows (TEV App. D.2
    notes that T = 0 reduces verification to greedy decoding).

    Args:
        parents: N parent indices; tokens: N incoming tokens.
        argmax_ids: N target argmax token ids, one per node (list or 1-D integer tensor).

    Returns:
        ``(path, bonus)``: node ids root..V and ``argmax_ids[V]``.

    Raises:
        ValueError: invalid tree, or ``argmax_ids`` not of length N / negative.
    """
    par, tok, _ = validate_tree(parents, tokens)
    am = argmax_ids.tolist() if isinstance(argmax_ids, torch.Tensor) else [int(a) for a in argmax_ids]
    if len(am) != len(par) or any(a < 0 for a in am):
        raise ValueError(f"argmax_ids must hold {len(par)} non-negative token ids, got {am}")
    kids = _child_index(par, tok)
    path = [0]
    while am[path[-1]] in kids[path[-1]]:
        path.append(kids[path[-1]][am[path[-1]]])
    return path, am[path[-1]]


#: verifiers by name (the names used in configs and result rows; :class:`impl.registry.Registry`)
VERIFIERS: Registry[Verifier] = Registry("verifier")
VERIFIERS.register("predraw_follow", predraw_follow)
VERIFIERS.register("sequential_residual", sequential_residual)
VERIFIERS.register("tev", tev)
