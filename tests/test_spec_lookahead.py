"""Lookahead decoding (impl.spec.lookahead): the step's tree layout and verification on hand-built
values, the n-gram pool, exactness against AR (greedy and position-keyed Gumbel sampling, with and
without EOS, over W / N / G), the accounting, a hand-built cycle model whose pooled n-grams are true
continuations, the method through ``decode_prompts`` and parameter validation."""

import copy

import pytest
import torch

from impl.spec.ar import ar_decode
from impl.spec.lookahead import NGramPool, _verify, lookahead_decode, step_layout
from impl.spec.sampling import DecodeRule
from impl.tev.parents import tree_attention_mask

from test_spec_baselines import _cycle_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_NEW = 40
PROMPTS = [[5], [3, 17, 42, 8, 9], list(range(1, 30))]
PARAMS = [(1, 2, 1), (3, 3, 2), (5, 4, 5)]  # (W, N, G)


# ------------------------------------------------------------------------------ hand-built layout
def test_step_layout_is_the_papers_tree():
    """W = 3, N = 3, two candidates: the root, the candidates as chains from it, the first level as a
    chain from the root and each second-level token under its column's first-level token; depths
    are the offsets i + j + 1."""
    window = [[10, 11, 12], [20, 21, 22]]
    lay = step_layout(7, window, [(1, 2), (3, 4)])
    assert lay.tokens == [7, 1, 2, 3, 4, 10, 11, 12, 20, 21, 22]
    assert lay.parents == [-1, 0, 1, 0, 3, 0, 5, 6, 5, 6, 7]
    assert lay.depths == [0, 1, 2, 1, 2, 1, 2, 3, 2, 3, 4]
    assert lay.candidate_rows == [[1, 2], [3, 4]]
    assert lay.window_rows == [[5, 6, 7], [8, 9, 10]]
    mask = tree_attention_mask(lay.parents, 4)[0, 0]
    # V[1][2] (row 10) sees the prefix, the root, V[0][0..2] and itself; not the candidates
    assert mask[10].tolist() == [True] * 4 + [True, False, False, False, False, True, True, True, False, False, True]
    # the second candidate's second token sees the root, its first token and itself only
    assert mask[4, 4:].tolist() == [True, False, False, True, True, False, False, False, False, False, False]


def test_verify_takes_the_longest_matching_candidate():
    lay = step_layout(7, [[0, 0], [0, 0]], [(1, 9), (1, 2), (5, 6)])
    # the target's decodes: after the root 1, after row 1 (token 1) 2, after row 3 (token 1) 2, ...
    ys = {0: 1, 1: 2, 2: 3, 3: 2, 4: 8, 5: 0, 6: 0}
    assert _verify(lay, ys) == (1, 2)  # (1, 9) stops after one token, (1, 2) matches both
    assert _verify(lay, {**ys, 0: 4}) == (-1, 0)  # no candidate starts with the target's token


def test_ngram_pool_caps_and_orders():
    pool = NGramPool(2)
    pool.add(1, (2, 3))
    pool.add(1, (4, 5))
    pool.add(1, (2, 3))  # refreshed: now the most recent
    assert pool.get(1) == [(2, 3), (4, 5)]
    pool.add(1, (6, 7))  # over the cap: the oldest, (4, 5), goes
    assert pool.get(1) == [(6, 7), (2, 3)] and pool.get(9) == [] and len(pool) == 2


# ------------------------------------------------------------------------------ exactness vs AR
def _check_steps(res, L, n_ngram):
    assert sum(s.committed for s in res.rounds) == len(res.tokens)
    for s in res.rounds:
        assert 0 <= s.accepted <= n_ngram - 1 and s.committed <= s.accepted + 1
        assert s.drafted == s.candidates * (n_ngram - 1)
        assert s.layer_work == s.rows * L and s.critical_layers == L
    assert res.critical_layers == L * len(res.rounds)
    assert res.seconds >= res.prefill_seconds >= 0


@pytest.fixture(scope="module")
def looping_model(tiny_model):
    """The tiny model with its MLP outputs at the plain initialisation scale (the shared fixture
    multiplies them by 4 so that greedy decoding does not loop): greedy decoding falls into loops, so
    the lookahead branch's n-grams recur and the verification branch accepts them, with attention
    (and so the kept KV rows) shaping every later token."""
    m = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.down_proj.weight.mul_(0.25)
    return m


@pytest.mark.parametrize("which", ["tiny_model", "looping_model"])
@pytest.mark.parametrize("rule", [DecodeRule(), DecodeRule(temperature=1.0, seed=3)], ids=["greedy", "sample"])
def test_lookahead_equals_ar(request, which, rule):
    model = request.getfixturevalue(which)
    accepted = 0
    for prompt in PROMPTS:
        ar = ar_decode(model, prompt, N_NEW, rule=rule).tokens
        eos = ar[N_NEW // 2]
        ar_eos = ar_decode(model, prompt, N_NEW, rule=rule, eos_token_id=eos).tokens
        for W, Ng, G in PARAMS:
            res = lookahead_decode(model, prompt, N_NEW, window=W, ngram=Ng, max_candidates=G, rule=rule)
            assert res.tokens == ar, (prompt, W, Ng, G)
            _check_steps(res, 12, Ng)
            accepted += sum(s.accepted for s in res.rounds)
            res = lookahead_decode(model, prompt, N_NEW, window=W, ngram=Ng, max_candidates=G, rule=rule,
                                   eos_token_id=eos)
            assert res.tokens == ar_eos and res.stopped_at_eos
    if which == "looping_model" and rule.greedy:
        # the verification branch accepted candidates on a model whose tokens depend on the context: the
        # KV rows of the accepted path were kept and the others dropped, or later tokens would differ
        assert accepted > 0


def test_lookahead_on_a_cycle_accepts_whole_ngrams():
    """On a model whose next token is a fixed permutation of the current one, every pooled n-gram of
    a column past the warm-up is a true continuation: the decode equals AR's, whole (N - 1)-token
    candidates are accepted, and it takes fewer forwards than tokens."""
    perm = [(t + 3) % 8 for t in range(8)]
    m = _cycle_model(perm)
    n = 40
    ar = ar_decode(m, [0, 1, 2, 3, 4, 5, 6, 7], n).tokens
    res = lookahead_decode(m, [0, 1, 2, 3, 4, 5, 6, 7], n, window=8, ngram=4, max_candidates=8)
    assert res.tokens == ar
    assert max(s.accepted for s in res.rounds) == 3
    assert len(res.rounds) < n
    _check_steps(res, 2, 4)


def test_lookahead_through_decode_prompts(tiny_model):
    from impl.methods import decode_prompts

    prompts = [{"id": "a", "input_ids": [3, 17, 42]}, {"id": "b", "input_ids": list(range(1, 20))}]
    rows = decode_prompts(tiny_model, None, prompts, "lookahead", {"window": 4, "ngram": 3, "max_candidates": 3},
                          DecodeRule(), 16, None)
    assert [r["ar_match"] for r in rows] == [True, True]
    assert all(r["critical_layers_total"] == 12 * r["spec_rounds"] for r in rows)


@pytest.mark.parametrize("kw, msg", [
    ({"window": 0}, "window"), ({"ngram": 1}, "ngram"), ({"max_candidates": 0}, "max_candidates"),
    ({"window": True}, "window"),
])
def test_lookahead_bad_parameters(tiny_model, kw, msg):
    with pytest.raises(ValueError, match=msg):
        lookahead_decode(tiny_model, [1, 2], 4, **kw)


def test_lookahead_refuses_a_window_past_the_context(tiny_model):
    with pytest.raises(ValueError, match="context"):
        lookahead_decode(tiny_model, [1 + i % 90 for i in range(99)], 20, window=10, ngram=5)


def test_lookahead_method_names_unknown_parameters(tiny_model):
    from impl.methods import build_method

    with pytest.raises(ValueError, match="unknown parameter"):
        build_method("lookahead", tiny_model, DecodeRule(), {"window": 2, "ngram": 2, "max_candidates": 1, "w": 3})
    with pytest.raises(ValueError, match="missing parameter"):
        build_method("lookahead", tiny_model, DecodeRule(), {"window": 2})
