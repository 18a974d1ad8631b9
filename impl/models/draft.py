"""A small draft model for a target LM: a layer-truncated copy, distilled to the frozen target.

The speculative arms of DEX's Fig. 5 (assisted decoding, PEARL; harness issue 18, item 1) need a draft
that speaks the target's tokenizer. Trained from scratch on this CPU it would be far too weak, so the
draft starts as the target itself with most layers removed: its token embeddings, the decoder layers at
``n`` evenly spaced depths (the first and the last included), its final norm and LM head (copies; tied
embeddings stay tied). The kept layers and the final norm are then distilled on ShareGPT tokens by the
masked full-vocabulary KL to the frozen target,

    L = KL(softmax(z_target) || softmax(z_draft)),

over supervised positions (a random ``position_fraction`` of each window, as the inducing adapters'
recipe, :mod:`impl.models.adapter_train`); embeddings and LM head stay frozen. The held-out top-1
agreement with the target, before and after, is the greedy acceptance rate of a one-token draft.

Source: DEX Sec. 5 (Fig. 5: speculative decoding with a small draft model); layer-truncated drafts as in
Draft & Verify (Zhang et al., 2024) and LayerSkip (Elhoushi et al., 2024), here as a separate model.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..schedule import lr_at
from .adapter_train import token_windows
from .depth import decoder_layers, num_layers

log = logging.getLogger("impl.models.draft")

__all__ = ["DraftTrainConfig", "draft_depths", "truncated_draft", "top1_agreement", "train_draft"]


def draft_depths(L: int, n: int) -> list[int]:
    """``n`` evenly spaced 1-based depths in [1, L], the first and the last included (``n = 1``: [L]).

    Raises:
        ValueError: ``n`` outside [1, L].
    """
    if not 1 <= n <= L:
        raise ValueError(f"draft layers: need 1 <= n <= L = {L}, got {n}")
    if n == 1:
        return [L]
    return sorted({int(round(x)) for x in np.linspace(1, L, n)})


def truncated_draft(model, depths: list[int]):
    """A new model of the target's class holding copies of its embeddings, the decoder layers at
    ``depths`` (1-based, in order), its final norm and LM head.

    Args:
        model: a Hugging Face decoder-only LM (``model.model.layers``), not modified.
        depths: strictly increasing depths in [1, L].

    Returns:
        the draft, in eval mode, same dtype and device, ``config.num_hidden_layers = len(depths)``,
        ``config.draft_of_depths`` recording ``depths``.

    Raises:
        ValueError: depths not strictly increasing or outside [1, L].
    """
    L = num_layers(model)
    if not depths or any(not 1 <= d <= L for d in depths) or list(depths) != sorted(set(depths)):
        raise ValueError(f"draft depths must be strictly increasing in [1, {L}], got {list(depths)}")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = len(depths)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[d - 1] for d in depths]
    cfg.draft_of_depths = list(depths)
    p = next(model.parameters())
    draft = type(model)(cfg).to(dtype=p.dtype, device=p.device)
    src = model.state_dict()
    state = {}
    for k, v in src.items():
        if ".layers." not in k:
            state[k] = v
    for i, d in enumerate(depths):
        prefix = f"model.layers.{d - 1}."
        for k, v in src.items():
            if k.startswith(prefix):
                state[f"model.layers.{i}." + k[len(prefix):]] = v
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"truncated_draft: state mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if cfg.tie_word_embeddings:
        draft.tie_weights()
    return draft.eval()


@dataclass(frozen=True)
class DraftTrainConfig:
    """Draft distillation budget (defaults live in the config section ``dex.draft``,
    :class:`impl.dex.schema.Draft`). Sizes in tokens.

    Attributes:
        steps: optimiser steps.
        batch_size: windows per step.
        seq_len: tokens per window.
        lr: peak AdamW learning rate (warm-up, then linear decay to 0).
        position_fraction: share of positions supervised per window.
        threads: torch threads.
        warmup_fraction: share of steps of linear warm-up.
        eval_windows: held-out windows for the agreement report.
        seed: data order and mask seed.
    """

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    position_fraction: float
    threads: int
    warmup_fraction: float = 0.06
    eval_windows: int = 32
    seed: int = 1234


@torch.no_grad()
def top1_agreement(target, draft, tokens: np.ndarray, seq_len: int, n_windows: int) -> dict[str, float]:
    """On evenly spaced windows of ``tokens``: the share of positions where the draft's argmax equals
    the target's (teacher-forced), and the mean KL(target || draft) in nats per position."""
    n_windows = max(1, min(n_windows, (len(tokens) - 1) // seq_len))
    starts = np.linspace(0, len(tokens) - seq_len - 1, n_windows).astype(np.int64)
    agree = kl = 0.0
    for i in range(0, n_windows, 8):
        x = token_windows(tokens, starts[i:i + 8], seq_len)
        zt = target(x).logits.float()  # [B, S, V]
        zd = draft(x).logits.float()
        agree += (zd.argmax(-1) == zt.argmax(-1)).float().sum().item()
        kl += F.kl_div(F.log_softmax(zd, -1), F.log_softmax(zt, -1), log_target=True, reduction="sum").item()
    n = n_windows * seq_len
    return {"top1_agreement": agree / n, "kl": kl / n}


def train_draft(target, draft, train_tokens: np.ndarray, val_tokens: np.ndarray, cfg: DraftTrainConfig,
                *, progress: bool = True) -> dict:
    """Distil ``draft`` (its decoder layers and final norm; embeddings and LM head frozen) to the frozen
    ``target`` by masked full-vocabulary KL.

    Args:
        target: the frozen target LM (not modified).
        draft: the draft (e.g. :func:`truncated_draft`), trained in place and returned in eval mode.
        train_tokens, val_tokens: 1-D integer token arrays (documents joined by EOS).
        cfg: budget and optimiser.

    Returns:
        a summary: steps, tokens seen, seconds, final KL, trained / total draft parameters, and the
        held-out top-1 agreement and KL with the target before and after.

    Raises:
        ValueError: a corpus shorter than one window.
    """
    torch.set_num_threads(cfg.threads)
    if len(train_tokens) <= cfg.seq_len + 1 or len(val_tokens) <= cfg.seq_len + 1:
        raise ValueError(f"draft corpus too short: {len(train_tokens)} train / {len(val_tokens)} val tokens "
                         f"for windows of {cfg.seq_len}")
    target.eval()
    draft.eval()
    before = top1_agreement(target, draft, val_tokens, cfg.seq_len, cfg.eval_windows)
    for p in draft.parameters():
        p.requires_grad_(False)
    trained = [p for p in decoder_layers(draft).parameters()] + [p for p in draft.model.norm.parameters()]
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=0.0)
    warm = max(1, round(cfg.warmup_fraction * cfg.steps))
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    losses: list[float] = []
    t0 = time.perf_counter()
    draft.train()
    for step in tqdm(range(cfg.steps), desc="draft", disable=not progress, mininterval=5):
        lr = lr_at(step, lr=cfg.lr, warmup=warm, steps=cfg.steps, decay="linear", floor=0.0)
        for g in opt.param_groups:
            g["lr"] = lr
        x = token_windows(train_tokens, rng.integers(0, len(train_tokens) - cfg.seq_len, size=cfg.batch_size),
                     cfg.seq_len)  # [B, S]
        mask = torch.rand(x.shape, generator=gen) < cfg.position_fraction  # [B, S] bool
        if not mask.any():
            mask[0, 0] = True
        with torch.no_grad():
            teacher = F.log_softmax(target(x).logits[mask].float(), -1)  # [M, V]
        hidden = draft.model(input_ids=x).last_hidden_state[mask]  # [M, H]: the head only where supervised
        student = F.log_softmax(draft.lm_head(hidden).float(), -1)
        loss = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % 25 == 0 or step == cfg.steps - 1:
            log.info("draft step %d kl %.4f lr %.2e", step, np.mean(losses[-25:]), lr)
    seconds = time.perf_counter() - t0
    for p in draft.parameters():
        p.requires_grad_(False)
    draft.eval()
    after = top1_agreement(target, draft, val_tokens, cfg.seq_len, cfg.eval_windows)
    return {
        "steps": cfg.steps,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "train_seconds": seconds,
        "final_kl": float(np.mean(losses[-25:])),
        "parameters_trained": sum(p.numel() for p in trained),
        "parameters_total": sum(p.numel() for p in draft.parameters()),
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "before": before,
        "after": after,
    }
