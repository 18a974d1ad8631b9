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
float64 before use. The verifiers in :mod:`impl.tev.verify` use :func:`law_from_gathered`, which
reads only the N - 1 edge probabilities (plus, when validating, the row sums) and agrees with the
reference to the precision of float32 rows (~1e-7 relative), exact zeros included.
"""

from __future__ import annotations

import torch

from .tree import IntSeq, depth_levels, validate_tree

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


#: rho values below this are recomputed exactly from the float64 row in :func:`law_from_gathered`
RHO_RECHECK = 1e-4


def law_from_gathered(
    par_t: torch.Tensor, tok_t: torch.Tensor, probs: torch.Tensor, row_sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(P, rho, w) from the N - 1 gathered edge probabilities only (fast path of :func:`exit_law`).

    The level-parallel law of Algorithm 1 (lines 3-7) without a pass over the ``[N, V]`` matrix:
    q(u) = p_{pa(u)}(x_u) is one gather of N - 1 entries; rho is one ``index_add``; P(v), the
    product of q along v's root path, is computed by pointer doubling (after k rounds every node
    holds the product of q over its 2^k nearest path nodes and a pointer to its 2^k-th ancestor, the
    root being a fixed point with q = 1), i.e. max(3, ceil(log2(max depth))) rounds of two gathers
    and a product, with no per-node or per-level Python loop and no depth computation. All products
    are float64.

    Normalisation: with ``row_sums`` (e.g. from a validation pass) every q is divided by its
    parent's row sum, as :func:`check_target_probs` renormalises; without it the rows are taken to
    sum to 1 (true of a float32 softmax to ~1e-7, the precision of the rows themselves). Either
    way, where the computed rho(v) is below :data:`RHO_RECHECK` it is recomputed exactly from v's
    float64 row (mass outside v's drafted children over the row total), so rho(v) is exactly 0 iff
    p_v has no mass outside its children, as in :func:`exit_law`.

    No validation: the caller guarantees a valid tree (``0 <= parents[v] < v``, distinct sibling
    tokens, in-vocabulary tokens) and non-negative rows with positive sums.

    Args:
        par_t: int64 ``[N]`` parents (``par_t[0] == -1``) on ``probs.device``.
        tok_t: int64 ``[N]`` incoming tokens on ``probs.device`` (the root's entry, a token id or -1,
            is not used).
        probs: floating ``[N, V]`` target rows p_v.
        row_sums: optional ``[N]`` row sums of ``probs``.

    Returns:
        ``(P, rho, w)`` float64 ``[N]``, as :func:`exit_law` (agreeing to ~1e-7 relative for
        float32 rows).
    """
    n = probs.shape[0]
    dev = probs.device
    f64 = torch.float64
    if n == 1:
        one = torch.ones(1, dtype=f64, device=dev)
        return one, one.clone(), one.clone()
    anc = par_t.clamp_min(0)  # the root points to itself (a fixed point of the doubling below)
    q = probs[anc, tok_t].to(f64)  # q[u] = p_{pa(u)}(x_u); the root's entry is overwritten
    if row_sums is not None:
        q /= row_sums.to(f64)[anc]
    pa = anc[1:]
    rho = torch.ones(n, dtype=f64, device=dev).index_add_(0, pa, q[1:], alpha=-1.0)  # <= 1 as q >= 0
    q[0] = 1.0
    if float(rho.min()) < RHO_RECHECK:  # rare: recompute those rows exactly (exact zeros, no rounding below 0)
        has_child = torch.zeros(n, dtype=torch.bool, device=dev)
        has_child[pa] = True
        cand = torch.nonzero(has_child & (rho < RHO_RECHECK)).flatten()
        if cand.numel():
            slot = torch.full((n,), -1, dtype=torch.long, device=dev)
            slot[cand] = torch.arange(cand.numel(), device=dev)
            rows = probs[cand].to(f64)
            total = rows.sum(-1)
            e = torch.nonzero(slot[pa] >= 0).flatten() + 1  # edges (child ids) under a candidate
            rows[slot[anc[e]], tok_t[e]] = 0.0
            rho[cand] = rows.sum(-1) / total
    # P by pointer doubling over the root paths (three unconditional rounds cover depth <= 8)
    P = q
    for _ in range(3):
        P = P * P[anc]
        anc = anc[anc]
    while bool(anc.any()):
        P = P * P[anc]
        anc = anc[anc]
    return P, rho, P * rho


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
