"""ExitTrain: exit-guided draft-tree training and its matched controls (TEV paper, Sec. 5, Eqs. 12-15;
Sec. 6.2 "Exit-guided training"; App. C.2 row form, Eqs. 66-67; App. D "Training configuration").

One training step (all three objectives share it up to the extra term)
---------------------------------------------------------------------
1. **data**: ``batch_size`` training rollouts and ``anchors_per_seq`` random response anchors per
   rollout, drawn from one ``torch.Generator`` seeded with ``cfg.seed`` -- the same draws for every
   objective, so the three runs see identical contexts in identical order. A context is an anchor a
   of a rollout ``x``: committed tokens ``x_0 .. x_a`` (the drafter sees target features of
   ``x_0 .. x_{a-1}`` and the block ``[x_a, MASK...]``).
2. **drafter pass**: one batched block pass (:meth:`impl.tev.drafter.BlockDrafter.forward`) gives the
   position-wise draft-logit rows ``z[b, j, k]`` (``[B, A, H, V]``; row k = marginal of depth k + 1)
   and the dense position-decayed token loss L_tok (:func:`impl.tev.drafter.block_loss`, Eq. 15).
3. **trees** (``"exit"`` and ``"prefix"`` only): for the first ``tree_contexts_per_seq`` anchors of
   every rollout, the CURRENT drafter's detached rows of that same pass are fed to the inference
   builder (:func:`impl.tev.builder.best_first_tree`, budget B, depth H_tree) rooted at ``x_a``. The
   structure is then frozen for the update.
4. **target**: ONE no-grad target forward per step evaluates every node of every tree under its real
   tree-parent context: per rollout, the rows are ``[x_0 .. x_{a_max - 1} | tree_1 | tree_2 | ...]``;
   prefix rows are causal, the rows of tree j (anchored at a_j) see prefix positions ``< a_j``, their
   ancestors and themselves, at positions ``a_j + depth(v)`` (the tree mask of
   :func:`impl.tev.tree.tree_attention_mask`, packed); rollouts are right-padded into one batch. Row v
   gives p_v = p(. | x_{0..a_j}, pi(v)) (Eq. 1) at ``target_temperature``.
5. **exit law**: :func:`impl.tev.exit_law.exit_law` gives P(v), rho(v), w(v) = P(v) rho(v) (Eqs. 2, 4)
   in float64, detached (computed from no-grad target rows; no gradient can reach the target or w).
6. **loss**: L = L_tok + lambda_exit * L_exit with

       L_exit = sum_i sum_{v != r} omega_i(v) [-log q_{theta, depth(v)}(x_v | c_i)] / sum_i (|V_i| - 1)

   (Eq. 14), evaluated in the logsumexp row form of App. C.2 (Eq. 67): with
   ``row(v) = (b, j, depth(v) - 1)``, numerator ``= sum_m (sum_{v: row(v)=m} omega_v) lse(z_m) -
   sum_v omega_v z_{row(v), x_v}``: one log-normaliser per distinct row and a gather of the selected
   logits (:func:`exit_loss`). All nodes of a tree at one depth share a row. The root is omitted
   (no incoming draft edge), so the included weights of a tree sum to 1 - w(r).

Objectives (Sec. 6.2, "matched initialization, data, and compute"):

* ``"exit"``: omega(v) = w(v) (ExitTrain, Eq. 15).
* ``"prefix"``: omega(v) = P(v) rescaled "to match the total non-root exit weight while retaining the
  same loss denominator": per realised tree, ``omega(v) = P(v) * sum_{u != r} w(u) / sum_{u != r} P(u)
  = P(v) (1 - w(r)) / C_p(T)`` (0 when C_p = 0); ``prefix_scope="batch"`` rescales over the whole
  minibatch instead (one factor per step). The denominator is Eq. 14's in both cases.
* ``"token"``: L_tok only (lambda_exit ignored); same steps, batches, anchors, optimiser and schedule.
  It builds no trees and runs no target forward, so its wall time is lower: the match is in
  optimiser steps, batches and data (the paper's "compute budget" is not specified further), not in
  FLOPs.
* ``"opd"``: Draft-OPD, the paper's position-wise on-policy distillation control (Sec. 6 "Methods"):
  L_tok + lambda_opd * forward KL to the target on blocks replayed from where greedy verification of
  the step's own drafts rejected them (:mod:`impl.tev.opd`); no trees, one no-grad target forward
  over the step's rollouts and a second drafter pass.

Per-step compute (measured and returned in ``summary["per_step"]``): every objective runs one drafter
forward + backward over ``batch_size * anchors_per_seq`` blocks of H rows (V-wide LM head). ``"exit"``
and ``"prefix"`` add ``batch_size * tree_contexts_per_seq`` best-first builds (CPU heap,
O(B log B) each), one no-grad target forward over ``batch_size`` packed rows of length
``a_max + sum_j (N_j)`` (N_j <= B + 1 tree rows per context; attention is quadratic in that length), the
exit law per tree (float64, O(N V)) and one extra logsumexp over the ``B_seq * m * H`` rows.
Measured on ``models/tiny-ls`` (12 layers, hidden 128, V 4096; CPU, 1 thread) with H = 8, B = 64,
4 rollouts x 16 anchors, m = 2: ~0.05-0.08 s drafter work per step for every objective, plus
~0.16-0.22 s per step of trees (8 trees, 520 tree rows, ~980 packed target tokens) for exit/prefix.

Evaluation (held-out rollouts; :func:`evaluate_trees`, :func:`evaluate_decoding`):
teacher-forced tree tau = mean over held-out contexts of 1 + C_p(T) of the tree the drafter builds
(Eq. 11: the expected block length of any saturated verifier, bonus included), and real decoding with
:func:`impl.tev.decode.tev_decode` (verifier ``"tev"``) on held-out prompts: tau micro-averaged over
rounds pooled over prompts (bonus included), and the mean of 1 + C_p over the same rounds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
from tqdm import tqdm

from impl.models.depth import embed, num_layers, readout_logits, run_layers

from .builder import best_first_tree
from .decode import tev_decode
from .drafter import (
    BlockDrafter,
    RolloutData,
    _block_labels,
    _pad_batch,
    _sample_anchors,
    block_loss,
    drafter_optimizer,
    evaluate_drafter,
    position_weights,
)
from .exit_law import exit_law
from .opd import forward_kl_loss, replay_anchors, rollout_target_logits
from .schema import DEFAULTS as TEV_DEFAULTS
from .schema import TevSection
from .tree import DraftTree

log = logging.getLogger("impl.tev.train")

#: the ``tev.exittrain`` config defaults (:mod:`impl.tev.schema`): the one source of the defaults below
_E = TEV_DEFAULTS["exittrain"]

#: training objectives of :func:`train_exittrain`
OBJECTIVES = ("exit", "token", "prefix", "opd")
#: objectives that realise trees and evaluate them with the target (Eq. 14's L_exit or its prefix control)
TREE_OBJECTIVES = ("exit", "prefix")
PREFIX_SCOPES = ("tree", "batch")


@dataclass(frozen=True)
class ExitTrainConfig:
    """Settings of :func:`train_exittrain` (shared by the three objectives).

    Attributes:
        steps: optimiser steps (the same for every objective: matched compute in steps).
        batch_size: training rollouts per step (App. D: batch size 4).
        anchors_per_seq: contexts (response anchors) per rollout for the dense token loss.
        tree_contexts_per_seq: of those, the first m get a realised tree and L_exit (``"exit"`` /
            ``"prefix"``); ``<= anchors_per_seq``.
        budget: B, non-root nodes of each training tree (App. D: B = 64).
        depth: maximum training-tree depth; None: the drafter's block size H.
        lambda_exit: lambda_exit of Eq. 15 (the paper does not state its value). Note the scale of
            Eq. 14: the weights of one tree sum to 1 - w(r) <= 1 while the denominator counts B
            nodes per tree, so L_exit is about (weighted CE) / B.
        lambda_opd: weight of Draft-OPD's forward KL (``"opd"``), a per-row mean on L_tok's scale.
        target_temperature: temperature of the target rows p_v behind w(v), and of Draft-OPD's
            target distributions (0: one-hot argmax rows, the greedy exit law; the paper does not
            state it). On tiny-ls, w at T = 1 raised the T = 1
            tree coverage and lowered the greedy one relative to token-only fine-tuning.
        prefix_scope: ``"tree"`` (rescale P per realised tree) or ``"batch"`` (per minibatch).
        lr, weight_decay, betas, grad_clip: AdamW and gradient-norm clipping (App. D: lr 1e-4 for
            released drafters; the default, from :mod:`impl.tev.schema`, suits the tiny targets).
        warmup_steps: linear warm-up, then cosine decay to 10% (as :func:`train_drafter`).
        gamma: DFlash position decay of L_tok (depth d weighted ``exp(-(d-1)/gamma)``).
        seed: seeds the data order (rollout picks and anchors); identical across objectives.
        eval_budgets: budgets of the held-out evaluation trees.
        eval_depth: depth of the evaluation trees; None: ``depth``.
        eval_temperatures: target temperatures of the evaluation (0 = greedy).
        eval_contexts_per_seq: held-out contexts per held-out rollout for the teacher-forced tree
            tau (evenly spaced response anchors); 0 disables it.
        eval_prompts: held-out prompts decoded with ``tev_decode`` per (B, T); 0 disables it.
        eval_new_tokens: tokens generated per evaluation prompt.
        eval_before: also evaluate the initial drafter (identical for every objective).
        max_tree_rows: at most this many tree rows per packed target forward (memory bound).
        log_every: log a line every this many steps (0: never).
        progress: show a tqdm bar.
    """

    steps: int = _E["steps"]
    batch_size: int = _E["batch_size"]
    anchors_per_seq: int = 16
    tree_contexts_per_seq: int = _E["tree_contexts_per_seq"]
    budget: int = _E["budget"]
    depth: int | None = None
    lambda_exit: float = _E["lambda_exit"]
    lambda_opd: float = _E["lambda_opd"]
    target_temperature: float = _E["target_temperature"]
    prefix_scope: str = "tree"
    lr: float = _E["lr"]
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    warmup_steps: int = 10
    gamma: float | None = TEV_DEFAULTS["drafter"]["gamma"]
    seed: int = 0
    eval_budgets: tuple[int, ...] = (16, 64)
    eval_depth: int | None = None
    eval_temperatures: tuple[float, ...] = (0.0, 1.0)
    eval_contexts_per_seq: int = 16
    eval_prompts: int = 4
    eval_new_tokens: int = 32
    eval_before: bool = True
    max_tree_rows: int = 1024
    log_every: int = 25
    progress: bool = False

    @classmethod
    def from_section(cls, tev: "TevSection", **overrides) -> "ExitTrainConfig":
        """The settings a typed ``tev`` section (:class:`impl.tev.schema.TevSection`) names:
        ``tev.exittrain`` plus the DFlash decay ``tev.drafter.gamma`` (fine-tuning keeps the base
        drafter's L_tok weighting); settings the section does not hold keep the dataclass defaults,
        ``overrides`` win over both."""
        e = tev.exittrain
        named = {k: getattr(e, k) for k in ("steps", "batch_size", "tree_contexts_per_seq", "budget", "lambda_exit",
                                            "lambda_opd", "target_temperature", "lr")}
        return cls(**{**named, "gamma": tev.drafter.gamma, **overrides})


# --- the target over realised trees ----------------------------------------------------------------

def target_rows_to_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Target next-token distributions from target logits, as :func:`impl.tev.decode.tev_decode`:
    float32 ``softmax(logits / T)`` for T > 0, one-hot argmax rows (ties to the lowest id) for T = 0.

    Args:
        logits: float ``[..., V]``. temperature: T >= 0.

    Raises:
        ValueError: T < 0.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature > 0:
        return torch.softmax(logits.float() / temperature, dim=-1)
    return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()


@torch.no_grad()
def tree_target_logits(target, groups: Sequence[tuple[Sequence[int], Sequence[tuple[int, DraftTree]]]],
                       max_tree_rows: int = 1024) -> list[list[torch.Tensor]]:
    """Target logits at every node of realised trees under their real tree-parent contexts (TEV
    Eq. 1; Sec. 5 "evaluate every node with the frozen target model under its actual tree-parent
    context"), many trees per forward.

    Each group is one token sequence ``x`` and trees anchored in it: tree j with anchor a_j has root
    token ``x[a_j]`` and node v is evaluated on ``x_0 .. x_{a_j}, pi(v)``. Trees of one sequence are
    packed behind its shared prefix ``x_0 .. x_{a_max - 1}`` (causal) with a tree mask (tree rows see
    the prefix positions ``< a_j``, their ancestors and themselves; positions ``a_j + depth``); pieces
    are right-padded into batches of at most ``max_tree_rows`` tree rows (a larger tree gets a forward
    of its own). The target runs without a KV cache and without gradients.

    Args:
        target: frozen Hugging Face causal LM (Llama/Qwen family).
        groups: ``(sequence ids, [(anchor, tree), ...])``; ``0 <= anchor < len(sequence)`` and
            ``tree.tokens[0] == sequence[anchor]``.
        max_tree_rows: tree rows per forward (>= 1).

    Returns:
        ``out[g][j]``: float ``[N_j, V]`` target logits of tree j of group g (row v = node v), on the
        target's device.

    Raises:
        ValueError: an anchor outside the sequence, a root token that differs from ``x[a]``, a tree
            position beyond the target's ``max_position_embeddings``, or ``max_tree_rows < 1``.
    """
    if max_tree_rows < 1:
        raise ValueError(f"max_tree_rows must be >= 1, got {max_tree_rows}")
    dev = next(target.parameters()).device
    max_pos = getattr(target.config, "max_position_embeddings", None)
    out: list[list[torch.Tensor | None]] = [[None] * len(trees) for _, trees in groups]
    # pieces: (group, [tree indices]) with at most max_tree_rows tree rows (or one tree)
    pieces: list[tuple[int, list[int]]] = []
    for g, (seq, trees) in enumerate(groups):
        cur: list[int] = []
        rows = 0
        for j, (a, tree) in enumerate(trees):
            a = int(a)
            if not 0 <= a < len(seq):
                raise ValueError(f"group {g}, tree {j}: anchor {a} outside a sequence of {len(seq)} tokens")
            if tree.tokens[0] != int(seq[a]):
                raise ValueError(f"group {g}, tree {j}: root token {tree.tokens[0]} != sequence token {seq[a]} "
                                 f"at the anchor {a}")
            if max_pos is not None and a + tree.max_depth >= max_pos:
                raise ValueError(f"group {g}, tree {j}: position {a + tree.max_depth} exceeds the target context "
                                 f"of {max_pos}")
            if cur and rows + len(tree) > max_tree_rows:
                pieces.append((g, cur))
                cur, rows = [], 0
            cur.append(j)
            rows += len(tree)
        if cur:
            pieces.append((g, cur))
    # batches of pieces with at most max_tree_rows tree rows in all
    batches: list[list[tuple[int, list[int]]]] = []
    cur_b: list[tuple[int, list[int]]] = []
    rows = 0
    for g, js in pieces:
        n = sum(len(groups[g][1][j][1]) for j in js)
        if cur_b and rows + n > max_tree_rows:
            batches.append(cur_b)
            cur_b, rows = [], 0
        cur_b.append((g, js))
        rows += n
    if cur_b:
        batches.append(cur_b)

    for batch in batches:
        ids_l, pos_l, masks, spans = [], [], [], []
        for g, js in batch:
            seq, trees = groups[g]
            P = max(int(trees[j][0]) for j in js)
            ids = [int(t) for t in seq[:P]]
            pos = list(range(P))
            n_tree = sum(len(trees[j][1]) for j in js)
            S = P + n_tree
            m = torch.zeros(S, S, dtype=torch.bool)
            m[:P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
            off = P
            sp = []
            for j in js:
                a, tree = int(trees[j][0]), trees[j][1]
                n = len(tree)
                ids += tree.tokens
                pos += [a + d for d in tree.depths]
                m[off:off + n, :a] = True
                m[off:off + n, off:off + n] = tree.ancestor_mask()
                sp.append((g, j, off, n))
                off += n
            ids_l.append(ids)
            pos_l.append(pos)
            masks.append(m)
            spans.append(sp)
        S_max = max(len(x) for x in ids_l)
        nb = len(ids_l)
        ids_t = torch.zeros(nb, S_max, dtype=torch.long)
        pos_t = torch.zeros(nb, S_max, dtype=torch.long)
        mask_t = torch.eye(S_max, dtype=torch.bool).repeat(nb, 1, 1)  # padding rows see themselves only
        for b in range(nb):
            s = len(ids_l[b])
            ids_t[b, :s] = torch.tensor(ids_l[b])
            pos_t[b, :s] = torch.tensor(pos_l[b])
            mask_t[b, :s, :s] = masks[b]
        ids_t, pos_t, mask_t = ids_t.to(dev), pos_t.to(dev), mask_t.to(dev)
        h = run_layers(target, embed(target, ids_t), 0, num_layers(target), position_ids=pos_t,
                       attention_mask=mask_t[:, None])
        for b, sp in enumerate(spans):
            for g, j, off, n in sp:
                out[g][j] = readout_logits(target, h[b, off:off + n])
    return out  # type: ignore[return-value]


# --- weights and the exit loss ---------------------------------------------------------------------

def prefix_weights(P: Sequence[torch.Tensor], w: Sequence[torch.Tensor], scope: str = "tree") -> list[torch.Tensor]:
    """Prefix-weighted control weights (TEV Sec. 6.2): P(v) "rescaled to match the total non-root exit
    weight while retaining the same loss denominator".

    ``scope="tree"``: per realised tree i, ``omega_i(v) = P_i(v) * S_w,i / S_P,i`` with
    ``S_w,i = sum_{v != r} w_i(v) = 1 - w_i(r)`` and ``S_P,i = sum_{v != r} P_i(v) = C_p(T_i)``
    (0 for every node when S_P,i = 0). ``scope="batch"``: one factor ``sum_i S_w,i / sum_i S_P,i``
    for the whole minibatch. Either way ``sum_{v != r} omega = sum_{v != r} w`` over the scope.

    Args:
        P, w: per tree, float ``[N_i]`` (root first) from :func:`impl.tev.exit_law.exit_law`.
        scope: ``"tree"`` or ``"batch"``.

    Returns:
        per tree, float64 ``[N_i - 1]`` weights of the non-root nodes 1..N_i-1 (detached).

    Raises:
        ValueError: unknown scope or length mismatch.
    """
    if scope not in PREFIX_SCOPES:
        raise ValueError(f"unknown prefix scope {scope!r}; choose from {', '.join(PREFIX_SCOPES)}")
    if len(P) != len(w):
        raise ValueError(f"{len(P)} P vectors but {len(w)} w vectors")
    P = [p.detach().double() for p in P]
    w = [x.detach().double() for x in w]
    if scope == "batch":
        sw = sum(float(x[1:].sum()) for x in w)
        sp = sum(float(p[1:].sum()) for p in P)
        f = sw / sp if sp > 0 else 0.0
        return [p[1:] * f for p in P]
    out = []
    for p, x in zip(P, w):
        sp = float(p[1:].sum())
        out.append(p[1:] * (float(x[1:].sum()) / sp) if sp > 0 else torch.zeros_like(p[1:]))
    return out


def exit_loss(row_logits: torch.Tensor, node_rows: torch.Tensor, node_tokens: torch.Tensor,
              node_weights: torch.Tensor, n_nodes: int | None = None) -> torch.Tensor:
    """The exit-guided loss L_exit (TEV Eq. 14) in the logsumexp row form of App. C.2 (Eq. 67).

    ``L = [sum_m W_m lse(z_m) - sum_v omega_v z_{row(v), x_v}] / n_nodes`` with
    ``W_m = sum_{v: row(v) = m} omega_v``: one log-normaliser per distinct row and a gather of the
    selected logits, equal to ``sum_v omega_v (-log softmax(z_{row(v)})[x_v]) / n_nodes`` (Eq. 66).

    Args:
        row_logits: float ``[M, V]`` draft-logit rows z_m (with gradient); row m = (context, future
            position depth(v) - 1), shared by all nodes of one context at one depth.
        node_rows: int64 ``[n]`` row index of each non-root node.
        node_tokens: int64 ``[n]`` incoming draft token x_v.
        node_weights: float ``[n]`` omega_v (w(v), or rescaled P(v)); detached here.
        n_nodes: the Eq. 14 denominator sum_i (|V_i| - 1); None: ``n``.

    Returns:
        float32 scalar (0 when there are no nodes); gradients flow into ``row_logits`` only.

    Raises:
        ValueError: mismatched shapes, a row or token index out of range, negative weights.
    """
    if row_logits.dim() != 2:
        raise ValueError(f"row_logits must be [M, V], got {tuple(row_logits.shape)}")
    n = node_rows.numel()
    if node_tokens.numel() != n or node_weights.numel() != n:
        raise ValueError(f"node_rows, node_tokens, node_weights must have equal lengths, got {n}, "
                         f"{node_tokens.numel()}, {node_weights.numel()}")
    denom = n if n_nodes is None else int(n_nodes)
    if n == 0 or denom == 0:
        return row_logits.sum() * 0.0
    M, V = row_logits.shape
    rows = node_rows.to(device=row_logits.device, dtype=torch.long).flatten()
    toks = node_tokens.to(device=row_logits.device, dtype=torch.long).flatten()
    if int(rows.min()) < 0 or int(rows.max()) >= M or int(toks.min()) < 0 or int(toks.max()) >= V:
        raise ValueError("a node row or token index is outside row_logits")
    om = node_weights.detach().to(device=row_logits.device, dtype=torch.float32).flatten()
    if bool((om < 0).any()):
        raise ValueError("node weights must be non-negative")
    z = row_logits.float()
    W = torch.zeros(M, dtype=torch.float32, device=z.device).index_add_(0, rows, om)
    used = torch.nonzero(W > 0).flatten()  # rows without weight need no log-normaliser
    num = (W[used] * torch.logsumexp(z[used], dim=-1)).sum() - (om * z[rows, toks]).sum()
    return num / denom


# --- building trees with the drafter ---------------------------------------------------------------

def _tree_depth(cfg_depth: int | None, H: int) -> int:
    d = H if cfg_depth is None else int(cfg_depth)
    if not 1 <= d <= H:
        raise ValueError(f"tree depth must be in [1, drafter.block_size={H}], got {d}")
    return d


def _build(block_logits: torch.Tensor, seq: Sequence[int], anchors: Sequence[int], budget: int, depth: int,
           max_pos: int | None) -> list[DraftTree]:
    """Best-first trees from detached ``[A, H, V]`` rows, one per anchor (depth cut at the context end)."""
    trees = []
    for j, a in enumerate(anchors):
        a = int(a)
        d = depth if max_pos is None else max(0, min(depth, max_pos - 1 - a))
        trees.append(best_first_tree(block_logits[j].detach(), budget, d, root_token=int(seq[a])))
    return trees


@dataclass
class TreeStats:
    """Realised trees of a set of contexts and their detached target-derived quantities.

    Attributes:
        trees: per context, the :class:`DraftTree`.
        P, rho, w: per context, float64 ``[N]`` (Eqs. 2, 4) on CPU.
    """

    trees: list[DraftTree]
    P: list[torch.Tensor]
    rho: list[torch.Tensor]
    w: list[torch.Tensor]

    @property
    def coverages(self) -> list[float]:
        """C_p(T) per tree (Eq. 6): expected accepted draft tokens (bonus not counted)."""
        return [float(p[1:].sum()) for p in self.P]


def _exit_laws(target, groups, temperature: float, max_tree_rows: int) -> TreeStats:
    logits = tree_target_logits(target, groups, max_tree_rows)
    trees, Ps, rhos, ws = [], [], [], []
    for (_, items), lg in zip(groups, logits):
        for (_, tree), l in zip(items, lg):
            probs = target_rows_to_probs(l, temperature).cpu()
            P, rho, w = exit_law(tree.parents, tree.tokens, probs)
            trees.append(tree)
            Ps.append(P)
            rhos.append(rho)
            ws.append(w)
    return TreeStats(trees, Ps, rhos, ws)


def _node_tensors(trees: list[DraftTree], weights: list[torch.Tensor], H: int):
    """Flattened (row, token, weight) of every non-root node; tree i's depth-d node uses row i*H + d-1."""
    rows, toks, oms = [], [], []
    for i, (tree, om) in enumerate(zip(trees, weights)):
        if len(tree) > 1:
            rows.append(torch.tensor(tree.depths[1:], dtype=torch.long) - 1 + i * H)
            toks.append(torch.tensor(tree.tokens[1:], dtype=torch.long))
            oms.append(om.double())
    if not rows:
        z = torch.zeros(0, dtype=torch.long)
        return z, z, torch.zeros(0, dtype=torch.float64)
    return torch.cat(rows), torch.cat(toks), torch.cat(oms)


# --- evaluation -----------------------------------------------------------------------------------

def _eval_anchors(s: Sequence[int], p: int, n: int) -> list[int]:
    lo, hi = max(p - 1, 0), len(s) - 2
    if hi < lo or n <= 0:
        return []
    if hi - lo + 1 <= n:
        return list(range(lo, hi + 1))
    return sorted({lo + round(i * (hi - lo) / (n - 1)) for i in range(n)}) if n > 1 else [lo]


@torch.no_grad()
def evaluate_trees(target, drafter: BlockDrafter, data: RolloutData, indices: Sequence[int], *,
                   budgets: Sequence[int], depth: int, temperatures: Sequence[float], contexts_per_seq: int = 16,
                   max_tree_rows: int = 1024, per_context: bool = False) -> dict:
    """Teacher-forced tree tau on rollout contexts: for evenly spaced response anchors of the given
    rollouts, the drafter drafts, the best-first builder builds a tree (budget B, depth), the target
    evaluates it (one packed forward per budget) and each context contributes 1 + C_p(T) (Eq. 11: the
    expected block length of every saturated exact verifier, bonus included; at T = 0 it is the
    greedy block length exactly).

    Args:
        target, drafter: frozen target and the drafter to evaluate (not modified; eval mode inside).
        data: rollouts with features for ``drafter.feature_layers``.
        indices: rollout indices (e.g. ``data.heldout_idx``).
        budgets, depth, temperatures: tree budgets, tree depth (``<= block_size``), target
            temperatures (0 = greedy one-hot rows).
        contexts_per_seq: anchors per rollout (all response anchors if fewer exist).
        max_tree_rows: tree rows per target forward.
        per_context: also return every context's value (for paired comparisons of drafters: the
            contexts depend only on ``data``, ``indices`` and ``contexts_per_seq``).

    Returns:
        ``{"B<b>": {"T<t>": mean 1 + C_p}}`` plus ``"n_contexts"``, and with ``per_context``
        ``"per_context": {"B<b>": {"T<t>": [1 + C_p per context]}}`` in a fixed context order.

    Raises:
        ValueError: a depth outside ``[1, block_size]``.
    """
    H = drafter.block_size
    depth = _tree_depth(depth, H)
    dev = drafter.fc.weight.device
    max_pos = getattr(target.config, "max_position_embeddings", None)
    was = drafter.training
    drafter.eval()
    rows = []  # (seq, anchors, block logits [A, H, V] on CPU)
    for i in indices:
        s, p = data.sequences[i]
        anchors = _eval_anchors(s, p, contexts_per_seq)
        if not anchors:
            continue
        ids, fts, lengths = _pad_batch([(s, p)], [data.features[i]], dev)
        lg = drafter(fts, ids, torch.tensor([anchors], device=dev), lengths)[0].float().cpu()
        rows.append((s, anchors, lg))
    drafter.train(was)
    out: dict = {"n_contexts": sum(len(a) for _, a, _ in rows)}
    per: dict = {}
    for b in budgets:
        groups = [(s, list(zip(anchors, _build(lg, s, anchors, int(b), depth, max_pos)))) for s, anchors, lg in rows]
        logits = tree_target_logits(target, groups, max_tree_rows)
        res = {}
        for t in temperatures:
            taus = []
            for (_, items), lgs in zip(groups, logits):
                for (_, tree), l in zip(items, lgs):
                    P, _, _ = exit_law(tree.parents, tree.tokens, target_rows_to_probs(l, float(t)).cpu())
                    taus.append(1.0 + float(P[1:].sum()))
            res[f"T{float(t):g}"] = sum(taus) / len(taus) if taus else float("nan")
            per.setdefault(f"B{int(b)}", {})[f"T{float(t):g}"] = taus
        out[f"B{int(b)}"] = res
    if per_context:
        out["per_context"] = per
    return out


@torch.no_grad()
def evaluate_decoding(target, drafter: BlockDrafter, prompts: Sequence[Sequence[int]], *, budgets: Sequence[int],
                      depth: int, temperatures: Sequence[float], new_tokens: int = 32, seed: int = 0) -> dict:
    """Real tree decoding (:func:`impl.tev.decode.tev_decode`, verifier ``"tev"``, best-first trees)
    on prompts, per budget and temperature.

    Prompt k at T > 0 uses a CPU generator seeded ``seed * 1000 + k`` (common random numbers across
    drafters).

    Returns:
        ``{"B<b>": {"T<t>": {"mean_tau": tau micro-averaged over rounds pooled over prompts (bonus
        included), "mean_expected_tau": mean of 1 + C_p over the same rounds, "rounds", "tokens"}}}``.
    """

    was = drafter.training
    drafter.eval()
    out: dict = {}
    for b in budgets:
        res = {}
        for t in temperatures:
            taus, covs, toks = [], [], 0
            for k, pr in enumerate(prompts):
                gen = torch.Generator().manual_seed(seed * 1000 + k)
                r = tev_decode(target, drafter, list(pr), new_tokens, budget=int(b), depth=depth, verifier="tev",
                               temperature=float(t), generator=gen)
                taus += r.taus
                covs += r.coverages
                toks += len(r.tokens)
            res[f"T{float(t):g}"] = {"mean_tau": sum(taus) / max(len(taus), 1),
                                     "mean_expected_tau": 1.0 + sum(covs) / max(len(covs), 1),
                                     "rounds": len(taus), "tokens": toks}
        out[f"B{int(b)}"] = res
    drafter.train(was)
    return out


def _evaluate(target, drafter, data: RolloutData, cfg: ExitTrainConfig, depth: int) -> dict:
    held = list(data.heldout_idx)
    ev_depth = _tree_depth(cfg.eval_depth if cfg.eval_depth is not None else depth, drafter.block_size)
    out = {"teacher_forced": evaluate_drafter(drafter, [data.sequences[i] for i in held],
                                              [data.features[i] for i in held], cfg.gamma)}
    if cfg.eval_contexts_per_seq > 0 and cfg.eval_budgets:
        out["tree_tau"] = evaluate_trees(target, drafter, data, held, budgets=cfg.eval_budgets, depth=ev_depth,
                                         temperatures=cfg.eval_temperatures,
                                         contexts_per_seq=cfg.eval_contexts_per_seq, max_tree_rows=cfg.max_tree_rows)
    if cfg.eval_prompts > 0 and cfg.eval_budgets:
        prompts = [data.sequences[i][0][:data.sequences[i][1]] for i in held[:cfg.eval_prompts]]
        out["decode"] = evaluate_decoding(target, drafter, prompts, budgets=cfg.eval_budgets, depth=ev_depth,
                                          temperatures=cfg.eval_temperatures, new_tokens=cfg.eval_new_tokens,
                                          seed=cfg.seed)
    return out


# --- training -------------------------------------------------------------------------------------

def clone_drafter(target, drafter: BlockDrafter) -> BlockDrafter:
    """A fresh :class:`BlockDrafter` for ``target`` with the same config and weights as ``drafter``
    (the target's shared embedding / LM head are not copied; the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        new = BlockDrafter(target, drafter.config)
    new.load_state_dict(drafter.state_dict())
    return new


def train_exittrain(target, drafter_init: BlockDrafter, rollouts: RolloutData, cfg: ExitTrainConfig = ExitTrainConfig(),
                    objective: str = "exit") -> tuple[BlockDrafter, dict]:
    """Fine-tune a copy of ``drafter_init`` with ExitTrain (``"exit"``: L_tok + lambda L_exit with
    w(v), TEV Eqs. 14-15) or a matched control (``"token"``: L_tok only; ``"prefix"``: rescaled P(v)
    instead of w(v), Sec. 6.2; ``"opd"``: Draft-OPD, :mod:`impl.tev.opd`); module docstring for one
    step and its compute.

    Every objective uses the same initial weights (a copy; ``drafter_init`` is not modified), the same
    rollouts, the same generator-driven sequence of (rollout, anchor) draws, the same optimiser,
    schedule and number of steps.

    Args:
        target: frozen causal LM (parameters untouched, no gradients; eval mode during the call).
        drafter_init: the initial drafter, e.g. from :func:`impl.tev.drafter.train_drafter`.
        rollouts: :class:`impl.tev.drafter.RolloutData` for the drafter's feature layers (e.g. from
            :func:`impl.tev.drafter.make_rollouts`, shared across objectives).
        cfg: :class:`ExitTrainConfig`.
        objective: ``"exit"``, ``"token"``, ``"prefix"`` or ``"opd"``.

    Returns:
        ``(drafter, summary)``; the drafter is in eval mode. ``summary``: ``"objective"``;
        ``"losses"``: per step ``{"total", "token", "exit", "opd"}`` lists (``exit`` filled for
        ``"exit"`` / ``"prefix"``, ``opd`` for ``"opd"``);
        ``"train_tree_tau"``: per step mean 1 + C_p of the realised training trees (``"exit"`` /
        ``"prefix"``); ``"train_chain_tau"`` and ``"replay_share"`` (``"opd"``): per step mean
        1 + accepted greedy draft tokens of the step's blocks and the share of blocks replayed;
        ``"first_batch"``: ``{"rollouts", "anchors"}`` of step 1;
        ``"data_order_sha1"``: hash of every step's draws; ``"seconds"``: wall-clock
        ``{"drafter", "trees", "replay", "train", "eval", "total"}`` (drafter = forward(s), loss,
        backward and optimiser; trees = build + target forward + exit law; replay = Draft-OPD's
        verification and target forward); ``"per_step"``: mean seconds and mean
        tree rows / packed target tokens per step; ``"before"`` (if ``cfg.eval_before``) and
        ``"after"``: held-out evaluation dicts (``"teacher_forced"``: :func:`evaluate_drafter`;
        ``"tree_tau"``: :func:`evaluate_trees`; ``"decode"``: :func:`evaluate_decoding`);
        ``"config"``.

    Raises:
        ValueError: unknown objective or prefix scope, non-positive steps / sizes,
            ``tree_contexts_per_seq`` outside ``[1, anchors_per_seq]`` (for ``"exit"`` / ``"prefix"``),
            a tree depth outside ``[1, block_size]``, rollout features for other layers, or no
            training rollouts.
    """
    t_all = time.perf_counter()
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
    if cfg.prefix_scope not in PREFIX_SCOPES:
        raise ValueError(f"unknown prefix_scope {cfg.prefix_scope!r}; choose from {', '.join(PREFIX_SCOPES)}")
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.anchors_per_seq < 1 or cfg.budget < 0:
        raise ValueError("steps, batch_size and anchors_per_seq must be >= 1 and budget >= 0")
    if objective in TREE_OBJECTIVES and not 1 <= cfg.tree_contexts_per_seq <= cfg.anchors_per_seq:
        raise ValueError(f"tree_contexts_per_seq must be in [1, anchors_per_seq={cfg.anchors_per_seq}], "
                         f"got {cfg.tree_contexts_per_seq}")
    if tuple(rollouts.feature_layers) != tuple(drafter_init.feature_layers):
        raise ValueError(f"rollout features are for layers {list(rollouts.feature_layers)}, the drafter reads "
                         f"{drafter_init.feature_layers}")
    train_idx = list(rollouts.train_idx)
    if not train_idx:
        raise ValueError("no training rollouts")
    H = drafter_init.block_size
    depth = _tree_depth(cfg.depth, H)
    drafter = clone_drafter(target, drafter_init)
    dev = drafter.fc.weight.device
    max_pos = getattr(target.config, "max_position_embeddings", None)
    was_training = target.training
    target.eval()
    seqs, feats = rollouts.sequences, rollouts.features

    t_eval = 0.0
    before = None
    if cfg.eval_before:
        t0 = time.perf_counter()
        before = _evaluate(target, drafter, rollouts, cfg, depth)
        t_eval += time.perf_counter() - t0

    gen = torch.Generator().manual_seed(cfg.seed)
    weights = position_weights(H, cfg.gamma, dev)
    opt, sched = drafter_optimizer(drafter, cfg)
    losses = {"total": [], "token": [], "exit": [], "opd": []}
    train_tau: list[float] = []
    chain_tau: list[float] = []
    replay_share: list[float] = []
    order = hashlib.sha1()
    first_batch = None
    t_drafter = t_trees = t_replay = 0.0
    n_tree_rows = n_packed = 0
    m = min(cfg.tree_contexts_per_seq, cfg.anchors_per_seq)
    drafter.train()
    try:
        bar = tqdm(range(cfg.steps), desc=f"exittrain[{objective}]", disable=not cfg.progress, mininterval=5)
    except ImportError:  # pragma: no cover
        bar = range(cfg.steps)
    t_train0 = time.perf_counter()
    for step in bar:
        # identical draws for every objective
        pick = torch.randint(0, len(train_idx), (min(cfg.batch_size, len(train_idx)),), generator=gen).tolist()
        items = [seqs[train_idx[i]] for i in pick]
        anchors = _sample_anchors(items, cfg.anchors_per_seq, gen, dev)
        order.update(json.dumps([[train_idx[i] for i in pick], anchors.tolist()]).encode())
        if first_batch is None:
            first_batch = {"rollouts": [train_idx[i] for i in pick], "anchors": anchors.tolist()}
        ids, fts, lengths = _pad_batch(items, [feats[train_idx[i]] for i in pick], dev)

        t0 = time.perf_counter()
        logits = drafter(fts, ids, anchors, lengths)  # [B, A, H, V]
        labels = _block_labels(ids, anchors, lengths, H)  # [B, A, H]
        l_tok = block_loss(logits, labels, weights)
        loss = l_tok
        t_drafter += time.perf_counter() - t0
        if objective == "opd":
            t0 = time.perf_counter()
            replay, replayed, accepted = replay_anchors(logits.detach(), labels, anchors, lengths)  # [B, A] each
            r_valid = (_block_labels(ids, replay, lengths, H) != -100) & replayed.unsqueeze(-1)  # [B, A, H]
            r_pos = replay.unsqueeze(-1) + torch.arange(H, device=dev)  # [B, A, H]
            tgt = rollout_target_logits(target, ids, r_pos)  # [B, A, H, V]
            chain_tau.append(1.0 + float(accepted.float().mean()))
            replay_share.append(float(replayed.float().mean()))
            t_replay += time.perf_counter() - t0
            t0 = time.perf_counter()
            r_logits = drafter(fts, ids, replay, lengths)  # [B, A, H, V], second pass with gradient
            l_opd = forward_kl_loss(r_logits, tgt, r_valid, weights, cfg.target_temperature)
            loss = l_tok + cfg.lambda_opd * l_opd
            losses["opd"].append(float(l_opd.detach()))
            t_drafter += time.perf_counter() - t0
        if objective in TREE_OBJECTIVES:
            t0 = time.perf_counter()
            ctx_logits = logits[:, :m]  # [B, m, H, V] rows of the tree contexts, with gradient
            with torch.no_grad():
                det = ctx_logits.detach().float().cpu()
                groups = []
                for b, (s, _) in enumerate(items):
                    anc = anchors[b, :m].tolist()
                    groups.append((s, list(zip(anc, _build(det[b], s, anc, cfg.budget, depth, max_pos)))))
                stats = _exit_laws(target, groups, cfg.target_temperature, cfg.max_tree_rows)
                if objective == "exit":
                    om = [w[1:] for w in stats.w]
                else:
                    om = prefix_weights(stats.P, stats.w, cfg.prefix_scope)
                rows, toks, omv = _node_tensors(stats.trees, om, H)
                n_nodes = sum(len(t) - 1 for t in stats.trees)
                n_tree_rows += sum(len(t) for t in stats.trees)
                n_packed += sum(max(a for a, _ in it) + sum(len(t) for _, t in it) for _, it in groups)
                train_tau.append(1.0 + sum(stats.coverages) / len(stats.coverages))
            t_trees += time.perf_counter() - t0
            t0 = time.perf_counter()
            l_exit = exit_loss(ctx_logits.reshape(-1, ctx_logits.shape[-1]), rows, toks, omv, n_nodes)
            loss = l_tok + cfg.lambda_exit * l_exit
            losses["exit"].append(float(l_exit.detach()))
            t_drafter += time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip and cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        t_drafter += time.perf_counter() - t0
        losses["total"].append(float(loss.detach()))
        losses["token"].append(float(l_tok.detach()))
        if cfg.log_every and (step + 1) % cfg.log_every == 0:
            k = cfg.log_every
            msg = f"exittrain[{objective}] step {step + 1}/{cfg.steps} loss {sum(losses['total'][-k:]) / k:.4f}"
            if train_tau:
                msg += f" train tree tau {sum(train_tau[-k:]) / len(train_tau[-k:]):.3f}"
            if chain_tau:
                msg += f" train chain tau {sum(chain_tau[-k:]) / len(chain_tau[-k:]):.3f}"
            log.info(msg)
    t_train = time.perf_counter() - t_train0
    drafter.eval()
    t0 = time.perf_counter()
    after = _evaluate(target, drafter, rollouts, cfg, depth)
    t_eval += time.perf_counter() - t0
    target.train(was_training)
    steps = cfg.steps
    summary = {
        "objective": objective,
        "losses": losses,
        "train_tree_tau": train_tau,
        "train_chain_tau": chain_tau,
        "replay_share": replay_share,
        "first_batch": first_batch,
        "data_order_sha1": order.hexdigest(),
        "seconds": {"drafter": t_drafter, "trees": t_trees, "replay": t_replay, "train": t_train, "eval": t_eval,
                    "total": time.perf_counter() - t_all},
        "per_step": {"seconds": t_train / steps, "drafter_seconds": t_drafter / steps, "tree_seconds": t_trees / steps,
                     "replay_seconds": t_replay / steps,
                     "blocks": min(cfg.batch_size, len(train_idx)) * cfg.anchors_per_seq,
                     "trees": min(cfg.batch_size, len(train_idx)) * m if objective in TREE_OBJECTIVES else 0,
                     "tree_rows": n_tree_rows / steps, "target_tokens": n_packed / steps},
        "before": before,
        "after": after,
        "config": {**asdict(cfg), "objective": objective, "depth_resolved": depth},
    }
    return drafter, summary
