"""The canonical exit law of a fixed draft tree and its target coverage (TEV paper, Sec. 3.1-3.2,
Eqs. 1-7, Lemma 1, App. A.2; level-wise propagation as in App. B, Algorithm 1 lines 3-7).

Given the target next-token distribution p_v at every node v of a fixed tree (one target forward),

* P(v)   = P(pa(v)) p_{pa(v)}(x_v), P(r) = 1           (Eq. 2: target prefix probability),
* rho(v) = 1 - sum_{u in Ch(v)} p_v(x_u)                 (Eq. 4: local exit probability),
* w(v)   = P(v) rho(v)                                    (Eq. 4: canonical exit law, Lemma 1),
* C_p(T) = sum_{u != r} P(u) = sum_v w(v) depth(v)       (Eq. 6: target coverage),
* p_v^res(a) = p_v(a) 1[a not in A(v)] / rho(v)          (Eq. 7: residual bonus distribution).

C_p(T) is the expected number of accepted *draft* tokens D of any saturated verifier; the expected
output-block length, which counts the bonus token (the project's tau), is 1 + C_p(T) (Eq. 9, 11).

All arithmetic is float64. :func:`exit_law` (the reference) renormalises the rows of ``probs`` in
float64 before use. :func:`impl.tev.verify.tev` uses :func:`edge_probs` and :func:`law_from_edges`,
which read only the N - 1 edge probabilities (plus, when validating, the row sums), form the same
recurrences level-parallel in a handful of whole-array numpy operations (a scatter-add and a
product over the tree's ancestor table; no per-node loop), and agree with the reference to the precision of
float32 rows (~1e-7 relative), exact zeros included. The tree's index tables (edge gather indices,
ancestor table) come from its :class:`impl.tev.plan.TreePlan`, built once when the tree is fixed.
"""

from __future__ import annotations

import numpy as np
import torch

from .plan import TreePlan
from .parents import IntSeq, depth_levels, validate_tree

#: default tolerance on |sum_a probs[v, a] - 1|
PROB_ATOL = 1e-4


def check_target_probs(
    parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, atol: float = PROB_ATOL
) -> tuple[list[int], list[int], list[int], torch.Tensor]:
    """Validate a tree and its per-node target distributions; return float64, renormalised rows.

    Args:
        parents: N parent indices (root 0 with parent -1, ``0 <= parents[v] < v``).
        tokens: N incoming tokens (root's may be -1), each draft token ``< V``.
        probs: floating ``[N, V]``; row v is p_v (Eq. 1), non-negative, finite, summing to 1 within
            ``atol``.
        atol: tolerance on each row sum.

    Returns:
        ``(parents, tokens, depths, p)``: three ``list[int]`` and ``p`` float64 ``[N, V]`` on
        ``probs.device`` with rows renormalised to sum to 1.

    Raises:
        ValueError: an invalid tree (see :func:`impl.tev.tree.validate_tree`), ``probs`` that is not a
            floating ``[N, V]`` tensor, negative / non-finite entries, a row sum off by more than
            ``atol`` (naming the node), or a draft token ``>= V``.
    """
    par, tok, depths = validate_tree(parents, tokens)
    if not isinstance(probs, torch.Tensor) or not probs.dtype.is_floating_point:
        raise ValueError(f"probs must be a floating torch tensor, got {type(probs).__name__}"
                         + (f" of dtype {probs.dtype}" if isinstance(probs, torch.Tensor) else ""))
    n = len(par)
    if probs.dim() != 2 or probs.shape[0] != n or probs.shape[1] < 1:
        raise ValueError(f"probs must have shape [N={n}, V], got {tuple(probs.shape)}")
    v_size = probs.shape[1]
    bad = [v for v in range(1, n) if tok[v] >= v_size]
    if bad:
        raise ValueError(f"node {bad[0]}: draft token {tok[bad[0]]} is outside the vocabulary of size {v_size}")
    p = probs.detach().to(torch.float64)
    if not bool(torch.isfinite(p).all()):
        raise ValueError("probs has non-finite entries")
    if bool((p < 0).any()):
        raise ValueError(f"probs has negative entries (node {int(torch.nonzero((p < 0).any(-1))[0])})")
    s = p.sum(-1)
    off = torch.nonzero((s - 1).abs() > atol).flatten()
    if off.numel():
        v = int(off[0])
        raise ValueError(f"probs row of node {v} sums to {float(s[v]):.6g}, not 1 (atol {atol:g})")
    return par, tok, depths, p / s.unsqueeze(-1)


def _law(par: list[int], tok: list[int], depths: list[int], p: torch.Tensor):
    """(P, rho, w) float64 ``[N]`` from validated inputs (level-parallel, Algorithm 1 lines 3-7)."""
    n = len(par)
    dev = p.device
    P = torch.zeros(n, dtype=torch.float64, device=dev)
    P[0] = 1.0
    rho = torch.ones(n, dtype=torch.float64, device=dev)
    if n == 1:
        return P, rho, P * rho
    par_t = torch.tensor(par[1:], dtype=torch.long, device=dev)
    tok_t = torch.tensor(tok[1:], dtype=torch.long, device=dev)
    # q[u] = p_{pa(u)}(x_u): the probability of following edge pa(u) -> u, all edges in one gather
    q = torch.zeros(n, dtype=torch.float64, device=dev)
    q[1:] = p[par_t, tok_t]
    covered = torch.zeros(n, dtype=torch.float64, device=dev).index_add_(0, par_t, q[1:])
    rho = (1.0 - covered).clamp_(0.0, 1.0)
    # Exactly zero when no target mass lies outside the drafted children (e.g. one-hot T=0 rows or
    # truncated supports), so that w(v) > 0 iff p_v^res is defined.
    nz_children = torch.zeros(n, dtype=torch.long, device=dev).index_add_(0, par_t, (q[1:] > 0).long())
    rho[(p > 0).sum(-1) == nz_children] = 0.0
    pt = torch.tensor(par, dtype=torch.long, device=dev)
    for nodes in depth_levels(depths)[1:]:
        nodes = nodes.to(dev)
        P[nodes] = P[pt[nodes]] * q[nodes]
    return P, rho, P * rho


#: rho values below this are recomputed exactly from the float64 row in :func:`law_from_edges`
RHO_RECHECK = 1e-4


def host_view(probs: torch.Tensor) -> np.ndarray | None:
    """A zero-copy ``[N, V]`` numpy view of a float32 / float64 CPU ``probs`` (any strides), or None
    for any other tensor (another device or dtype), which :func:`edge_probs` then reads through torch."""
    if not probs.is_cpu or probs.dtype not in (torch.float32, torch.float64):
        return None
    return (probs.detach() if probs.requires_grad else probs).numpy()


def edge_probs(plan: TreePlan, probs: torch.Tensor, host: np.ndarray | None = None,
               row_sums: np.ndarray | None = None) -> np.ndarray:
    """e(u) = q(u) = p_{pa(u)}(x_u) for every non-root u, with e(root) = 1: the edge probabilities of
    Algorithm 1 (line 7), one gather of N - 1 entries and nothing else of ``probs``.

    Args:
        plan: the tree's :class:`impl.tev.plan.TreePlan` (validated; every token ``< V``).
        probs: floating ``[N, V]``.
        host: :func:`host_view` of ``probs`` (gathered in numpy), or None (one torch gather).
        row_sums: optional float64 ``[N]`` row sums; each q(u) is then divided by its parent row's sum
            (the rows renormalised, as :func:`check_target_probs` does).

    Returns:
        float64 ``[N]``: ``e[0] = 1``, ``e[u]`` the (exact, or renormalised) entry of edge pa(u) -> u.
    """
    e = np.empty(len(plan))
    e[0] = 1.0
    if len(plan) > 1:
        if host is not None and host.flags.c_contiguous:  # one flat take (lighter than 2-D fancy indexing)
            e[1:] = host.ravel().take(plan.edge_flat(host.shape[1]))
        elif host is not None:
            e[1:] = host[plan.edge_parents, plan.edge_tokens]
        else:
            dev = probs.device
            pa = torch.from_numpy(plan.edge_parents).to(dev)
            tk = torch.from_numpy(plan.edge_tokens).to(dev)
            e[1:] = probs.detach()[pa, tk].to(torch.float64).cpu().numpy()
        if row_sums is not None:
            e[1:] /= row_sums[plan.edge_parents]
    return e


def _recheck(rho: np.ndarray, plan: TreePlan, probs: torch.Tensor) -> None:
    """Recompute in place, from v's float64 row, every rho(v) < RHO_RECHECK (only nodes with
    children get there, rarely): the mass outside v's drafted children over the row total."""
    for v in np.flatnonzero(rho < RHO_RECHECK).tolist():
        row = probs[v].detach().to(torch.float64, copy=True)
        total = float(row.sum())
        row[torch.from_numpy(plan.child_tokens[v]).to(row.device)] = 0.0
        rho[v] = float(row.sum()) / total


def _prefix_and_rho(plan: TreePlan, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """P (Eq. 2: one ``take`` of the ancestor table, one product over its D rows) and the unchecked
    rho = 1 - sum over children of q (Eq. 4: one scatter-add), float64 ``[N]`` each."""
    n = len(plan)
    if n == 1:  # root only: it is the exit node
        return np.ones(1), np.ones(1)
    rho = np.bincount(plan.edge_parents, weights=e[1:], minlength=n)
    np.subtract(1.0, rho, out=rho)
    return np.multiply.reduce(e.take(plan.ancestors), axis=0), rho


def law_from_edges(plan: TreePlan, e: np.ndarray, probs: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(P, rho, w) of Algorithm 1, lines 3-7, from the edge probabilities, level-parallel in a few
    whole-array numpy operations (no per-node loop):

    * P(v) = prod_k e(ancestors[k, v]) (Eq. 2 unrolled along the root path: one gather of the
      ``[D, N]`` ancestor table and one product over its D rows);
    * rho(v) = 1 - sum_{u in Ch(v)} q(u) (Eq. 4: one scatter-add of the edges onto their parents);
      rho(v) below :data:`RHO_RECHECK` is recomputed exactly from v's float64 row, so rho(v) is
      exactly 0 iff p_v has no mass outside its children;
    * w = P rho (Eq. 4, Lemma 1).

    The arithmetic is float64, as in :func:`exit_law` (the reference), and agrees with it to ~1e-7
    relative for float32 rows, exact zeros included.

    Args:
        plan: the tree's :class:`impl.tev.plan.TreePlan`.
        e: :func:`edge_probs` of the tree, float64 ``[N]``.
        probs: floating ``[N, V]`` target rows (read only for the rare exact rho recomputation).

    Returns:
        ``(P, rho, w)``, float64 ``[N]`` each.
    """
    P, rho = _prefix_and_rho(plan, e)
    if rho.min() < RHO_RECHECK:
        _recheck(rho, plan, probs)
    return P, rho, P * rho


def unchecked_exit_cdf(plan: TreePlan, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The hot-path form of :func:`exit_cdf`: the same arithmetic (:func:`_prefix_and_rho`, then w and
    its cumulative sums in place), without the exact rho recheck. Returns ``(cdf, rho)``, float64 ``[N]`` each.

    A caller must treat an exit node v with ``rho[v] < RHO_RECHECK`` as unconfirmed and redraw it
    with the same uniform from :func:`exit_cdf` (as :func:`impl.tev.verify.tev` does): a node whose
    p_v has no mass outside its children then has w(v) = 0 exactly and cannot be drawn, and the other
    nodes' cumulative weights differ from :func:`exit_cdf`'s by at most the float32 rounding of the
    rows (~1e-7 of P per rechecked node).
    """
    cdf, rho = _prefix_and_rho(plan, e)
    cdf *= rho
    return np.cumsum(cdf, out=cdf), rho


def exit_cdf(plan: TreePlan, e: np.ndarray, probs: torch.Tensor) -> np.ndarray:
    """Cumulative sums (in node id order) of the canonical exit law w of :func:`law_from_edges`: the
    inverse CDF of Algorithm 1, line 8. Args: as :func:`law_from_edges`. Returns float64 ``[N]``."""
    _, _, w = law_from_edges(plan, e, probs)
    return np.cumsum(w, out=w)


def exit_law(
    parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, atol: float = PROB_ATOL
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target prefix probabilities, local exit probabilities and the canonical exit law.

    Implements Eqs. 2 and 4 (Lemma 1) with the level-wise propagation of App. B, Algorithm 1,
    lines 3-7: all edge probabilities are gathered at once and P is pushed one depth level at a time.

    Args:
        parents: N parent indices (root 0 with parent -1, ``0 <= parents[v] < v``), list or 1-D
            integer tensor.
        tokens: N incoming tokens; ``tokens[v]`` for v >= 1 indexes the columns of ``probs``.
        probs: floating ``[N, V]``, row v = p_v (Eq. 1); rows must sum to 1 within ``atol``.
        atol: row-sum tolerance.

    Returns:
        ``(P, rho, w)``, each float64 ``[N]`` on ``probs.device``: P(root) = 1, rho(leaf) = 1,
        ``w = P * rho`` sums to 1 (Eq. 5). rho(v) is exactly 0 when p_v has no mass outside v's
        drafted children.

    Raises:
        ValueError: on invalid inputs (see :func:`check_target_probs`).
    """
    par, tok, depths, p = check_target_probs(parents, tokens, probs, atol)
    return _law(par, tok, depths, p)


def target_coverage(parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, atol: float = PROB_ATOL) -> float:
    """C_p(T) = sum over non-root u of P(u) (Eq. 6): expected accepted draft tokens at saturation.

    Args/Raises: as :func:`exit_law`. Returns a Python float (the bonus token is *not* counted).
    """
    P, _, _ = exit_law(parents, tokens, probs, atol)
    return float(P[1:].sum())


def expected_block_length(parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, atol: float = PROB_ATOL) -> float:
    """1 + C_p(T) (Eqs. 9 and 11): the expected output-block length E[L] of every saturated exact
    verifier, counting the bonus token (the project's tau per round).

    Args/Raises: as :func:`exit_law`. Returns a Python float.
    """
    return 1.0 + target_coverage(parents, tokens, probs, atol)


def residual_distribution(p_v: torch.Tensor, child_tokens: IntSeq) -> torch.Tensor:
    """p_v^res (Eq. 7): p_v with the drafted child tokens A(v) removed, renormalised.

    Args:
        p_v: floating ``[V]``, the target distribution at node v.
        child_tokens: the tokens of v's children (empty at a leaf, where p_v^res = p_v).

    Returns:
        float64 ``[V]`` summing to 1, zero on ``child_tokens``.

    Raises:
        ValueError: if ``p_v`` is not 1-D, or no mass lies outside ``child_tokens`` (rho(v) = 0, so
            p_v^res is undefined; an exact verifier never exits there).
    """
    if p_v.dim() != 1:
        raise ValueError(f"p_v must be 1-D [V], got shape {tuple(p_v.shape)}")
    res = p_v.detach().to(torch.float64).clone()
    ct = child_tokens.tolist() if isinstance(child_tokens, torch.Tensor) else list(child_tokens)
    if ct:
        res[torch.tensor(ct, dtype=torch.long, device=res.device)] = 0.0
    s = res.sum()
    if not s > 0:
        raise ValueError("p_v has no mass outside the drafted children (rho(v) = 0): p_v^res is undefined")
    return res / s
