"""Depth-selection baselines (impl.spec.self_spec / adadecode / dynamic_exit): exactness against AR
(greedy and position-keyed Gumbel sampling, with and without EOS), round statistics, the layer-work
accounting on a hand-built model, and parameter validation."""

import copy

import pytest
import torch

from impl.spec.adadecode import adadecode_decode, uniform_shortcut_layers
from impl.spec.ar import ar_decode
from impl.spec.dynamic_exit import dynamic_exit_decode, token_per_layer
from impl.spec.sampling import DecodeRule
from impl.spec.self_spec import self_spec_decode

pytestmark = pytest.mark.usefixtures("one_torch_thread")

L = 12
N = 24
PROMPTS = [[5], [3, 17, 42, 8, 9], list(range(1, 30))]


def _eos_cases(model, prompt, rule):
    """(eos id, AR ids) pairs: no EOS, and an EOS id that AR emits mid-generation."""
    ar = ar_decode(model, prompt, N, rule=rule).tokens
    eos = ar[N // 2]
    ar_eos = ar_decode(model, prompt, N, rule=rule, eos_token_id=eos)
    assert ar_eos.stopped_at_eos and len(ar_eos.tokens) <= N // 2 + 1
    return [(None, ar), (eos, ar_eos.tokens)]


def _check_spec_rounds(res, L):
    assert sum(r.committed for r in res.rounds) == len(res.tokens)
    for r in res.rounds:
        assert 0 <= r.accepted <= r.drafted <= r.planned
        assert r.committed <= r.accepted + 1
        assert r.layer_work == (r.drafted + 1) * L
        assert r.critical_layers == r.drafted * r.exit_layer + L
    assert res.layer_work == sum(r.layer_work for r in res.rounds)
    assert res.critical_layers == sum(r.critical_layers for r in res.rounds)
    assert res.seconds >= res.prefill_seconds >= 0


def _check_ada_rounds(res):
    assert sum(r.committed for r in res.rounds) == len(res.tokens)
    for r in res.rounds:
        assert 0 <= r.accepted <= r.drafted == len(r.exit_layers)
        assert r.committed <= r.accepted + 1
    assert res.layer_work == sum(r.layer_work for r in res.rounds)
    assert res.critical_layers == sum(r.critical_layers for r in res.rounds)


@pytest.fixture(scope="module")
def identity_tail_model(tiny_model):
    """The tiny model with layers 5..12 made exact identities (attention and MLP outputs zeroed), so
    every readout at depth >= 4 equals the final-depth readout: all depth->=4 drafts are accepted."""
    m = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for layer in m.model.layers[4:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return m


# ------------------------------------------------------------------ exactness: LayerSkip self-spec


@pytest.mark.parametrize("rule", [DecodeRule(), DecodeRule(temperature=1.0, seed=3)], ids=["greedy", "sample"])
def test_self_spec_equals_ar(tiny_model, rule):
    settings = [(1, 1), (1, 6), (6, 3), (L - 1, 1), (L - 1, 6)]
    seen = set()
    for prompt in PROMPTS:
        for eos, ar in _eos_cases(tiny_model, prompt, rule):
            for E, k in settings:
                res = self_spec_decode(tiny_model, prompt, N, exit_layer=E, num_speculations=k, rule=rule,
                                       eos_token_id=eos)
                assert res.tokens == ar, (prompt, eos, E, k)
                assert res.stopped_at_eos == (eos is not None)
                _check_spec_rounds(res, L)
                assert all(r.exit_layer == E and r.planned == k for r in res.rounds)
                seen |= {("accept", r.accepted > 0) for r in res.rounds} | {("reject", r.accepted < r.drafted)
                                                                           for r in res.rounds}
    assert seen == {("accept", True), ("accept", False), ("reject", True), ("reject", False)}


def test_self_spec_sampling_other_seed(tiny_model):
    rule = DecodeRule(temperature=0.7, seed=11)
    ar = ar_decode(tiny_model, PROMPTS[1], N, rule=rule).tokens
    assert self_spec_decode(tiny_model, PROMPTS[1], N, exit_layer=3, num_speculations=4, rule=rule).tokens == ar


# ------------------------------------------------------------------ exactness: AdaDecode


@pytest.mark.parametrize("rule", [DecodeRule(), DecodeRule(temperature=1.0, seed=5)], ids=["greedy", "sample"])
def test_adadecode_equals_ar(tiny_model, rule):
    settings = [([1], 0.0, 6), ([3, 6, 9], 0.0, 1), ([3, 6, 9], 0.1, 6), ([L - 1], 0.0, 6), ([4, 8], 1.0, 6)]
    seen = set()
    for prompt in PROMPTS:
        for eos, ar in _eos_cases(tiny_model, prompt, rule):
            for sc, thr, cap in settings:
                res = adadecode_decode(tiny_model, prompt, N, shortcut_layers=sc, threshold=thr,
                                       max_speculations=cap, rule=rule, eos_token_id=eos)
                assert res.tokens == ar, (prompt, eos, sc, thr, cap)
                assert res.stopped_at_eos == (eos is not None)
                _check_ada_rounds(res)
                for r in res.rounds:
                    assert set(r.exit_layers) <= set(sc)
                    assert r.drafted <= cap
                    seen |= {("accept", r.accepted > 0), ("reject", r.accepted < r.drafted)}
                    seen |= {("mixed depths", len(set(r.exit_layers)) > 1)}
    # both verdicts and rounds mixing exit depths (partial deferred layers) were exercised
    assert {("accept", True), ("reject", True), ("mixed depths", True)} <= seen


def test_adadecode_threshold_extremes(tiny_model):
    prompt = PROMPTS[1]
    never = adadecode_decode(tiny_model, prompt, N, shortcut_layers=[2, 4, 6, 8, 10], threshold=1.0,
                             max_speculations=8)
    assert never.early_tokens == 0
    assert all(r.drafted == 0 and r.committed == 1 and r.steps == 1 for r in never.rounds)
    assert never.layer_work == never.critical_layers == L * N  # plain AR accounting
    always = adadecode_decode(tiny_model, prompt, N, shortcut_layers=[2], threshold=0.0, max_speculations=3)
    # threshold 0: every token that may exit early does, at the first shortcut, up to the cap of 3.
    assert always.early_tokens > 0
    assert all(set(r.exit_layers) == {2} for r in always.rounds if r.drafted)
    assert all(r.drafted <= 3 for r in always.rounds)
    assert uniform_shortcut_layers(48, 8) == [8, 16, 24, 32, 40]
    assert uniform_shortcut_layers(80, 10) == [10, 20, 30, 40, 50, 60, 70]


# ------------------------------------------------------------------ exactness: DEL


@pytest.mark.parametrize("rule", [DecodeRule(), DecodeRule(temperature=1.0, seed=7)], ids=["greedy", "sample"])
def test_dynamic_exit_equals_ar(tiny_model, rule):
    settings = [{}, dict(confidence_threshold=0.0, max_speculations=6), dict(confidence_threshold=0.1),
                dict(exit_layers=[1, L - 1], max_speculations=1, confidence_threshold=1.0, decay=1.0)]
    for prompt in PROMPTS:
        for eos, ar in _eos_cases(tiny_model, prompt, rule):
            for kw in settings:
                res = dynamic_exit_decode(tiny_model, prompt, N, rule=rule, eos_token_id=eos, **kw)
                assert res.tokens == ar, (prompt, eos, kw)
                assert res.stopped_at_eos == (eos is not None)
                _check_spec_rounds(res, L)
                cands = kw.get("exit_layers", range(1, L))
                assert all(r.exit_layer in cands for r in res.rounds)
                assert set(res.acceptance_estimates) == set(cands)
                assert all(0.0 <= a <= 1.0 for a in res.acceptance_estimates.values())


def test_dynamic_exit_confidence_stop(tiny_model):
    # Threshold 1: every draft is below it, so drafting stops after one token each round.
    res = dynamic_exit_decode(tiny_model, PROMPTS[0], N, confidence_threshold=1.0)
    assert all(r.drafted == min(1, r.planned) for r in res.rounds[:-1])
    assert all(r.drafted <= 1 for r in res.rounds)


# ------------------------------------------------------------------ accounting on a hand-built model


def test_self_spec_accounting_hand_built(identity_tail_model):
    m = identity_tail_model
    prompt = [3, 4, 5]
    ar = ar_decode(m, prompt, 10).tokens
    res = self_spec_decode(m, prompt, 10, exit_layer=4, num_speculations=3)
    assert res.tokens == ar
    # Every draft is accepted: rounds draft 3, 3, then min(3, 10 - 8 - 1) = 1.
    assert [(r.drafted, r.accepted, r.committed) for r in res.rounds] == [(3, 3, 4), (3, 3, 4), (1, 1, 2)]
    # layer_work = sum (k+1) L = 10 * 12; critical = sum (k*E + L) = 24 + 24 + 16.
    assert res.layer_work == 120
    assert res.critical_layers == 64
    assert res.tokens_per_round == pytest.approx(10 / 3)
    assert res.acceptance_rate == 1.0


def test_adadecode_accounting_hand_built(identity_tail_model):
    m = identity_tail_model
    prompt = [3, 4, 5]
    ar = ar_decode(m, prompt, 5).tokens
    res = adadecode_decode(m, prompt, 5, shortcut_layers=[4], threshold=0.0, max_speculations=2)
    assert res.tokens == ar
    # Steps: early@4, early@4, full (verifies 2 + commits the new token's final decode); early@4,
    # early@4 reaches 5 tokens, then a flush runs the 2 pending positions through layers 5..12.
    got = [(r.drafted, r.accepted, r.exit_layers, r.committed, r.steps, r.layer_work, r.critical_layers)
           for r in res.rounds]
    # round 1 work: 4 + 4 + (12 + 2 * 8) = 36; critical 4 + 4 + 12 = 20.
    # round 2 work: 4 + 4 + 2 * 8 = 24;       critical 4 + 4 + 8 = 16.
    assert got == [(2, 2, [4, 4], 3, 3, 36, 20), (2, 2, [4, 4], 2, 3, 24, 16)]
    assert res.layer_work == 5 * L and res.critical_layers == 36


def test_dynamic_exit_learns_identity_depth(identity_tail_model):
    res = dynamic_exit_decode(identity_tail_model, [3, 4, 5], 40, confidence_threshold=0.0)
    assert res.tokens == ar_decode(identity_tail_model, [3, 4, 5], 40).tokens
    _check_spec_rounds(res, L)
    # Shadow tokens at depths >= 4 always match the final token, so their estimates approach 1 and
    # the TPL choice settles on depth 4 with the longest speculation; every draft there is accepted.
    assert all(res.acceptance_estimates[l] > 0.9 for l in range(4, L))
    late = res.rounds[3:]
    assert late and all(r.exit_layer == 4 and r.accepted == r.drafted for r in late)
    assert res.rounds[-2].planned == 8
    assert token_per_layer(1.0, 4, 8, L) == pytest.approx(9 / 44)
    assert token_per_layer(0.0, 4, 8, L) == pytest.approx(1 / 44)


# ------------------------------------------------------------------ validation


def test_bad_parameters_raise(tiny_model):
    m, p = tiny_model, [1, 2, 3]
    bad_self = [dict(exit_layer=0, num_speculations=2), dict(exit_layer=L, num_speculations=2),
                dict(exit_layer=2.5, num_speculations=2), dict(exit_layer=True, num_speculations=2),
                dict(exit_layer=2, num_speculations=0)]
    for kw in bad_self:
        with pytest.raises(ValueError, match="exit_layer|num_speculations"):
            self_spec_decode(m, p, 4, **kw)
    bad_ada = [dict(shortcut_layers=[], threshold=0.5, max_speculations=2),
               dict(shortcut_layers=[0, 4], threshold=0.5, max_speculations=2),
               dict(shortcut_layers=[4, L], threshold=0.5, max_speculations=2),
               dict(shortcut_layers=[6, 3], threshold=0.5, max_speculations=2),
               dict(shortcut_layers=[4], threshold=-0.1, max_speculations=2),
               dict(shortcut_layers=[4], threshold=1.5, max_speculations=2),
               dict(shortcut_layers=[4], threshold=0.5, max_speculations=0)]
    for kw in bad_ada:
        with pytest.raises(ValueError, match="shortcut_layers|threshold|max_speculations"):
            adadecode_decode(m, p, 4, **kw)
    bad_del = [dict(exit_layers=[]), dict(exit_layers=[0]), dict(exit_layers=[L]), dict(exit_layers=[3, 3]),
               dict(max_speculations=0), dict(confidence_threshold=2.0), dict(decay=0.0),
               dict(prior_acceptance=1.5), dict(prior_weight=0.0)]
    for kw in bad_del:
        with pytest.raises(ValueError, match="exit_layers|max_speculations|confidence_threshold|decay|prior"):
            dynamic_exit_decode(m, p, 4, **kw)
    calls = [lambda **k: self_spec_decode(exit_layer=2, num_speculations=2, **k),
             lambda **k: adadecode_decode(shortcut_layers=[4], threshold=0.5, max_speculations=2, **k),
             lambda **k: dynamic_exit_decode(**k)]
    for call in calls:
        with pytest.raises(ValueError, match="empty prompt"):
            call(model=m, input_ids=[], max_new_tokens=4)
        with pytest.raises(ValueError, match="exceeds the context"):
            call(model=m, input_ids=[1] * 120, max_new_tokens=9)
        with pytest.raises(ValueError, match="max_new_tokens"):
            call(model=m, input_ids=p, max_new_tokens=0)
        with pytest.raises(ValueError, match="eos_token_id"):
            call(model=m, input_ids=p, max_new_tokens=4, eos_token_id=97)
        with pytest.raises(ValueError, match="outside"):
            call(model=m, input_ids=[1, 200], max_new_tokens=4)


# ------------------------------------------------------------------ library reference: transformers' early exit


@pytest.mark.parametrize("eos", [None, 0])
def test_hf_early_exit_equals_ar(tiny_model, eos):
    from impl.spec.hf_early_exit import hf_early_exit_decode

    for prompt in PROMPTS:
        ar = ar_decode(tiny_model, prompt, N, eos_token_id=eos).tokens
        for exit_layer, k in [(1, 1), (4, 3), (L - 1, 6)]:
            res = hf_early_exit_decode(tiny_model, prompt, N, exit_layer=exit_layer, num_speculations=k,
                                       eos_token_id=eos)
            assert res.tokens == ar, (prompt, exit_layer, k)
            assert res.verify_passes >= 1 and res.draft_passes >= 1
    assert tiny_model.generation_config.num_assistant_tokens != 6  # the draft settings were restored


def test_hf_early_exit_drops_only_transformers_warning_against_its_own_draft_call(tiny_model):
    import logging

    from impl.spec.hf_early_exit import hf_early_exit_decode

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("transformers.generation.utils")
    log.addHandler(handler)
    try:
        logging.Logger.warning_once.cache_clear()  # transformers' warning_once: each message once per process
        hf_early_exit_decode(tiny_model, PROMPTS[0], 4, exit_layer=4, num_speculations=2, eos_token_id=None)
        log.warning("another warning")
    finally:
        log.removeHandler(handler)
    msgs = [r.getMessage() for r in records]
    assert not [m for m in msgs if "Passing `generation_config` together" in m], msgs
    assert "another warning" in msgs and not log.filters  # the filter is gone after the call


def test_hf_early_exit_accounting_matches_lssd_hand_built(identity_tail_model):
    """Every depth->=4 draft is accepted: transformers' passes cost what LSSD's rounds cost."""
    from impl.spec.hf_early_exit import hf_early_exit_decode

    prompt = [3, 4, 5]
    hf = hf_early_exit_decode(identity_tail_model, prompt, 10, exit_layer=4, num_speculations=3, eos_token_id=None)
    ss = self_spec_decode(identity_tail_model, prompt, 10, exit_layer=4, num_speculations=3)
    assert hf.tokens == ss.tokens == ar_decode(identity_tail_model, prompt, 10).tokens
    assert (hf.draft_passes, hf.verify_passes) == (7, 3)
    assert hf.critical_layers == ss.critical_layers == 64


@pytest.mark.parametrize("eos", [None, 0])
def test_hf_prompt_lookup_equals_ar(tiny_model, eos):
    from impl.spec.hf_prompt_lookup import hf_prompt_lookup_decode

    for prompt in PROMPTS + [[3, 17, 42, 8, 3, 17, 42, 8, 3, 17]]:  # the last one: n-grams that recur
        ar = ar_decode(tiny_model, prompt, N, eos_token_id=eos).tokens
        for k, ngram in [(1, 1), (3, 2), (8, 3)]:
            res = hf_prompt_lookup_decode(tiny_model, prompt, N, num_tokens=k, max_matching_ngram_size=ngram,
                                          eos_token_id=eos)
            assert res.tokens == ar, (prompt, k, ngram)
            assert 1 <= res.verify_passes <= len(ar) and res.critical_layers == L * res.verify_passes


def _cycle_model(perm):
    """A 2-layer Llama whose layers are exact identities and whose LM head maps token t to perm[t]:
    greedy decoding walks the permutation's cycle from the last prompt token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    V = len(perm)
    cfg = LlamaConfig(vocab_size=V, hidden_size=V, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.model.embed_tokens.weight.copy_(torch.eye(V))
        head = torch.zeros(V, V)
        for t, nxt in enumerate(perm):
            head[nxt, t] = 1.0
        m.lm_head.weight.copy_(head)
    return m


def test_hf_prompt_lookup_accounting_hand_built():
    """On a cycle that the prompt already contains, every draft is the true continuation: each
    verification (the first one reads the prompt too) commits num_tokens + 1 tokens, so passes =
    ceil(n / (k + 1)); without a recurring n-gram nothing is drafted and every token costs a pass, as AR's."""
    from impl.spec.hf_prompt_lookup import hf_prompt_lookup_decode

    perm = [(t + 1) % 8 for t in range(8)]  # 0 -> 1 -> ... -> 7 -> 0
    m = _cycle_model(perm)
    prompt = list(range(8)) + [0]  # the whole cycle, then its first token again
    n, k = 14, 3
    ar = ar_decode(m, prompt, n).tokens
    assert ar == [(1 + i) % 8 for i in range(n)]
    res = hf_prompt_lookup_decode(m, prompt, n, num_tokens=k, max_matching_ngram_size=2, eos_token_id=None)
    assert res.tokens == ar
    assert res.verify_passes == -(-n // (k + 1)) == 4 and res.critical_layers == 2 * 4
    no_match = hf_prompt_lookup_decode(m, [5], 2, num_tokens=k, max_matching_ngram_size=2, eos_token_id=None)
    assert no_match.tokens == [6, 7] and no_match.verify_passes == 2


@pytest.mark.parametrize("eos", [None, 0])
def test_hf_assisted_equals_ar(tiny_model, eos):
    """A draft with other weights (most drafts rejected) and the target's own copy (all accepted)."""
    from transformers import LlamaForCausalLM

    from impl.spec.hf_assisted import hf_assisted_decode

    torch.manual_seed(1)
    other = LlamaForCausalLM(copy.deepcopy(tiny_model.config)).eval()
    other.config.num_hidden_layers = 2
    other.model.layers = other.model.layers[:2]
    for prompt in PROMPTS:
        ar = ar_decode(tiny_model, prompt, N, eos_token_id=eos).tokens
        for assistant, k in [(other, 1), (other, 4), (copy.deepcopy(tiny_model), 5)]:
            res = hf_assisted_decode(tiny_model, assistant, prompt, N, num_assistant_tokens=k, eos_token_id=eos)
            assert res.tokens == ar, (prompt, k)
            assert res.critical_layers == L * res.target_passes and res.draft_passes >= 1
    assert other.generation_config.num_assistant_tokens != 4  # the draft settings were restored


def test_hf_assisted_accounting_hand_built():
    """An assistant equal to the target drafts the true continuation: passes = ceil(n / (k + 1)) of
    the target and k per round of the assistant."""
    from impl.spec.hf_assisted import hf_assisted_decode

    m = _cycle_model([(t + 1) % 8 for t in range(8)])
    n, k = 16, 3
    res = hf_assisted_decode(m, copy.deepcopy(m), [4], n, num_assistant_tokens=k, eos_token_id=None)
    assert res.tokens == ar_decode(m, [4], n).tokens == [(5 + i) % 8 for i in range(n)]
    assert (res.target_passes, res.draft_passes) == (4, 12) and res.draft_layers == 2 * 12


def test_hf_assisted_bad_parameters(tiny_model, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from impl.methods import build_method
    from impl.spec.hf_assisted import hf_assisted_decode

    with pytest.raises(ValueError, match="must be a separate model"):
        hf_assisted_decode(tiny_model, tiny_model, [1, 2], 4, num_assistant_tokens=2, eos_token_id=None)
    small_vocab = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=2)).eval()
    with pytest.raises(ValueError, match=r"vocabulary \(50 ids\) is not the target's \(97\)"):
        hf_assisted_decode(tiny_model, small_vocab, [1, 2], 4, num_assistant_tokens=2, eos_token_id=None)
    with pytest.raises(ValueError, match="num_assistant_tokens=0"):
        build_method("hf_assisted", tiny_model, DecodeRule(), {"assistant": copy.deepcopy(tiny_model),
                                                               "num_assistant_tokens": 0})
    with pytest.raises(ValueError, match="greedy only"):
        build_method("assisted", tiny_model, DecodeRule(temperature=1.0), {"assistant": "x", "num_assistant_tokens": 2})
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_method("assisted", tiny_model, DecodeRule(), {"assistant": str(tmp_path / "nowhere"),
                                                            "num_assistant_tokens": 2})
    copy.deepcopy(tiny_model).save_pretrained(tmp_path / "draft")
    run = build_method("assisted", tiny_model, DecodeRule(), {"assistant": str(tmp_path / "draft"),
                                                              "num_assistant_tokens": 3})
    row = run([3, 17, 42], 8, None)
    assert row["token_ids"] == ar_decode(tiny_model, [3, 17, 42], 8).tokens and row["draft_passes"] >= 1


def test_hf_prompt_lookup_bad_parameters(tiny_model):
    from impl.methods import build_method
    from impl.spec.hf_prompt_lookup import hf_prompt_lookup_decode

    with pytest.raises(ValueError, match="num_tokens=0 must be an integer >= 1"):
        hf_prompt_lookup_decode(tiny_model, [1, 2], 4, num_tokens=0, eos_token_id=None)
    with pytest.raises(ValueError, match="empty prompt"):
        hf_prompt_lookup_decode(tiny_model, [], 4, num_tokens=2, eos_token_id=None)
    with pytest.raises(ValueError, match="greedy only"):
        build_method("hf_prompt_lookup", tiny_model, DecodeRule(temperature=1.0), {"num_tokens": 2})
    with pytest.raises(ValueError, match="missing"):
        build_method("prompt_lookup", tiny_model, DecodeRule(), {})
    with pytest.raises(ValueError, match="max_matching_ngram_size=True"):
        build_method("hf_prompt_lookup", tiny_model, DecodeRule(), {"num_tokens": 2, "max_matching_ngram_size": True})
    run = build_method("prompt_lookup", tiny_model, DecodeRule(), {"num_tokens": 3})
    row = run([3, 17, 42], 6, None)
    assert row["token_ids"] == ar_decode(tiny_model, [3, 17, 42], 6).tokens
    assert row["critical_layers_total"] == L * row["verify_passes"]


def test_hf_early_exit_bad_parameters(tiny_model):
    from impl.methods import build_method
    from impl.spec.hf_early_exit import hf_early_exit_decode

    with pytest.raises(ValueError, match="exit_layer=12 is outside"):
        hf_early_exit_decode(tiny_model, [1, 2], 4, exit_layer=L, num_speculations=2, eos_token_id=None)
    with pytest.raises(ValueError, match="greedy only"):
        build_method("hf_early_exit", tiny_model, DecodeRule(temperature=1.0), {"exit_layer": 2, "num_speculations": 2})
    with pytest.raises(ValueError, match="missing"):
        build_method("hf_early_exit", tiny_model, DecodeRule(), {"exit_layer": 2})
