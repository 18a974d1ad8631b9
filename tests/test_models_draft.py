"""The draft model of the speculative arms (impl.models.draft): a layer-truncated copy of the target,
exact where the dropped layers are identities, and distilled towards the target."""

import copy

import numpy as np
import pytest
import torch

from impl.models.draft import DraftTrainConfig, draft_depths, top1_agreement, train_draft, truncated_draft


def test_draft_depths():
    assert draft_depths(30, 4) == [1, 11, 20, 30]
    assert draft_depths(12, 3) == [1, 6, 12]
    assert draft_depths(12, 1) == [12]
    assert draft_depths(5, 5) == [1, 2, 3, 4, 5]
    for n in (0, 13):
        with pytest.raises(ValueError, match="1 <= n <= L = 12"):
            draft_depths(12, n)


def test_full_depth_draft_is_the_model(tiny_model):
    x = torch.tensor([[5, 17, 42, 8, 9, 3]])
    draft = truncated_draft(tiny_model, list(range(1, 13)))
    assert torch.equal(draft(x).logits, tiny_model(x).logits)


def test_draft_equals_target_where_the_dropped_layers_are_identities(tiny_model):
    """Layers 5..12 made exact identities: a draft of depths 1-4 (and 12) computes the target's logits,
    with a KV cache too (greedy generate)."""
    m = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for layer in m.model.layers[4:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    x = torch.tensor([[5, 17, 42, 8, 9, 3]])
    for depths in ([1, 2, 3, 4], [1, 2, 3, 4, 12]):
        draft = truncated_draft(m, depths)
        assert draft.config.num_hidden_layers == len(depths) and draft.config.draft_of_depths == depths
        torch.testing.assert_close(draft(x).logits, m(x).logits, rtol=0, atol=1e-5)
        kw = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(x), pad_token_id=0)
        assert torch.equal(draft.generate(x, **kw), m.generate(x, **kw))
    # the kept layers are copies: training the draft leaves the target alone
    draft = truncated_draft(m, [1, 12])
    assert draft.model.layers[1].mlp.up_proj.weight.data_ptr() != m.model.layers[11].mlp.up_proj.weight.data_ptr()
    torch.testing.assert_close(draft.model.layers[1].mlp.up_proj.weight, m.model.layers[11].mlp.up_proj.weight)


def test_bad_depths(tiny_model):
    for depths in ([], [0, 3], [3, 2], [2, 2], [1, 13]):
        with pytest.raises(ValueError, match=r"strictly increasing in \[1, 12\]"):
            truncated_draft(tiny_model, depths)


def test_tied_embeddings_stay_tied():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    d = truncated_draft(m, [1, 4])
    assert d.lm_head.weight.data_ptr() == d.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(d.model.embed_tokens.weight, m.model.embed_tokens.weight)


def test_distillation_moves_the_draft_towards_the_target(tiny_model):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 97, size=6000).astype(np.int32)
    train, val = tokens[:5000], tokens[5000:]
    target = copy.deepcopy(tiny_model)
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    draft = truncated_draft(target, [1, 6, 12])
    emb = draft.model.embed_tokens.weight.clone()
    cfg = DraftTrainConfig(steps=40, batch_size=4, seq_len=32, lr=3e-3, position_fraction=0.5, threads=1,
                           eval_windows=8)
    with torch.enable_grad():
        s = train_draft(target, draft, train, val, cfg, progress=False)
    assert s["after"]["kl"] < 0.8 * s["before"]["kl"], s
    assert s["after"] == top1_agreement(target, draft, val, 32, 8)
    assert s["tokens_seen"] == 40 * 4 * 32 and s["parameters_trained"] < s["parameters_total"]
    assert torch.equal(draft.model.embed_tokens.weight, emb)  # embeddings (and the LM head) frozen
    assert all(torch.equal(v, target_before[k]) for k, v in target.state_dict().items())  # target untouched
    assert not any(p.requires_grad for p in draft.parameters()) and not draft.training
    with pytest.raises(ValueError, match="draft corpus too short"):
        train_draft(target, draft, train[:20], val, cfg, progress=False)


def test_train_draft_command(tmp_path, tiny_tokenizer, data_dir):
    import json

    from conftest import save_wide_llama, smoke_config

    from impl.cli import main
    from impl.models.load import load_model

    save_wide_llama(tmp_path / "model", tiny_tokenizer)
    cfg = smoke_config(data_dir=str(data_dir), dex={"draft": {"layers": 2, "steps": 2, "batch_size": 2, "seq_len": 16,
                                                              "max_chars": 20000, "threads": 1}})
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    out, summ = tmp_path / "model-draft", tmp_path / "draft.json"
    main(["train-draft", "--config-json", f"@{tmp_path / 'cfg.json'}", "--quiet", "--model-dir", str(tmp_path / "model"),
          "--out", str(out), "--summary", str(summ)])
    s = json.loads(summ.read_text())
    assert s["depths"] == [1, 4] and s["steps"] == 2 and s["data"] == "sharegpt"
    draft = load_model(out)
    assert draft.config.num_hidden_layers == 2 and (out / "tokenizer.json").is_file()
    cfg["dex"]["draft"] = None
    cfg["dex"]["speculative"] = {}  # the smoke config's assisted / PEARL arms need a draft
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="dex.draft is not set"):
        main(["train-draft", "--config-json", f"@{tmp_path / 'cfg.json'}", "--quiet", "--model-dir",
              str(tmp_path / "model"), "--out", str(tmp_path / "x"), "--summary", str(tmp_path / "x.json")])
