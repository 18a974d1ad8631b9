"""Verifier-stage latency benchmark (impl.tev.latency, TEV App. D.1 / Table 3) and the fast paths it
times (impl.tev.verify, impl.tev.exit_law.edge_probs / law_from_edges, impl.tev.decode.commit_cache).

Fast paths against reference implementations: the one-pass exit law from the gathered edge
probabilities equals the float64 reference :func:`exit_law` (exact zeros included); the batched
two-level inverse CDF (predraw) and TEV's two-level residual bonus draw return exactly the one-level
float64 inverse-CDF index for the same uniforms and never a zero-probability (or drafted) token; each
verifier gives the same output as a reference written from the definitions with the same generator
consumption (validate=True and validate=False alike); the sampler / draw-mode variants keep the
committed-block law (chi-square); the in-place KV commit equals a full gather. The benchmark runs on a
tiny random target with a FixedDrafter and returns well-formed rows whose mean block lengths agree
with each other and with 1 + mean C_p, at the target's V and on the same trees restricted to narrower
vocabularies (restrict_vocab keeps the drafted tokens and every row's mode). No timing is asserted
(machines are noisy).
"""

import functools
import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from impl.tev.decode import FixedDrafter, commit_cache
from impl.tev.exit_law import (
    RHO_RECHECK,
    edge_probs,
    exit_cdf,
    exit_law,
    host_view,
    law_from_edges,
    residual_distribution,
    unchecked_exit_cdf,
)
from impl.tev.latency import DEFAULT_VERIFIERS, TargetChainDrafter, bigram_drafter, restrict_vocab, verifier_latency
from impl.tev.plan import tree_plan
from impl.tev.tree import DraftTree, path_to
from impl.tev.verify import (
    VERIFIERS,
    _categorical,
    _residual_draw,
    _search_cdf,
    _categorical_rows,
    inverse_cdf_rows,
    predraw_follow,
    sequential_residual,
    tev,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P_MIN = 1e-3


# --- random trees and rows ------------------------------------------------------------------------

def _random_tree(g, n, v_size, max_depth, chain=False):
    t = DraftTree.root_only(0)
    while len(t) < n:
        if chain and len(t) <= max_depth:  # one deep chain first, so the doubling needs > 3 rounds
            u = len(t) - 1
        else:
            cand = [u for u in range(len(t)) if t.depths[u] < max_depth and len(t.children[u]) < v_size - 1]
            u = cand[int(torch.randint(len(cand), (), generator=g))]
        used = {t.tokens[c] for c in t.children[u]}
        free = [a for a in range(v_size) if a not in used]
        t.add_child(u, free[int(torch.randint(len(free), (), generator=g))])
    return t


def _rows(g, t, v_size, kind, dtype=torch.float32):
    n = len(t)
    logits = torch.randn(n, v_size, generator=g, dtype=torch.float64) * 2
    for u in range(1, n):
        logits[t.parents[u], t.tokens[u]] += 2.0
    if kind == "onehot":
        return torch.nn.functional.one_hot(logits.argmax(-1), v_size).to(dtype)
    probs = torch.softmax(logits, -1)
    if kind == "truncated":  # the widest node's mass lies only on its drafted children (rho = 0)
        v = max(range(n), key=lambda u: len(t.children[u]))
        keep = torch.zeros(v_size, dtype=torch.bool)
        keep[[t.tokens[c] for c in t.children[v]]] = True
        probs[v] = torch.where(keep, probs[v], 0.0)
        probs[v] /= probs[v].sum()
    if kind == "zeros":  # sparse rows (top-k style truncation)
        probs = torch.where(probs > probs.median(-1, keepdim=True).values, probs, 0.0)
        probs /= probs.sum(-1, keepdim=True)
    return _dyadic(probs).to(dtype)


def _dyadic(probs: torch.Tensor) -> torch.Tensor:
    """Rows on the 2^-24 grid summing to exactly 1, so that every float32 partial sum is exact and
    fast paths that sum in float32 agree bit for bit with float64 references."""
    q = torch.round(probs.double() * 2 ** 24)
    top = q.argmax(-1)
    q[torch.arange(q.shape[0]), top] += 2 ** 24 - q.sum(-1)
    return q / 2 ** 24


CASES = [(seed, n, v, d, kind, chain) for seed, (n, v, d, kind, chain) in enumerate([
    (1, 5, 2, "soft", False), (2, 3, 1, "soft", False), (9, 7, 3, "soft", False), (30, 50, 4, "soft", False),
    (20, 40, 12, "soft", True), (40, 4096, 8, "soft", False), (12, 9, 3, "truncated", False),
    (15, 20, 4, "onehot", False), (25, 64, 6, "zeros", True), (129, 300, 8, "soft", False),
])]


def _fast_law(t, probs, row_sums=None, host=True):
    plan = tree_plan(t.parents, t.tokens)
    rs = None if row_sums is None else np.asarray(row_sums, dtype=np.float64)
    e = edge_probs(plan, probs, host_view(probs) if host else None, rs)
    return (x.tolist() for x in law_from_edges(plan, e, probs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed,n,v,d,kind,chain", CASES)
def test_fast_law_equals_reference(seed, n, v, d, kind, chain, dtype):
    g = torch.Generator().manual_seed(seed)
    t = _random_tree(g, n, v, d, chain)
    probs = _rows(g, t, v, kind, dtype)
    P0, rho0, w0 = (x.tolist() for x in exit_law(t.parents, t.tokens, probs))
    for host, row_sums in [(True, None), (False, None), (True, probs.sum(-1).tolist())]:
        P, rho, w = _fast_law(t, probs, row_sums, host)
        assert all(isinstance(x, float) for x in P + rho + w) and len(w) == n
        torch.testing.assert_close(torch.tensor(P), torch.tensor(P0), rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(torch.tensor(rho), torch.tensor(rho0), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(torch.tensor(w), torch.tensor(w0), rtol=1e-6, atol=1e-12)
        assert [x == 0 for x in w] == [x == 0 for x in w0] and [x == 0 for x in rho] == [x == 0 for x in rho0]


@pytest.mark.parametrize("seed,n,v,d,kind,chain", CASES)
def test_exit_cdf_is_the_cumulative_law(seed, n, v, d, kind, chain):
    """TEV's hot path samples from the cumulative sums of w: the same floats as accumulating the w of
    law_from_edges left to right (both branches: with and without the exact rho recheck)."""
    g = torch.Generator().manual_seed(seed)
    t = _random_tree(g, n, v, d, chain)
    probs = _rows(g, t, v, kind)
    plan = tree_plan(t.parents, t.tokens)
    for row_sums in (None, probs.sum(-1).double().numpy()):
        e = edge_probs(plan, probs, host_view(probs), row_sums)
        _, _, w = law_from_edges(plan, e, probs)
        c = exit_cdf(plan, e, probs)
        np.testing.assert_allclose(c, list(itertools.accumulate(w.tolist())), rtol=1e-13, atol=0)
        # the hot-path form: identical where no rho needs the exact recheck, within float32 rounding elsewhere
        fast, rho = unchecked_exit_cdf(plan, e)
        if rho.min() >= RHO_RECHECK:
            assert fast.tolist() == c.tolist()
        else:
            np.testing.assert_allclose(fast, c, rtol=0, atol=1e-6)


def test_search_cdf_never_returns_a_zero_weight():
    c = np.cumsum([0.0, 0.25, 0.0, 0.75, 0.0])
    assert [_search_cdf(c, u) for u in (0.0, 0.2, 0.25, 0.9, 1 - 2 ** -53, 1.0)] == [1, 1, 3, 3, 3, 3]
    with pytest.raises(ValueError, match="total"):
        _search_cdf(np.zeros(2), 0.5)


def test_fast_law_renormalises_with_row_sums():
    g = torch.Generator().manual_seed(3)
    t = _random_tree(g, 12, 10, 4)
    probs = _rows(g, t, 10, "soft", torch.float64) * torch.linspace(1 - 8e-5, 1 + 8e-5, 12)[:, None].double()
    _, _, w0 = exit_law(t.parents, t.tokens, probs)
    _, _, w = _fast_law(t, probs, probs.sum(-1).tolist())
    torch.testing.assert_close(torch.tensor(w, dtype=torch.float64), w0, rtol=1e-12, atol=1e-15)


def test_edge_probs_read_only_the_edges_of_any_layout():
    """The zero-copy host view (contiguous float32 / float64 CPU rows) and the torch gather (any
    other tensor: a strided view, bfloat16) return the same exact entries."""
    g = torch.Generator().manual_seed(5)
    t = _random_tree(g, 30, 40, 5)
    probs = _rows(g, t, 40, "soft", torch.float32)
    want = [1.0] + [float(probs[p, x]) for p, x in zip(t.parents[1:], t.tokens[1:])]
    plan = tree_plan(t.parents, t.tokens)
    assert host_view(probs) is not None
    assert edge_probs(plan, probs, host_view(probs)).tolist() == want == edge_probs(plan, probs).tolist()
    wide = torch.zeros(len(t), 80)
    wide[:, ::2] = probs
    assert edge_probs(plan, wide[:, ::2], host_view(wide[:, ::2])).tolist() == want  # strided view
    assert edge_probs(plan, wide[:, ::2]).tolist() == want
    bf = probs.to(torch.bfloat16)
    assert host_view(bf) is None
    assert edge_probs(plan, bf).tolist() == [1.0] + [float(bf[p, x]) for p, x in zip(t.parents[1:], t.tokens[1:])]
    root = tree_plan([-1], [3])
    assert edge_probs(root, probs[:1]).tolist() == edge_probs(root, probs[:1], host_view(probs[:1])).tolist() == [1.0]


def test_root_only_law():
    plan = tree_plan([-1], [3])
    probs = torch.tensor([[0.5, 0.5]])
    P, rho, w = law_from_edges(plan, edge_probs(plan, probs), probs)
    assert P.tolist() == rho.tolist() == w.tolist() == [1.0]


@pytest.mark.parametrize("seed,n,v,d,kind,chain", CASES)
def test_tree_plan_tables(seed, n, v, d, kind, chain):
    """The plan's ancestor table lists every node's root path (self first, root excluded, 0-padded),
    its child lists and child map match the tree, and DraftTree.plan() is cached until the tree grows."""
    g = torch.Generator().manual_seed(seed)
    t = _random_tree(g, n, v, d, chain)
    plan = t.plan()
    assert plan is t.plan() and plan.ancestors.shape == (t.max_depth, len(t))
    for u in range(len(t)):
        want = path_to(t.parents, u)[1:][::-1]
        assert plan.ancestors[:, u].tolist() == want + [0] * (t.max_depth - len(want))
        assert plan.children[u] == t.children[u] and plan.child_tokens[u].tolist() == sorted(t.tokens[c] for c in t.children[u])
    assert plan.child_map == {(t.parents[u], t.tokens[u]): u for u in range(1, len(t))}
    t.add_child(0, v + 7)
    assert t.plan() is not plan and len(t.plan()) == len(t)


def test_verifiers_refuse_a_plan_of_another_tree():
    g = torch.Generator().manual_seed(2)
    t = _random_tree(g, 12, 10, 4)
    other = _random_tree(g, 12, 10, 4)
    probs = _rows(g, t, 10, "soft")
    for f in (predraw_follow, sequential_residual, tev):
        with pytest.raises(ValueError, match="TreePlan"):
            f(t.parents, t.tokens, probs, torch.Generator().manual_seed(0), plan="x")
        with pytest.raises(ValueError, match="plan"):
            f(t.parents, t.tokens, probs, torch.Generator().manual_seed(0), plan=tree_plan([-1, 0], [1, 2]))
        if other.parents != t.parents or other.tokens != t.tokens:
            with pytest.raises(ValueError, match="plan does not describe"):
                f(t.parents, t.tokens, probs, torch.Generator().manual_seed(0), plan=other.plan())


# --- sampling primitives --------------------------------------------------------------------------

def _reference_index(row: torch.Tensor, u: float) -> int:
    c = row.to(torch.float64).cumsum(0)
    return int(torch.searchsorted(c, torch.tensor([u * float(c[-1])], dtype=torch.float64), right=True))


@pytest.mark.parametrize("v", [1, 2, 7, 64, 65, 97, 1000, 4096])
def test_two_level_inverse_cdf_equals_one_level(v):
    g = torch.Generator().manual_seed(v)
    n = 300
    probs = torch.softmax(torch.randn(n, v, generator=g) * 3, -1)
    probs[::3] = torch.where(torch.rand(n // 3 + (n % 3 > 0), v, generator=g) < 0.7, 0.0, probs[::3])
    probs[::3, 0] += 1e-3  # keep every row's total positive
    u = torch.rand(n, dtype=torch.float64, generator=g)
    got = inverse_cdf_rows(probs, u).tolist()
    assert all(float(probs[r, i]) > 0 for r, i in enumerate(got))  # never a zero-probability token
    # with exact block sums (grid values) the two-level search is the one-level one, index for index
    probs = _dyadic(probs).float()
    got = inverse_cdf_rows(probs, u).tolist()
    assert got == [_reference_index(probs[r], float(u[r])) for r in range(n)]
    assert all(float(probs[r, i]) > 0 for r, i in enumerate(got))
    # a uniform at the top of [0, 1) lands on the last positive entry, never on trailing zeros
    top = torch.full((n,), 1 - 2 ** -53, dtype=torch.float64)
    last = [int(torch.nonzero(probs[r] > 0).flatten()[-1]) for r in range(n)]
    assert inverse_cdf_rows(probs, top).tolist() == last


@pytest.mark.parametrize("v", [1, 2, 7, 64, 65, 97, 1000, 4096])
def test_residual_draw_equals_one_level_and_skips_drafted(v):
    """TEV's bonus draw: the two-level search over row v minus the drafted tokens returns, on grid
    rows (exact partial sums), the one-level float64 inverse-CDF index of the zeroed row for the
    same uniform, through the host view and through torch alike; on any rows it never returns a
    drafted or zero-probability token, and the top uniform lands on the last eligible token."""
    g = torch.Generator().manual_seed(v)
    n = 40
    probs = torch.softmax(torch.randn(n, v, generator=g) * 3, -1)
    probs[::3] = torch.where(torch.rand(len(range(0, n, 3)), v, generator=g) < 0.7, 0.0, probs[::3])
    probs[:, 0] += 1e-3
    probs /= probs.sum(-1, keepdim=True)
    for rows in (probs, _dyadic(probs).float()):
        for r in range(n):
            k = int(torch.randint(0, v, (), generator=g))  # drafted children (some may carry no mass)
            drafted = sorted(torch.randperm(v, generator=g)[:k].tolist())
            if float(rows[r].sum()) - sum(float(rows[r, a]) for a in drafted) <= 0:
                continue  # no residual mass: w(v) = 0, never an exit node
            pairs = np.asarray(drafted, dtype=np.int64)
            zeroed = rows[r].double().clone()
            zeroed[drafted] = 0.0
            for u in [float(x) for x in torch.rand(5, dtype=torch.float64, generator=g)] + [1 - 2 ** -53]:
                got = [_residual_draw(rows, r, pairs, u, h) for h in (host_view(rows), None)]
                assert got[0] == got[1] and got[0] not in drafted and float(rows[r, got[0]]) > 0
                if rows is not probs:  # exact partial sums: index for index
                    assert got[0] == _reference_index(zeroed, u)
            top = _residual_draw(rows, r, pairs, 1 - 2 ** -53, None)
            assert top == int(torch.nonzero(zeroed > 0).flatten()[-1]) or rows is probs


def test_categorical_never_draws_zero_weight_and_matches_law():
    g = torch.Generator().manual_seed(0)
    for size in (5, 600):  # the Python-float path and the tensor path
        w = torch.rand(size, dtype=torch.float64, generator=g)
        w[::2] = 0.0
        counts = Counter(_categorical(w, g) for _ in range(20_000))
        assert all(w[i] > 0 for i in counts)
        if size == 5:
            exp = (w / w.sum() * 20_000)[w > 0]
            obs = torch.tensor([counts.get(i, 0) for i in range(size) if w[i] > 0], dtype=torch.float64)
            assert stats.chisquare(obs.numpy(), exp.numpy()).pvalue > P_MIN
    assert _categorical(torch.tensor([0.0, 0.0, 2.0]), g) == 2
    with pytest.raises(ValueError, match="total"):
        _categorical(torch.zeros(3, dtype=torch.float64), g)
    with pytest.raises(ValueError, match="total"):
        _categorical(torch.zeros(700, dtype=torch.float64), g)


def test_categorical_rows_samplers_match_row_laws():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(3, 6, generator=g), -1)
    for sampler in ("cdf", "multinomial"):
        counts = [Counter() for _ in range(3)]
        for _ in range(8000):
            for r, i in enumerate(_categorical_rows(probs, g, sampler)):
                counts[r][i] += 1
        for r in range(3):
            obs = [counts[r].get(i, 0) for i in range(6)]
            exp = probs[r].double() * 8000
            assert stats.chisquare(obs, (exp * (8000 / exp.sum())).numpy()).pvalue > P_MIN


# --- verifiers against reference implementations --------------------------------------------------

def _ref_predraw(t, probs, g):
    """Definition: one uniform per node (one batched draw), exact float64 inverse CDF per row, follow."""
    u = torch.rand(len(t), dtype=torch.float64, generator=g)
    drawn = [_reference_index(probs[v], float(u[v])) for v in range(len(t))]
    path = [0]
    while True:
        nxt = [c for c in t.children[path[-1]] if t.tokens[c] == drawn[path[-1]]]
        if not nxt:
            return path, drawn[path[-1]]
        path.append(nxt[0])


def _ref_tev(t, probs, g):
    """Algorithm 1 from the float64 reference law, inverse-CDF draws (one uniform each)."""
    _, _, w = exit_law(t.parents, t.tokens, probs)
    v = _reference_index(w, float(torch.rand(1, dtype=torch.float64, generator=g)))
    res = residual_distribution(probs[v], [t.tokens[c] for c in t.children[v]])
    return path_to(t.parents, v), _reference_index(res, float(torch.rand(1, dtype=torch.float64, generator=g)))


def _ref_sequential(t, probs, g):
    """Eqs. 45-53 with the residual renormalised by a full sum after every rejection."""
    path = [0]
    while True:
        v = path[-1]
        gv = probs[v].double() / probs[v].double().sum()
        for c in t.children[v]:
            if float(torch.rand((), dtype=torch.float64, generator=g)) < float(gv[t.tokens[c]]):
                path.append(c)
                break
            gv[t.tokens[c]] = 0.0
            gv /= gv.sum()
        else:
            return path, _reference_index(gv, float(torch.rand(1, dtype=torch.float64, generator=g)))


REFERENCES = {"predraw_follow": _ref_predraw, "tev": _ref_tev, "sequential_residual": _ref_sequential}


@pytest.mark.parametrize("seed,n,v,d,kind,chain", CASES)
@pytest.mark.parametrize("name", list(VERIFIERS))
def test_verifier_equals_reference_for_the_same_generator_state(name, seed, n, v, d, kind, chain):
    g = torch.Generator().manual_seed(100 + seed)
    t = _random_tree(g, n, v, d, chain)
    probs = _rows(g, t, v, kind)
    draws = 60 if v < 1000 else 15
    for validate in (True, False):
        a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        got = [VERIFIERS[name](t.parents, t.tokens, probs, a, validate=validate) for _ in range(draws)]
        want = [REFERENCES[name](t, probs, b) for _ in range(draws)]
        assert got == want, (name, validate)
    if kind == "onehot":  # T = 0: the greedy path whatever the generator
        assert len(set(map(str, got))) == 1


def test_tensor_tree_inputs():
    g = torch.Generator().manual_seed(4)
    t = _random_tree(g, 15, 12, 4)
    probs = _rows(g, t, 12, "soft")
    for f in VERIFIERS.values():
        a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        assert (f(t.parents, t.tokens, probs, a, validate=False)
                == f(torch.tensor(t.parents), torch.tensor(t.tokens), probs, b, validate=False))


@pytest.mark.parametrize("name", list(VERIFIERS))
def test_validating_path_rejects_bad_rows(name):
    """validate=True (the default, the public API) rejects rows that are not distributions with a
    clear error; validate=False (the decode loop / benchmark, rows from a softmax) skips the checks
    for every verifier alike."""
    t = DraftTree.from_paths([[1, 2], [3]], root_token=0)
    good = torch.full((len(t), 5), 0.2)
    bad = {"negative": (0, 1, -0.1, "negative"), "nan": (2, 3, float("nan"), "non-finite"),
           "sum": (1, 4, 0.9, "node 1 sums to")}
    f = VERIFIERS[name]
    for row, col, val, msg in bad.values():
        probs = good.clone()
        probs[row, col] = val
        with pytest.raises(ValueError, match=msg):
            f(t.parents, t.tokens, probs, torch.Generator())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        f(t.parents, [0, 1, 2, 9], good, torch.Generator())
    with pytest.raises(ValueError, match="parent"):
        f([-1, 0, 5, 0], t.tokens, good, torch.Generator())
    path, bonus = f(t.parents, t.tokens, good, torch.Generator().manual_seed(0), validate=False)
    assert path[0] == 0 and 0 <= bonus < 5


def test_variant_options_are_checked():
    t = DraftTree.from_paths([[1]], root_token=0)
    probs = torch.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="sampler"):
        tev(t.parents, t.tokens, probs, torch.Generator(), sampler="gumbel")
    with pytest.raises(ValueError, match="draws"):
        predraw_follow(t.parents, t.tokens, probs, torch.Generator(), draws="some")
    with pytest.raises(ValueError, match="sampler"):
        sequential_residual(t.parents, t.tokens, probs, torch.Generator(), sampler="x")


# --- the variants keep the committed-block law (chi-square, as tests/test_tev_verify.py) ----------

def _sequence_law(t, probs):
    law = {}
    for v in range(len(t)):
        path = t.path_to(v)
        pre = math.prod(float(probs[a, t.tokens[b]]) for a, b in zip(path, path[1:]))
        drafted = {t.tokens[c] for c in t.children[v]}
        for y in range(probs.shape[1]):
            if y not in drafted:
                law[tuple(t.path_tokens(v)) + (y,)] = pre * float(probs[v, y])
    return law


def _pvalue(counts, law):
    keys = [k for k in law if law[k] > 0]
    n = sum(counts.values())
    exp = [law[k] / sum(law[j] for j in keys) * n for k in keys]
    obs = [counts.get(k, 0) for k in keys]
    big = [i for i, e in enumerate(exp) if e >= 5]
    small = [i for i, e in enumerate(exp) if e < 5]
    f_exp, f_obs = [exp[i] for i in big], [obs[i] for i in big]
    if small:
        f_exp.append(sum(exp[i] for i in small))
        f_obs.append(sum(obs[i] for i in small))
    s = sum(f_obs) / sum(f_exp)
    return float(stats.chisquare(f_obs, [e * s for e in f_exp]).pvalue)


VARIANTS = {
    "predraw_visited": functools.partial(predraw_follow, draws="visited"),
    "predraw_multinomial": functools.partial(predraw_follow, sampler="multinomial"),
    "predraw_visited_multinomial": functools.partial(predraw_follow, draws="visited", sampler="multinomial"),
    "sequential_multinomial": functools.partial(sequential_residual, sampler="multinomial"),
    "tev_multinomial": functools.partial(tev, sampler="multinomial"),
    "tev_no_validation": functools.partial(tev, validate=False),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_committed_block_is_target_distributed(name):
    g = torch.Generator().manual_seed(11)
    t = _random_tree(g, 8, 6, 3)
    probs = _rows(g, t, 6, "soft")
    probs = (probs.double() / probs.double().sum(-1, keepdim=True)).float()
    f, gen = VARIANTS[name], torch.Generator().manual_seed(2024)
    counts = Counter()
    for _ in range(12_000):
        path, bonus = f(t.parents, t.tokens, probs, gen)
        counts[tuple(t.tokens[u] for u in path[1:]) + (bonus,)] += 1
    law = _sequence_law(t, probs)
    assert all(law.get(k, 0) > 0 for k in counts)
    assert _pvalue(counts, law) > P_MIN


# --- the in-place KV commit -----------------------------------------------------------------------

@pytest.mark.parametrize("path", [[0], [0, 1, 2], [0, 1, 2, 3, 4, 5], [0, 3, 4, 5], [0, 1, 5, 9], [0, 6], [0, 2, 7]])
def test_commit_equals_full_gather(tiny_model, path):
    from transformers import DynamicCache

    prefix = [3, 1, 4, 1, 5]
    tree = DraftTree.from_paths([[10, 11, 12, 13, 14], [20, 21], [30, 31, 32], [40]], root_token=9)
    with torch.no_grad():
        cache = DynamicCache(config=tiny_model.config)
        tiny_model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
        tiny_model(input_ids=tree.input_ids(), attention_mask=tree.attention_mask(len(prefix)),
                   position_ids=tree.position_ids(len(prefix)), cache=cache, use_cache=True)
    keep = torch.tensor(list(range(len(prefix))) + [len(prefix) + u for u in path])
    want = [(layer.keys.index_select(-2, keep).clone(), layer.values.index_select(-2, keep).clone())
            for layer in cache.layers]
    commit_cache(cache, len(prefix), len(tree), path)
    assert cache.get_seq_length() == len(prefix) + len(path)
    for layer, (k, v) in zip(cache.layers, want):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)


# --- the benchmark ----------------------------------------------------------------------------------

V_TINY = 97
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5], [2, 7, 1, 8]]


def _peaked(n, last):
    """Peaked random marginals (a confident drafter that knows nothing)."""
    return torch.randn(8, V_TINY, generator=torch.Generator().manual_seed(7919 * n + last)) * 3.0


@pytest.fixture(scope="module")
def oracle_drafter(tiny_model):
    """A FixedDrafter whose rows favour the target's greedy continuation where the committed
    (length, last token) matches a point of the prompts' greedy runs: accepted paths of depth > 0."""
    from impl.spec.ar import ar_decode

    table = {}
    for p in PROMPTS:
        full = p + ar_decode(tiny_model, p, 60).tokens
        for n in range(len(p), len(full)):
            table[(n, full[n - 1])] = full[n:n + 8]

    def fn(n, last):
        z = torch.randn(8, V_TINY, generator=torch.Generator().manual_seed(7919 * n + last))
        for k, t in enumerate(table.get((n, last), [])):
            z[k, t] += 4.0
        return z

    return FixedDrafter(fn, block_size=8)


@pytest.fixture(scope="module")
def latency_rows(tiny_model, oracle_drafter):
    arms = {name: VERIFIERS[name] for name in DEFAULT_VERIFIERS}
    arms["predraw_multinomial"] = functools.partial(predraw_follow, sampler="multinomial")
    return verifier_latency(tiny_model, oracle_drafter, PROMPTS, budgets=(4, 16), depth=4, temperature=0.3,
                            n_trees=12, repeats=30, seed=3, verifiers=arms, rounds_per_prompt=4,
                            isolated=("predraw_multinomial",), law_draws=50)


def test_benchmark_rows_are_well_formed(latency_rows):
    rows = latency_rows
    assert [(r["budget"], r["verifier"]) for r in rows] == [
        (b, v) for b in (4, 16) for v in list(DEFAULT_VERIFIERS) + ["predraw_multinomial"]]
    for r in rows:
        assert r["n_trees"] == 12 and r["n_calls"] == 360 and r["repeats"] == 30
        assert r["baseline"] == "predraw_follow" and r["depth"] == 4 and r["temperature"] == 0.3
        assert len(r["tree_us"]) == 12 and all(x > 0 for x in r["tree_us"])
        for k in ("median_us", "mean_us", "decision_median_us", "commit_median_us", "ratio_median",
                  "ratio_of_means", "decision_ratio_median", "tau_se"):
            assert math.isfinite(r[k]) and r[k] > 0, k
        assert 1.0 <= r["mean_tau"] <= 5.0 and r["expected_tau"] == 1.0 + r["mean_cp"]
        assert 0 < r["mean_tree_size"] <= r["budget"]
        if r["verifier"] == "predraw_follow":
            assert r["ratio_median"] == r["ratio_of_means"] == r["decision_ratio_median"] == 1.0
    # every verifier saw the same realized trees
    for b in (4, 16):
        assert len({(r["mean_cp"], r["mean_tree_size"]) for r in rows if r["budget"] == b}) == 1


def test_benchmark_mean_block_lengths_agree(latency_rows):
    for b in (4, 16):
        rows = [r for r in latency_rows if r["budget"] == b]
        assert rows[0]["mean_cp"] > 0.15  # drafts get accepted: the check has something to test
        for r in rows:  # E[tau | tree] = 1 + C_p(tree) for every exact verifier (Eq. 11)
            assert abs(r["mean_tau"] - r["expected_tau"]) < 4.5 * r["tau_se"], r
        for r in rows:
            for s in rows:  # pairwise, within the combined sampling error
                assert abs(r["mean_tau"] - s["mean_tau"]) < 4.5 * math.hypot(r["tau_se"], s["tau_se"])


def test_benchmark_law_sample_holds_the_exit_law(latency_rows, tiny_model, oracle_drafter):
    """The untimed law sample: law_draws calls per tree of every interleaved verifier (none for an isolated
    one), each verifier's mean tau at 1 + C_p of the same trees within its sampling error (Eq. 11); its SE is
    sqrt(law_draws / repeats) smaller than the timed calls' (here 50 vs 30 calls per tree)."""
    for r in latency_rows:
        if r["verifier"] == "predraw_multinomial":
            assert r["law_n_calls"] == 0 and math.isnan(r["law_mean_tau"]) and math.isnan(r["law_tau_se"])
            continue
        assert r["law_n_calls"] == 12 * 50 and 0 < r["law_tau_se"] < r["tau_se"]
        assert abs(r["law_mean_tau"] - r["expected_tau"]) < 4.5 * r["law_tau_se"], r
    with pytest.raises(ValueError, match="law_draws"):
        verifier_latency(tiny_model, oracle_drafter, PROMPTS, budgets=(4,), depth=4, n_trees=1, repeats=1,
                         law_draws=-1)


def test_restrict_vocab_keeps_the_tree_and_the_modes():
    """Drafted tokens and every row's mode survive the restriction, renumbered to their column; the
    kept columns are the largest ones in token order and each row is renormalised, so the exit law of
    the restricted problem equals the original's conditioned on the kept columns."""
    V, tree = 50, DraftTree.from_paths([[7, 3], [7, 44], [12]], root_token=5)  # N = 5 nodes
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(len(tree), V, generator=g) * 2.0, -1)  # [N, V]
    probs[:, 44] = 1e-9  # a drafted token of tiny mass is still kept
    probs /= probs.sum(-1, keepdim=True)
    sub_tree, sub = restrict_vocab(tree, probs, 12)
    assert sub.shape == (5, 12) and sub.is_contiguous() and torch.allclose(sub.sum(-1), torch.ones(5))
    drafted = set(tree.tokens[1:])
    others = sorted((c for c in range(V) if c not in drafted), key=lambda c: -float(probs[:, c].max()))
    kept = sorted(drafted | set(others[:12 - len(drafted)]))
    assert len(kept) == 12 and set(tree.tokens[1:]) <= set(kept) and set(probs.argmax(-1).tolist()) <= set(kept)
    assert sub_tree.parents == tree.parents and sub_tree.tokens[0] == -1
    assert [kept[t] for t in sub_tree.tokens[1:]] == tree.tokens[1:]
    assert torch.allclose(sub, probs[:, kept] / probs[:, kept].sum(-1, keepdim=True))
    P, _, _ = exit_law(sub_tree.parents, sub_tree.tokens, sub)
    # a child's edge probability is p_parent(token) renormalised over the kept columns
    assert float(P[1:].sum()) > 0
    assert restrict_vocab(tree, probs, V) == (tree, probs)
    with pytest.raises(ValueError, match="2 N - 1 = 9"):
        restrict_vocab(tree, probs, 8)
    with pytest.raises(ValueError, match="V = 50"):
        restrict_vocab(tree, probs, 51)


def test_benchmark_vocab_sweep_times_the_same_trees(tiny_model, oracle_drafter):
    """With vocab_sizes the benchmark adds rows per narrower V' on the same trees (same sizes, same
    number of calls), full V first; widths at or above V are skipped; every width keeps the exactness
    check (mean tau = 1 + mean C_p within sampling error)."""
    rows = verifier_latency(tiny_model, oracle_drafter, PROMPTS, budgets=(4, 16), depth=4, temperature=0.3,
                            n_trees=6, repeats=10, seed=3, rounds_per_prompt=4, vocab_sizes=(500, 40))
    assert [(r["budget"], r["vocab_size"], r["restricted"], r["verifier"]) for r in rows] == [
        (b, v, v < V_TINY, name) for b in (4, 16) for v in (V_TINY, 40) for name in DEFAULT_VERIFIERS]
    for b in (4, 16):
        got = [r for r in rows if r["budget"] == b]
        assert len({r["mean_tree_size"] for r in got}) == 1 and len({r["n_calls"] for r in got}) == 1
        for r in got:
            assert abs(r["mean_tau"] - r["expected_tau"]) < 4.5 * r["tau_se"] + 1e-9, r
    with pytest.raises(ValueError, match="vocab_sizes must be ints >= 2 \\* max\\(budgets\\) \\+ 1 = 33"):
        verifier_latency(tiny_model, oracle_drafter, PROMPTS, budgets=(4, 16), depth=4, n_trees=1, repeats=1,
                         vocab_sizes=(32,))


def test_benchmark_greedy_block_lengths_are_exact(tiny_model):
    rows = verifier_latency(tiny_model, FixedDrafter(_peaked, block_size=8), [[3, 1, 4, 1, 5]], budgets=(8,), depth=3,
                            temperature=0.0, n_trees=4, repeats=2, warmup=0, seed=0)
    for r in rows:  # one-hot rows: tau = 1 + C_p exactly on every call
        assert r["mean_tau"] == pytest.approx(r["expected_tau"], abs=1e-9) and r["tau_se"] == pytest.approx(0)


def test_benchmark_stand_in_drafters(tiny_model):
    chain = TargetChainDrafter(tiny_model, block_size=4)
    rows = verifier_latency(tiny_model, chain, [[3, 1, 4, 1, 5]], budgets=(6,), depth=4, n_trees=3, repeats=2,
                            verifiers=["predraw_follow", "tev"])
    assert [r["verifier"] for r in rows] == ["predraw_follow", "tev"] and rows[0]["mean_cp"] > 0
    marg = chain.draft_tokens([3, 1, 4])
    assert marg.shape == (4, V_TINY) and torch.allclose(marg.exp().sum(-1), torch.ones(4), atol=1e-5)
    bigram = bigram_drafter(tiny_model, block_size=3, sharpen=2.0)
    m = bigram.draft(torch.zeros(2, 0), 5)
    assert m.shape == (3, V_TINY)
    after_first = bigram.draft(torch.zeros(0, 0), int(m[0].argmax()))  # the chain: row 1 = row 0 of argmax
    assert torch.equal(m[1], after_first[0])


def test_benchmark_input_checks(tiny_model):
    drafter = FixedDrafter(_peaked, block_size=8)
    ok = dict(budgets=(4,), depth=2, n_trees=1, repeats=1)
    with pytest.raises(ValueError, match="baseline"):
        verifier_latency(tiny_model, drafter, [[1, 2]], verifiers=["tev"], **ok)
    with pytest.raises(ValueError, match="unknown verifier"):
        verifier_latency(tiny_model, drafter, [[1, 2]], verifiers=["predraw_follow", "nope"], **ok)
    with pytest.raises(ValueError, match="depth"):
        verifier_latency(tiny_model, drafter, [[1, 2]], **{**ok, "depth": 9})
    with pytest.raises(ValueError, match="prompt"):
        verifier_latency(tiny_model, drafter, [], **ok)
    with pytest.raises(ValueError, match="budgets"):
        verifier_latency(tiny_model, drafter, [[1, 2]], **{**ok, "budgets": (0,)})
    with pytest.raises(ValueError, match="context"):
        verifier_latency(tiny_model, drafter, [[1] * 120], **ok)
    with pytest.raises(ValueError, match="isolated"):
        verifier_latency(tiny_model, drafter, [[1, 2]], isolated=["predraw_follow"], **ok)
    with pytest.raises(ValueError, match="isolated"):
        verifier_latency(tiny_model, drafter, [[1, 2]], isolated=["nope"], **ok)


def test_benchmark_isolated_arm_gets_its_own_passes(tiny_model, monkeypatch):
    """An isolated reference arm is timed on the same trees with the same number of calls, but never
    inside an interleaved pass: every call of it comes after all calls of the other arms on a tree."""
    import impl.tev.latency as lat

    calls: list[str] = []

    def tracer(name, f):
        def g(*a, **k):
            calls.append(name)
            return f(*a, **k)
        return g

    arms = {"predraw_follow": tracer("p", predraw_follow), "heavy": tracer("h", tev), "tev": tracer("t", tev)}
    rows = lat.verifier_latency(tiny_model, FixedDrafter(_peaked, block_size=8), [[3, 1, 4, 1, 5]], budgets=(6,),
                                depth=3, n_trees=2, repeats=2, warmup=1, verifiers=arms, isolated=["heavy"])
    by = {r["verifier"]: r for r in rows}
    assert by["heavy"]["timing"] == "isolated" and by["tev"]["timing"] == "interleaved"
    assert by["heavy"]["n_calls"] == by["tev"]["n_calls"] == 4
    timed = "".join(calls)
    # per tree: 3 interleaved passes of p and t, then 3 passes of h (plus the untimed decoding tev calls)
    for block in timed.split("h" * 3)[:-1]:
        assert "h" not in block
    assert timed.count("h") == 6 and timed.count("p") == 6


def test_report_latency_verdicts():
    """The report judges TEV against the benchmark's baseline on its paired statistic (median of the
    per-tree ratios) and shows the ratio of the medians too; another predraw flavour (no paired
    column) is judged on the ratio of the medians."""
    import pandas as pd

    from impl.tev.report import _latency_verdicts

    rows = [{"budget": b, "verifier": v, "baseline": "predraw_follow", "median_us": m, "ratio_median": r}
            for b, v, m, r in [(64, "predraw_follow", 100.0, 1.0), (64, "tev", 78.0, 0.74),
                               (64, "predraw_ddtree_multinomial", 4000.0, 40.0),
                               (128, "predraw_follow", 200.0, 1.0), (128, "tev", 140.0, 0.66)]]
    lines = _latency_verdicts(pd.DataFrame(rows))
    assert len(lines) == 3
    assert "B = 64 vs predraw with" in lines[0] and "median per-tree ratio 0.74, ratio of medians 0.78" in lines[0]
    assert lines[0].endswith("**PASS**") and "ratio of medians 0.02" in lines[1] and lines[1].endswith("**PASS**")
    assert "B = 128" in lines[2] and "(target <= 0.6)" in lines[2] and lines[2].endswith("**FAIL**")


@pytest.mark.parametrize("build_mode,commit_mode", [("inference", "plain"), ("inference", "inference"),
                                                    ("no_grad", "inference"), ("no_grad", "no_grad")])
def test_commit_in_any_grad_mode(tiny_model, build_mode, commit_mode):
    """The in-place commit works whichever grad mode built the cache and whichever the caller is in,
    and a further forward after it extends the cache as usual."""
    from transformers import DynamicCache

    modes = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "plain": torch.enable_grad}
    prefix = [3, 1, 4, 1, 5]
    tree = DraftTree.from_paths([[10, 11, 12], [20, 21]], root_token=9)
    with modes[build_mode]():
        cache = DynamicCache(config=tiny_model.config)
        tiny_model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
        tiny_model(input_ids=tree.input_ids(), attention_mask=tree.attention_mask(len(prefix)),
                   position_ids=tree.position_ids(len(prefix)), cache=cache, use_cache=True)
    keep = torch.tensor(list(range(len(prefix))) + [len(prefix) + u for u in (0, 4, 5)])
    want = [layer.keys.index_select(-2, keep).clone() for layer in cache.layers]
    with modes[commit_mode]():
        commit_cache(cache, len(prefix), len(tree), [0, 4, 5])
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, want))
    with modes[build_mode](), torch.no_grad():
        tiny_model(input_ids=torch.tensor([[7]]), cache=cache, use_cache=True)
    assert cache.get_seq_length() == len(prefix) + 4


def test_report_ratio_by_vocab():
    """The V sweep's line lists TEV's paired ratio to predraw per target budget at each width, smallest
    first; one width gives no line."""
    import pandas as pd

    from impl.tev.report import _ratio_by_vocab

    rows = [{"budget": b, "vocab_size": v, "verifier": ver, "baseline": "predraw_follow", "ratio_median": r}
            for b in (32, 64, 128) for v, r in ((49152, 0.2), (4096, 0.6))
            for ver, r in (("predraw_follow", 1.0), ("tev", r * (0.9 if b == 128 else 1.0)))]
    (line,) = _ratio_by_vocab(pd.DataFrame(rows))
    assert "V = 4,096 / 49,152 columns" in line and "B = 64: 0.60 / 0.20; B = 128: 0.54 / 0.18" in line
    assert _ratio_by_vocab(pd.DataFrame([r for r in rows if r["vocab_size"] == 4096])) == []


def test_report_latency_without_target_budgets_says_so():
    import pandas as pd

    from impl.tev.report import _latency_verdicts

    lines = _latency_verdicts(pd.DataFrame([{"budget": 8, "verifier": "tev", "median_us": 1.0}]))
    assert len(lines) == 1 and "B = 64 and 128" in lines[0] and "(8)" in lines[0]
    assert "PASS" not in lines[0] and "FAIL" not in lines[0]


def test_report_tau_agreement():
    """Predraw and TEV taus on the same trees must agree within 1.96 combined SE; a gap beyond it FAILs."""
    import pandas as pd

    from impl.tev.report import _tau_agreement

    rows = [{"budget": b, "verifier": v, "mean_tau": t, "tau_se": se}
            for b, v, t, se in [(64, "predraw_follow", 1.40, 0.03), (64, "tev", 1.45, 0.03),
                                (128, "predraw_follow", 1.40, 0.01), (128, "tev", 1.50, 0.01)]]
    lines = _tau_agreement(pd.DataFrame(rows))
    assert len(lines) == 2 and "B = 64" in lines[0] and lines[0].endswith("**PASS**")
    assert "+0.100" in lines[1] and lines[1].endswith("**FAIL**")
    assert _tau_agreement(pd.DataFrame([{"budget": 64, "verifier": "tev", "median_us": 1.0}])) == []
    # the untimed law sample, where both arms have one, decides (its smaller SE resolves the same +0.05 gap)
    law = [{**r, "n_calls": 90, "expected_tau": 1.45, "law_n_calls": 3000, "law_mean_tau": t, "law_tau_se": 0.005}
           for r, t in zip(rows[:2], (1.40, 1.45))]
    line, = _tau_agreement(pd.DataFrame(law))
    assert "3000 untimed calls each" in line and "exit law 1 + C_p = 1.450" in line and line.endswith("**FAIL**")
    law[0]["law_n_calls"] = 0  # predraw without a law sample: the timed calls decide
    line, = _tau_agreement(pd.DataFrame(law))
    assert "the 90 timed calls" in line and line.endswith("**PASS**")
