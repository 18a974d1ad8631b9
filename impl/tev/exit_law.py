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
float64 before use. :func:`impl.tev.verify.tev` uses :func:`law_from_gathered`, which reads only
the N - 1 edge probabilities (plus, when validating, the row sums), works on N-long float64 host
vectors, and agrees with the reference to the precision of float32 rows (~1e-7 relative), exact
zeros included.
"""

from __future__ import annotations

import operator

import numpy as np
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


def gather_f64(probs: torch.Tensor, rows: np.ndarray, cols: np.ndarray | None = None) -> np.ndarray:
    """float64 host (numpy) copy of ``probs[rows, cols]`` (``cols`` None: the whole rows).

    A float32 / float64 CPU tensor is read through its zero-copy numpy view, so only the requested
    entries are touched; any other tensor (another device or dtype) is gathered by torch and the
    result (``len(rows)`` values, or rows) copied to the host.

    Args:
        probs: floating ``[N, V]`` tensor.
        rows: int64 ``[M]`` row ids.
        cols: int64 ``[M]`` column ids, or None.

    Returns:
        float64 ``[M]`` (entries) or ``[M, V]`` (rows), a fresh array.
    """
    if probs.device.type == "cpu" and probs.dtype in (torch.float32, torch.float64):
        a = (probs.detach() if probs.requires_grad else probs).numpy()
        out = a[rows] if cols is None else a[rows, cols]
        return out.astype(np.float64)
    r = torch.from_numpy(rows).to(probs.device)
    out = probs.detach()[r] if cols is None else probs.detach()[r, torch.from_numpy(cols).to(probs.device)]
    return out.to(torch.float64).cpu().numpy()


def _recheck_small_rho(rho: np.ndarray, pa: np.ndarray, tok: np.ndarray, probs: torch.Tensor) -> None:
    """Recompute in place, from v's float64 row, every rho(v) < RHO_RECHECK of a node with children:
    mass outside v's drafted children over the row total (exactly 0 when there is none)."""
    n = rho.shape[0]
    has_child = np.zeros(n, dtype=bool)
    has_child[pa] = True
    cand = np.flatnonzero(has_child & (rho < RHO_RECHECK))
    rows = gather_f64(probs, cand)
    total = rows.sum(1)
    slot = np.full(n, -1, dtype=np.int64)
    slot[cand] = np.arange(cand.size)
    e = np.flatnonzero(slot[pa] >= 0)  # edges (child id - 1) hanging under a candidate
    rows[slot[pa[e]], tok[e + 1]] = 0.0
    rho[cand] = rows.sum(1) / total


def law_from_gathered(
    parents, tokens, probs: torch.Tensor, row_sums=None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(P, rho, w) from the N - 1 gathered edge probabilities only (the fast path of :func:`exit_law`
    used by :func:`impl.tev.verify.tev`; TEV App. B, Algorithm 1 lines 3-7).

    Level-parallel, with a fixed handful of array operations and no pass over the ``[N, V]`` matrix:
    q(u) = p_{pa(u)}(x_u) is one gather of N - 1 entries; rho(v) = 1 - sum_{u in Ch(v)} q(u) is one
    ``bincount``; P(v), the product of q along v's root path, is computed by pointer doubling (after
    k rounds every node holds the product of q over its 2^k nearest path nodes and a pointer to its
    2^k-th ancestor, the root a fixed point with q = 1): three rounds for depth <= 8, one more per
    doubling of the depth, each two gathers and a product. The arrays are N-long float64 numpy
    vectors on the host: at these sizes the cost is per-operation dispatch, which numpy keeps ~3x
    below torch on a CPU (only the N - 1 gathered values cross from another device).

    Normalisation: with ``row_sums`` (e.g. from a validation pass) every q is divided by its parent's
    row sum, as :func:`check_target_probs` renormalises; without it the rows are taken to sum to 1
    (true of a float32 softmax to ~1e-7, the precision of the rows themselves). Either way, where the
    computed rho(v) is below :data:`RHO_RECHECK` it is recomputed exactly from v's float64 row (mass
    outside v's drafted children over the row total), so rho(v) is exactly 0 iff p_v has no mass
    outside its children, as in :func:`exit_law`.

    No validation: the caller guarantees a valid tree (``0 <= parents[v] < v``, distinct sibling
    tokens, in-vocabulary tokens) and non-negative rows with positive sums.

    Args:
        parents: int64 ``[N]`` parents (``parents[0] == -1``): a numpy array (no copy), a list or a
            CPU tensor.
        tokens: int64 ``[N]`` incoming tokens, same kinds (the root's entry is not used).
        probs: floating ``[N, V]`` target rows p_v, on any device.
        row_sums: optional ``[N]`` row sums of ``probs`` (numpy or CPU tensor).

    Returns:
        ``(P, rho, w)`` float64 numpy ``[N]``, as :func:`exit_law` (agreeing to ~1e-7 relative for
        float32 rows; exact zeros of rho and w where :func:`exit_law` has them).
    """
    par = np.asarray(parents, dtype=np.int64)
    tok = np.asarray(tokens, dtype=np.int64)
    n = par.shape[0]
    if n == 1:
        return np.ones(1), np.ones(1), np.ones(1)
    pa = par[1:]
    q = gather_f64(probs, pa, tok[1:])  # q[u - 1] = p_{pa(u)}(x_u)
    if row_sums is not None:
        q /= np.asarray(row_sums, dtype=np.float64)[pa]
    rho = 1.0 - np.bincount(pa, weights=q, minlength=n)
    if rho.min() < RHO_RECHECK:  # rare: recompute those rows exactly (exact zeros, no rounding below 0)
        _recheck_small_rho(rho, pa, tok, probs)
    P = np.empty(n)
    P[0] = 1.0
    P[1:] = q
    anc = par.copy()
    anc[0] = 0  # the root points to itself
    for _ in range(3):  # P by pointer doubling over the root paths (three rounds cover depth <= 8)
        P *= P[anc]
        anc = anc[anc]
    while anc.any():
        P *= P[anc]
        anc = anc[anc]
    return P, rho, P * rho


def host_view(probs: torch.Tensor) -> memoryview | None:
    """A flat, zero-copy ``memoryview`` of a C-contiguous float32 / float64 CPU ``probs``
    (``view[v * V + a] == float(probs[v, a])``), or None for any other tensor (other device, dtype
    or layout), which the readers below then access through torch."""
    if probs.device.type != "cpu" or probs.dtype not in (torch.float32, torch.float64) or not probs.is_contiguous():
        return None
    a = (probs.detach() if probs.requires_grad else probs).numpy()
    return memoryview(a).cast("B").cast("f" if probs.dtype == torch.float32 else "d")


def edge_probs(parents: list[int], tokens: list[int], probs: torch.Tensor, host: memoryview | None = None) -> list[float]:
    """q(u) = p_{pa(u)}(x_u) for u = 1..N-1 (the edge probabilities of Algorithm 1, line 7), as
    Python floats: N - 1 reads, nothing else of ``probs`` is touched.

    Args:
        parents, tokens: the tree as ``list[int]`` (validated).
        probs: floating ``[N, V]``.
        host: :func:`host_view` of ``probs`` (read directly), or None (one torch gather).

    Returns:
        ``list[float]`` of length N - 1, entry u - 1 for node u.
    """
    v_size = probs.shape[1]
    if host is not None:
        return [host[p * v_size + t] for p, t in zip(parents[1:], tokens[1:])]
    if len(parents) == 1:
        return []
    idx = torch.tensor([p * v_size + t for p, t in zip(parents[1:], tokens[1:])], device=probs.device)
    return probs.detach().reshape(-1).take(idx).tolist()


def law_one_pass(
    parents: list[int], tokens: list[int], q: list[float], probs: torch.Tensor, row_sums: list[float] | None = None,
) -> tuple[list[float], list[float], list[float]]:
    """(P, rho, w) of Algorithm 1, lines 3-7, from the edge probabilities ``q`` in one pass over the
    nodes in id order (a parent precedes its children, so P(pa(v)) is final when P(v) is formed).

    The same recurrences as the level-parallel forms (:func:`exit_law`, :func:`law_from_gathered`)
    and the same float64 arithmetic, on Python floats: at draft-tree sizes (N <= a few hundred) the
    whole law costs ~40 ns a node, below the dispatch cost of a single tensor operation, so it beats
    any vectorised form on a CPU, warm or cold. rho(v) below :data:`RHO_RECHECK` is recomputed
    exactly from v's float64 row (exact zeros, as :func:`exit_law`).

    Args:
        parents, tokens: the tree as ``list[int]`` (validated: ``0 <= parents[v] < v``).
        q: :func:`edge_probs` of the tree (entry u - 1 for node u).
        probs: floating ``[N, V]`` target rows (read only for the rare exact rho recomputation).
        row_sums: optional per-node row sums; each q is then divided by its parent's (renormalised
            rows, as :func:`check_target_probs`); None takes the rows to sum to 1.

    Returns:
        ``(P, rho, w)``, three ``list[float]`` of length N (as :func:`exit_law`, to ~1e-7 relative
        for float32 rows, exact zeros included).
    """
    n = len(parents)
    pa = parents[1:]
    if row_sums is not None:
        q = [x / row_sums[p] for x, p in zip(q, pa)]
    P = [1.0]
    cov = [0.0] * n  # sum of the children's edge probabilities
    for p, x in zip(pa, q):  # node v = len(P): its parent p < v is final
        P.append(P[p] * x)
        cov[p] += x
    rho = [1.0 - c for c in cov]
    if max(cov) > 1.0 - RHO_RECHECK:  # rare: only nodes with children can get here
        for v in [v for v in range(n) if rho[v] < RHO_RECHECK]:
            row = probs[v].detach().to(torch.float64, copy=True)
            total = float(row.sum())
            row[torch.tensor([t for p, t in zip(parents, tokens) if p == v], device=row.device)] = 0.0
            rho[v] = float(row.sum()) / total
    return P, rho, list(map(operator.mul, P, rho))


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
