"""The torchrun commands' shared launch rules (impl/torchrun.py): ranks from torchrun's environment,
one GPU per rank or CPU with the GPUs hidden, the common arguments, the prompts every rank accepts."""

import os

import pytest
import torch

from impl.argtypes import ArgumentParser
from impl.torchrun import Ranks, add_run_args, fail, select_device, usable_prompts


def test_ranks_from_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert Ranks.from_env() == Ranks(0, 1, 0, 1)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert Ranks.from_env() == Ranks(5, 8, 1, 8)  # no LOCAL_WORLD_SIZE: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Ranks.from_env().local_world == 4


def test_select_device_one_gpu_per_rank(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_device("auto", Ranks(1, 2, 1, 2)) == torch.device("cuda", 1)
    assert select_device("cuda", Ranks(0, 4, 0, 2)) == torch.device("cuda", 0)  # 2 nodes of 2
    with pytest.raises(ValueError, match="one GPU per rank: 3 ranks on this node, 2 GPUs"):
        select_device("cuda", Ranks(2, 3, 2, 3))
    assert select_device("auto", Ranks(2, 3, 2, 3)) == torch.device("cpu")  # too few GPUs: gloo on CPU
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # hidden, so nothing later picks a GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert select_device("cpu", Ranks(0, 2, 0, 2)) == torch.device("cpu") and os.environ["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        select_device("tpu", Ranks(0, 1, 0, 1))


def test_common_arguments_and_refusal(capsys):
    ap = add_run_args(ArgumentParser(prog="x"))
    a = ap.parse_args(["--prompts", "p.jsonl", "--out", "o.jsonl"])
    assert (a.max_new_tokens, a.n_prompts, a.warmup_prompts, a.threads, a.timeout_s, a.device, a.ignore_eos) == \
        (64, None, 1, 1, 600.0, "auto", False)
    for bad in (["--threads", "0"], ["--max-new-tokens", "0"], ["--device", "tpu"], ["--timeout-s", "-1"]):
        with pytest.raises(SystemExit) as e:
            ap.parse_args(["--prompts", "p", "--out", "o", *bad])
        assert e.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        fail(3, "no such prompt file: p")
    assert e.value.code == 2 and capsys.readouterr().err == "[rank 3] error: no such prompt file: p\n"


def test_usable_prompts_keeps_order_and_skips_refused():
    def check(p):
        if not p["input_ids"]:
            raise ValueError("empty")
        return p["input_ids"]
    prompts = [{"input_ids": [1]}, {"input_ids": []}, {"input_ids": [2, 3]}]
    assert usable_prompts(prompts, check) == [[1], [2, 3]]
