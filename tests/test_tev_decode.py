"""DDTree builder and the TEV decoding loop (impl.tev.builder, impl.tev.decode).

Builder: a hand-built best-first tree, agreement with brute-force top-B prefix selection, budget,
depth, determinism, distinct siblings. Decoding, in the project's three exactness tiers: greedy runs
equal ``ar_decode`` token for token with every verifier, chain mode and B in {1, 4, 16} (untrained
drafter and an oracle-ish fixed drafter that makes deep, non-contiguous accepted paths); the KV
commit equals a fresh causal forward; with T = 1 the joint law of the first two generated tokens
matches the target's exact joint (chi-square) for every verifier.
"""

import itertools
import math
from collections import Counter

import pytest
import torch
from scipy import stats

from impl.spec.ar import ar_decode
from impl.tev.builder import best_first_tree, chain_tree
from impl.tev.decode import FixedDrafter, TEVResult, commit_cache, tev_decode
from impl.tev.drafter import BlockDrafter, DrafterConfig
from impl.tev.tree import DraftTree
from impl.tev.verify import VERIFIERS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P_MIN = 1e-3


# --- builder ------------------------------------------------------------------------------------

def _hand_marginals():
    # row 0 (depth 1): token 3 .5, token 0 .27, token 2 .14, token 1 .09
    # row 1 (depth 2): token 1 .62, token 2 .23, token 3 .10, token 0 .05
    p = torch.zeros(2, 4, dtype=torch.float64)
    p[0, [3, 0, 2, 1]] = torch.tensor([0.5, 0.27, 0.14, 0.09], dtype=torch.float64)
    p[1, [1, 2, 3, 0]] = torch.tensor([0.62, 0.23, 0.10, 0.05], dtype=torch.float64)
    return p.log()


def test_best_first_hand_built():
    # cumulative: 3:.5  3,1:.31  0:.27  0,1:.1674  2:.14  3,2:.115  1:.09  2,1:.0868 ...
    tree, scores = best_first_tree(_hand_marginals(), budget=6, depth=2, root_token=9, return_scores=True)
    assert tree.parents == [-1, 0, 1, 0, 3, 0, 1]
    assert tree.tokens == [9, 3, 1, 0, 1, 2, 2]
    want = [1.0, 0.5, 0.31, 0.27, 0.27 * 0.62, 0.14, 0.5 * 0.23]
    assert [round(math.exp(s), 6) for s in scores] == [round(w, 6) for w in want]
    t1 = best_first_tree(_hand_marginals(), budget=3, depth=1, root_token=9)
    assert (t1.parents, t1.tokens) == ([-1, 0, 0, 0], [9, 3, 0, 2])
    t8 = best_first_tree(_hand_marginals(), budget=8, depth=2)
    assert t8.parents[7] == 0 and t8.tokens[7] == 1  # token 1 at depth 1 (.09) beats 2,1 (.0868)
    assert best_first_tree(_hand_marginals(), budget=0, depth=2).parents == [-1]
    assert best_first_tree(_hand_marginals(), budget=5, depth=0).parents == [-1]
    # logits are log-softmaxed: shifting a row changes nothing
    shifted = _hand_marginals() + torch.tensor([[3.0], [-1.0]], dtype=torch.float64)
    assert best_first_tree(shifted, 6, 2, 9).tokens == tree.tokens


def _all_prefix_scores(lp, depth):
    out = {}
    for d in range(1, depth + 1):
        for seq in itertools.product(range(lp.shape[1]), repeat=d):
            out[seq] = sum(float(lp[k, t]) for k, t in enumerate(seq))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_best_first_is_top_budget_prefixes(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, generator=g, dtype=torch.float64) * 2
    lp = torch.log_softmax(logits, -1)
    budget, depth = 9, 3
    tree, scores = best_first_tree(logits, budget, depth, return_scores=True)
    got = {tuple(tree.path_tokens(v)) for v in range(1, len(tree))}
    ranked = sorted(_all_prefix_scores(lp, depth).items(), key=lambda kv: -kv[1])
    assert got == {k for k, _ in ranked[:budget]}
    assert len(tree) == budget + 1 and tree.max_depth <= depth
    assert all(a >= b - 1e-12 for a, b in zip(scores[1:], scores[2:]))  # pop order: non-increasing
    for v in range(1, len(tree)):
        assert abs(scores[v] - _all_prefix_scores(lp, depth)[tuple(tree.path_tokens(v))]) < 1e-9


@pytest.mark.parametrize("budget,depth", [(1, 4), (4, 2), (16, 3), (40, 4), (200, 2)])
def test_best_first_budget_depth_determinism(budget, depth):
    g = torch.Generator().manual_seed(budget)
    logits = torch.randn(4, 11, generator=g)
    tree = best_first_tree(logits, budget, depth, root_token=5)
    assert len(tree) - 1 == min(budget, sum(11 ** d for d in range(1, depth + 1)))
    assert tree.max_depth <= depth
    assert all(0 <= tree.parents[v] < v for v in range(1, len(tree)))
    for v in range(len(tree)):  # siblings distinct (DraftTree validates too)
        kids = [tree.tokens[u] for u in tree.children[v]]
        assert len(kids) == len(set(kids))
    again = best_first_tree(logits.clone(), budget, depth, root_token=5)
    assert (again.parents, again.tokens) == (tree.parents, tree.tokens)


def test_best_first_ties_and_zero_probability():
    uniform = torch.zeros(2, 4)
    t = best_first_tree(uniform, 5, 2)
    assert (t.parents, t.tokens) == ([-1, 0, 0, 0, 0, 1], [-1, 0, 1, 2, 3, 0])  # depth, then token id
    masked = torch.tensor([[0.0, float("-inf"), 0.0], [float("-inf"), 0.0, float("-inf")]])
    t = best_first_tree(masked, 10, 2)
    assert sorted(t.path_tokens(v)[-1] for v in range(1, len(t)) if t.depths[v] == 1) == [0, 2]
    assert len(t) - 1 == 4 and 1 not in t.tokens[1:3]
    with pytest.raises(ValueError):
        best_first_tree(torch.zeros(2, 4), 3, 3)
    with pytest.raises(ValueError):
        best_first_tree(torch.zeros(2, 4), -1, 1)
    with pytest.raises(ValueError):
        best_first_tree(torch.full((2, 4), float("nan")), 3, 1)


def test_chain_tree():
    t = chain_tree(_hand_marginals(), 2, root_token=7)
    assert (t.parents, t.tokens) == ([-1, 0, 1], [7, 3, 1])
    assert chain_tree(_hand_marginals(), 0).parents == [-1]


# --- decoding: greedy equals AR -----------------------------------------------------------------

PROMPT, N_NEW, H = [3, 1, 4, 1, 5, 9, 2, 6], 24, 4


@pytest.fixture(scope="module")
def reference(tiny_model):
    return ar_decode(tiny_model, PROMPT, N_NEW).tokens


@pytest.fixture(scope="module")
def block_drafter(tiny_model):
    torch.manual_seed(1)
    return BlockDrafter(tiny_model, DrafterConfig(block_size=H, n_layers=2)).eval()


def _oracle(full):
    """Marginals that favour the AR continuation: strongly at most positions, weakly at every third
    (so the right token is often a later sibling and accepted paths are not contiguous)."""
    def fn(n, last):
        z = torch.randn(H, 97, generator=torch.Generator().manual_seed(n))
        for k in range(H):
            if n + k < len(full):
                z[k, full[n + k]] += 3.0 if (n + k) % 3 else 0.8
        return z
    return fn


def _check_rounds(r: TEVResult, depth, budget):
    assert r.rounds == len(r.committed) == len(r.coverages) == len(r.tree_sizes)
    assert all(1 <= t <= depth + 1 for t in r.taus)
    assert all(1 <= c <= t for c, t in zip(r.committed, r.taus))
    assert sum(r.committed) == len(r.tokens)
    assert all(0 <= s <= budget for s in r.tree_sizes)
    assert all(len(v) == r.rounds and all(x >= 0 for x in v) for v in r.stage_seconds.values())
    # T = 0: the realised coverage is the deterministic number of accepted draft tokens
    if r.temperature == 0:
        assert [round(c, 9) for c in r.coverages] == [t - 1 for t in r.taus]


@pytest.mark.parametrize("tree_mode", ["best_first", "chain"])
@pytest.mark.parametrize("verifier", list(VERIFIERS))
@pytest.mark.parametrize("budget", [1, 4, 16])
def test_greedy_equals_ar_untrained_drafter(tiny_model, reference, block_drafter, verifier, budget, tree_mode):
    r = tev_decode(tiny_model, block_drafter, PROMPT, N_NEW, budget=budget, depth=H, verifier=verifier,
                   tree_mode=tree_mode)
    assert r.tokens == reference
    _check_rounds(r, H, budget)


@pytest.mark.parametrize("tree_mode", ["best_first", "chain"])
@pytest.mark.parametrize("verifier", list(VERIFIERS))
@pytest.mark.parametrize("budget", [1, 4, 16])
def test_greedy_equals_ar_oracle_drafter(tiny_model, reference, verifier, budget, tree_mode):
    drafter = FixedDrafter(_oracle(PROMPT + reference), block_size=H)
    r = tev_decode(tiny_model, drafter, PROMPT, N_NEW, budget=budget, depth=H, verifier=verifier,
                   tree_mode=tree_mode)
    assert r.tokens == reference
    _check_rounds(r, H, budget)
    assert max(r.taus) >= min(budget, 2) + 1 and r.rounds < N_NEW


def test_greedy_edge_cases(tiny_model, reference, block_drafter):
    # a one-token prompt, budget 0 (plain AR through the tree path), EOS inside an accepted block
    one = ar_decode(tiny_model, [7], 10).tokens
    assert tev_decode(tiny_model, block_drafter, [7], 10, budget=4, depth=H).tokens == one
    r = tev_decode(tiny_model, block_drafter, PROMPT, 6, budget=0, depth=H)
    assert r.tokens == reference[:6] and r.taus == [1] * 6 and r.tree_sizes == [0] * 6
    eos = reference[9]
    ar_eos = ar_decode(tiny_model, PROMPT, N_NEW, eos_token_id=eos)
    drafter = FixedDrafter(_oracle(PROMPT + reference), block_size=H)
    r = tev_decode(tiny_model, drafter, PROMPT, N_NEW, budget=16, depth=H, eos_token_id=eos)
    assert r.tokens == ar_eos.tokens and r.stopped_at_eos == ar_eos.stopped_at_eos
    r = tev_decode(tiny_model, drafter, PROMPT, 5, budget=16, depth=H)
    assert r.tokens == reference[:5]
    with pytest.raises(ValueError, match="verifier"):
        tev_decode(tiny_model, drafter, PROMPT, 4, budget=4, depth=2, verifier="nope")
    with pytest.raises(ValueError, match="depth"):
        tev_decode(tiny_model, drafter, PROMPT, 4, budget=4, depth=H + 1)
    with pytest.raises(ValueError, match="Generator"):
        tev_decode(tiny_model, drafter, PROMPT, 4, budget=4, depth=2, temperature=1.0)
    with pytest.raises(ValueError, match="tree_mode"):
        tev_decode(tiny_model, drafter, PROMPT, 4, budget=4, depth=2, tree_mode="beam")


def test_commit_cache_equals_causal_forward(tiny_model):
    """After a tree forward, gathering a non-contiguous accepted path leaves exactly the KV a causal
    forward of prefix + path computes."""
    from transformers import DynamicCache

    prefix, n = [3, 1, 4, 1, 5], 4
    tree = DraftTree.from_paths([[10, 11], [12, 13, 14], [15]], root_token=9)  # 0-1-2, 0-3-4-5, 0-6
    path = [0, 3, 4, 5]
    with torch.no_grad():
        cache = DynamicCache(config=tiny_model.config)
        tiny_model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
        tiny_model(input_ids=tree.input_ids(), attention_mask=tree.attention_mask(len(prefix)),
                   position_ids=tree.position_ids(len(prefix)), cache=cache, use_cache=True)
        commit_cache(cache, len(prefix), len(tree), path)
        ref = DynamicCache(config=tiny_model.config)
        tiny_model(input_ids=torch.tensor([prefix + [9, 12, 13, 14]]), cache=ref, use_cache=True)
    assert cache.get_seq_length() == len(prefix) + n
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        commit_cache(cache, len(prefix), len(tree), [1, 2])


# --- decoding: T = 1 sampling is exact ----------------------------------------------------------

N_SAMPLES = 1500
V_SMALL = 8


@pytest.fixture(scope="module")
def small_setup():
    from transformers import LlamaForCausalLM

    from impl.models.tiny import TinyArch

    torch.manual_seed(1)
    cfg = TinyArch(num_layers=2, hidden_size=16, num_heads=2, intermediate_size=32,
                   max_position_embeddings=32).to_hf_config(vocab_size=V_SMALL, eos_token_id=0)
    cfg.initializer_range = 0.5
    model = LlamaForCausalLM(cfg).eval()
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        joint = {}
        for a in range(V_SMALL):
            p2 = torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1].double(), -1)
            for b in range(V_SMALL):
                joint[(a, b)] = float(p1[a] * p2[b])
        # round 1 drafts from the target's own first-step law and the law after its argmax, so deep
        # paths are accepted often; later rounds draft noise that depends on the context
        l1 = torch.log(p1).float()
        l2 = torch.log_softmax(model(torch.tensor([prompt + [int(p1.argmax())]])).logits[0, -1], -1)

    def marginals(n, last):
        if n == len(prompt):
            return torch.stack([l1, l2])
        return torch.randn(2, V_SMALL, generator=torch.Generator().manual_seed(1000 * n + last))

    drafter = FixedDrafter(marginals, block_size=2)
    # a context-blind second token (what a wrong KV commit or a stale root would tend to give)
    p2_fixed = l2.double().exp()
    wrong = {(a, b): float(p1[a] * p2_fixed[b]) for a in range(V_SMALL) for b in range(V_SMALL)}
    return model, prompt, joint, wrong, drafter


def _chisquare(counts: Counter, law: dict) -> float:
    keys = sorted(law)
    n = sum(counts.values())
    exp = [law[k] * n for k in keys]
    obs = [counts.get(k, 0) for k in keys]
    big = [i for i, e in enumerate(exp) if e >= 5]
    small = [i for i, e in enumerate(exp) if e < 5]
    f_exp, f_obs = [exp[i] for i in big], [obs[i] for i in big]
    if small:
        f_exp.append(sum(exp[i] for i in small))
        f_obs.append(sum(obs[i] for i in small))
    s = sum(f_obs) / sum(f_exp)
    return float(stats.chisquare(f_obs, [e * s for e in f_exp]).pvalue)


@pytest.mark.parametrize("verifier,tree_mode", [(v, "best_first") for v in VERIFIERS] + [("tev", "chain")])
def test_sampling_joint_of_first_two_tokens(small_setup, verifier, tree_mode):
    """T = 1: the first two committed tokens (three generated, so round 1 drafts depth-2 trees) are
    distributed as the target's exact joint p(a | c) p(b | c, a)."""
    model, prompt, joint, wrong, drafter = small_setup
    counts: Counter = Counter()
    taus: list[int] = []
    for s in range(N_SAMPLES):
        r = tev_decode(model, drafter, prompt, 3, budget=4, depth=2, verifier=verifier, temperature=1.0,
                       generator=torch.Generator().manual_seed(s), tree_mode=tree_mode)
        counts[tuple(r.tokens[:2])] += 1
        taus.append(r.taus[0])
        _check_rounds(r, 2, 4)
    pval = _chisquare(counts, joint)
    assert pval > P_MIN, f"{verifier}/{tree_mode}: chi-square p = {pval:.3g}"
    assert _chisquare(counts, wrong) < 1e-6  # the test has power
    assert taus.count(3) > N_SAMPLES // 10  # first rounds often accept a whole depth-2 path
