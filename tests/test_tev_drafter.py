"""The DFlash-style block drafter (impl.tev.drafter): shapes, non-causal blocks, incremental context,
the batched training forward against single-block drafting, save/load, and a tiny training run."""

import json

import pytest
import torch

from impl.tev.drafter import (
    BlockDrafter,
    DrafterConfig,
    DrafterTrainConfig,
    block_loss,
    default_feature_layers,
    drafter_dir_for,
    position_weights,
    target_features,
    train_drafter,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def drafter(tiny_model):
    torch.manual_seed(0)
    return BlockDrafter(tiny_model, DrafterConfig(block_size=4, n_layers=2, init_std=0.2)).eval()


def _feats(tiny_model, drafter, ids):
    return target_features(tiny_model, ids, drafter.feature_layers)


def test_default_feature_layers():
    assert default_feature_layers(12) == (2, 6, 10)
    assert default_feature_layers(32, 5) == (2, 9, 16, 23, 30)
    assert default_feature_layers(2) == (2,)


def test_shapes_and_own_parameters_only(tiny_model, drafter):
    assert drafter.feature_layers == [2, 6, 10] and drafter.feature_dim == 3 * 32
    f = _feats(tiny_model, drafter, [3, 1, 4, 1, 5])
    assert f.shape == (5, 96)
    assert drafter.draft(f, 9).shape == (4, 97)
    assert drafter.draft(f[:0], 9).shape == (4, 97)  # empty context
    assert drafter.block_logits(f, [9, -1]).shape == (2, 97)
    target_ids = {id(p) for p in tiny_model.parameters()}
    assert not any(id(p) in target_ids for p in drafter.parameters())
    assert not any(k.startswith(("_shared", "embed", "lm_head")) for k in drafter.state_dict())
    with pytest.raises(ValueError, match="context features"):
        drafter.draft(torch.zeros(3, 7), 1)
    with pytest.raises(ValueError, match="feature_layers"):
        BlockDrafter(tiny_model, DrafterConfig(feature_layers=(0, 3)))


def test_target_features_match_the_depth_readout(tiny_model, drafter):
    from impl.models.depth import hidden_states_by_depth

    ids = [3, 1, 4, 1, 5, 9]
    hs = hidden_states_by_depth(tiny_model, torch.tensor([ids]))[:, 0]  # [L, S, h]
    want = torch.cat([hs[d - 1] for d in drafter.feature_layers], dim=-1)
    torch.testing.assert_close(_feats(tiny_model, drafter, ids), want)


def test_block_is_non_causal_and_context_matters(tiny_model, drafter):
    f = _feats(tiny_model, drafter, [3, 1, 4, 1, 5])
    with torch.no_grad():
        a = drafter.block_logits(f, [9, -1, -1, -1])
        b = drafter.block_logits(f, [9, -1, 7, -1])  # a later block position changes
        c = drafter.block_logits(f * 1.5 + 0.1, [9, -1, -1, -1])
    assert not torch.allclose(a[0], b[0]) and not torch.allclose(a[1], b[1])  # earlier rows see it
    assert not torch.allclose(a, c)
    torch.testing.assert_close(a, drafter.draft(f, 9).detach())


def test_incremental_context_equals_full_context(tiny_model, drafter):
    f = _feats(tiny_model, drafter, [3, 1, 4, 1, 5, 9, 2])
    with torch.no_grad():
        ctx = drafter.init_context(f[:3])
        drafter.extend_context(ctx, f[3:5])
        drafter.extend_context(ctx, f[5:])
        torch.testing.assert_close(drafter.draft_from_context(ctx, 6), drafter.draft(f, 6), atol=1e-5, rtol=1e-5)
    assert ctx.length == 7


def test_training_forward_equals_single_block_drafts(tiny_model, drafter):
    """The batched, masked training pass gives every anchored block exactly what ``draft`` gives with
    the context cut at the anchor (the block mask is right)."""
    seqs = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8]]
    T = max(map(len, seqs))
    ids = torch.zeros(2, T, dtype=torch.long)
    feats = torch.zeros(2, T, drafter.feature_dim)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        feats[i, :len(s)] = _feats(tiny_model, drafter, s)
    anchors = torch.tensor([[0, 4, 8], [5, 2, 1]])
    with torch.no_grad():
        out = drafter(feats, ids, anchors, torch.tensor([len(s) for s in seqs]))
        assert out.shape == (2, 3, 4, 97)
        for b, s in enumerate(seqs):
            for j, a in enumerate(anchors[b].tolist()):
                want = drafter.draft(feats[b, :a], s[a])
                torch.testing.assert_close(out[b, j], want, atol=1e-4, rtol=1e-4)


def test_position_weights_and_loss():
    w = position_weights(4, 2.0)
    torch.testing.assert_close(w, torch.exp(-torch.arange(4.0) / 2.0))
    assert position_weights(3, None).tolist() == [1.0, 1.0, 1.0]
    logits = torch.zeros(1, 2, 4, 5)
    labels = torch.tensor([[[1, 2, -100, -100], [0, 0, 0, 0]]])
    # uniform logits: every valid CE is log 5, whatever the weights
    assert abs(float(block_loss(logits, labels, w)) - float(torch.log(torch.tensor(5.0)))) < 1e-6
    logits[0, 0, 0, 1] = 10.0  # depth-1 of block 0 right and confident: weighted mean drops
    assert float(block_loss(logits, labels, w)) < float(torch.log(torch.tensor(5.0)))


def test_save_load_roundtrip(tiny_model, drafter, tmp_path):
    f = _feats(tiny_model, drafter, [3, 1, 4, 1, 5])
    d = drafter.save(tmp_path / "drafter")
    meta = json.loads((d / "drafter_config.json").read_text())
    assert meta["config"]["feature_layers"] == [2, 6, 10] and meta["target"]["vocab_size"] == 97
    loaded = BlockDrafter.load(d, tiny_model)
    assert loaded.config == drafter.config
    with torch.no_grad():
        assert torch.equal(loaded.draft(f, 9), drafter.draft(f, 9))
    with pytest.raises(FileNotFoundError):
        BlockDrafter.load(tmp_path / "nope", tiny_model)
    assert drafter_dir_for("models/tiny-ls").as_posix() == "models/tiny-ls-drafter"
    from transformers import LlamaForCausalLM

    from impl.models.tiny import TinyArch

    other = LlamaForCausalLM(TinyArch(num_layers=12, hidden_size=32, num_heads=4, intermediate_size=64,
                                      max_position_embeddings=64).to_hf_config(vocab_size=50, eos_token_id=0))
    with pytest.raises(ValueError, match="vocab_size"):
        BlockDrafter.load(d, other)


def test_fingerprint_names_the_weights_bit_for_bit(tiny_model, drafter, tmp_path):
    fp = drafter.fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert BlockDrafter.load(drafter.save(tmp_path / "d"), tiny_model).fingerprint() == fp  # saved and loaded: the same
    with torch.no_grad():
        drafter.norm.weight[0] = torch.nextafter(drafter.norm.weight[0], torch.tensor(2.0))  # one ulp in one weight
    assert drafter.fingerprint() != fp
    torch.manual_seed(0)
    twin = BlockDrafter(tiny_model, DrafterConfig(block_size=4, n_layers=2, init_std=0.2))
    assert twin.fingerprint() == fp  # the same seeded initialisation


def test_tiny_training_run_decreases_loss(tiny_model):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 97, (int(torch.randint(3, 8, (), generator=g)),), generator=g).tolist()
               for _ in range(10)]
    before = [p.detach().clone() for p in tiny_model.parameters()]
    cfg = DrafterTrainConfig(drafter=DrafterConfig(block_size=4, n_layers=1), rollout_new_tokens=24, steps=40,
                             batch_size=4, anchors_per_seq=8, lr=3e-3, warmup_steps=5, heldout_fraction=0.2,
                             log_every=0)
    drafter, summary = train_drafter(tiny_model, prompts, cfg)
    losses = summary["losses"]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert summary["heldout_after"]["loss"] < summary["heldout_before"]["loss"]
    acc = summary["heldout_after"]["accuracy"]
    assert len(acc) == 4 and all(0.0 <= a <= 1.0 for a in acc)
    assert 1.0 <= summary["heldout_after"]["chain_tau"] <= 5.0
    assert summary["n_train"] == 8 and summary["n_heldout"] == 2
    assert set(summary["seconds"]) == {"rollouts", "features", "train", "eval", "total"}
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))  # target frozen
    assert all(p.grad is None for p in tiny_model.parameters())
    assert not drafter.training


def test_batched_greedy_rollouts_follow_the_target_and_stop_at_eos(tiny_model):
    """Greedy rollouts batched through transformers' generate (left padding) give the batch-1 AR decode's
    ids on the tiny target, in prompt order, cut after the first EOS; ``batch_size=1`` keeps the exact path."""
    from impl.spec.ar import ar_decode
    from impl.tev.drafter import batched_greedy_rollouts, make_rollouts

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 7, 5, 9, 4)]
    ref = [(p + ar_decode(tiny_model, p, 12).tokens, len(p)) for p in prompts]
    assert batched_greedy_rollouts(tiny_model, prompts, 12, None, batch_size=3) == ref
    eos = ref[1][0][len(prompts[1]) + 4]  # a token prompt 1 generates at its 5th step: it must stop there
    stopped = batched_greedy_rollouts(tiny_model, prompts, 12, eos, batch_size=5)
    want = [(p + ar_decode(tiny_model, p, 12, eos_token_id=eos).tokens, len(p)) for p in prompts]
    assert stopped == want and len(stopped[1][0]) <= len(prompts[1]) + 5
    layers = (2, 4)
    a = make_rollouts(tiny_model, prompts, layers, new_tokens=12, batch_size=4)
    b = make_rollouts(tiny_model, prompts, layers, new_tokens=12, progress=True)  # bars change nothing
    assert a.sequences == b.sequences == ref
    with pytest.raises(ValueError, match="batch_size"):
        make_rollouts(tiny_model, prompts, layers, new_tokens=4, batch_size=0)
