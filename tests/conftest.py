"""Shared fixtures: a tiny randomly initialised Llama (seeded) and a tiny byte-level tokenizer."""

from pathlib import Path

import pytest
import torch

import os

ROOT = Path(__file__).resolve().parents[1]
# Same rule as scripts/data_dir.sh: IMPL_DATA_DIR, else ../shared/data, else /work/shared/data.
DATA_DIR = Path(os.environ.get("IMPL_DATA_DIR") or ROOT.parent / "shared" / "data")
if not DATA_DIR.is_dir():
    DATA_DIR = Path("/work/shared/data")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests that read the session's smoke DAG run (``smoke_run``) share one pytest-xdist worker, so that
    the DAG runs once, and go first, so that its ~13 minutes overlap the rest of the suite on the other
    worker (``scripts/test.sh`` runs ``-n 2 --dist loadgroup``); the slow real-SGLang-server tests join that
    worker after them. Without xdist only the order changes."""
    smoke = [item for item in items if "smoke_run" in getattr(item, "fixturenames", ())]
    for item in smoke:
        item.add_marker(pytest.mark.xdist_group("smoke"))
    # the tests that start real SGLang servers (several processes each) join the same worker, after the DAG:
    # one heavy job at a time, so the other worker's timing-sensitive server tests are not starved
    for item in items:
        if item.path.name.startswith("test_sglang_") and item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("smoke"))
    first = {id(item) for item in smoke}
    items[:] = smoke + [item for item in items if id(item) not in first]


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    the tiny models' decodes are latency-bound, and with pytest-xdist two workers share the two cores, so more
    threads only oversubscribe them. The previous count is restored after the module."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(autouse=True)
def _no_data_dir_override(monkeypatch):
    """Tests pass data_dir explicitly; IMPL_DATA_DIR (which overrides it) must not leak into them."""
    monkeypatch.delenv("IMPL_DATA_DIR", raising=False)


@pytest.fixture(scope="session")
def tiny_model():
    """A seeded random 12-layer Llama (hidden 32, vocab 97) in eval mode, initialised wide
    (std 0.2, MLP outputs x4) so that candidates at different depths disagree often and greedy
    outputs do not loop: every branch of the EAD and DEX code gets exercised."""
    from impl.models.tiny import TinyArch

    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    cfg = TinyArch(num_layers=12, hidden_size=32, num_heads=4, intermediate_size=64,
                   max_position_embeddings=128).to_hf_config(vocab_size=97, eos_token_id=0)
    cfg.initializer_range = 0.2
    model = LlamaForCausalLM(cfg).eval()
    # Scale up the residual stream so that layers move the argmax (random init is too smooth).
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from impl.models.tokenizer import train_tokenizer

    texts = ["Question: how many apples?\nAnswer: 3 apples. #### 3", "def f(x):\n    return x + 1\n"] * 20
    return train_tokenizer(texts, 300, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def data_dir():
    if not DATA_DIR.is_dir():
        pytest.skip(f"data folder {DATA_DIR} not present")
    return DATA_DIR


def save_wide_llama(out_dir, tokenizer, max_position_embeddings: int = 128, vocab_size: int | None = None):
    """Save a seeded random 4-layer Llama (hidden 32, 4 heads / 2 KV heads) over ``tokenizer``'s
    vocabulary (or ``vocab_size``), initialised wide (std 0.2, MLP outputs x4) so that skipped layers
    change the greedy ids, with the tokenizer beside it; returns the model (eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    cfg = LlamaConfig(vocab_size=vocab_size or len(tokenizer), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_position_embeddings, eos_token_id=eos, bos_token_id=eos,
                      initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model


def token_trained_drafter(model, rollout_temperature: float):
    """A block drafter (H = 4, one layer) trained 40 steps with the token loss on ``model``'s rollouts of
    10 seeded random prompts (24 new tokens at ``rollout_temperature``, 20% held out): the shared starting
    point of the ExitTrain and Draft-OPD tests. Returns ``(drafter, RolloutData)``."""
    from impl.tev.drafter import BlockDrafter, DrafterConfig, DrafterTrainConfig, make_rollouts, train_drafter

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 97, (int(torch.randint(3, 8, (), generator=g)),), generator=g).tolist()
               for _ in range(10)]
    dcfg = DrafterConfig(block_size=4, n_layers=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = BlockDrafter(model, dcfg)
    data = make_rollouts(model, prompts, drafter.feature_layers, new_tokens=24, temperature=rollout_temperature,
                         heldout_fraction=0.2)
    drafter, _ = train_drafter(model, None, DrafterTrainConfig(drafter=dcfg, steps=40, batch_size=4, anchors_per_seq=8,
                                                               lr=3e-3, warmup_steps=5, log_every=0),
                               drafter=drafter, data=data)
    return drafter, data


def smoke_snakemake(out: Path, data_dir: Path, *extra: str, **kw):
    """``snakemake --cores 2`` on configs/smoke.yaml with every output under ``out`` (a Popen)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "--nolock", "--configfile", "configs/smoke.yaml",
           "--config", f"data_dir={data_dir}", f"results_dir={out}/results", f"figures_dir={out}/figures",
           f"models_dir={out}/models", f"logs_dir={out}/logs", *extra]
    return subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, data_dir):
    """The smoke DAG run once per session (real data, tiny models trained in it); tests read its outputs
    or copy them, never change them."""
    out = tmp_path_factory.mktemp("smoke")
    p = smoke_snakemake(out, data_dir)
    log, _ = p.communicate(timeout=1800)
    assert p.returncode == 0, log[-4000:]
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def smoke_config(**overrides) -> dict:
    """``configs/smoke.yaml`` with ``overrides`` merged in (dicts key by key), validated without the path
    checks: a config a command accepts, for tests that call commands directly."""
    from impl.config import read_yaml, validate_config

    return validate_config(_merge(read_yaml(ROOT / "configs" / "smoke.yaml"), overrides), check_paths=False)


def torchrun(module: str, K: int, *args, timeout: int = 180, device: str | None = "cpu"):
    """``python -m torch.distributed.run --nproc-per-node K -m MODULE [--device DEVICE] ARGS`` on a free
    local port, one thread per rank, from the repository root; returns the CompletedProcess (text)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(K), "--master-addr", "127.0.0.1",
           "--master-port", str(port), "-m", module, *(["--device", device] if device else []), *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
