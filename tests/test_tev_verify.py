"""Exactness of the fixed-tree verifiers (TEV Sec. 2, App. A.4, Sec. 4 / App. B) in three tiers:

1. hand-built one-hot (T = 0) rows: every verifier returns the argmax-follow path;
2. seeded distribution tests: on random trees the committed block pi(V) || Y of each verifier is
   distributed as target sampling token by token (chi-square), TEV's exit node follows w, accepted-node
   frequencies follow P (Eq. 58) and E[L] = 1 + C_p(T) (Eq. 11); deliberately wrong verifiers fail the
   same chi-square test, so the test has power;
3. end to end on a tiny model: greedy tree speculative decoding equals AR decoding token for token.
"""

from collections import Counter
from functools import lru_cache

import pytest
import torch
from scipy import stats

from impl.tev.exit_law import exit_law, target_coverage
from impl.tev.tree import DraftTree, path_to
from impl.tev.verify import VERIFIERS, greedy_follow

N_DRAWS = 20_000
P_MIN = 1e-3


# --- tier 1: hand-built, greedy ---------------------------------------------------------------

def _hand_tree():
    #   0 -1-> 1 -2-> 2 ;  1 -3-> 3 -0-> 4 ;  0 -4-> 5
    return DraftTree.from_paths([[1, 2], [1, 3, 0], [4]], root_token=9)


@pytest.mark.parametrize("argmax,path,bonus", [
    ([0, 0, 0, 0, 0, 0], [0], 0),              # root argmax not drafted: exit at the root
    ([4, 0, 0, 0, 0, 0], [0, 5], 0),           # to a leaf
    ([1, 3, 0, 1, 0, 0], [0, 1, 3], 1),        # stop at an internal node
    ([1, 3, 0, 0, 2, 0], [0, 1, 3, 4], 2),     # all the way down
    ([1, 2, 7, 0, 0, 0], [0, 1, 2], 7),
])
def test_greedy_paths(argmax, path, bonus):
    t = _hand_tree()
    assert greedy_follow(t.parents, t.tokens, argmax) == (path, bonus)
    probs = torch.nn.functional.one_hot(torch.tensor(argmax), 10).float()
    for name, f in VERIFIERS.items():
        for seed in range(4):
            got = f(t.parents, t.tokens, probs, torch.Generator().manual_seed(seed))
            assert got == (path, bonus), name


def test_root_only_tree_returns_a_bonus_from_the_root_row():
    probs = torch.tensor([[0.0, 0.0, 1.0]])
    for f in VERIFIERS.values():
        assert f([-1], [5], probs, torch.Generator().manual_seed(0)) == ([0], 2)


def test_same_seed_same_output():
    t, probs = _case("A")
    for name, f in VERIFIERS.items():
        a = [f(t.parents, t.tokens, probs, g) for g in [torch.Generator().manual_seed(7)] for _ in range(20)]
        b = [f(t.parents, t.tokens, probs, g) for g in [torch.Generator().manual_seed(7)] for _ in range(20)]
        assert a == b, name
        assert len(set(map(str, a))) > 1, name  # and it is actually random at T > 0


def test_input_validation():
    t = _hand_tree()
    probs = torch.full((6, 10), 0.1)
    for f in VERIFIERS.values():
        with pytest.raises(ValueError, match="torch.Generator"):
            f(t.parents, t.tokens, probs, None)
        with pytest.raises(ValueError, match=r"shape \[N=6, V\]"):
            f(t.parents, t.tokens, probs[:5], torch.Generator())
        with pytest.raises(ValueError, match="node 2 sums to"):
            f(t.parents, t.tokens, torch.cat([probs[:2], probs[2:3] * 2, probs[3:]]), torch.Generator())
        with pytest.raises(ValueError, match="node 2: token 1 repeats"):
            f([-1, 0, 0], [0, 1, 1], probs[:3], torch.Generator())
    with pytest.raises(ValueError, match="6 non-negative token ids"):
        greedy_follow(t.parents, t.tokens, [0, 1])


# --- tier 2: seeded distribution tests ----------------------------------------------------------

def _random_tree(g, n, v_size, max_depth):
    t = DraftTree.root_only(0)
    while len(t) < n:
        cand = [u for u in range(len(t)) if t.depths[u] < max_depth and len(t.children[u]) < v_size - 1]
        u = cand[int(torch.randint(len(cand), (), generator=g))]
        used = {t.tokens[c] for c in t.children[u]}
        free = [a for a in range(v_size) if a not in used]
        t.add_child(u, free[int(torch.randint(len(free), (), generator=g))])
    return t


@lru_cache(maxsize=None)
def _case(name):
    """Random tree + target rows; drafted tokens are boosted (a decent drafter) so deep nodes are
    reached often. Case B has a row whose mass lies only on its drafted children (rho = 0)."""
    g = torch.Generator().manual_seed({"A": 11, "B": 12}[name])
    n, v_size = {"A": (8, 6), "B": (9, 8)}[name]
    t = _random_tree(g, n, v_size, max_depth=3)
    logits = torch.randn(n, v_size, generator=g)
    for u in range(1, n):
        logits[t.parents[u], t.tokens[u]] += 1.5
    probs = torch.softmax(logits, -1)
    if name == "B":
        v = max(range(n), key=lambda u: len(t.children[u]))
        keep = torch.zeros(v_size, dtype=torch.bool)
        keep[[t.tokens[c] for c in t.children[v]]] = True
        probs[v] = torch.where(keep, probs[v], 0.0)
        probs[v] /= probs[v].sum()
    return t, probs


def _sequence_law(t, probs):
    """Target probability of every possible committed block pi(v) || y (y not a drafted child of v),
    as the autoregressive product of next-token probabilities along the block."""
    law = {}
    for v in range(len(t)):
        path = t.path_to(v)
        prefix_prob = 1.0
        for a, b in zip(path, path[1:]):
            prefix_prob *= float(probs[a, t.tokens[b]])
        drafted = {t.tokens[c] for c in t.children[v]}
        for y in range(probs.shape[1]):
            if y not in drafted:
                law[tuple(t.path_tokens(v)) + (y,)] = prefix_prob * float(probs[v, y])
    return law


@lru_cache(maxsize=None)
def _samples(verifier_name, case):
    f = _WRONG.get(verifier_name) or VERIFIERS[verifier_name]
    t, probs = _case(case)
    g = torch.Generator().manual_seed(2024)
    blocks, exits = Counter(), Counter()
    for _ in range(N_DRAWS):
        path, bonus = f(t.parents, t.tokens, probs, g)
        assert path == path_to(t.parents, path[-1])  # a root path, root included
        blocks[tuple(t.tokens[u] for u in path[1:]) + (bonus,)] += 1
        exits[path[-1]] += 1
    return blocks, exits


def _chisquare(counts: Counter, law: dict) -> tuple[float, int]:
    """(p-value, number of draws outside the law's support); cells with expected count < 5 are merged."""
    outside = sum(c for k, c in counts.items() if law.get(k, 0.0) <= 0.0)
    keys = [k for k in law if law[k] > 0]
    n = sum(counts.values())
    total = sum(law[k] for k in keys)
    exp = [law[k] / total * n for k in keys]
    obs = [counts.get(k, 0) for k in keys]
    big = [i for i, e in enumerate(exp) if e >= 5]
    small = [i for i, e in enumerate(exp) if e < 5]
    f_exp, f_obs = [exp[i] for i in big], [obs[i] for i in big]
    if small:
        f_exp.append(sum(exp[i] for i in small))
        f_obs.append(sum(obs[i] for i in small))
    f_obs_t = torch.tensor(f_obs, dtype=torch.float64)
    f_exp_t = torch.tensor(f_exp, dtype=torch.float64)
    f_exp_t *= f_obs_t.sum() / f_exp_t.sum()
    return float(stats.chisquare(f_obs_t.numpy(), f_exp_t.numpy()).pvalue), outside


@pytest.mark.parametrize("case", ["A", "B"])
@pytest.mark.parametrize("name", list(VERIFIERS))
def test_committed_block_is_target_distributed(name, case):
    t, probs = _case(case)
    blocks, _ = _samples(name, case)
    pval, outside = _chisquare(blocks, _sequence_law(t, probs))
    assert outside == 0
    assert pval > P_MIN, f"{name} on case {case}: chi-square p = {pval:.3g}"


@pytest.mark.parametrize("case", ["A", "B"])
@pytest.mark.parametrize("name", list(VERIFIERS))
def test_mean_block_length_and_acceptance_match_the_ceiling(name, case):
    t, probs = _case(case)
    blocks, exits = _samples(name, case)
    lengths = torch.tensor([len(k) for k, c in blocks.items() for _ in range(c)], dtype=torch.float64)
    target = 1.0 + target_coverage(t.parents, t.tokens, probs)  # Eq. 11, bonus counted
    se = float(lengths.std()) / N_DRAWS ** 0.5
    assert abs(float(lengths.mean()) - target) < 4 * se, (float(lengths.mean()), target, se)
    # Eq. 58: node u is accepted (lies on the path) with probability P(u)
    P, _, _ = exit_law(t.parents, t.tokens, probs)
    anc = t.ancestor_mask()
    for u in range(1, len(t)):
        acc = sum(c for v, c in exits.items() if anc[v, u]) / N_DRAWS
        p = float(P[u])
        assert abs(acc - p) < 4.5 * (p * (1 - p) / N_DRAWS) ** 0.5 + 1e-12, (name, u, acc, p)


@pytest.mark.parametrize("case", ["A", "B"])
def test_tev_exit_node_follows_w(case):
    t, probs = _case(case)
    _, exits = _samples("tev", case)
    _, _, w = exit_law(t.parents, t.tokens, probs)
    pval, outside = _chisquare(exits, {v: float(w[v]) for v in range(len(t))})
    assert outside == 0 and pval > P_MIN
    if case == "B":
        assert any(float(w[v]) == 0.0 for v in range(len(t)))  # the rho = 0 node is never an exit


def _sequential_without_renormalisation(parents, tokens, probs, generator):
    """WRONG: tests child j with the raw p_v(x_j) instead of the renormalised residual g(x_j)."""
    t = DraftTree(list(parents), list(tokens))
    path = [0]
    while True:
        v = path[-1]
        for u in t.children[v]:
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(probs[v, t.tokens[u]]):
                path.append(u)
                break
        else:
            res = probs[v].double().clone()
            res[[t.tokens[u] for u in t.children[v]]] = 0.0
            return path, int(torch.multinomial(res, 1, generator=generator))


def _tev_exit_from_prefix_probability(parents, tokens, probs, generator):
    """WRONG: draws the exit node from P (normalised) instead of w = P rho."""
    t = DraftTree(list(parents), list(tokens))
    P, _, _ = exit_law(parents, tokens, probs)
    v = int(torch.multinomial(P, 1, generator=generator))
    res = probs[v].double().clone()
    res[[t.tokens[u] for u in t.children[v]]] = 0.0
    if res.sum() == 0:
        res = probs[v].double()
    return t.path_to(v), int(torch.multinomial(res, 1, generator=generator))


_WRONG = {
    "wrong_sequential_no_renorm": _sequential_without_renormalisation,
    "wrong_tev_exit_from_P": _tev_exit_from_prefix_probability,
}


@pytest.mark.parametrize("name", list(_WRONG))
def test_wrong_verifiers_fail_the_same_test(name):
    t, probs = _case("A")
    blocks, _ = _samples(name, "A")
    pval, outside = _chisquare(blocks, _sequence_law(t, probs))
    assert outside == 0  # they fail on frequencies, not on support
    assert pval < 1e-6, f"{name}: chi-square p = {pval:.3g} (the test has no power)"


# --- tier 3: end to end on a tiny model, greedy --------------------------------------------------

@pytest.mark.parametrize("name", list(VERIFIERS))
def test_greedy_tree_decoding_equals_ar(tiny_model, name):
    """Speculative decoding with random draft trees (one branch follows the AR reference for a random
    number of steps, the rest is noise), verified from one masked tree forward per round at T = 0,
    commits exactly the AR greedy tokens."""
    from transformers import DynamicCache

    from impl.spec.ar import ar_decode

    prompt, n_new = [3, 1, 4, 1, 5, 9, 2, 6], 16
    ref = ar_decode(tiny_model, prompt, n_new).tokens
    g = torch.Generator().manual_seed(5)
    out, rounds = list(prompt), 0
    with torch.no_grad():
        while len(out) < len(prompt) + n_new:
            done = len(out) - len(prompt)
            k = int(torch.randint(0, 4, (), generator=g))
            paths = [ref[done:done + k]] + [torch.randint(0, 97, (3,), generator=g).tolist() for _ in range(2)]
            tree = DraftTree.from_paths(paths, root_token=out[-1])
            cache = DynamicCache(config=tiny_model.config)
            tiny_model(input_ids=torch.tensor([out[:-1]]), cache=cache, use_cache=True)
            logits = tiny_model(input_ids=tree.input_ids(), attention_mask=tree.attention_mask(len(out) - 1),
                                position_ids=tree.position_ids(len(out) - 1), cache=cache).logits[0]
            probs = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
            path, bonus = VERIFIERS[name](tree.parents, tree.tokens, probs, g)
            assert (path, bonus) == greedy_follow(tree.parents, tree.tokens, logits.argmax(-1))
            assert len(path) - 1 >= len(ref[done:done + k])  # the reference branch (cut at the end) is accepted
            out += tree.path_tokens(path[-1]) + [bonus]
            rounds += 1
    assert out[len(prompt):len(prompt) + n_new] == ref
    assert rounds < n_new  # some rounds committed more than one token
