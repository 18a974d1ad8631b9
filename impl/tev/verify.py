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
"""

from __future__ import annotations

from typing import Callable

import torch

from .exit_law import PROB_ATOL, _law, check_target_probs
from .tree import IntSeq, path_to, validate_tree

Verifier = Callable[..., tuple[list[int], int]]


def _check_generator(generator) -> None:
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")


def _child_index(par: list[int], tok: list[int]) -> list[dict[int, int]]:
    """Per node, a map from child token to child id (children in ascending id order)."""
    kids: list[dict[int, int]] = [{} for _ in par]
    for u in range(1, len(par)):
        kids[par[u]][tok[u]] = u
    return kids


def _draw(dist: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(dist, 1, generator=generator))


def predraw_follow(
    parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, generator: torch.Generator, atol: float = PROB_ATOL
) -> tuple[list[int], int]:
    """DDTree's predraw-and-follow verifier (TEV Sec. 2; App. A.4.1, Eqs. 42-44).

    One target token R_v ~ p_v is pre-drawn independently at every node (one batched draw over the
    N rows). Starting at the root, the verifier moves to the child u with x_u = R_v while one
    exists; at the first node v without such a child it stops, and R_v is the bonus token.

    Args:
        parents: N parent indices; tokens: N incoming tokens (see module docstring).
        probs: floating ``[N, V]`` target distributions p_v.
        generator: ``torch.Generator`` on ``probs.device``.
        atol: row-sum tolerance of ``probs``.

    Returns:
        ``(path, bonus)``: accepted node ids root..V (``list[int]``) and the bonus token id (int).

    Raises:
        ValueError: invalid tree or ``probs`` (see :func:`impl.tev.exit_law.check_target_probs`), or a
            ``generator`` that is not a ``torch.Generator``.
    """
    _check_generator(generator)
    par, tok, _, p = check_target_probs(parents, tokens, probs, atol)
    drawn = torch.multinomial(p, 1, generator=generator).flatten().tolist()  # R_v for every v
    kids = _child_index(par, tok)
    path = [0]
    while drawn[path[-1]] in kids[path[-1]]:
        path.append(kids[path[-1]][drawn[path[-1]]])
    return path, drawn[path[-1]]


def sequential_residual(
    parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, generator: torch.Generator, atol: float = PROB_ATOL
) -> tuple[list[int], int]:
    """EAGLE-style exact sequential residual verification (TEV Sec. 2; App. A.4.2, Eqs. 45-53).

    At the current node v the drafted children u_1, ..., u_k are tested in ascending id order with
    the residual g (g^(0) = p_v): child u_j is accepted with probability g^(j-1)(x_j) (the
    SpecInfer/EAGLE ratio min(1, g/q) for a deterministic draft, q = point mass on x_j); on
    rejection x_j is removed from g and g is renormalised (Eq. 46). An accepted child becomes the
    new current node; if all children are rejected (or v is a leaf) the bonus token is drawn from
    the final residual g^(k) = p_v^res (Eq. 53).

    Args:
        parents: N parent indices; tokens: N incoming tokens (see module docstring).
        probs: floating ``[N, V]`` target distributions p_v.
        generator: ``torch.Generator`` on ``probs.device`` (one uniform per child test, one
            categorical draw for the bonus).
        atol: row-sum tolerance of ``probs``.

    Returns:
        ``(path, bonus)``: accepted node ids root..V (``list[int]``) and the bonus token id (int).

    Raises:
        ValueError: invalid tree, ``probs`` or ``generator`` (as :func:`predraw_follow`).
    """
    _check_generator(generator)
    par, tok, _, p = check_target_probs(parents, tokens, probs, atol)
    kids = _child_index(par, tok)
    path = [0]
    while True:
        v = path[-1]
        g = p[v].clone()
        accepted = None
        for x, u in kids[v].items():
            a = float(g[x])  # g^(j-1)(x_j), already normalised
            r = float(torch.rand((), dtype=torch.float64, generator=generator, device=p.device))
            if r < a:
                accepted = u
                break
            g[x] = 0.0
            s = g.sum()
            if not s > 0:  # unreachable: a rejection has probability 1 - a > 0 only if mass remains
                raise RuntimeError(f"node {v}: empty residual after rejecting token {x}")
            g /= s
        if accepted is None:
            return path, _draw(g, generator)
        path.append(accepted)


def tev(
    parents: IntSeq, tokens: IntSeq, probs: torch.Tensor, generator: torch.Generator, atol: float = PROB_ATOL
) -> tuple[list[int], int]:
    """Tree Exit Verification (TEV Sec. 4; App. B, Algorithm 1; exactness in Corollary 2).

    Computes the canonical exit law w level-parallel (Algorithm 1, lines 3-7), draws the exit node
    V ~ Categorical(w) (line 8) and one bonus token Y ~ p_V^res, i.e. p_V with V's drafted child
    tokens removed and renormalised (p_V itself at a leaf; line 9). The accepted path is the root
    path of V.

    Args:
        parents: N parent indices; tokens: N incoming tokens (see module docstring).
        probs: floating ``[N, V]`` target distributions p_v.
        generator: ``torch.Generator`` on ``probs.device`` (exactly two categorical draws).
        atol: row-sum tolerance of ``probs``.

    Returns:
        ``(path, bonus)``: accepted node ids root..V (``list[int]``) and the bonus token id (int).

    Raises:
        ValueError: invalid tree, ``probs`` or ``generator`` (as :func:`predraw_follow`).
    """
    _check_generator(generator)
    par, tok, depths, p = check_target_probs(parents, tokens, probs, atol)
    _, _, w = _law(par, tok, depths, p)
    exit_node = _draw(w, generator)
    res = p[exit_node].clone()
    child_tokens = [tok[u] for u in range(1, len(par)) if par[u] == exit_node]
    if child_tokens:
        res[torch.tensor(child_tokens, dtype=torch.long, device=p.device)] = 0.0
    return path_to(par, exit_node), _draw(res, generator)


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


#: verifiers by name (the names used in configs and result rows)
VERIFIERS: dict[str, Verifier] = {
    "predraw_follow": predraw_follow,
    "sequential_residual": sequential_residual,
    "tev": tev,
}
