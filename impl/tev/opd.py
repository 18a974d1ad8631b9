"""Draft-OPD: position-wise on-policy distillation of a block drafter, the drafter control the TEV
paper compares against (tev-exittrain.txt Sec. 1, Sec. 2 "Related draft-model training", Sec. 6
"Methods": "Draft-OPD replaces only the drafter with its position-wise distilled checkpoint";
Lei et al., 2026, arXiv:2605.29343).

One Draft-OPD step, on the same (rollout, anchor) draws as every other objective of
:func:`impl.tev.train.train_exittrain` (so the comparison stays matched in steps, data and order):

1. **verification**: at each anchor a the drafter's greedy block ``d_k = argmax z[a, k]`` (the rows of
   the step's first drafter pass, detached) is verified against the rollout. A rollout is the target's
   own continuation, so on a greedy rollout this is exactly what greedy target verification of a
   chain accepts: L = the number of leading depths with ``d_k = x_{a+k+1}`` (:func:`replay_anchors`).
2. **replay**: where verification rejected the draft (L < H with a real token at depth L + 1), the
   next decoding round's context is the accepted prefix plus the target's correction,
   ``x_0 .. x_{a+L+1}``: the drafter drafts again from ``a' = a + L + 1`` (a second block pass with
   gradient). Blocks that were fully accepted, or that reach the rollout's end, are not replayed.
3. **distillation**: forward KL from the target to the drafter on every row of the replayed blocks,
   ``KL(p_T(. | x_{<=a'+k}) || q_theta,k(. | c_{a'}))`` with p_T the target's next-token distribution
   on the rollout at ``target_temperature`` (one-hot argmax rows at T = 0: then KL is the CE of the
   target's greedy token), weighted with DFlash's position decay and averaged
   (:func:`forward_kl_loss`); the target rows come from one no-grad causal forward per step over the
   step's rollouts (:func:`rollout_target_logits`).

The loss of the ``"opd"`` objective is ``L_tok + lambda_opd * L_OPD`` (L_tok as every objective has,
TEV Eq. 15; lambda_opd = ``tev.exittrain.lambda_opd``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from impl.models.depth import embed, num_layers, readout_logits, run_layers

__all__ = ["replay_anchors", "rollout_target_logits", "forward_kl_loss"]


@torch.no_grad()
def replay_anchors(block_logits: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor,
                   lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy chain verification of every drafted block against its rollout and the anchors the next
    round replays from (module docstring, steps 1-2).

    Args:
        block_logits: float ``[B, A, H, V]`` draft-logit rows of the blocks anchored at ``anchors``.
        labels: int64 ``[B, A, H]``: ``x_{a+k+1}``, or -100 beyond the rollout's end
            (:func:`impl.tev.drafter._block_labels`).
        anchors: int64 ``[B, A]`` block anchors (positions of the last committed token).
        lengths: int64 ``[B]`` rollout lengths.

    Returns:
        ``(replay, replayed, accepted)``: int64 ``[B, A]`` replay anchors ``a + L + 1`` (where nothing
        is replayed: ``length - 1``, an anchor without labels); bool ``[B, A]`` whether the block was
        rejected and is replayed; int64 ``[B, A]`` accepted draft tokens L (bonus not counted).

    Raises:
        ValueError: mismatched shapes.
    """
    if block_logits.shape[:-1] != labels.shape or labels.shape[:2] != anchors.shape:
        raise ValueError(f"shapes disagree: block_logits {tuple(block_logits.shape)}, labels {tuple(labels.shape)}, "
                         f"anchors {tuple(anchors.shape)}")
    H = labels.shape[-1]
    valid = labels != -100
    hit = (block_logits.argmax(-1) == labels) & valid
    accepted = hit.long().cumprod(-1).sum(-1)  # [B, A]
    at_reject = torch.gather(labels, -1, accepted.clamp(max=H - 1).unsqueeze(-1)).squeeze(-1)
    replay = anchors + accepted + 1
    last = (lengths.view(-1, 1) - 1).expand_as(anchors)
    # rejected at a real token, and the replayed block has at least one label (a' <= length - 2)
    replayed = (accepted < H) & (at_reject != -100) & (replay <= last - 1)
    return torch.where(replayed, replay, last), replayed, accepted


@torch.no_grad()
def rollout_target_logits(target, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The target's next-token logits on its own rollouts at chosen positions: one causal forward per
    call, no KV cache, no gradient.

    Args:
        target: frozen Hugging Face causal LM (Llama/Qwen family).
        input_ids: int64 ``[B, T]`` right-padded rollouts (padding after a rollout's end is never seen
            by its own positions: the forward is causal).
        positions: int64 ``[B, ...]`` positions t (clamped to ``T - 1``); row t predicts ``x_{t+1}``.

    Returns:
        float ``[B, ..., V]`` logits of ``p(. | x_0 .. x_t)``.
    """
    B, T = input_ids.shape
    dev = input_ids.device
    pos = torch.arange(T, device=dev).expand(B, T)
    h = run_layers(target, embed(target, input_ids), 0, num_layers(target), position_ids=pos)  # [B, T, D]
    idx = positions.clamp(min=0, max=T - 1).reshape(B, -1)  # [B, n]
    rows = torch.gather(h, 1, idx.unsqueeze(-1).expand(-1, -1, h.shape[-1]))  # [B, n, D]
    logits = readout_logits(target, rows)  # [B, n, V]
    return logits.view(*positions.shape, logits.shape[-1])


def forward_kl_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor,
                    weights: torch.Tensor, temperature: float) -> torch.Tensor:
    """Position-weighted forward KL from the target to the drafter, ``sum_rows w_k KL(p || q) /
    sum_rows w_k`` over valid rows (module docstring, step 3).

    Args:
        draft_logits: float ``[..., H, V]`` draft rows q (with gradient).
        target_logits: float ``[..., H, V]`` target rows (detached); p = softmax(logits / T), or the
            one-hot argmax row at T = 0 (then KL = -log q of the target's greedy token).
        valid: bool ``[..., H]`` rows that count.
        weights: float ``[H]`` position weights (DFlash decay, :func:`impl.tev.drafter.position_weights`).
        temperature: T >= 0.

    Returns:
        float32 scalar (0 with gradient when no row is valid).

    Raises:
        ValueError: mismatched shapes or T < 0.
    """
    if draft_logits.shape != target_logits.shape or draft_logits.shape[:-1] != valid.shape:
        raise ValueError(f"shapes disagree: draft {tuple(draft_logits.shape)}, target {tuple(target_logits.shape)}, "
                         f"valid {tuple(valid.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    tgt = target_logits.detach().float()
    if temperature > 0:
        logp = F.log_softmax(tgt / temperature, dim=-1)
        kl = (logp.exp() * (logp - logq)).sum(-1)
    else:
        kl = -logq.gather(-1, tgt.argmax(-1, keepdim=True)).squeeze(-1)
    w = weights.to(kl.device).view(*([1] * (valid.dim() - 1)), -1) * valid
    return (kl * w).sum() / w.sum().clamp(min=1e-9)
