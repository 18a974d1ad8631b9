"""ExitTrain (impl.tev.train): the App. C.2 row form of L_exit against the direct Eq. 14 sum, the
prefix-weighted control's rescaling (Sec. 6.2), target rows under real tree-parent contexts, detached
weights and drafter-only gradients, identical data across objectives, and a short run on a tiny random
target where exit-guided training raises the tree coverage over token-only fine-tuning."""

import pytest
import torch

from impl.tev.drafter import (
    DrafterConfig,
    DrafterTrainConfig,
    _pad_batch,
    make_rollouts,
    train_drafter,
)
from impl.tev.exit_law import exit_law
from impl.tev.train import (
    ExitTrainConfig,
    evaluate_trees,
    exit_loss,
    prefix_weights,
    target_rows_to_probs,
    train_exittrain,
    tree_target_logits,
)
from impl.tev.builder import best_first_tree
from impl.tev.tree import DraftTree

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hand_trees():
    # tree A (context 0): r -> 5 -> {2, 7}, r -> 3 -> 1;  tree B (context 1): r -> 4 -> 4 -> 0
    a = DraftTree.from_paths([[5, 2], [5, 7], [3, 1]], root_token=9)
    b = DraftTree.from_paths([[4, 4, 0]], root_token=8)
    return a, b


def _random_probs(n, V, g):
    return torch.softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 2, -1)


def test_exit_loss_row_form_equals_naive_sum():
    g = torch.Generator().manual_seed(0)
    V, H = 11, 3
    trees = _hand_trees()
    # drafter rows: context i, future position k -> row i * H + k
    z = torch.randn(len(trees) * H, V, generator=g, dtype=torch.float64).float().requires_grad_(True)
    rows, toks, oms, naive = [], [], [], 0.0
    n_nodes = 0
    for i, t in enumerate(trees):
        _, _, w = exit_law(t.parents, t.tokens, _random_probs(len(t), V, g))
        for v in range(1, len(t)):
            r = i * H + t.depths[v] - 1
            rows.append(r)
            toks.append(t.tokens[v])
            oms.append(float(w[v]))
            # Eq. 14 numerator term, directly: -w(v) log q_{depth(v)}(x_v | c_i)
            naive = naive - w[v] * torch.log_softmax(z[r].double(), -1)[t.tokens[v]]
        n_nodes += len(t) - 1
    naive = naive / n_nodes
    loss = exit_loss(z, torch.tensor(rows), torch.tensor(toks), torch.tensor(oms, dtype=torch.float64), n_nodes)
    torch.testing.assert_close(loss.double(), naive, rtol=1e-5, atol=1e-6)
    g1, = torch.autograd.grad(loss, z)
    g2, = torch.autograd.grad(naive, z)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)
    # nodes at one depth of one context share one row (one log-normaliser): rows 0 (5, 3) and 1 (2, 7, 1)
    assert rows[:5] == [0, 1, 1, 0, 1]
    # the default denominator is the node count; no nodes -> 0 with a graph
    torch.testing.assert_close(exit_loss(z, torch.tensor(rows), torch.tensor(toks), torch.tensor(oms)), loss)
    empty = exit_loss(z, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0))
    assert float(empty.detach()) == 0.0 and empty.requires_grad
    with pytest.raises(ValueError, match="outside"):
        exit_loss(z, torch.tensor([99]), torch.tensor([0]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="non-negative"):
        exit_loss(z, torch.tensor([0]), torch.tensor([0]), torch.tensor([-1.0]))


def test_prefix_rescaling_hand_built():
    # r -> a (p_r(a) = .6), r -> b (.3); a -> c (p_a(c) = .5); V = 4 tokens: a=0, b=1, c=2, other=3
    t = DraftTree([-1, 0, 0, 1], [3, 0, 1, 2])
    probs = torch.tensor([[.6, .3, 0., .1], [0., 0., .5, .5], [.25, .25, .25, .25], [.25, .25, .25, .25]])
    P, rho, w = exit_law(t.parents, t.tokens, probs)
    torch.testing.assert_close(P, torch.tensor([1., .6, .3, .3], dtype=torch.float64))
    torch.testing.assert_close(w, torch.tensor([.1, .3, .3, .3], dtype=torch.float64))
    # Sec. 6.2: P rescaled to the total non-root exit weight (0.9) over C_p = 1.2 -> factor 0.75
    om, = prefix_weights([P], [w], "tree")
    torch.testing.assert_close(om, torch.tensor([.45, .225, .225], dtype=torch.float64))
    assert abs(float(om.sum()) - float(w[1:].sum())) < 1e-12
    # a second tree: r -> x only, p_r(x) = 0.5 -> P = [1, .5], w = [.5, .5]: already matched (factor 1)
    t2 = DraftTree([-1, 0], [3, 0])
    P2, _, w2 = exit_law(t2.parents, t2.tokens, torch.tensor([[.5, .5, 0, 0], [.25] * 4]))
    a, b = prefix_weights([P, P2], [w, w2], "tree")
    torch.testing.assert_close(b, torch.tensor([.5], dtype=torch.float64))
    # batch scope: one factor (0.9 + 0.5) / (1.2 + 0.5)
    a, b = prefix_weights([P, P2], [w, w2], "batch")
    f = 1.4 / 1.7
    torch.testing.assert_close(torch.cat([a, b]), torch.tensor([.6, .3, .3, .5], dtype=torch.float64) * f)
    # C_p = 0 (T = 0 row whose argmax is not drafted): all-zero weights, no division by zero
    P0, _, w0 = exit_law(t2.parents, t2.tokens, torch.tensor([[0., 1., 0., 0.], [1., 0., 0., 0.]]))
    z0, = prefix_weights([P0], [w0])
    assert float(z0.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="scope"):
        prefix_weights([P], [w], "node")


def test_tree_rows_are_the_target_under_real_tree_parent_contexts(tiny_model):
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(1, 97, (20,), generator=g).tolist()
    anchors = [5, 12, 19]
    trees = [best_first_tree(torch.randn(3, 97, generator=g) * 3, 6, 3, root_token=seq[a]) for a in anchors]
    other = DraftTree(list(trees[0].parents), [seq[8]] + trees[0].tokens[1:])  # a second sequence
    groups = [(seq, list(zip(anchors, trees))), (seq[:9], [(8, other)])]
    for max_rows in (1024, 14, 5):  # two padded rows; pieces of two trees; one tree per forward
        out = tree_target_logits(tiny_model, groups, max_tree_rows=max_rows)
        for (s, items), lg in zip(groups, out):
            for (a, tree), l in zip(items, lg):
                assert l.shape == (len(tree), 97)
                for v in range(len(tree)):
                    ids = s[:a + 1] + tree.path_tokens(v)
                    with torch.no_grad():
                        want = tiny_model(torch.tensor([ids])).logits[0, -1]
                    torch.testing.assert_close(l[v], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="root token"):
        tree_target_logits(tiny_model, [(seq, [(5, DraftTree([-1], [seq[5] + 1]))])])
    p0 = target_rows_to_probs(torch.tensor([[1., 3., 3.]]), 0.0)
    assert p0.tolist() == [[0., 1., 0.]]


@pytest.fixture(scope="module")
def setup(tiny_model):
    from conftest import token_trained_drafter

    return token_trained_drafter(tiny_model, 1.0)


def _cfg(**kw):
    base = dict(steps=3, batch_size=4, anchors_per_seq=8, tree_contexts_per_seq=4, budget=8, lambda_exit=64.0,
                lr=3e-3, warmup_steps=2, eval_budgets=(8,), eval_temperatures=(0.0, 1.0), eval_contexts_per_seq=4,
                eval_prompts=1, eval_new_tokens=8, log_every=0)
    base.update(kw)
    return ExitTrainConfig(**base)


def test_weights_detached_and_gradients_reach_only_the_drafter(tiny_model, setup):
    drafter, data = setup
    i = data.train_idx[0]
    s, p = data.sequences[i]
    ids, fts, lengths = _pad_batch([(s, p)], [data.features[i]], "cpu")
    anchors = torch.tensor([[p - 1, p + 3]])
    drafter.zero_grad(set_to_none=True)
    drafter.train()
    logits = drafter(fts, ids, anchors, lengths)[0]  # [2, H, V], with gradient
    trees = [best_first_tree(logits[j].detach(), 8, 4, root_token=s[int(a)]) for j, a in enumerate(anchors[0])]
    lg = tree_target_logits(tiny_model, [(s, list(zip(anchors[0].tolist(), trees)))])[0]
    assert not any(x.requires_grad for x in lg)  # target rows carry no graph
    rows, toks, oms = [], [], []
    for j, (t, l) in enumerate(zip(trees, lg)):
        _, _, w = exit_law(t.parents, t.tokens, target_rows_to_probs(l, 1.0))
        assert not w.requires_grad
        rows += [j * 4 + d - 1 for d in t.depths[1:]]
        toks += t.tokens[1:]
        oms.append(w[1:])
    om = torch.cat(oms).clone().requires_grad_(True)  # even a weight that asks for a gradient gets none
    loss = exit_loss(logits.reshape(-1, 97), torch.tensor(rows), torch.tensor(toks), om)
    loss.backward()
    assert om.grad is None
    assert all(q.grad is None for q in tiny_model.parameters())
    grads = [q.grad for q in drafter.parameters()]
    assert all(gr is not None for gr in grads) and sum(float(gr.abs().sum()) for gr in grads) > 0
    drafter.zero_grad(set_to_none=True)
    drafter.eval()


def test_objectives_share_init_and_data_order(tiny_model, setup):
    drafter, data = setup
    init = {k: v.clone() for k, v in drafter.state_dict().items()}
    target_before = [q.detach().clone() for q in tiny_model.parameters()]
    sums = {}
    for obj in ("token", "exit", "prefix", "opd"):
        d, s = train_exittrain(tiny_model, drafter, data, _cfg(), obj)
        sums[obj] = s
        assert d is not drafter and not d.training
        assert len(s["losses"]["total"]) == 3
        assert len(s["losses"]["exit"]) == (3 if obj in ("exit", "prefix") else 0)
        assert len(s["losses"]["opd"]) == (3 if obj == "opd" else 0)
        for key in ("teacher_forced", "tree_tau", "decode"):
            assert key in s["after"]
        assert set(s["after"]["tree_tau"]["B8"]) == {"T0", "T1"}
        assert 1.0 <= s["after"]["decode"]["B8"]["T0"]["mean_tau"] <= 5.0
        assert set(s["seconds"]) == {"drafter", "trees", "replay", "train", "eval", "total"}
    first = sums["token"]["first_batch"]
    assert first["anchors"] and all(len(r) == 8 for r in first["anchors"])
    assert sums["opd"]["per_step"]["trees"] == 0 and sums["opd"]["seconds"]["replay"] > 0
    assert len(sums["opd"]["train_chain_tau"]) == 3 and all(0 <= x <= 1 for x in sums["opd"]["replay_share"])
    for obj in ("exit", "prefix", "opd"):
        assert sums[obj]["first_batch"] == first
        assert sums[obj]["data_order_sha1"] == sums["token"]["data_order_sha1"]
        assert sums[obj]["before"] == sums["token"]["before"]  # the same initial drafter
        if obj != "opd":
            assert sums[obj]["per_step"]["trees"] == 16 and sums[obj]["per_step"]["tree_rows"] > 16
    assert sums["token"]["per_step"]["trees"] == 0 and sums["token"]["seconds"]["trees"] == 0.0
    # same first-step token loss (same init, same batch); the init itself is untouched
    assert sums["exit"]["losses"]["token"][0] == pytest.approx(sums["token"]["losses"]["token"][0], rel=1e-6)
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in init.items())
    assert all(torch.equal(a, b) for a, b in zip(target_before, tiny_model.parameters()))
    assert all(q.grad is None for q in tiny_model.parameters())
    with pytest.raises(ValueError, match="objective"):
        train_exittrain(tiny_model, drafter, data, _cfg(), "kl")
    with pytest.raises(ValueError, match="tree_contexts_per_seq"):
        train_exittrain(tiny_model, drafter, data, _cfg(tree_contexts_per_seq=9), "exit")


def test_exit_training_raises_tree_coverage_over_token_only(tiny_model, setup):
    """30 steps from the same token-trained init on the same draws: the exit-guided drafter's trees
    cover more target mass (mean 1 + C_p at T = 1, and the greedy block length at T = 0) on the
    training contexts than the token-only control's. Measured T = 1 margins over data seeds 0-3:
    +0.005..+0.024 for lambda_exit = 64; lambda_exit = 1 changes nothing visible (L_exit ~ CE / B)."""
    drafter, data = setup
    cfg = _cfg(steps=30, eval_contexts_per_seq=0, eval_prompts=0, eval_before=False, budget=8)
    res = {}
    for obj in ("token", "exit"):
        d, _ = train_exittrain(tiny_model, drafter, data, cfg, obj)
        res[obj] = evaluate_trees(tiny_model, d, data, data.train_idx, budgets=(8,), depth=4,
                                  temperatures=(0.0, 1.0), contexts_per_seq=8)["B8"]
    assert res["exit"]["T1"] > res["token"]["T1"] + 0.003, res
    assert res["exit"]["T0"] >= res["token"]["T0"], res


def test_shared_rollouts_reproduce_train_drafter(tiny_model):
    """train_drafter on precomputed RolloutData equals its own rollouts (greedy: same data, same draws)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 97, (4,), generator=g).tolist() for _ in range(5)]
    dcfg = DrafterConfig(block_size=3, n_layers=1)
    cfg = DrafterTrainConfig(drafter=dcfg, rollout_new_tokens=10, steps=4, batch_size=2, anchors_per_seq=4,
                             heldout_fraction=0.2, log_every=0)
    d1, s1 = train_drafter(tiny_model, prompts, cfg)
    data = make_rollouts(tiny_model, prompts, d1.feature_layers, new_tokens=10, heldout_fraction=0.2)
    assert len(data.train_idx) == 4 and data.heldout_idx == [4] and data.rollout_tokens == 50
    d2, s2 = train_drafter(tiny_model, None, cfg, data=data)
    assert s1["losses"] == s2["losses"] and s1["heldout_after"] == s2["heldout_after"]
    assert all(torch.equal(a, b) for a, b in zip(d1.state_dict().values(), d2.state_dict().values()))
    bad = make_rollouts(tiny_model, prompts, (1, 2), new_tokens=2)
    with pytest.raises(ValueError, match="layers"):
        train_drafter(tiny_model, None, cfg, data=bad)
    with pytest.raises(ValueError, match="layers"):
        train_exittrain(tiny_model, d1, bad, _cfg(), "token")


def test_tev_train_dex_head_trains_only_the_base_drafter(tmp_path, tiny_tokenizer, data_dir):
    """``tev-train --dex-head`` (rule train_head): the base drafter alone, with dex.speculative.dflash.drafter's
    settings, under the layout the DEX cell reads (``<dir>/base``); without those settings one clear line."""
    import json

    from conftest import save_wide_llama, smoke_config

    from impl.cli import main

    target = save_wide_llama(tmp_path / "model", tiny_tokenizer)
    head = {"block_size": 3, "n_layers": 1, "prompts": 4, "prompt_max_tokens": 16, "rollout_new_tokens": 4,
            "steps": 2, "batch_size": 2, "threads": 1}
    cfg = smoke_config(data_dir=str(data_dir), dex={"speculative": {"dflash": {"objective": "base", "depth": 3,
                                                                               "drafter": head}}})
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    out, summ = tmp_path / "head", tmp_path / "head.json"
    main(["tev-train", "--dex-head", "--config-json", f"@{tmp_path / 'cfg.json'}", "--quiet", "--model-dir",
          str(tmp_path / "model"), "--out", str(out), "--summary", str(summ)])
    s = json.loads(summ.read_text())
    assert s["drafters"] == ["base"] and s["n_prompts"] == 4 and sorted(p.name for p in out.iterdir()) == ["base"]
    from impl.tev.drafter import BlockDrafter

    assert BlockDrafter.load(out / "base", target).block_size == 3
    from impl.report.dex import head_table

    t = head_table([s]).iloc[0]  # the report's dex_head row
    assert t["block_size"] == 3 and t["n_prompts"] == 4 and t["steps"] == 2 and t["chain_tau_after"] >= 1.0
    cfg["dex"]["speculative"]["dflash"]["drafter"] = None
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="dex.speculative.dflash.drafter is not set"):
        main(["tev-train", "--dex-head", "--config-json", f"@{tmp_path / 'cfg.json'}", "--quiet", "--model-dir",
              str(tmp_path / "model"), "--out", str(tmp_path / "x"), "--summary", str(tmp_path / "x.json")])


def test_tev_train_writes_every_objective_and_the_learning_curve(tmp_path, tiny_tokenizer, data_dir):
    """``tev-train`` (rule tev_train): base + the four fine-tuned drafters (Draft-OPD included) under one
    directory, and the base drafter's held-out learning curve at curve_steps (step 0 first, the last at
    ``steps``), each point with the tree tau of the main cells' B at T = 0."""
    import json

    from conftest import save_wide_llama, smoke_config

    from impl.cli import main
    from impl.tev.drafter import curve_steps

    save_wide_llama(tmp_path / "model", tiny_tokenizer)
    cfg = smoke_config(data_dir=str(data_dir))
    cfg["dex"]["speculative"]["dflash"] = None
    cfg["tev"].update(budget=6, depth=3,
                      drafter={**cfg["tev"]["drafter"], "block_size": 3, "prompts": 6, "prompt_max_tokens": 16,
                               "rollout_new_tokens": 6, "steps": 6, "batch_size": 2, "threads": 1, "curve_points": 3},
                      exittrain={**cfg["tev"]["exittrain"], "steps": 2, "batch_size": 2, "budget": 6})
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    out, summ = tmp_path / "drafters", tmp_path / "train.json"
    main(["tev-train", "--config-json", f"@{tmp_path / 'cfg.json'}", "--quiet", "--model-dir", str(tmp_path / "model"),
          "--out", str(out), "--summary", str(summ)])
    s = json.loads(summ.read_text())
    assert s["drafters"] == ["base", "exit", "opd", "prefix", "token"]
    assert sorted(p.name for p in out.iterdir()) == s["drafters"]
    curve = s["summaries"]["base"]["curve"]
    assert curve_steps(6, 3) == [2, 4, 6] and [p["step"] for p in curve] == [0, 2, 4, 6]
    assert all(p["tree_budget"] == 6 and 1.0 <= p["tree_tau"] <= 4.0 and p["n_contexts"] > 0 for p in curve)
    assert curve[-1]["chain_tau"] == s["summaries"]["base"]["heldout_after"]["chain_tau"]
    assert len(s["summaries"]["opd"]["losses"]["opd"]) == 2
    # the shared base drafter is evaluated once; every objective's summary carries that evaluation
    befores = [s["summaries"][k]["before"] for k in ("token", "prefix", "exit", "opd")]
    assert befores[0] is not None and all(b == befores[0] for b in befores)
    assert curve_steps(2, 5) == [1, 2] and curve_steps(10, 0) == []
    # every saved drafter is named by its weights' fingerprint, and a retrain in another process (a later
    # session's) reproduces each bit for bit: what lets the cells of one run come from two sessions
    from impl.models.load import load_model
    from impl.models.adapters import model_fingerprint
    from impl.tev.drafter import BlockDrafter

    target = load_model(tmp_path / "model")
    assert s["target_fingerprint"] == model_fingerprint(target)
    assert s["fingerprints"] == {k: BlockDrafter.load(out / k, target).fingerprint() for k in s["drafters"]}
    assert all(s["fingerprints"][k] != s["fingerprints"]["base"] for k in ("token", "prefix", "exit", "opd"))
    import os
    import subprocess
    import sys

    again = tmp_path / "train2.json"
    subprocess.run([sys.executable, "-m", "impl", "tev-train", "--config-json", f"@{tmp_path / 'cfg.json'}", "--quiet",
                    "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path / "drafters2"), "--summary", str(again)],
                   check=True, env={**os.environ, "PYTHONHASHSEED": "123"}, timeout=600)
    assert json.loads(again.read_text())["fingerprints"] == s["fingerprints"]
