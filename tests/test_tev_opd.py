"""Draft-OPD (impl.tev.opd): greedy verification and replay anchors on hand-built blocks, the forward
KL against a direct sum, the target rows on padded rollouts against unpadded forwards, and training:
the OPD objective lowers the KL it distils on replayed blocks below the token-only control's, from
the same init and the same draws."""

import math

import pytest
import torch

from impl.tev.drafter import _block_labels, _pad_batch, position_weights
from impl.tev.opd import forward_kl_loss, replay_anchors, rollout_target_logits
from impl.tev.train import ExitTrainConfig, train_exittrain

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _onehot_rows(tokens, V=10):
    """[A, H, V] logits whose argmax row k is tokens[a][k]."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float() * 5.0


def test_replay_anchors_hand_built():
    # one rollout of 12 tokens; H = 3; anchors 2, 4, 8, 10
    seq = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]])
    lengths = torch.tensor([12])
    anchors = torch.tensor([[2, 4, 8, 10]])
    labels = _block_labels(seq, anchors, lengths, 3)  # a=2: 4 5 6; a=4: 6 7 8; a=8: 1 2 3; a=10: 3 -100 -100
    assert labels[0, 3].tolist() == [3, -100, -100]
    drafts = [[4, 5, 0],   # two accepted, rejected at depth 3 -> replay from 2 + 2 + 1 = 5
              [0, 7, 8],   # rejected at depth 1 (later matches do not count) -> replay from 5
              [1, 2, 3],   # all accepted: nothing to replay
              [3, 0, 0]]   # accepted up to the rollout's end: nothing to replay
    logits = _onehot_rows(drafts).unsqueeze(0)  # [1, 4, 3, V]
    replay, replayed, accepted = replay_anchors(logits, labels, anchors, lengths)
    assert accepted.tolist() == [[2, 0, 3, 1]]
    assert replayed.tolist() == [[True, True, False, False]]
    assert replay.tolist() == [[5, 5, 11, 11]]  # not replayed: length - 1, an anchor without labels
    # a rejection whose replay anchor would have no label left is not replayed
    late = replay_anchors(_onehot_rows([[0, 0, 0]]).unsqueeze(0), _block_labels(seq, torch.tensor([[10]]), lengths, 3),
                          torch.tensor([[10]]), lengths)
    assert late[1].tolist() == [[False]] and late[2].tolist() == [[0]]
    with pytest.raises(ValueError, match="shapes"):
        replay_anchors(logits[:, :2], labels, anchors, lengths)


def test_forward_kl_loss_equals_the_direct_sum():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 4, 7, generator=g, requires_grad=True)  # [B, A, H, V]
    t = torch.randn(2, 3, 4, 7, generator=g)
    valid = torch.rand(2, 3, 4, generator=g) > 0.3
    w = position_weights(4, 2.0)
    T = 0.7
    num = den = 0.0
    for idx in torch.nonzero(valid).tolist():
        b, a, k = idx
        p = torch.softmax(t[b, a, k] / T, -1).double()
        q = torch.softmax(z[b, a, k].detach(), -1).double()
        num += float(w[k]) * float((p * (p.log() - q.log())).sum())
        den += float(w[k])
    got = forward_kl_loss(z, t, valid, w, T)
    assert float(got.detach()) == pytest.approx(num / den, rel=1e-5)
    got.backward()
    assert z.grad is not None and float(z.grad[~valid].abs().sum()) == 0.0  # invalid rows get no gradient
    # T = 0: the CE of the target's greedy token
    ce = forward_kl_loss(z.detach(), t, valid, torch.ones(4), 0.0)
    lq = torch.log_softmax(z.detach(), -1)
    direct = -lq.gather(-1, t.argmax(-1, keepdim=True)).squeeze(-1)[valid].mean()
    assert float(ce) == pytest.approx(float(direct), rel=1e-5)
    assert float(forward_kl_loss(z, t, torch.zeros_like(valid), w, 1.0)) == 0.0
    with pytest.raises(ValueError, match="temperature"):
        forward_kl_loss(z, t, valid, w, -1.0)


def test_rollout_target_logits_equal_unpadded_forwards(tiny_model):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (9, 14)]
    ids, _, _ = _pad_batch([(s, 1) for s in seqs], [torch.zeros(len(s), 2) for s in seqs], "cpu")
    positions = torch.tensor([[[0, 3], [7, 8]], [[2, 5], [12, 13]]])  # [B, A, H]
    got = rollout_target_logits(tiny_model, ids, positions)
    assert got.shape == (2, 2, 2, 97) and not got.requires_grad
    with torch.no_grad():
        for b, s in enumerate(seqs):
            ref = tiny_model(torch.tensor([s])).logits[0]
            for a in range(2):
                for k in range(2):
                    assert torch.allclose(got[b, a, k], ref[int(positions[b, a, k])], atol=1e-4)


@pytest.fixture(scope="module")
def trained(tiny_model):
    from conftest import token_trained_drafter

    return token_trained_drafter(tiny_model, 0.0)  # greedy rollouts: verification against them is the target's


def _replayed_kl(target, drafter, data, T: float) -> float:
    """Forward KL of the drafter on the blocks replayed from every response anchor of the training
    rollouts (where its own greedy block was rejected)."""
    num = den = 0.0
    H = drafter.block_size
    w = torch.ones(H)
    with torch.no_grad():
        for i in data.train_idx:
            s, p = data.sequences[i]
            ids, fts, lengths = _pad_batch([(s, p)], [data.features[i]], "cpu")
            anchors = torch.tensor([list(range(p - 1, len(s) - 1))])
            labels = _block_labels(ids, anchors, lengths, H)
            replay, replayed, _ = replay_anchors(drafter(fts, ids, anchors, lengths), labels, anchors, lengths)
            valid = (_block_labels(ids, replay, lengths, H) != -100) & replayed.unsqueeze(-1)
            tgt = rollout_target_logits(target, ids, replay.unsqueeze(-1) + torch.arange(H))
            n = float(valid.sum())
            if n:
                num += float(forward_kl_loss(drafter(fts, ids, replay, lengths), tgt, valid, w, T)) * n
                den += n
    return num / den


def test_opd_lowers_the_replayed_kl_below_token_only(tiny_model, trained):
    """30 steps from the same token-trained init on the same draws: Draft-OPD's drafter has a lower
    forward KL to the target on its own replayed blocks than the token-only control's (the quantity
    it distils; evaluated on every anchor of the training rollouts)."""
    drafter, data = trained
    cfg = ExitTrainConfig(steps=30, batch_size=4, anchors_per_seq=8, lr=3e-3, warmup_steps=2, lambda_opd=1.0,
                          target_temperature=1.0, eval_contexts_per_seq=0, eval_prompts=0, eval_before=False,
                          log_every=0)
    kl = {}
    for obj in ("token", "opd"):
        d, s = train_exittrain(tiny_model, drafter, data, cfg, obj)
        kl[obj] = _replayed_kl(tiny_model, d, data, 1.0)
        assert math.isfinite(kl[obj])
    assert s["data_order_sha1"] and len(s["losses"]["opd"]) == 30
    assert kl["opd"] < kl["token"] - 1e-3, kl
    assert all(q.grad is None for q in tiny_model.parameters())
