"""Profitability-aware mode switching (vSkipper Sec. 3.3):

- the controller: prefill thresholds (small batch dense, large batch routed), share probing cadence,
  decode mode set after prefill, one promotion that never reverts, the override and ablation switches;
- a mixed-mode batch equals running its dense rows unmodified (RUN, no epilogue) and its routed rows
  routed;
- in the continuous-batching engine, the switch's tokens equal a plain-PyTorch replay of each request's
  recorded modes;
- derive_thresholds is monotone in its inputs; profile_routed_cost runs and feeds it.
"""

import copy
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from impl.vskipper import RandomSkip, RowMeta, bind_skipper, plain_greedy, routed_cb_config, routed_context
from impl.vskipper.flexidepth import FlexiDepthSkipper
from impl.vskipper.mode import (
    ABLATIONS,
    ModeController,
    ModeSwitch,
    _block_mask,
    derive_thresholds,
    generate_with_switch,
    packed_forward,
    profile_routed_cost,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_LAYERS = 4


def _tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=N_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0,
                      initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def base_model():
    return _tiny()


def _prefill(rid, n, start=0, prompt_len=None):
    return RowMeta.for_sequence(rid, start, n, prompt_len=prompt_len or start + n)


def _decode(rids, tok=50, prompt_len=10):
    return RowMeta.concat([RowMeta.for_sequence(r, tok, 1, prompt_len=prompt_len) for r in rids])


# -- configuration ---------------------------------------------------------------------------------------
def test_switch_config_and_ablations():
    sw = ModeSwitch.paper(enter_threshold=12)
    assert (sw.min_prefill_tokens, sw.min_skip_share, sw.probe_every, sw.enter_threshold) == (1536, 0.35, 64, 12)
    assert sw.ablation("always-route").always_route
    assert sw.ablation("never-route").never_route
    assert not sw.ablation("prefill-only").route_decode and sw.ablation("prefill-only").route_prefill
    assert not sw.ablation("decode-only").route_prefill
    assert not sw.ablation("no-promotion").promote
    assert sw.ablation("served") == sw and set(ABLATIONS) >= {"served", "no-promotion"}
    with pytest.raises(ValueError, match="unknown mode-switch setting"):
        sw.ablation("nope")
    with pytest.raises(ValueError, match="exclude"):
        ModeSwitch(always_route=True, never_route=True)
    with pytest.raises(ValueError, match="probe_every"):
        ModeSwitch(probe_every=0)
    d = ModeSwitch.from_thresholds({"min_prefill_tokens": None, "min_skip_share": 0.2, "enter_threshold": 7},
                                   promote=False)
    assert d.min_prefill_tokens == math.inf and d.enter_threshold == 7 and not d.promote
    assert d.to_dict()["min_prefill_tokens"] is None


def test_switch_json_and_thresholds_file_round_trip(tmp_path):
    """An infinite threshold survives the JSON form (None), and a thresholds file gives the same switch
    whether it is profile-mode's whole JSON or the bare derive_thresholds() output."""
    sw = ModeSwitch(min_prefill_tokens=math.inf, enter_threshold=66, initial_share=0.5, promote=False)
    assert ModeSwitch.from_fields(json.loads(json.dumps(sw.to_dict()))) == sw
    with pytest.raises(ValueError, match="no field 'enter'"):
        ModeSwitch.from_fields({"enter": 3})
    derived = {"min_prefill_tokens": None, "min_skip_share": 0.119, "probe_every": 64, "enter_threshold": 66}
    (tmp_path / "profile.json").write_text(json.dumps({"policy": "flexidepth", "thresholds": derived}))
    (tmp_path / "bare.json").write_text(json.dumps(derived))
    a = ModeSwitch.from_profile(tmp_path / "profile.json")
    assert a == ModeSwitch.from_profile(tmp_path / "bare.json") == ModeSwitch.from_thresholds(derived)
    assert a.min_prefill_tokens == math.inf and a.enter_threshold == 66
    assert ModeSwitch.from_profile(tmp_path / "bare.json", promote=False).promote is False
    (tmp_path / "bad.json").write_text('{"policy": "flexidepth"}')
    for bad in ("bad.json", "missing.json"):
        with pytest.raises(ValueError, match=bad):
            ModeSwitch.from_profile(tmp_path / bad)


# -- the controller --------------------------------------------------------------------------------------
def test_prefill_thresholds_and_share_probe():
    c = ModeController(ModeSwitch(min_prefill_tokens=100, min_skip_share=0.35, probe_every=64))
    small = c.plan(_prefill("a", 50))  # below the token threshold: dense, no probe
    assert not small.routed.any() and c.prefill_mode["a"] is False and c.share is None
    big = c.plan(_prefill("b", 150))  # first eligible batch: probe, routed
    assert big.routed.all() and c.events[-1]["probe"]
    c.observe_share(0.5)
    assert c.probes == [{"admitted_batch": 1, "batch": 1, "n_prompt_tokens": 150, "share": 0.5}]
    assert c.plan(_prefill("c", 120)).routed.all()  # share 0.5 > 0.35
    c.observe_share(0.3)
    assert not c.plan(_prefill("d", 500)).routed.any()  # share 0.3 not above 0.35
    # a later chunk keeps its request's admission mode, whatever the new batch decides
    mixed = c.plan(RowMeta.concat([_prefill("c", 20, start=120, prompt_len=200), _prefill("e", 30)]))
    assert mixed.routed.tolist() == [True] * 20 + [False] * 30
    assert c.prefill_mode == {"a": False, "b": True, "c": True, "d": False, "e": False}


def test_probe_cadence():
    c = ModeController(ModeSwitch(min_prefill_tokens=10, min_skip_share=0.35, probe_every=3))
    probes = []
    for i in range(10):
        n = 5 if i == 4 else 20  # admitted batch 4 is too small to probe
        c.plan(_prefill(f"r{i}", n))
        if c.events[-1]["probe"]:
            probes.append(i)
            c.observe_share(0.6)
    # probes at admitted batches 0, 3, 6, 9 (the small batch 4 only counts as admitted)
    assert probes == [0, 3, 6, 9]
    c2 = ModeController(ModeSwitch(min_prefill_tokens=10, probe_every=3))
    probes = []
    for i in range(8):
        n = 5 if i == 3 else 20  # the probe due at 3 is deferred to the next eligible batch (4)
        c2.plan(_prefill(f"r{i}", n))
        if c2.events[-1]["probe"]:
            probes.append(i)
            c2.observe_share(0.6)
    assert probes == [0, 4, 7]
    # a prior estimate delays the first probe by probe_every admitted batches
    c3 = ModeController(ModeSwitch(min_prefill_tokens=10, probe_every=2, initial_share=0.5))
    flags = []
    for i in range(3):
        c3.plan(_prefill(f"r{i}", 20))
        flags.append(c3.events[-1]["probe"])
    assert flags == [False, False, True]


def test_decode_mode_and_one_promotion_never_reverting():
    c = ModeController(ModeSwitch(enter_threshold=3, min_prefill_tokens=math.inf))
    assert not c.plan(_decode(["a"], tok=10)).routed.any()  # load 1 < 3: dense after prefill
    assert not c.plan(_decode(["a", "b"], tok=11)).routed.any()  # load 2
    out = c.plan(_decode(["a", "b", "c"], tok=12))  # load 3 crosses: a, b promoted, c set routed
    assert out.routed.all()
    assert c.promoted == {"a": 2, "b": 2} and c.routed_from == {"a": 12, "b": 12, "c": 12}
    for _ in range(3):  # load falls back: never reverts
        assert c.plan(_decode(["a"], tok=13)).routed.all()
    assert [e["kind"] for e in c.events].count("promote") == 2
    assert c.plan(_decode(["d"], tok=10)).routed.tolist() == [False]  # a new request at low load: dense
    # a mixed batch: routed and dense decode rows side by side
    assert c.plan(_decode(["a", "d"], tok=14)).routed.tolist() == [True, False]
    assert c.decode_routed("a")(12) and not c.decode_routed("a")(11) and not c.decode_routed("d")(99)
    s = c.summary()
    assert s["promotions"] == 2 and s["decode_routed_requests"] == 3 and s["decode_dense_requests"] == 1
    for d in (c.prefill_mode, c.decode_mode, c.routed_from, c.promoted):  # what a server does on release
        d.clear()
    assert c.summary() == s  # the request counts are since the start, as the row counts are
    # explicit load overrides the batch count
    c2 = ModeController(ModeSwitch(enter_threshold=3))
    assert c2.plan(_decode(["x"]), decode_load=5).routed.all()


def test_ablation_switches():
    def run(sw):
        c = ModeController(sw)
        pre = [bool(c.plan(_prefill(f"p{i}", n)).routed.all()) for i, n in enumerate((5, 50))]
        if c._pending is not None:
            c.observe_share(0.9)
        dec = [c.plan(_decode(["x"])).routed.tolist()[0], c.plan(_decode(["x", "y", "z"])).routed.tolist()[0]]
        return pre, dec, c

    base = ModeSwitch(min_prefill_tokens=20, min_skip_share=0.35, enter_threshold=3)
    pre, dec, c = run(base)
    assert pre == [False, True] and dec == [False, True] and c.promoted == {"x": 3}  # served hybrid
    pre, dec, _ = run(base.ablation("always-route"))
    assert pre == [True, True] and dec == [True, True]
    pre, dec, c = run(base.ablation("never-route"))
    assert pre == [False, False] and dec == [False, False] and c.probes == []
    pre, dec, _ = run(base.ablation("prefill-only"))
    assert pre == [False, True] and dec == [False, False]
    pre, dec, _ = run(base.ablation("decode-only"))
    assert pre == [False, False] and dec == [False, True]
    pre, dec, c = run(base.ablation("no-promotion"))
    assert pre == [False, True] and dec == [False, False] and c.promoted == {}
    assert c.decode_mode == {"x": False, "y": True, "z": True}  # set after prefill at load 3


# -- mixed-mode execution --------------------------------------------------------------------------------
def test_mixed_mode_batch_equals_dense_rows_run(base_model):
    """Two requests packed in one forward, one routed and one dense: the dense request's logits are the
    base model's (its rows RUN with no epilogue even under FlexiDepth), the routed one's are those of a
    routed forward of it alone."""
    sk = FlexiDepthSkipper.for_model(base_model, (1, 2, 3), init_logit=0.0, init_spread=2.0, adapter_init_scale=1.0,
                                     seed=3)
    routed = copy.deepcopy(base_model)
    bind_skipper(routed, sk)
    a, b = [5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45]
    ids = torch.tensor([a + b])
    pos = torch.tensor([list(range(len(a))) + list(range(len(b)))])
    T = len(a) + len(b)
    blocks = [(0, None)] * len(a) + [(len(a), None)] * len(b)
    mask = _block_mask(blocks, T, list(range(T)), torch.float32, torch.device("cpu"))
    meta = RowMeta.concat([RowMeta.for_sequence("A", 0, len(a), prompt_len=len(a), routed=True),
                           RowMeta.for_sequence("B", 0, len(b), prompt_len=len(b), routed=False)])
    got = packed_forward(routed, ids, pos, mask, meta)[0]
    with torch.no_grad():
        dense_b = base_model(torch.tensor([b])).logits[0]
        dense_a = base_model(torch.tensor([a])).logits[0]
    solo_a = packed_forward(routed, torch.tensor([a]), torch.arange(len(a))[None], None,
                            RowMeta.for_sequence("A", 0, len(a), prompt_len=len(a)))[0]
    torch.testing.assert_close(got[len(a):], dense_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[: len(a)], solo_a, atol=1e-5, rtol=1e-5)
    assert (got[: len(a)] - dense_a).abs().max() > 1e-2  # the routed request really was routed
    # a batch whose rows are all dense runs the original layers (router not consulted)
    ctx = routed_context(routed)
    ctx.reset_stats()
    meta_d = RowMeta.for_sequence("B", 0, len(b), prompt_len=len(b), routed=False)
    out = packed_forward(routed, torch.tensor([b]), torch.arange(len(b))[None], None, meta_d)[0]
    torch.testing.assert_close(out, dense_b, atol=1e-5, rtol=1e-5)
    assert ctx.counts == {}


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
           [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [60, 61], [20, 21, 22, 23, 24, 25]]
NEW = 8


def test_engine_switch_matches_plain_replay(base_model):
    """Under the switch (small thresholds so that the tiny batches cross them), the engine's tokens equal
    a plain-PyTorch replay of each request's recorded prefill mode and decode routing point."""
    sk = RandomSkip(routed_layers=range(1, N_LAYERS), r=0.6, d=2 / 3, seed=3)
    routed = copy.deepcopy(base_model)
    bind_skipper(routed, sk)
    sw = ModeSwitch(min_prefill_tokens=12, min_skip_share=0.2, probe_every=2, enter_threshold=3)
    ids = [f"doc-{i}" for i in range(len(PROMPTS))]
    cb = routed_cb_config(page_size=16, num_blocks=48, max_batch_tokens=16, max_requests_per_batch=4)
    got, ctl = generate_with_switch(routed, PROMPTS, sw, max_new_tokens=NEW, request_ids=ids, cb_config=cb)
    want = [plain_greedy(routed, p, request_id=rid, max_new_tokens=NEW, prefill_routed=ctl.prefill_mode[rid],
                         decode_routed=ctl.decode_routed(rid)) for rid, p in zip(ids, PROMPTS)]
    assert got == want
    s = ctl.summary()
    # the scenario really exercised the switch: both prefill modes, a probe with a measured share, both
    # decode modes, promotions, and batches mixing routed and dense rows
    assert s["prefill_routed_requests"] >= 1 and s["prefill_dense_requests"] >= 1
    assert ctl.probes and 0.0 < ctl.probes[0]["share"] < 1.0
    assert s["rows"]["decode"]["routed"] > 0 and s["rows"]["decode"]["dense"] > 0
    assert s["promotions"] >= 1
    dense = [plain_greedy(base_model, p, request_id="x", max_new_tokens=NEW) for p in PROMPTS]
    assert got != dense
    # never-route through the switch is the dense engine
    got_d, ctl_d = generate_with_switch(routed, PROMPTS, sw.ablation("never-route"), max_new_tokens=NEW,
                                        request_ids=ids, cb_config=cb)
    assert got_d == dense and ctl_d.summary()["rows"]["prefill"]["routed"] == 0
    with pytest.raises(ValueError, match="allow_block_sharing=False"):
        generate_with_switch(routed, PROMPTS[:1], sw, max_new_tokens=2,
                             cb_config=routed_cb_config(allow_block_sharing=True, page_size=16, num_blocks=8))


# -- thresholds ------------------------------------------------------------------------------------------
def _profile(a=0.002, b=1e-6, c=5e-7, a_d=0.001, b_d=2e-6, c_d=4e-6, n_routed=16):
    return {"n_routed_layers": n_routed,
            "prefill": {"fixed_cost_s": a, "fixed_cost_per_row_s": b, "saving_per_row_layer_s": c},
            "decode": {"fixed_cost_s": a_d, "fixed_cost_per_row_s": b_d, "saving_per_row_layer_s": c_d}}


def _n(x):
    return math.inf if x is None else x


def test_derive_thresholds_rule_and_monotonicity():
    d = derive_thresholds(_profile(), 0.5)
    assert d["min_skip_share"] == pytest.approx(0.35)  # 0.7 x the policy's share
    # N = ceil(a / (c n_R S - b)) = ceil(0.002 / (5e-7 * 16 * 0.35 - 1e-6)) = ceil(0.002 / 1.8e-6) = 1112
    assert d["min_prefill_tokens"] == 1112 and d["prefill_profitable"]
    assert d["enter_threshold"] == math.ceil(0.001 / (4e-6 * 16 * 0.35 - 2e-6))
    assert d["break_even_share"]["prefill"] == pytest.approx(1e-6 / (5e-7 * 16))
    sw = ModeSwitch.from_thresholds(d)
    assert sw.min_prefill_tokens == 1112 and sw.min_skip_share == pytest.approx(0.35)

    shares = [0.02, 0.15, 0.3, 0.5, 0.8, 1.0]
    for key in ("min_prefill_tokens", "enter_threshold"):
        vals = [_n(derive_thresholds(_profile(), s)[key]) for s in shares]
        assert all(x >= y for x, y in zip(vals, vals[1:])), (key, vals)  # more skipping: lower threshold
        assert vals[0] == math.inf and vals[-1] < math.inf
    guards = [derive_thresholds(_profile(), s)["min_skip_share"] for s in shares]
    assert guards == sorted(guards)
    for field, key, grid in (("a", "min_prefill_tokens", [0.0, 1e-3, 2e-3, 8e-3]),
                             ("b", "min_prefill_tokens", [0.0, 5e-7, 1e-6, 3e-6, 1e-5]),
                             ("a_d", "enter_threshold", [1e-4, 1e-3, 1e-2]),
                             ("b_d", "enter_threshold", [0.0, 2e-6, 1e-5, 1e-4])):
        vals = [_n(derive_thresholds(_profile(**{field: v}), 0.5)[key]) for v in grid]
        assert all(x <= y for x, y in zip(vals, vals[1:])), (field, vals)  # more fixed cost: higher threshold
    for field, key in (("c", "min_prefill_tokens"), ("c_d", "enter_threshold")):
        vals = [_n(derive_thresholds(_profile(**{field: v}), 0.5)[key]) for v in (1e-7, 5e-7, 1e-6, 1e-5)]
        assert all(x >= y for x, y in zip(vals, vals[1:])), (field, vals)  # more saving: lower threshold
    margins = [_n(derive_thresholds(_profile(), 0.5, margin=m)["min_prefill_tokens"]) for m in (1.0, 1.5, 2.0)]
    assert margins == sorted(margins)
    per_phase = derive_thresholds(_profile(), {"prefill": 0.9, "decode": 0.02})
    assert per_phase["prefill_profitable"] and not per_phase["decode_profitable"]
    assert per_phase["enter_threshold"] is None
    with pytest.raises(ValueError, match="skip shares"):
        derive_thresholds(_profile(), 1.5)
    with pytest.raises(ValueError, match="lacks"):
        derive_thresholds({"n_routed_layers": 2}, 0.5)


def test_profile_routed_cost_feeds_the_rule(base_model):
    model = copy.deepcopy(base_model)
    sk = FlexiDepthSkipper.for_model(model, (1, 2, 3), init_logit=0.0, init_spread=2.0)
    prof = profile_routed_cost(model, sk, prefill_tokens=(16, 32), prefill_prompt_len=8, decode_requests=(2, 4),
                               decode_context=8, repeats=1, warmup=0)
    assert routed_context(model) is None  # unbound again
    assert prof["n_routed_layers"] == 3 and prof["device"] == "cpu"
    for ph, ns in (("prefill", [16, 32]), ("decode", [2, 4])):
        assert [p["n_rows"] for p in prof[ph]["points"]] == ns
        for p in prof[ph]["points"]:
            assert all(p[k] > 0 for k in ("t_dense_s", "t_routed_zero_s", "t_routed_all_skip_s"))
        assert all(math.isfinite(prof[ph][k]) for k in ("fixed_cost_s", "fixed_cost_per_row_s",
                                                        "saving_per_row_layer_s"))
    d = derive_thresholds(prof, 0.5)
    assert set(d) >= {"min_prefill_tokens", "min_skip_share", "enter_threshold", "probe_every"}
    # a model already bound to the skipper is profiled as is and stays bound
    bind_skipper(model, sk)
    profile_routed_cost(model, sk, prefill_tokens=(8,), prefill_prompt_len=8, decode_requests=(2,),
                        decode_context=4, repeats=1, warmup=0)
    assert routed_context(model) is not None
    with pytest.raises(ValueError, match="another skipper"):
        profile_routed_cost(model, RandomSkip(routed_layers=[1], r=0.5, d=1.0), repeats=1)
