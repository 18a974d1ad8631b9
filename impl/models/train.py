"""Training the tiny models: plain LM loss (``tiny-std``) or plus a LayerSkip-style early-exit loss
(``tiny-ls``).

Early-exit loss (LayerSkip, Elhoushi et al. 2024, as summarised in DEX App. A.1 / DESIGN.md): the
shared final norm + LM head reads out intermediate layers; each step supervises a rotating set of
``layers_per_step`` early depths (a curriculum over 1..L-1) on a random ``position_fraction`` of the
positions, added to the final-depth loss with weight ``weight``. Both models see the same data
windows in the same order (same seed), the same optimiser and the same step budget.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaForCausalLM

from ..schedule import lr_at
from ..schema import Training
from .depth import embed, readout_logits, run_layers
from .tiny import TinyArch

log = logging.getLogger("impl.models.train")


#: the ``training`` section's defaults (:class:`impl.schema.Training`): the one source of the defaults below
_T = Training()


@dataclass(frozen=True)
class EarlyExit:
    """LayerSkip-style early-exit loss settings (config ``models.<name>.early_exit``)."""

    enabled: bool = False
    layers_per_step: int = 3
    position_fraction: float = 0.25
    weight: float = 1.0


@dataclass(frozen=True)
class TrainConfig:
    """Training budget and optimiser (config section ``training``); times in steps, sizes in tokens."""

    steps: int = _T.steps
    batch_size: int = _T.batch_size
    seq_len: int = _T.seq_len
    lr: float = _T.lr
    warmup_steps: int = _T.warmup_steps
    weight_decay: float = _T.weight_decay
    grad_clip: float = _T.grad_clip
    eval_windows: int = _T.eval_windows
    seed: int = 1234
    threads: int = _T.threads
    early_exit: EarlyExit = field(default_factory=EarlyExit)


def early_exit_depths(step: int, num_layers: int, k: int) -> list[int]:
    """Depths (1-based, in [1, L-1]) supervised by the early-exit loss at ``step``: a rotation that
    visits every early depth equally often."""
    n = num_layers - 1
    k = min(k, n)
    return sorted({(step * k + j) % n + 1 for j in range(k)})


def _lr(step: int, cfg: TrainConfig) -> float:
    return lr_at(step, lr=cfg.lr, warmup=cfg.warmup_steps, steps=cfg.steps, decay="cosine", floor=0.1)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(tokens[idx].astype(np.int64))


@torch.no_grad()
def depth_losses(model, val_tokens: np.ndarray, seq_len: int, n_windows: int, batch: int = 8) -> list[float]:
    """Mean next-token cross-entropy (nats/token) of the readout at every depth 1..L on fixed,
    evenly spaced validation windows. Returns a list of L floats (last = the model's own loss)."""
    L = len(model.model.layers)
    n_windows = max(1, min(n_windows, (len(val_tokens) - 1) // (seq_len + 1)))
    starts = np.linspace(0, len(val_tokens) - seq_len - 2, n_windows).astype(np.int64)
    totals = np.zeros(L)
    count = 0
    for i in range(0, len(starts), batch):
        w = _windows(val_tokens, starts[i : i + batch], seq_len)
        x, y = w[:, :-1], w[:, 1:]
        pos = torch.arange(seq_len).unsqueeze(0).expand(x.shape[0], -1)
        states: list[torch.Tensor] = []
        run_layers(model, embed(model, x), 0, L, position_ids=pos, on_layer=lambda d, h: states.append(h))
        for d, h in enumerate(states):
            logits = readout_logits(model, h)
            totals[d] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        count += y.numel()
    return (totals / count).tolist()


def train_tiny(
    arch: TinyArch,
    cfg: TrainConfig,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    tokenizer,
    out_dir: str | Path,
    *,
    progress: bool = True,
) -> dict:
    """Train one tiny Llama from scratch and save it as a Hugging Face directory.

    Args:
        arch: model architecture.
        cfg: budget, optimiser and early-exit settings.
        train_tokens, val_tokens: 1-D integer arrays of token ids (documents joined by EOS).
        tokenizer: the ``PreTrainedTokenizerFast`` saved beside the weights.
        out_dir: destination directory (written by the caller atomically).

    Returns:
        summary dict: steps, tokens_seen, seconds, tokens_per_second, final train loss, per-depth
        validation losses (nats/token), val_loss (final depth), parameter count.

    Raises:
        ValueError: if the corpus is shorter than one training window.
    """
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if len(train_tokens) <= cfg.seq_len + 1:
        raise ValueError(f"training corpus has {len(train_tokens)} tokens, fewer than seq_len+1")
    hf_config = arch.to_hf_config(len(tokenizer), tokenizer.eos_token_id)

    model = LlamaForCausalLM(hf_config)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    rng = np.random.default_rng(cfg.seed)
    pos_gen = torch.Generator().manual_seed(cfg.seed + 1)
    L = arch.num_layers
    ee = cfg.early_exit
    t0 = time.perf_counter()
    losses = []
    bar = tqdm(range(cfg.steps), desc=f"train {Path(out_dir).name}", disable=not progress, mininterval=5)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg)
        starts = rng.integers(0, len(train_tokens) - cfg.seq_len - 1, size=cfg.batch_size)
        w = _windows(train_tokens, starts, cfg.seq_len)
        x, y = w[:, :-1], w[:, 1:]
        pos = torch.arange(cfg.seq_len).unsqueeze(0).expand(x.shape[0], -1)
        depths = early_exit_depths(step, L, ee.layers_per_step) if ee.enabled else []
        kept: dict[int, torch.Tensor] = {}

        def keep(d: int, h: torch.Tensor) -> None:
            if d in depths:
                kept[d] = h

        h = run_layers(model, embed(model, x), 0, L, position_ids=pos, on_layer=keep)
        logits = readout_logits(model, h)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        main_loss = loss.detach()
        if depths:
            mask = torch.rand(y.shape, generator=pos_gen) < ee.position_fraction
            yy = y[mask]
            ee_loss = sum(F.cross_entropy(readout_logits(model, kept[d][mask]), yy) for d in depths) / len(depths)
            loss = loss + ee.weight * ee_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(main_loss.item())
        if step % 50 == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
            log.info("step %d loss %.4f lr %.2e", step, np.mean(losses[-50:]), _lr(step, cfg))
    seconds = time.perf_counter() - t0
    model.eval()
    val = depth_losses(model, val_tokens, cfg.seq_len, cfg.eval_windows)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    tokens_seen = cfg.steps * cfg.batch_size * cfg.seq_len
    return {
        "steps": cfg.steps,
        "tokens_seen": tokens_seen,
        "train_seconds": seconds,
        "tokens_per_second": tokens_seen / seconds,
        "final_train_loss": float(np.mean(losses[-50:])),
        "val_loss": val[-1],
        "val_loss_by_depth": val,
        "parameters": sum(p.numel() for p in model.parameters()),
        "num_layers": L,
        "early_exit": asdict(ee),
    }


def unigram_baseline(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the add-one-smoothed unigram distribution of the training
    tokens, evaluated on the validation tokens: the floor a trained LM must beat."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val_tokens].mean())
