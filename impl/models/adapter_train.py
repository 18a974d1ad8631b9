"""Training inducing adapters by self-distillation from the frozen final depth (DEX App. C.2).

For each batch the frozen full-depth model gives teacher logits z_L; each adapted non-final depth l
gives student logits z_l = head(norm(adapter_l(h_l))) through the shared final norm and LM head. The
loss is the masked full-vocabulary KL

    L = 1/|X\\{L}| sum_l tau^2 KL(softmax(z_L / tau) || softmax(z_l / tau)),   tau = 1,

over supervised positions. Only adapter parameters are optimised (AdamW, weight decay 0, warm-up
then linear decay, as the paper); the backbone, final norm and LM head are frozen. Adapter l only
touches z_l, so training the adapters of several exploration sets jointly (one adapter per depth in
the union of their non-final depths) gives each depth the same gradient direction as training each
set alone; one set therefore serves every DEX-1/K configuration.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..schedule import lr_at
from .adapters import InducingAdapter, adapter_param_count, new_adapters
from .corpus import sharegpt_docs
from .depth import embed, num_layers, readout_logits, run_layers

log = logging.getLogger("impl.models.adapter_train")


@dataclass(frozen=True)
class AdapterTrainConfig:
    """Adapter training budget; sizes in tokens. ``steps``, ``batch_size``, ``seq_len``, ``lr``,
    ``position_fraction`` and ``threads`` have no defaults here: their one source of defaults is the
    config section ``dex.adapters`` (:class:`impl.dex.schema.Adapters`), which ``python -m impl
    train-adapters`` reads; a caller outside the DAG names them.

    Attributes:
        steps: optimiser steps.
        batch_size: windows per step (micro-batch x accumulation of the paper, 4 x 4 = 16 there).
        seq_len: tokens per window.
        lr: peak AdamW learning rate (1e-3 in the paper).
        warmup_fraction: share of steps of linear warm-up (0.06 in the paper), then linear decay.
        position_fraction: share of positions supervised per window (1.0 = all; less saves LM-head
            compute on CPU).
        temperature: distillation temperature tau (1 in the paper).
        eval_windows: held-out windows for the before/after agreement report.
        seed: data order and initialisation seed.
        threads: torch threads.
    """

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    position_fraction: float
    threads: int
    warmup_fraction: float = 0.06
    temperature: float = 1.0
    eval_windows: int = 32
    seed: int = 1234


def _lr(step: int, cfg: AdapterTrainConfig) -> float:
    warm = max(1, round(cfg.warmup_fraction * cfg.steps))
    return lr_at(step, lr=cfg.lr, warmup=warm, steps=cfg.steps, decay="linear", floor=0.0)


def token_windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    """``[len(starts), seq_len]`` int64 windows of a 1-D token array, starting at ``starts``."""
    idx = starts[:, None] + np.arange(seq_len)[None, :]
    return torch.from_numpy(tokens[idx].astype(np.int64))


@torch.no_grad()
def _states(model, x: torch.Tensor, depths: list[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Frozen hidden states at ``depths`` ``{l: [B, S, H]}`` and teacher logits ``[B, S, V]``."""
    pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
    kept: dict[int, torch.Tensor] = {}
    h = run_layers(model, embed(model, x), 0, num_layers(model), position_ids=pos,
                   on_layer=lambda d, s: kept.__setitem__(d, s) if d in depths else None)
    return kept, readout_logits(model, h)


@torch.no_grad()
def agreement(model, adapters: dict[int, InducingAdapter] | None, tokens: np.ndarray, depths: list[int],
              seq_len: int, n_windows: int) -> dict[int, dict[str, float]]:
    """Per depth, on evenly spaced windows of ``tokens``: top-1 agreement of the depth's readout with
    the final depth (share of positions) and the mean KL(final || depth) in nats/token."""
    n_windows = max(1, min(n_windows, (len(tokens) - 1) // seq_len))
    starts = np.linspace(0, len(tokens) - seq_len - 1, n_windows).astype(np.int64)
    out = {d: {"top1_agreement": 0.0, "kl": 0.0} for d in depths}
    for i in range(0, n_windows, 8):
        x = token_windows(tokens, starts[i:i + 8], seq_len)
        kept, zl = _states(model, x, depths)
        pl = F.log_softmax(zl.float(), -1)
        for d in depths:
            z = readout_logits(model, kept[d], adapters.get(d) if adapters else None).float()
            out[d]["top1_agreement"] += (z.argmax(-1) == zl.argmax(-1)).float().sum().item()
            out[d]["kl"] += F.kl_div(F.log_softmax(z, -1), pl, log_target=True, reduction="sum").item()
    n = n_windows * seq_len
    return {d: {k: v / n for k, v in r.items()} for d, r in out.items()}


def train_adapters(model, depths, train_tokens: np.ndarray, val_tokens: np.ndarray, cfg: AdapterTrainConfig,
                   *, progress: bool = True) -> tuple[dict[int, InducingAdapter], dict]:
    """Train inducing adapters at ``depths`` on a frozen ``model`` (DEX App. C.2).

    Args:
        model: a causal LM with a shared final norm / LM head; frozen (not modified).
        depths: 1-based non-final depths, each in [1, L-1].
        train_tokens, val_tokens: 1-D integer arrays of token ids (documents joined by EOS).
        cfg: budget and optimiser.

    Returns:
        ``(adapters, summary)``: adapters by depth (eval mode), and a summary with the step count,
        tokens seen, seconds, final loss, parameters per adapter (4h^2+4h+1 for m = 2h), and the
        held-out top-1 agreement / KL with the final depth per depth before and after training.

    Raises:
        ValueError: a depth outside [1, L-1], or a corpus shorter than one window.
    """
    torch.set_num_threads(cfg.threads)
    depths = sorted(set(int(d) for d in depths))
    if len(train_tokens) <= cfg.seq_len + 1 or len(val_tokens) <= cfg.seq_len + 1:
        raise ValueError(f"adapter corpus too short: {len(train_tokens)} train / {len(val_tokens)} val tokens "
                         f"for windows of {cfg.seq_len}")
    adapters = new_adapters(model, depths, seed=cfg.seed)
    model.eval()
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        return _train(model, adapters, depths, train_tokens, val_tokens, cfg, progress)
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)


def _train(model, adapters, depths, train_tokens, val_tokens, cfg, progress):
    before = agreement(model, None, val_tokens, depths, cfg.seq_len, cfg.eval_windows)
    params = [p for a in adapters.values() for p in a.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    tau = cfg.temperature
    losses: list[float] = []
    t0 = time.perf_counter()
    for a in adapters.values():
        a.train()
    for step in tqdm(range(cfg.steps), desc="adapters", disable=not progress, mininterval=5):
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg)
        starts = rng.integers(0, len(train_tokens) - cfg.seq_len, size=cfg.batch_size)
        x = token_windows(train_tokens, starts, cfg.seq_len)
        kept, zl = _states(model, x, depths)
        mask = torch.rand(x.shape, generator=gen) < cfg.position_fraction
        if not mask.any():
            mask[0, 0] = True
        teacher = F.log_softmax(zl[mask].float() / tau, -1)
        loss = 0.0
        for d in depths:
            z = readout_logits(model, adapters[d](kept[d][mask])).float()
            loss = loss + tau ** 2 * F.kl_div(F.log_softmax(z / tau, -1), teacher, log_target=True,
                                              reduction="batchmean")
        loss = loss / len(depths)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == cfg.steps - 1:
            log.info("step %d kl %.4f lr %.2e", step, np.mean(losses[-50:]), _lr(step, cfg))
    seconds = time.perf_counter() - t0
    for a in adapters.values():
        a.eval()
    after = agreement(model, adapters, val_tokens, depths, cfg.seq_len, cfg.eval_windows)
    h = model.config.hidden_size
    summary = {
        "depths": depths,
        "steps": cfg.steps,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "train_seconds": seconds,
        "final_kl": float(np.mean(losses[-50:])),
        "parameters_per_adapter": adapter_param_count(h),
        "parameters_total": sum(p.numel() for p in params),
        "backbone_parameters": sum(p.numel() for p in model.parameters()),
        "before": {str(d): v for d, v in before.items()},
        "after": {str(d): v for d, v in after.items()},
    }
    return adapters, summary


def sharegpt_tokens(data_dir: str | Path, tokenizer, max_chars: int, val_fraction: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
    """The ShareGPT subset as token ids (documents joined by EOS, the same transcript format as the
    training corpus), split by document into train / held-out arrays (int32)."""

    docs, total = [], 0
    for d in sharegpt_docs(Path(data_dir)):
        docs.append(d)
        total += len(d)
        if total >= max_chars:
            break
    n_val = max(1, round(len(docs) * val_fraction))
    eos = tokenizer.eos_token_id

    def pack(ds):
        ids: list[int] = []
        for d in ds:
            ids.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
            ids.append(eos)
        return np.asarray(ids, dtype=np.int32)

    return pack(docs[n_val:]), pack(docs[:n_val])


__all__ = ["AdapterTrainConfig", "train_adapters", "agreement", "sharegpt_tokens", "token_windows"]
