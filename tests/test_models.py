"""Layer-range execution and intermediate readout reproduce the model; training helpers."""

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from impl.models.depth import hidden_states_by_depth, readout_logits, run_layers, embed
from impl.models.load import load_model, load_tokenizer
from impl.models.train import EarlyExit, TrainConfig, early_exit_depths, train_tiny, unigram_baseline
from impl.models.tiny import TinyArch


def test_layer_runner_reproduces_forward(tiny_model):
    x = torch.tensor([[5, 7, 11, 13, 17, 19]])
    hs = hidden_states_by_depth(tiny_model, x)
    assert hs.shape == (12, 1, 6, 32)
    with torch.no_grad():
        ref = tiny_model(x).logits
    assert torch.equal(readout_logits(tiny_model, hs[-1]), ref)


def test_layer_runner_with_cache_matches_full(tiny_model):
    x = torch.tensor([[5, 7, 11, 13, 17, 19]])
    full = hidden_states_by_depth(tiny_model, x)
    cache = DynamicCache(config=tiny_model.config)
    part1 = hidden_states_by_depth(tiny_model, x[:, :4], cache=cache)
    part2 = hidden_states_by_depth(tiny_model, x[:, 4:], cache=cache)
    # fp32 sums in a different order (cache vs one pass; thread count changes the kernels): 1e-4
    torch.testing.assert_close(torch.cat([part1, part2], dim=2), full, rtol=1e-4, atol=1e-4)


def test_run_layers_in_two_ranges(tiny_model):
    x = torch.tensor([[1, 2, 3]])
    pos = torch.arange(3).unsqueeze(0)
    h = embed(tiny_model, x)
    mid = run_layers(tiny_model, h, 0, 5, position_ids=pos)
    end = run_layers(tiny_model, mid, 5, 12, position_ids=pos)
    assert torch.equal(end, hidden_states_by_depth(tiny_model, x)[-1])
    with pytest.raises(ValueError):
        run_layers(tiny_model, h, 3, 13, position_ids=pos)


def test_early_exit_rotation_covers_all_early_depths():
    seen = set()
    for step in range(11):
        d = early_exit_depths(step, 12, 3)
        assert all(1 <= x <= 11 for x in d) and len(d) == 3
        seen.update(d)
    assert seen == set(range(1, 12))


def test_unigram_baseline_hand_computed():
    train = np.array([0, 0, 1])
    # add-one: counts [3, 2, 1] / 6 ; val token 0 -> -log(0.5)
    assert unigram_baseline(train, np.array([0]), 3) == pytest.approx(np.log(2))


def test_missing_model_dir_names_path_and_rule(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_model"):
        load_model(tmp_path / "nope", builder="train_model")


@pytest.mark.slow
def test_train_tiny_learns_and_saves(tmp_path, tiny_tokenizer):
    text = "Question: how many apples?\nAnswer: 3 apples. #### 3\n" * 200
    ids = np.array(tiny_tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.uint16)
    arch = TinyArch(num_layers=4, hidden_size=32, num_heads=4, intermediate_size=64, max_position_embeddings=64)
    cfg = TrainConfig(steps=100, batch_size=4, seq_len=32, warmup_steps=5, eval_windows=4, lr=1e-2,
                      early_exit=EarlyExit(enabled=True, layers_per_step=2))
    s = train_tiny(arch, cfg, ids, ids, tiny_tokenizer, tmp_path / "m", progress=False)
    assert s["val_loss"] < unigram_baseline(ids, ids, len(tiny_tokenizer)) - 1.0
    assert len(s["val_loss_by_depth"]) == 4
    m = load_model(tmp_path / "m")
    tok = load_tokenizer(tmp_path / "m")
    assert m.config.num_hidden_layers == 4 and tok.eos_token_id == tiny_tokenizer.eos_token_id
