"""Inducing adapters (DEX App. C.2): size, initialisation, persistence, training, and that DEX with
adapters stays lossless."""

import numpy as np
import pytest
import torch

from impl.models.adapter_train import AdapterTrainConfig, agreement, train_adapters
from impl.models.adapters import (InducingAdapter, adapter_param_count, load_adapters, new_adapters, save_adapters,
                                  select_adapters)


def test_parameter_count_matches_paper():
    for h in (32, 128, 8192):
        assert adapter_param_count(h) == 4 * h * h + 4 * h + 1
    a = InducingAdapter(32)
    assert sum(p.numel() for p in a.parameters()) == 4 * 32 * 32 + 4 * 32 + 1


def test_alpha_init_keeps_adapter_near_identity():
    torch.manual_seed(0)
    a = InducingAdapter(32)
    assert a.alpha.item() == pytest.approx(1e-3)
    h = torch.randn(3, 5, 32)
    out = a(h)
    assert out.shape == h.shape
    assert 0 < (out - h).abs().max() < 1e-2
    with torch.no_grad():
        a.alpha.fill_(0.0)
    assert torch.equal(a(h), h)


def test_save_load_roundtrip(tiny_model, tmp_path):
    ad = new_adapters(tiny_model, [3, 6, 9], seed=1)
    with torch.no_grad():
        for a in ad.values():
            a.alpha.fill_(0.5)
    save_adapters(ad, tmp_path / "ad", {"note": "x"})
    back = load_adapters(tmp_path / "ad", tiny_model)
    assert sorted(back) == [3, 6, 9]
    h = torch.randn(4, 32)
    for d in ad:
        assert torch.allclose(ad[d](h), back[d](h))


def test_bad_depths_and_missing_files(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="outside"):
        new_adapters(tiny_model, [12])
    with pytest.raises(FileNotFoundError, match="train-adapters"):
        load_adapters(tmp_path / "nope")
    ad = new_adapters(tiny_model, [4, 8])
    with pytest.raises(ValueError, match="needs adapters at depths \\[6\\]"):
        select_adapters(ad, (6, 12))
    assert sorted(select_adapters(ad, (4, 8, 12))) == [4, 8]
    assert select_adapters(None, (4, 8, 12)) == {}


def test_training_reduces_kl_and_leaves_backbone(tiny_model):
    rng = np.random.default_rng(0)
    toks = rng.integers(1, 97, size=6000).astype(np.int32)
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    cfg = AdapterTrainConfig(steps=40, batch_size=4, seq_len=32, lr=1e-2, position_fraction=1.0, eval_windows=8, threads=1)
    ad, summary = train_adapters(tiny_model, [4, 8], toks[:5000], toks[5000:], cfg, progress=False)
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for d in ("4", "8"):
        assert summary["after"][d]["kl"] < summary["before"][d]["kl"]
    assert summary["parameters_per_adapter"] == 4 * 32 * 32 + 4 * 32 + 1
    again = agreement(tiny_model, ad, toks[5000:], [4, 8], 32, 8)
    assert again[4]["kl"] == pytest.approx(summary["after"]["4"]["kl"], rel=1e-5)
    assert all(p.requires_grad for p in tiny_model.parameters())  # flags restored


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dex_with_adapters_is_lossless(tiny_model, temperature):
    from impl.dex import DEXDecoder, ReferenceExecutor
    from impl.spec.ar import ar_decode
    from impl.spec.sampling import DecodeRule

    ad = new_adapters(tiny_model, [3, 6, 9], alpha_init=2.0, seed=3)  # large gate: proposals really change
    rule = DecodeRule(temperature, seed=5)
    prompt = [5, 17, 42, 8, 33]
    ref = ar_decode(tiny_model, prompt, 20, rule=rule).tokens
    plain = DEXDecoder(ReferenceExecutor(tiny_model, (3, 6, 9, 12), rule=rule)).decode(prompt, 20)
    res = DEXDecoder(ReferenceExecutor(tiny_model, (3, 6, 9, 12), rule=rule, adapters=ad)).decode(prompt, 20)
    assert res.tokens == ref == plain.tokens
    assert [m.anchor_cands for m in res.metrics] != [m.anchor_cands for m in plain.metrics]


def test_adapters_refused_for_another_model(tiny_model, tmp_path):
    """The set records its backbone's fingerprint; a model with other weights (same architecture)
    is refused, the backbone itself accepted."""
    import copy

    ad = new_adapters(tiny_model, [3, 6], seed=1)
    save_adapters(ad, tmp_path / "ad", {"model_dir": "models/x"}, model=tiny_model)
    assert sorted(load_adapters(tmp_path / "ad", tiny_model)) == [3, 6]
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        other.get_output_embeddings().weight.add_(0.01)
    with pytest.raises(ValueError, match="trained on another model"):
        load_adapters(tmp_path / "ad", other)
