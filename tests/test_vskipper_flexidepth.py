"""FlexiDepth-style skipper (vSkipper Sec. 3.1, 3.4; FlexiDepth) on tiny random Llama models:

- router / adapter shapes and parameters, w in (0, 1), RUN iff w > 0.5, the two output formulas;
- checkpoint round trip (safetensors + json) and its errors;
- the training forward equals the routed layer's inference computation;
- in the continuous-batching engine, greedy tokens equal the plain-PyTorch routed reference and an
  independent full-recompute reference;
- a short stage-1 training run lowers the held-out loss, and the skip penalty moves the skip ratio
  in the expected direction; train_and_save writes a loadable checkpoint.
"""

import copy
import json

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from impl.vskipper import (
    bind_skipper,
    build_skipper,
    generate_greedy,
    plain_forward,
    plain_greedy,
    registered_skippers,
    routed_cb_config,
    routed_context,
    validate_skipper,
)
from impl.vskipper.flexidepth import (
    FlexiDepthSkipper,
    FlexiDepthTrainConfig,
    SwiGLUAdapter,
    flexidepth_forward,
    load_flexidepth,
    skip_penalty,
    train_and_save,
    train_flexidepth,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_LAYERS = 4
ROUTED = (1, 2, 3)
PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1, 2, 3],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [60, 61]]
NEW = 6


def _tiny():
    """Seeded random 4-layer Llama (hidden 32, GQA 4/2 heads), initialised wide like test_vskipper_routed."""
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


def _mixed_skipper(model, seed=3):
    """A random skipper whose weights spread around 0.5 (about half the rows skip) with non-zero adapters."""
    return FlexiDepthSkipper.for_model(model, ROUTED, init_logit=0.0, init_spread=2.0, adapter_init_scale=1.0,
                                       seed=seed)


# -- the policy ----------------------------------------------------------------------------------------
def test_router_and_adapter_shapes():
    sk = FlexiDepthSkipper(ROUTED, 32, intermediate_size=64)
    assert (sk.router_dim, sk.adapter_dim) == (2, 4)  # H / 16, intermediate / 16
    r = sk.router(2)
    assert r.enc.weight.shape == (2, 32) and r.enc.bias is None
    assert r.mid_norm.weight.shape == (2,)
    assert r.dec.weight.shape == (32, 2) and r.dec.bias is None
    assert r.head.weight.shape == (1, 32) and r.head.bias.shape == (1,)
    assert r.norm.weight.shape == (32,)
    ad = sk.projector(2)
    assert isinstance(ad, SwiGLUAdapter)
    assert ad.gate_proj.weight.shape == (4, 32) and ad.up_proj.weight.shape == (4, 32)
    assert ad.down_proj.weight.shape == (32, 4)
    per_layer = (32 + 2 * 32 + 2 + 2 * 32 + 32 + 1) + (32 + 3 * 4 * 32)
    assert sum(p.numel() for p in sk.parameters()) == 3 * per_layer
    assert set(sk.routers.keys()) == {"1", "2", "3"} and set(sk.projectors.keys()) == {"1", "2", "3"}
    assert sk.prefix_shareable and not sk.identity_run
    validate_skipper(sk, num_layers=N_LAYERS, hidden_size=32)
    assert "flexidepth" in registered_skippers()
    built = build_skipper("flexidepth", routed_layers=[2], hidden_size=32, router_dim=4, adapter_dim=8)
    assert isinstance(built, FlexiDepthSkipper) and built.router_dim == 4 and built.routed_layers == (2,)
    with pytest.raises(ValueError, match="threshold"):
        FlexiDepthSkipper(ROUTED, 32, threshold=1.5)


def test_weights_in_unit_interval_and_run_iff_above_half():
    sk = FlexiDepthSkipper(ROUTED, 32, intermediate_size=64, init_logit=0.0, init_spread=3.0, seed=1)
    h = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 2.0
    for layer in ROUTED:
        w = sk.weight(layer, h)
        assert w.shape == (64,) and w.dtype == torch.float32
        assert bool(((w > 0) & (w < 1)).all())
        run = sk.route(layer, h, None)
        assert run.dtype == torch.bool and torch.equal(run, w > 0.5)
        assert 0 < int(run.sum()) < 64  # both decisions occur
    w3 = sk.weight(1, h.view(4, 16, 32))  # any leading shape
    assert w3.shape == (4, 16) and torch.allclose(w3.reshape(-1), sk.weight(1, h))
    # the initial bias sets where w starts
    high = FlexiDepthSkipper(ROUTED, 32, init_logit=2.0, init_spread=0.1)
    assert bool(high.route(1, h, None).all())


def test_output_formulas():
    sk = FlexiDepthSkipper(ROUTED, 32, intermediate_size=64, init_logit=0.0, init_spread=2.0, adapter_init_scale=1.0)
    g = torch.Generator().manual_seed(2)
    h, mid, mlp = (torch.randn(5, 32, generator=g) for _ in range(3))
    w = sk.weight(2, h)[:, None]
    torch.testing.assert_close(sk.project(2, h, None), h + (1 - w) * sk.projector(2)(h))
    torch.testing.assert_close(sk.run_epilogue(2, h, mid + mlp, None, hidden_mid=mid, mlp_out=mlp), mid + w * mlp)
    with pytest.raises(ValueError, match="mlp_out"):
        sk.run_epilogue(2, h, mid + mlp, None)
    # adapters start at zero by default: a skipped row starts as the identity
    fresh = FlexiDepthSkipper(ROUTED, 32)
    torch.testing.assert_close(fresh.project(1, h, None), h)


def test_for_model_copies_norms_and_defaults(base_model):
    sk = FlexiDepthSkipper.for_model(base_model)
    assert sk.routed_layers == (2, 3)  # second half of the layers
    layer = base_model.model.layers[3]
    torch.testing.assert_close(sk.router(3).norm.weight, layer.input_layernorm.weight)
    torch.testing.assert_close(sk.projector(3).norm.weight, layer.post_attention_layernorm.weight)
    with pytest.raises(ValueError, match="outside"):
        FlexiDepthSkipper.for_model(base_model, [N_LAYERS])


# -- checkpoint ------------------------------------------------------------------------------------------
def test_checkpoint_roundtrip(tmp_path, base_model):
    sk = _mixed_skipper(base_model)
    out = sk.save(tmp_path / "ck", extra={"num_hidden_layers": N_LAYERS, "base_model": "tiny", "train": {"x": 1}})
    meta = json.loads((out / "flexidepth.json").read_text())
    assert meta["format"] == "vskipper-flexidepth" and meta["routed_layers"] == list(ROUTED)
    assert (meta["hidden_size"], meta["router_dim"], meta["adapter_dim"]) == (32, 2, 4)
    assert meta["train"] == {"x": 1}
    loaded = load_flexidepth(out, base_model)
    assert loaded.routed_layers == sk.routed_layers and loaded.threshold == sk.threshold
    a, b = sk.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    h = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    for layer in ROUTED:
        assert torch.equal(loaded.route(layer, h, None), sk.route(layer, h, None))
    assert loaded.checkpoint_meta["base_model"] == "tiny"
    assert isinstance(build_skipper("flexidepth", checkpoint=out), FlexiDepthSkipper)
    # errors
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_flexidepth(tmp_path / "missing")
    wide = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4))
    with pytest.raises(ValueError, match="hidden_size"):
        load_flexidepth(out, wide)
    deep = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                        num_attention_heads=4))
    with pytest.raises(ValueError, match="trained for 4 layers"):
        load_flexidepth(out, deep)
    meta["version"] = 99
    (out / "flexidepth.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a vskipper-flexidepth v1"):
        load_flexidepth(out)


# -- execution -------------------------------------------------------------------------------------------
def test_training_forward_equals_routed_layers(base_model):
    """The training forward (both branches on full windows, hard routes) is the routed inference
    computation: same logits as the routed layers in plain PyTorch, and dense without a skipper."""
    sk = _mixed_skipper(base_model)
    routed = copy.deepcopy(base_model)
    bind_skipper(routed, sk)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        ref = flexidepth_forward(base_model, sk, ids)
        dense = flexidepth_forward(base_model, None, ids)
        torch.testing.assert_close(dense.logits, base_model(ids).logits, atol=1e-5, rtol=1e-5)
    got = plain_forward(routed, ids, DynamicCache(config=routed.config), request_id="a", prompt_len=ids.shape[1])
    torch.testing.assert_close(got, ref.logits, atol=1e-5, rtol=1e-5)
    skip = float((~ref.run).float().mean())
    assert 0.2 < skip < 0.8
    assert routed_context(routed).skip_ratio() == pytest.approx(skip, abs=1e-6)
    assert ref.weights.shape == (1, ids.shape[1], len(ROUTED))
    assert float(skip_penalty(ref.weights)) == pytest.approx(float(ref.weights.mean(-1).pow(2).mean()))


def _recompute_greedy(model, sk, prompt, n):
    """Independent reference: re-run the full-window FlexiDepth forward on the whole sequence per token."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            tok = int(flexidepth_forward(model, sk, torch.tensor([seq])).logits[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
    return out


def test_engine_matches_plain_routed_reference(base_model):
    sk = _mixed_skipper(base_model)
    routed = copy.deepcopy(base_model)
    bind_skipper(routed, sk)
    cb = routed_cb_config(page_size=16, num_blocks=32, max_batch_tokens=16, max_requests_per_batch=4)
    got = generate_greedy(routed, PROMPTS, max_new_tokens=NEW, cb_config=cb)
    ctx = routed_context(routed)
    ratios = (ctx.skip_ratio(0), ctx.skip_ratio(1))
    plain = [plain_greedy(routed, p, request_id=f"req_{i}", max_new_tokens=NEW) for i, p in enumerate(PROMPTS)]
    assert got == plain
    assert got == [_recompute_greedy(base_model, sk, p, NEW) for p in PROMPTS]
    dense = [plain_greedy(base_model, p, request_id="x", max_new_tokens=NEW) for p in PROMPTS]
    assert sum(g != d for g, d in zip(got, dense)) >= 2  # skipping changed the computation
    assert all(0.15 < r < 0.85 for r in ratios)  # Project-Only rows in prefill and decode
    # dense mode of the bound model is the base model (router not consulted)
    assert generate_greedy(routed, PROMPTS, max_new_tokens=NEW, mode="dense", cb_config=cb) == dense


# -- training --------------------------------------------------------------------------------------------
def _pattern_windows(n, length, seed):
    """Deterministic next-token process x' = (3 x + 7) mod 97 from random starts: learnable structure."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 97, (n, 1), generator=g)
    cols = [x]
    for _ in range(length - 1):
        cols.append((3 * cols[-1] + 7) % 97)
    return torch.cat(cols, 1)


def test_short_training_lowers_loss_and_penalty_moves_skip_ratio(base_model):
    train, val = _pattern_windows(64, 24, 0), _pattern_windows(8, 24, 1)
    common = dict(routed_layers=ROUTED, steps=40, batch_size=8, seq_len=24, lr=1e-2, eval_windows=8, log_every=10,
                  init_logit=0.0, init_spread=1.0, seed=5)
    model = copy.deepcopy(base_model)
    flags = [p.requires_grad for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    sk0, s0 = train_flexidepth(model, train, FlexiDepthTrainConfig(skip_alpha=0.0, **common), val_windows=val)
    assert s0["eval_lm_loss"] < s0["eval_lm_loss_before"] - 0.05
    assert s0["lm_loss_last"] < s0["lm_loss_first"]
    assert s0["seconds"] > 0 and s0["trainable_params"] == sum(p.numel() for p in sk0.parameters())
    assert len(s0["history"]) == 4 and set(s0["eval_skip_ratio_by_layer"]) == set(ROUTED)
    # the backbone is frozen and its flags restored
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert [p.requires_grad for p in model.parameters()] == flags
    _, s_hi = train_flexidepth(model, train, FlexiDepthTrainConfig(skip_alpha=20.0, **common), val_windows=val)
    assert s_hi["eval_skip_ratio"] > s0["eval_skip_ratio"] + 0.2
    assert s_hi["eval_mean_weight"] < s0["eval_mean_weight"]
    json.dumps(s0)  # JSON-able summary


def test_train_and_save_writes_loadable_checkpoint(tmp_path, base_model):
    model_dir = tmp_path / "model"
    base_model.save_pretrained(model_dir)
    stream = _pattern_windows(40, 16, 2).reshape(-1)
    cfg = FlexiDepthTrainConfig(routed_layers=(2, 3), steps=3, batch_size=4, seq_len=16, eval_windows=4)
    summary = train_and_save(model_dir, tmp_path / "ck", cfg, stream)
    assert summary["checkpoint"] == str(tmp_path / "ck") and summary["train_windows"] == 36
    sk = load_flexidepth(tmp_path / "ck", base_model)
    assert sk.routed_layers == (2, 3)
    meta = sk.checkpoint_meta
    assert meta["num_hidden_layers"] == N_LAYERS and meta["train"]["steps"] == 3
    assert meta["base_model"] == str(model_dir)
    with pytest.raises(ValueError, match="hold some out"):
        train_flexidepth(base_model, stream[: 16 * 4], cfg)
