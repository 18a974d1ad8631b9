"""Canonical exit law (TEV Sec. 3.1-3.2, Eqs. 2-7, Lemma 1, App. A.2): by hand, against brute-force
enumeration of target continuations, conservation identities, degenerate rows and input checks."""

import itertools

import pytest
import torch

from impl.tev.exit_law import (
    check_target_probs,
    exit_law,
    expected_block_length,
    residual_distribution,
    target_coverage,
)
from impl.tev.tree import DraftTree


def _hand():
    # root(0) --tok0--> 1 --tok2--> 3 ;  root --tok1--> 2     (depth 2, 4 nodes, V = 5)
    parents, tokens = [-1, 0, 0, 1], [-1, 0, 1, 2]
    probs = torch.tensor([
        [0.5, 0.2, 0.1, 0.1, 0.1],
        [0.1, 0.1, 0.6, 0.1, 0.1],
        [0.2, 0.2, 0.2, 0.2, 0.2],
        [0.3, 0.3, 0.2, 0.1, 0.1],
    ])
    return parents, tokens, probs


def test_exit_law_by_hand():
    parents, tokens, probs = _hand()
    P, rho, w = exit_law(parents, tokens, probs)
    assert P.dtype == rho.dtype == w.dtype == torch.float64
    torch.testing.assert_close(P, torch.tensor([1.0, 0.5, 0.2, 0.3], dtype=torch.float64))
    torch.testing.assert_close(rho, torch.tensor([0.3, 0.4, 1.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(w, torch.tensor([0.3, 0.2, 0.2, 0.3], dtype=torch.float64))
    assert P[0] == 1.0 and abs(float(w.sum()) - 1) < 1e-12
    # Eq. 6, both forms: sum of non-root P, and expected exit depth
    assert target_coverage(parents, tokens, probs) == pytest.approx(1.0)
    assert float((w * torch.tensor([0, 1, 1, 2])).sum()) == pytest.approx(1.0)
    assert expected_block_length(parents, tokens, probs) == pytest.approx(2.0)
    # Eq. 7 at the root: tokens 0 and 1 removed, renormalised by rho = 0.3
    torch.testing.assert_close(residual_distribution(probs[0], [0, 1]),
                               torch.tensor([0, 0, 1 / 3, 1 / 3, 1 / 3], dtype=torch.float64))
    torch.testing.assert_close(residual_distribution(probs[2], []), probs[2].double())


def _random_case(seed, n, v_size, max_depth=3, boost=1.5):
    g = torch.Generator().manual_seed(seed)
    t = DraftTree.root_only(0)
    while len(t) < n:
        cand = [u for u in range(len(t)) if t.depths[u] < max_depth and len(t.children[u]) < v_size - 1]
        u = cand[int(torch.randint(len(cand), (), generator=g))]
        used = {t.tokens[c] for c in t.children[u]}
        free = [a for a in range(v_size) if a not in used]
        t.add_child(u, free[int(torch.randint(len(free), (), generator=g))])
    logits = torch.randn(n, v_size, generator=g, dtype=torch.float64)
    for u in range(1, n):
        logits[t.parents[u], t.tokens[u]] += boost
    return t, torch.softmax(logits, -1)


def _brute_force(t, probs):
    """Exit law and joint (exit, next token) law by enumerating every continuation z of length
    max_depth + 1 and walking it down the tree (the definition of V*(Z), Sec. 3.1)."""
    n, v_size = probs.shape
    kids = [{t.tokens[c]: c for c in t.children[u]} for u in range(n)]
    w = torch.zeros(n, dtype=torch.float64)
    joint = torch.zeros(n, v_size, dtype=torch.float64)
    for z in itertools.product(range(v_size), repeat=t.max_depth + 1):
        v, pz, exit_tok = 0, 1.0, None
        for a in z:
            if exit_tok is not None:  # after the exit: any continuation law (uniform) marginalises out
                pz /= v_size
                continue
            pz *= float(probs[v, a])
            if a in kids[v]:
                v = kids[v][a]
            else:
                exit_tok = a
        w[v] += pz
        joint[v, exit_tok] += pz
    return w, joint


@pytest.mark.parametrize("seed,n,v_size", [(0, 6, 4), (1, 8, 5), (2, 7, 3)])
def test_exit_law_matches_enumeration(seed, n, v_size):
    t, probs = _random_case(seed, n, v_size)
    P, rho, w = exit_law(t.parents, t.tokens, probs)
    w_bf, joint = _brute_force(t, probs)
    torch.testing.assert_close(w, w_bf, atol=1e-12, rtol=0)  # Lemma 1
    assert float(w.sum()) == pytest.approx(1.0, abs=1e-12)  # Eq. 5
    # Theorem 1 / Eq. 10: the bonus token given the exit node follows p_v^res
    for v in range(n):
        res = residual_distribution(probs[v], [t.tokens[c] for c in t.children[v]])
        torch.testing.assert_close(joint[v], w[v] * res, atol=1e-12, rtol=0)
    # Eq. 25 (conservation) and Eq. 26 (subtree sums)
    for v in range(n):
        assert float(w[v] + sum(P[c] for c in t.children[v])) == pytest.approx(float(P[v]), abs=1e-12)
    anc = t.ancestor_mask()  # anc[v, u]: u is an ancestor-or-self of v
    torch.testing.assert_close(anc.double().T @ w, P, atol=1e-12, rtol=0)
    # Eq. 6: both forms of C_p
    depth = torch.tensor(t.depths, dtype=torch.float64)
    assert target_coverage(t.parents, t.tokens, probs) == pytest.approx(float((w * depth).sum()), abs=1e-12)
    # P(v) is the target probability of pi(v) (Eq. 2)
    for v in range(n):
        path = t.path_to(v)
        prob = 1.0
        for a, b in zip(path, path[1:]):
            prob *= float(probs[a, t.tokens[b]])
        assert float(P[v]) == pytest.approx(prob, rel=1e-6)


def test_exit_law_invariant_to_node_numbering():
    # same tree (as a set of prefixes), two topological numberings
    t1 = DraftTree.from_paths([[1, 2], [1, 3], [4, 0]], root_token=0)
    t2 = DraftTree.from_paths([[4, 0], [1, 3], [1, 2]], root_token=0)
    g = torch.Generator().manual_seed(3)
    rows = {}  # target distribution keyed by prefix
    for t in (t1, t2):
        for v in range(len(t)):
            key = tuple(t.path_tokens(v))
            if key not in rows:
                rows[key] = torch.softmax(torch.randn(5, generator=g), -1)
    laws = []
    for t in (t1, t2):
        probs = torch.stack([rows[tuple(t.path_tokens(v))] for v in range(len(t))])
        _, _, w = exit_law(t.parents, t.tokens, probs)
        laws.append({tuple(t.path_tokens(v)): float(w[v]) for v in range(len(t))})
    assert laws[0].keys() == laws[1].keys()
    for k in laws[0]:
        assert laws[0][k] == pytest.approx(laws[1][k], abs=1e-12)


def test_one_hot_rows_give_greedy_exit_and_exact_zeros():
    t = DraftTree.from_paths([[1, 2], [1, 3], [4]], root_token=0)
    argmax = [1, 3, 0, 2, 1]  # root -> 1 -> 3 (tok 3), then 2 is not a child of the leaf 3
    probs = torch.nn.functional.one_hot(torch.tensor(argmax), 5).float()
    P, rho, w = exit_law(t.parents, t.tokens, probs)
    assert w.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert rho.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert P.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert target_coverage(t.parents, t.tokens, probs) == 2.0


def test_truncated_support_gives_exact_zero_rho():
    # root's target mass lies only on its drafted children: rho(root) must be exactly 0, not ~1e-17
    parents, tokens = [-1, 0, 0], [0, 1, 2]
    probs = torch.tensor([[0.0, 0.1, 0.9, 0.0], [0.25] * 4, [0.25] * 4])
    _, rho, w = exit_law(parents, tokens, probs)
    assert rho[0] == 0.0 and w[0] == 0.0 and float(w.sum()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rho"):
        residual_distribution(probs[0], [1, 2])


def test_root_only_tree():
    P, rho, w = exit_law([-1], [5], torch.tensor([[0.3, 0.7]]))
    assert P.tolist() == rho.tolist() == w.tolist() == [1.0]
    assert target_coverage([-1], [5], torch.tensor([[0.3, 0.7]])) == 0.0


def test_rows_are_renormalised_in_float64():
    parents, tokens, probs = _hand()
    noisy = probs * (1 + 5e-5)  # within the default tolerance
    _, _, _, p = check_target_probs(parents, tokens, noisy)
    assert p.dtype == torch.float64
    torch.testing.assert_close(p.sum(-1), torch.ones(4, dtype=torch.float64), atol=1e-15, rtol=0)
    torch.testing.assert_close(exit_law(parents, tokens, noisy)[2], exit_law(parents, tokens, probs)[2])


@pytest.mark.parametrize("probs,msg", [
    (torch.full((4, 5), 0.2, dtype=torch.float64)[:3], r"shape \[N=4, V\]"),
    (torch.full((4, 5), 1, dtype=torch.long), "floating"),
    ([[0.2] * 5] * 4, "floating torch tensor"),
    (torch.tensor([[0.2] * 5] * 3 + [[0.2, 0.2, 0.2, 0.2, 0.3]]), "node 3 sums to 1.1"),
    (torch.tensor([[0.2] * 5] * 2 + [[-0.2, 0.4, 0.4, 0.2, 0.2]] + [[0.2] * 5]), r"negative entries \(node 2\)"),
    (torch.tensor([[0.2] * 5] * 3 + [[float("nan")] * 5]), "non-finite"),
    (torch.full((4, 2), 0.5), "node 3: draft token 2 is outside the vocabulary of size 2"),
])
def test_invalid_probs(probs, msg):
    parents, tokens, _ = _hand()
    with pytest.raises(ValueError, match=msg):
        exit_law(parents, tokens, probs)


def test_invalid_tree_is_rejected():
    _, _, probs = _hand()
    with pytest.raises(ValueError, match="node 2: token 0 repeats"):
        exit_law([-1, 0, 0, 1], [-1, 0, 0, 2], probs)
