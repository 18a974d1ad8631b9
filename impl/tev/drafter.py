"""A DFlash-style block drafter and its training on target rollouts (TEV paper, Sec. 2 "Tree
speculative decoding", Sec. 5 and App. C.2 "DFlash's position-wise draft-logit row", App. D
"Training configuration"; DFlash, Chen et al. 2026).

Architecture (:class:`BlockDrafter`)
------------------------------------
A few NON-causal transformer layers (pre-norm attention + SwiGLU MLP, RoPE) draft a whole block in
one pass:

* **context**: the frozen target's pre-norm hidden states after the decoder layers
  ``feature_layers`` (1-based depths, default three spread over the depth) are concatenated per
  context position, projected to the hidden size (``fc``) and RMS-normalised. In every draft layer
  these projected features supply extra keys/values (the layer's own ``k_proj``/``v_proj``, RoPE at
  the context position); they are never updated by the draft layers, so their K/V can be cached and
  extended incrementally (:class:`DrafterContext`).
* **block**: ``[last committed token, MASK x (H-1)]`` at positions ``n_ctx .. n_ctx + H - 1`` where
  ``n_ctx`` is the number of context positions. The last committed token has no target features yet
  (its target KV is computed by the next tree forward). Tokens are embedded with the target's (frozen,
  shared) input embedding; MASK is a learned embedding. Block queries attend to every context
  position and to every block position (bidirectional).
* **output**: the drafter's own final RMSNorm, then the target's (frozen, shared) LM head. Row k of
  the ``[H, V]`` logits is the marginal of the token at depth k + 1 after the last committed token,
  i.e. of position ``n_ctx + k + 1`` (next-token shift: row k sits at position ``n_ctx + k``). DDTree
  takes the tokens of depth-(k+1) nodes from row k.

This is DFlash's block with its anchor in front: DFlash feeds ``[anchor, MASK x (B-1)]`` and reads
B - 1 marginals at the mask positions; here H rows read H marginals with a next-token shift, so H
inputs draft H tokens. Draft attention is plain PyTorch ``scaled_dot_product_attention``.

Training (:func:`train_drafter`)
--------------------------------
The frozen target generates responses (greedy or sampled) to prompt ids (the chat + math prompt mixture
of :mod:`impl.tev.prompts`), as the paper trains on target rollouts (App. D). Blocks are anchored
at random response positions a (block input ``[x_a, MASK...]``, context = features of positions
``< a``); many anchors of one sequence share one drafter pass with a block-diagonal mask (as in
DFlash/SpecForge). The dense token loss L_tok (Eq. 15) weights the cross-entropy of depth d = k + 1
by ``exp(-(d - 1) / gamma)`` (DFlash's exponential position decay, ``w_k = exp(-(k-1)/gamma)`` for
mask position k >= 1) and divides by the sum of the weights; AdamW. The rollouts and their features
are made once (:func:`make_rollouts`, :class:`RolloutData`) and can be shared with ExitTrain; the
exit-guided term L_exit lives in :mod:`impl.tev.train`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from impl.models.depth import embed, run_layers
from impl.spec.ar import ar_decode, check_prompt_ids

from ..schedule import warmup_decay_scheduler
from .schema import DEFAULTS as TEV_DEFAULTS
from .schema import Drafter

log = logging.getLogger("impl.tev.drafter")

#: the ``tev.drafter`` config defaults (:mod:`impl.tev.schema`): the one source of the defaults below
_D = TEV_DEFAULTS["drafter"]

CONFIG_NAME = "drafter_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1


# --- configuration ------------------------------------------------------------------------------

def default_feature_layers(num_layers: int, k: int = 3) -> tuple[int, ...]:
    """``k`` target depths (1-based) spread evenly from 2 to L - 2 (DFlash/EAGLE-3 style low, middle
    and high features; for L = 12, k = 3: ``(2, 6, 10)``).

    Raises:
        ValueError: ``num_layers < 1`` or ``k < 1``.
    """
    if num_layers < 1 or k < 1:
        raise ValueError(f"need num_layers >= 1 and k >= 1, got {num_layers}, {k}")
    lo, hi = min(2, num_layers), max(min(2, num_layers), num_layers - 2)
    if k == 1:
        return ((lo + hi) // 2,)
    out = sorted({int(round(lo + (hi - lo) * i / (k - 1))) for i in range(k)})
    return tuple(out)


@dataclass(frozen=True)
class DrafterConfig:
    """Architecture of a :class:`BlockDrafter`.

    Attributes:
        block_size: H, the number of drafted positions (block = last token + H - 1 masks); the
            maximum tree depth the drafter supports.
        n_layers: number of non-causal draft layers.
        feature_layers: 1-based target depths whose hidden states form the context features; None:
            :func:`default_feature_layers` (3 layers).
        n_heads: attention heads; None: the target's ``num_attention_heads``.
        intermediate_size: MLP width; None: the target's ``intermediate_size``.
        rope_theta: RoPE base; None: the target's (10000 if not found).
        rms_norm_eps: RMSNorm epsilon.
        init_std: standard deviation of the normal weight initialisation.
    """

    block_size: int = _D["block_size"]
    n_layers: int = _D["n_layers"]
    feature_layers: tuple[int, ...] | None = None
    n_heads: int | None = None
    intermediate_size: int | None = None
    rope_theta: float | None = None
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02


def _target_rope_theta(cfg) -> float:
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0) or 10000.0)


def _resolve_config(target, config: DrafterConfig) -> DrafterConfig:
    tc = target.config
    n_layers_target = int(tc.num_hidden_layers)
    fl = config.feature_layers
    fl = default_feature_layers(n_layers_target) if fl is None else tuple(int(x) for x in fl)
    if not fl:
        raise ValueError("feature_layers must name at least one target layer")
    if len(set(fl)) != len(fl) or any(not 1 <= d <= n_layers_target for d in fl):
        raise ValueError(f"feature_layers {fl} must be distinct depths in [1, {n_layers_target}]")
    n_heads = int(config.n_heads or tc.num_attention_heads)
    h = int(tc.hidden_size)
    if h % n_heads or (h // n_heads) % 2:
        raise ValueError(f"hidden size {h} must split into {n_heads} heads of even size (RoPE)")
    if config.block_size < 1 or config.n_layers < 1:
        raise ValueError(f"block_size and n_layers must be >= 1, got {config.block_size}, {config.n_layers}")
    return DrafterConfig(
        block_size=int(config.block_size),
        n_layers=int(config.n_layers),
        feature_layers=fl,
        n_heads=n_heads,
        intermediate_size=int(config.intermediate_size or tc.intermediate_size),
        rope_theta=float(config.rope_theta or _target_rope_theta(tc)),
        rms_norm_eps=float(config.rms_norm_eps),
        init_std=float(config.init_std),
    )


def _target_signature(target) -> dict:
    tc = target.config
    return {
        "hidden_size": int(tc.hidden_size),
        "vocab_size": int(tc.vocab_size),
        "num_hidden_layers": int(tc.num_hidden_layers),
        "name_or_path": str(getattr(tc, "_name_or_path", "") or ""),
    }


# --- layers -------------------------------------------------------------------------------------

def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention, as Llama) of ``x`` ``[B, nh, S, hd]`` at integer
    positions ``pos`` ``[B, S]``."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos.to(torch.float32).unsqueeze(-1) * inv  # [B, S, hd/2]
    emb = torch.cat([ang, ang], dim=-1).unsqueeze(1)  # [B, 1, S, hd]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class _DraftLayer(nn.Module):
    """Pre-norm non-causal attention (queries: block; keys/values: context features + block) and a
    SwiGLU MLP."""

    def __init__(self, hidden: int, n_heads: int, inter: int, eps: float, theta: float):
        super().__init__()
        self.n_heads, self.head_dim, self.theta = n_heads, hidden // n_heads, theta
        self.attn_norm = nn.RMSNorm(hidden, eps=eps)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[B, nh, T, hd]`` of projected context features ``ctx`` ``[B, T, h]`` at ``pos``."""
        return _rope(self._heads(self.k_proj(ctx)), pos, self.theta), self._heads(self.v_proj(ctx))

    def forward(self, x, pos, ctx_k, ctx_v, mask):
        a = self.attn_norm(x)
        q = _rope(self._heads(self.q_proj(a)), pos, self.theta)
        k = torch.cat([ctx_k, _rope(self._heads(self.k_proj(a)), pos, self.theta)], dim=2)
        v = torch.cat([ctx_v, self._heads(self.v_proj(a))], dim=2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o_proj(o.transpose(1, 2).reshape(x.shape))
        m = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


@dataclass
class DrafterContext:
    """Cached context keys/values of a :class:`BlockDrafter` for one sequence (batch 1).

    Attributes:
        keys, values: one ``[1, nh, n, hd]`` tensor per draft layer (RoPE applied at positions
            ``0 .. n-1``).
        length: n, the number of context positions (target features) cached.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0


# --- the drafter --------------------------------------------------------------------------------

class BlockDrafter(nn.Module):
    """DFlash-style block drafter conditioned on a frozen target's hidden-state features (module
    docstring; TEV Sec. 2, Sec. 5 "DFlash's position-wise marginal distribution").

    The target's input embedding and LM head are used (frozen, detached) but are not registered as
    submodules: ``parameters()``, ``state_dict()`` and :meth:`save` hold the drafter's own weights
    only.

    Args:
        target: the Hugging Face causal LM (Llama/Qwen family) the drafter serves.
        config: :class:`DrafterConfig`; unset fields are resolved from the target.

    Attributes:
        config: the resolved :class:`DrafterConfig` (every field set).
        block_size: H; feature_layers: ``list[int]`` of 1-based target depths; feature_dim:
            ``len(feature_layers) * hidden_size``.

    Raises:
        ValueError: feature layers outside ``[1, L]`` or repeated, a hidden size that does not
            split into heads of even size, ``block_size < 1`` or ``n_layers < 1``.
    """

    def __init__(self, target, config: DrafterConfig = DrafterConfig()):
        super().__init__()
        self.config = _resolve_config(target, config)
        self.target_signature = _target_signature(target)
        c = self.config
        h = self.target_signature["hidden_size"]
        self.hidden_size = h
        self.fc = nn.Linear(len(c.feature_layers) * h, h, bias=False)
        self.ctx_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        self.layers = nn.ModuleList(
            _DraftLayer(h, c.n_heads, c.intermediate_size, c.rms_norm_eps, c.rope_theta) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self._init_weights()
        p = next(target.parameters())
        self.to(device=p.device, dtype=p.dtype)
        object.__setattr__(self, "_shared", (target.get_input_embeddings(), target.get_output_embeddings()))

    def _init_weights(self) -> None:
        std = self.config.init_std
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=std)
        nn.init.normal_(self.mask_embedding, std=std)

    # -- properties ----------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """H: drafted positions per block (the largest tree depth this drafter serves)."""
        return self.config.block_size

    @property
    def feature_layers(self) -> list[int]:
        """1-based target depths whose pre-norm hidden states form the context features."""
        return list(self.config.feature_layers)

    @property
    def feature_dim(self) -> int:
        """F = len(feature_layers) * hidden_size, the width of one context feature row."""
        return len(self.config.feature_layers) * self.hidden_size

    # -- building blocks -----------------------------------------------------------------------

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[..., h]`` of block ids (``-1`` = MASK) with the frozen target embedding."""
        emb_w = self._shared[0].weight.detach()
        out = F.embedding(ids.clamp(min=0), emb_w)
        return torch.where((ids < 0).unsqueeze(-1), self.mask_embedding.to(out.dtype), out)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        head = self._shared[1]
        bias = head.bias.detach() if getattr(head, "bias", None) is not None else None
        return F.linear(self.norm(x), head.weight.detach(), bias)

    def _context(self, features: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ctx = self.ctx_norm(self.fc(features))
        return [layer.context_kv(ctx, pos) for layer in self.layers]

    def _run(self, block_ids, block_pos, ctx_kv, mask) -> torch.Tensor:
        x = self._embed(block_ids)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, block_pos, k, v, mask)
        return self._logits(x)

    def _check_features(self, features: torch.Tensor) -> torch.Tensor:
        if not isinstance(features, torch.Tensor) or features.dim() != 2 or features.shape[1] != self.feature_dim:
            shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
            raise ValueError(f"context features must be [n, {self.feature_dim}], got {shape}")
        p = self.fc.weight
        return features.to(device=p.device, dtype=p.dtype)

    # -- incremental context (decoding) --------------------------------------------------------

    def init_context(self, features: torch.Tensor | None = None) -> DrafterContext:
        """A :class:`DrafterContext` holding the K/V of ``features`` ``[n, F]`` (positions 0..n-1).

        Raises:
            ValueError: ``features`` not ``[n, feature_dim]``.
        """
        p = self.fc.weight
        nh, hd = self.config.n_heads, self.hidden_size // self.config.n_heads
        empty = torch.zeros(1, nh, 0, hd, device=p.device, dtype=p.dtype)
        ctx = DrafterContext([empty] * len(self.layers), [empty] * len(self.layers), 0)
        if features is not None:
            self.extend_context(ctx, features)
        return ctx

    def extend_context(self, ctx: DrafterContext, features: torch.Tensor) -> DrafterContext:
        """Append the K/V of ``features`` ``[m, F]`` (positions ``ctx.length .. ctx.length + m - 1``)
        to ``ctx`` in place; returns ``ctx``.

        Raises:
            ValueError: ``features`` not ``[m, feature_dim]``.
        """
        features = self._check_features(features)
        m = features.shape[0]
        if m == 0:
            return ctx
        pos = torch.arange(ctx.length, ctx.length + m, device=features.device).unsqueeze(0)
        for i, (k, v) in enumerate(self._context(features.unsqueeze(0), pos)):
            ctx.keys[i] = torch.cat([ctx.keys[i], k], dim=2)
            ctx.values[i] = torch.cat([ctx.values[i], v], dim=2)
        ctx.length += m
        return ctx

    def draft_from_context(self, ctx: DrafterContext, last_token: int) -> torch.Tensor:
        """H position-wise draft logits after the cached context and ``last_token``.

        Args:
            ctx: context of n target-feature positions (the committed tokens before ``last_token``).
            last_token: the last committed token id (at position n).

        Returns:
            float ``[H, V]``: row k is the logit vector of the token at depth k + 1 (position n+k+1).
        """
        return self.block_logits_from_context(ctx, [int(last_token)] + [-1] * (self.block_size - 1))

    def block_logits_from_context(self, ctx: DrafterContext, block_tokens: Sequence[int]) -> torch.Tensor:
        """Logits ``[S, V]`` of an arbitrary block (``-1`` = MASK) at positions n .. n+S-1 after the
        cached context (every block row sees the whole context and the whole block)."""
        dev = self.fc.weight.device
        ids = torch.tensor([list(block_tokens)], dtype=torch.long, device=dev)
        pos = torch.arange(ctx.length, ctx.length + ids.shape[1], device=dev).unsqueeze(0)
        return self._run(ids, pos, list(zip(ctx.keys, ctx.values)), None)[0]

    def draft(self, context_features: torch.Tensor, last_token: int) -> torch.Tensor:
        """Draft one block (one pass): ``[last_token, MASK x (H-1)]`` after the context.

        Args:
            context_features: float ``[n, F]``, F = ``feature_dim``: the concatenated target hidden
                states at ``feature_layers`` for the n committed positions before ``last_token``
                (n may be 0).
            last_token: the last committed token (its target features are not in the context).

        Returns:
            float ``[H, V]`` draft logits; row k is the marginal of depth k + 1.

        Raises:
            ValueError: ``context_features`` not ``[n, feature_dim]``.
        """
        return self.draft_from_context(self.init_context(context_features), last_token)

    def block_logits(self, context_features: torch.Tensor, block_tokens: Sequence[int]) -> torch.Tensor:
        """Logits ``[S, V]`` of an arbitrary block ``block_tokens`` (ids, ``-1`` = MASK) after
        ``context_features`` ``[n, F]``: the non-causal primitive behind :meth:`draft`."""
        return self.block_logits_from_context(self.init_context(context_features), block_tokens)

    # -- training forward ----------------------------------------------------------------------

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        """Draft logits for many anchored blocks of a padded batch, in one pass (training).

        Block j of sequence b is ``[x_a, MASK x (H-1)]`` at positions ``a .. a+H-1``
        (``a = anchors[b, j]``); it attends to the context features of positions ``< a`` and to its
        own block only.

        Args:
            features: float ``[B, T, F]`` target features of each (right-padded) sequence.
            input_ids: int64 ``[B, T]`` token ids.
            anchors: int64 ``[B, A]`` anchor positions, ``0 <= a < lengths[b]``.
            lengths: int64 ``[B]`` true sequence lengths.

        Returns:
            float ``[B, A, H, V]``: ``[b, j, k]`` is the logit vector of token ``x_{a+k+1}``.
        """
        B, T, _ = features.shape
        A, H = anchors.shape[1], self.block_size
        dev = features.device
        k = torch.arange(H, device=dev)
        block_ids = torch.full((B, A, H), -1, dtype=torch.long, device=dev)
        block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
        block_pos = (anchors.unsqueeze(-1) + k).reshape(B, A * H)
        ctx_pos = torch.arange(T, device=dev).expand(B, T)
        ctx_vis = ctx_pos.unsqueeze(1) < anchors.reshape(B, A, 1).repeat_interleave(H, 1)  # [B, A*H, T]
        blk = torch.arange(A, device=dev).repeat_interleave(H)
        blk_vis = (blk[:, None] == blk[None, :]).expand(B, -1, -1)
        mask = torch.cat([ctx_vis, blk_vis], dim=-1).unsqueeze(1)  # [B, 1, A*H, T + A*H]
        ctx_kv = self._context(features.to(self.fc.weight.dtype), ctx_pos)
        return self._run(block_ids.reshape(B, A * H), block_pos, ctx_kv, mask).view(B, A, H, -1)

    # -- persistence ---------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """A content hash of the drafter's own weights: sha256 over every ``state_dict`` entry (name, dtype,
        shape and bytes, in name order; the shared target embedding and LM head are not the drafter's).
        Equal for two drafters exactly when their weights are bit-identical, so the cells' rows can name the
        drafter they ran and the tables refuse rows of two different trainings of one drafter (a retrain in
        a later session included). Returns 16 hex digits."""

        h = hashlib.sha256()
        for k, v in sorted(self.state_dict().items()):
            t = v.detach().to("cpu").contiguous()
            h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    def save(self, path: str | Path) -> Path:
        """Write ``model.safetensors`` (drafter weights only) and ``drafter_config.json`` (resolved
        config, target signature, format version) into directory ``path`` (created). Returns it."""

        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(p / WEIGHTS_NAME))
        meta = {"format_version": FORMAT_VERSION, "kind": "tev_block_drafter",
                "config": {**asdict(self.config), "feature_layers": list(self.config.feature_layers)},
                "target": self.target_signature}
        tmp = p / (CONFIG_NAME + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        tmp.rename(p / CONFIG_NAME)
        return p

    @classmethod
    def load(cls, path: str | Path, target) -> "BlockDrafter":
        """Load a drafter saved with :meth:`save` for ``target`` (eval mode, target's device/dtype).

        Raises:
            FileNotFoundError: missing directory, config or weights (names the path).
            ValueError: the target's hidden size, vocabulary or depth differ from the saved ones.
        """

        p = Path(path)
        if not (p / CONFIG_NAME).is_file() or not (p / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"drafter directory incomplete or missing: {p} (needs {CONFIG_NAME} and "
                                    f"{WEIGHTS_NAME}; train one with python -m impl tev-train, rule tev_train)")
        meta = json.loads((p / CONFIG_NAME).read_text())
        sig, saved = _target_signature(target), meta["target"]
        for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
            if sig[key] != saved[key]:
                raise ValueError(f"drafter at {p} was trained for a target with {key}={saved[key]}, "
                                 f"this target has {sig[key]}")
        names = {f.name for f in fields(DrafterConfig)}
        cfg = {k: v for k, v in meta["config"].items() if k in names}
        cfg["feature_layers"] = tuple(cfg["feature_layers"])
        drafter = cls(target, DrafterConfig(**cfg))
        state = load_file(str(p / WEIGHTS_NAME), device=str(next(target.parameters()).device))
        drafter.load_state_dict(state)
        return drafter.eval()


def drafter_dir_for(model_dir: str | Path) -> Path:
    """The conventional drafter directory beside a model directory: ``<model_dir>-drafter``
    (e.g. ``models/tiny-ls`` -> ``models/tiny-ls-drafter``)."""
    p = Path(model_dir)
    return p.with_name(p.name + "-drafter")


# --- target features ----------------------------------------------------------------------------

@torch.no_grad()
def target_features(target, input_ids: Sequence[int] | torch.Tensor, feature_layers: Sequence[int]) -> torch.Tensor:
    """Concatenated pre-norm target hidden states at ``feature_layers`` for every position of a
    sequence (one causal forward; layers after the deepest feature layer are skipped).

    Args:
        target: the causal LM.
        input_ids: S token ids (list or 1-D int64 tensor).
        feature_layers: 1-based depths.

    Returns:
        float ``[S, len(feature_layers) * hidden]`` on the target's device.
    """

    dev = next(target.parameters()).device
    ids = torch.as_tensor(list(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids,
                          dtype=torch.long, device=dev).view(1, -1)
    want = {int(d): i for i, d in enumerate(feature_layers)}
    got: list[torch.Tensor | None] = [None] * len(want)

    def grab(depth, h):
        if depth in want:
            got[want[depth]] = h[0]

    run_layers(target, embed(target, ids), 0, max(want), position_ids=torch.arange(ids.shape[1], device=dev)[None],
               on_layer=grab)
    return torch.cat(got, dim=-1)


# --- training -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class DrafterTrainConfig:
    """Settings of :func:`train_drafter`.

    Attributes:
        drafter: architecture of a new drafter (ignored when one is passed in).
        rollout_new_tokens: response tokens the target generates per prompt.
        rollout_temperature: 0 for greedy rollouts, > 0 to sample at this temperature.
        eos_token_id: rollouts stop at this id (None: never early).
        heldout_fraction: the last ``ceil(fraction * n)`` prompts are held out for evaluation
            (at least one prompt is kept for training).
        steps: optimiser steps.
        batch_size: rollouts per step.
        anchors_per_seq: blocks anchored per rollout per step (random response positions).
        lr, weight_decay, betas, grad_clip: AdamW and gradient-norm clipping (TEV App. D uses
            lr 1e-4 when fine-tuning released drafters; a drafter trained from scratch on a tiny
            target needs a larger one).
        warmup_steps: linear learning-rate warm-up, then cosine decay to 10%.
        gamma: DFlash position decay: depth d is weighted ``exp(-(d-1)/gamma)``; None or <= 0:
            uniform weights.
        seed: seeds anchors, batches, initialisation and sampled rollouts.
        log_every: log a line every this many steps.
        progress: show a tqdm bar.
        curve_points: learning curve: held-out metrics after this many evenly spaced steps (the last
            one at ``steps``; 0: none). See :func:`train_drafter`'s ``curve``.
    """

    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    rollout_new_tokens: int = _D["rollout_new_tokens"]
    rollout_temperature: float = _D["rollout_temperature"]
    eos_token_id: int | None = None
    heldout_fraction: float = _D["heldout_fraction"]
    steps: int = _D["steps"]
    batch_size: int = _D["batch_size"]
    anchors_per_seq: int = 16
    lr: float = _D["lr"]
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    warmup_steps: int = 20
    gamma: float | None = _D["gamma"]
    seed: int = 0
    log_every: int = 25
    progress: bool = False
    curve_points: int = _D["curve_points"]

    @classmethod
    def from_section(cls, drafter: "Drafter", **overrides) -> "DrafterTrainConfig":
        """The settings a typed ``tev.drafter`` section (:class:`impl.tev.schema.Drafter`) names,
        architecture included; settings the section does not hold keep the dataclass defaults,
        ``overrides`` (``seed``, ``progress``, ...) win over both."""
        arch = DrafterConfig(block_size=drafter.block_size, n_layers=drafter.n_layers)
        named = {k: getattr(drafter, k) for k in ("rollout_new_tokens", "rollout_temperature", "steps", "batch_size",
                                                  "lr", "gamma", "heldout_fraction", "curve_points")}
        return cls(drafter=arch, **{**named, **overrides})


def position_weights(block_size: int, gamma: float | None, device=None) -> torch.Tensor:
    """float32 ``[H]`` loss weights of block rows k = 0..H-1 (depth d = k + 1):
    ``exp(-k / gamma)`` = DFlash's ``exp(-(d-1)/gamma)``; all ones when gamma is None or <= 0."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.ones_like(k) if gamma is None or gamma <= 0 else torch.exp(-k / float(gamma))


def _block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, lengths: torch.Tensor, H: int) -> torch.Tensor:
    """int64 ``[B, A, H]``: ``x_{a+k+1}``, or -100 beyond the sequence end."""
    idx = anchors.unsqueeze(-1) + 1 + torch.arange(H, device=anchors.device)
    valid = idx < lengths.view(-1, 1, 1)
    lab = torch.gather(input_ids.unsqueeze(1).expand(-1, anchors.shape[1], -1), 2,
                       idx.clamp(max=input_ids.shape[1] - 1))
    return torch.where(valid, lab, torch.full_like(lab, -100))


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Dense token loss L_tok (TEV Eq. 15; DFlash position-decayed CE): sum over valid
    (block, depth) of ``weights[k] * CE`` divided by the sum of those weights.

    Args:
        logits: float ``[..., H, V]``; labels: int64 ``[..., H]`` (-100 = ignore); weights: ``[H]``.

    Returns:
        scalar tensor (0 when no label is valid).
    """
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                         ignore_index=-100, reduction="none").view(labels.shape)
    w = weights.view(*([1] * (labels.dim() - 1)), -1) * (labels != -100)
    return (ce * w).sum() / w.sum().clamp(min=1e-9)


@torch.no_grad()
def _rollouts(target, prompts, new_tokens: int, eos_token_id, temperature: float, gen,
              progress: bool = False) -> list[tuple[list[int], int]]:
    out = []
    for ids in tqdm(prompts, desc="rollouts", disable=not progress, mininterval=5):
        r = ar_decode(target, list(ids), new_tokens, eos_token_id=eos_token_id, temperature=temperature,
                      generator=gen)
        out.append((list(ids) + r.tokens, len(ids)))
    return out


@torch.no_grad()
def batched_greedy_rollouts(target, prompts: Sequence[Sequence[int]], new_tokens: int, eos_token_id: int | None,
                            batch_size: int, progress: bool = False) -> list[tuple[list[int], int]]:
    """Greedy rollouts ``batch_size`` prompts at a time with transformers' ``generate`` (left padding,
    attention mask, KV cache), cut after the first EOS as :func:`impl.spec.ar.ar_decode` stops.

    The target's greedy path up to float rounding: padded batches change the matmul shapes, so a near
    tie can break differently than in the batch-1 AR decode (training data, not a decoding result).

    Args:
        target: causal LM in eval mode. prompts: non-empty id lists. new_tokens: >= 1.
        eos_token_id: stop after this id (None: never early). batch_size: prompts per ``generate`` call.
        progress: show a tqdm bar over prompts.

    Returns:
        ``(prompt + response ids, prompt length)`` per prompt, in order.
    """
    dev = next(target.parameters()).device
    pad = 0 if eos_token_id is None else int(eos_token_id)
    out: list[tuple[list[int], int]] = []
    bar = tqdm(total=len(prompts), desc="rollouts", disable=not progress, mininterval=5)
    for i in range(0, len(prompts), batch_size):
        chunk = [list(map(int, p)) for p in prompts[i:i + batch_size]]
        T = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), T), pad, dtype=torch.long, device=dev)
        mask = torch.zeros((len(chunk), T), dtype=torch.long, device=dev)
        for b, p in enumerate(chunk):
            ids[b, T - len(p):] = torch.tensor(p, device=dev)
            mask[b, T - len(p):] = 1
        gen = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=None,
                              do_sample=False, eos_token_id=eos_token_id, pad_token_id=pad,
                              num_beams=1)[:, T:]  # [b, <= new_tokens]
        for b, p in enumerate(chunk):
            resp = gen[b].tolist()
            if eos_token_id is not None and eos_token_id in resp:
                resp = resp[:resp.index(eos_token_id) + 1]
            out.append((p + resp, len(p)))
        bar.update(len(chunk))
    bar.close()
    return out


@dataclass
class RolloutData:
    """Target rollouts with their target features and a train / held-out split, computed once and
    shared by :func:`train_drafter` and :func:`impl.tev.train.train_exittrain` (so that every training
    objective sees the same data).

    Attributes:
        sequences: ``(token ids, prompt length)`` per rollout (prompt followed by the response).
        features: float ``[len, F]`` target features of each sequence at ``feature_layers``.
        feature_layers: the 1-based target depths of ``features``.
        train_idx, heldout_idx: indices into ``sequences`` (held out = the last ones).
        seconds: wall-clock ``{"rollouts", "features"}``.
    """

    sequences: list[tuple[list[int], int]]
    features: list[torch.Tensor]
    feature_layers: tuple[int, ...]
    train_idx: list[int]
    heldout_idx: list[int]
    seconds: dict = field(default_factory=dict)

    @property
    def rollout_tokens(self) -> int:
        """Total response tokens over all rollouts."""
        return sum(len(s) - p for s, p in self.sequences)


def make_rollouts(target, prompts_token_ids: Sequence[Sequence[int]], feature_layers: Sequence[int], *,
                  new_tokens: int = 64, temperature: float = 0.0, eos_token_id: int | None = None,
                  heldout_fraction: float = 0.1, seed: int = 0,
                  generator: torch.Generator | None = None, batch_size: int = 1,
                  progress: bool = False) -> RolloutData:
    """Roll the frozen target out on every prompt (TEV App. D online rollouts) and compute its
    features once.

    Args:
        target: causal LM (put in eval mode for the call, restored after).
        prompts_token_ids: at least 2 prompt id lists, inside the vocabulary and context.
        feature_layers: 1-based target depths (a drafter's ``feature_layers``).
        new_tokens: response tokens per prompt (>= 1; fewer when EOS stops a rollout).
        temperature: 0 greedy, > 0 sampled at this temperature.
        eos_token_id: rollouts stop after this id (None: never early).
        heldout_fraction: the last ``ceil(fraction * n)`` rollouts are held out (at least one, and
            at least one kept for training).
        seed: seeds ``generator`` when it is None.
        generator: CPU generator for sampled rollouts (advanced in place).
        batch_size: greedy rollouts per ``generate`` call (:func:`batched_greedy_rollouts`; faster on a
            real target); 1: one exact AR decode per prompt. Sampled rollouts are always one at a time.
        progress: show tqdm bars over the rollouts and the feature passes.

    Returns:
        :class:`RolloutData`.

    Raises:
        ValueError: fewer than 2 prompts, bad prompt ids, ``new_tokens < 1`` or ``batch_size < 1``.
    """

    prompts = [list(map(int, p)) for p in prompts_token_ids]
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(prompts) < 2:
        raise ValueError(f"need at least 2 prompts (train + held out), got {len(prompts)}")
    for p in prompts:
        check_prompt_ids(target, p)
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    was_training = target.training
    target.eval()
    try:
        t0 = time.perf_counter()
        seqs = (batched_greedy_rollouts(target, prompts, new_tokens, eos_token_id, batch_size, progress)
                if batch_size > 1 and temperature == 0 else
                _rollouts(target, prompts, new_tokens, eos_token_id, temperature, gen, progress))
        t_roll = time.perf_counter() - t0
        t0 = time.perf_counter()
        feats = [target_features(target, s, feature_layers)
                 for s, _ in tqdm(seqs, desc="target features", disable=not progress, mininterval=5)]
        t_feat = time.perf_counter() - t0
    finally:
        target.train(was_training)
    n_held = min(len(seqs) - 1, max(1, math.ceil(heldout_fraction * len(seqs))))
    return RolloutData(seqs, feats, tuple(int(d) for d in feature_layers), list(range(len(seqs) - n_held)),
                       list(range(len(seqs) - n_held, len(seqs))), {"rollouts": t_roll, "features": t_feat})


def _pad_batch(items, feats, device):
    """Right-pad sequences: ids ``[B, T]``, features ``[B, T, F]``, lengths ``[B]``."""
    T = max(len(s) for s, _ in items)
    F_ = feats[0].shape[1]
    ids = torch.zeros(len(items), T, dtype=torch.long, device=device)
    fts = torch.zeros(len(items), T, F_, dtype=feats[0].dtype, device=device)
    for i, ((s, _), f) in enumerate(zip(items, feats)):
        ids[i, :len(s)] = torch.tensor(s, device=device)
        fts[i, :len(s)] = f
    lengths = torch.tensor([len(s) for s, _ in items], device=device)
    return ids, fts, lengths


def _sample_anchors(items, n_anchors: int, gen: torch.Generator, device) -> torch.Tensor:
    """``[B, A]`` anchors uniformly among response positions a in [len(prompt)-1, len-2]."""
    rows = []
    for s, p in items:
        lo, hi = p - 1, len(s) - 2
        if hi < lo:  # no response token to predict: a harmless anchor whose labels are all invalid
            rows.append([len(s) - 1] * n_anchors)
            continue
        rows.append((lo + torch.randint(0, hi - lo + 1, (n_anchors,), generator=gen)).tolist())
    return torch.tensor(rows, dtype=torch.long, device=device)


@torch.no_grad()
def evaluate_drafter(drafter: BlockDrafter, sequences: list[tuple[list[int], int]], feats: list[torch.Tensor],
                     gamma: float | None = None, chunk: int = 32) -> dict:
    """Teacher-forced block metrics on rollouts, over every response anchor.

    Args:
        drafter: the drafter (its block size H is used).
        sequences: ``(token ids, prompt length)`` pairs; anchors are a in [prompt_len - 1, len - 2].
        feats: the target features ``[len, F]`` of each sequence.
        gamma: position decay of the reported loss.
        chunk: anchors per drafter pass.

    Returns:
        ``{"loss", "accuracy": [H] top-1 accuracy per depth, "n_blocks": [H] counted blocks per depth,
        "chain_tau": mean of 1 + (number of leading depths whose argmax is right)}``; chain_tau is the
        greedy DFlash chain tau (bonus counted) on greedy rollouts of the target.
    """
    H = drafter.block_size
    dev = drafter.fc.weight.device
    w = position_weights(H, gamma, dev)
    correct = torch.zeros(H, dtype=torch.float64)
    count = torch.zeros(H, dtype=torch.float64)
    loss_num = loss_den = 0.0
    taus: list[float] = []
    was_training = drafter.training
    drafter.eval()
    for (s, p), f in zip(sequences, feats):
        anchors_all = list(range(max(p - 1, 0), len(s) - 1))
        ids, fts, lengths = _pad_batch([(s, p)], [f], dev)
        for i in range(0, len(anchors_all), chunk):
            anchors = torch.tensor([anchors_all[i:i + chunk]], dtype=torch.long, device=dev)
            logits = drafter(fts, ids, anchors, lengths)
            labels = _block_labels(ids, anchors, lengths, H)
            valid = labels != -100
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                 ignore_index=-100, reduction="none").view(labels.shape)
            ww = w.view(1, 1, -1) * valid
            loss_num += float((ce * ww).sum())
            loss_den += float(ww.sum())
            hit = (logits.argmax(-1) == labels) & valid
            correct += hit.sum((0, 1)).double().cpu()
            count += valid.sum((0, 1)).double().cpu()
            # leading-match length; a block cut by the sequence end counts its valid depths only
            lead = hit.long().cumprod(-1).sum(-1).flatten().tolist()
            taus.extend(1.0 + x for x in lead)
    drafter.train(was_training)
    acc = [float(c / n) if n > 0 else float("nan") for c, n in zip(correct, count)]
    return {"loss": loss_num / max(loss_den, 1e-9), "accuracy": acc, "n_blocks": [int(n) for n in count],
            "chain_tau": sum(taus) / max(len(taus), 1)}


def drafter_optimizer(drafter, cfg) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the drafter's parameters with linear warm-up, then cosine decay to 10% of ``cfg.lr``
    over ``cfg.steps`` (shared by :func:`train_drafter` and :func:`impl.tev.train.train_exittrain`;
    ``cfg`` needs ``lr, betas, weight_decay, warmup_steps, steps``)."""
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    return opt, warmup_decay_scheduler(opt, warmup=cfg.warmup_steps, steps=cfg.steps, decay="cosine", floor=0.1)


def curve_steps(steps: int, points: int) -> list[int]:
    """The optimiser steps after which the learning curve is measured: ``points`` evenly spaced steps
    in ``[1, steps]``, the last one ``steps`` (fewer when ``points > steps``; none when 0)."""
    if points <= 0:
        return []
    return sorted({max(1, round(steps * i / points)) for i in range(1, points + 1)})


def train_drafter(target, prompts_token_ids: Sequence[Sequence[int]] | None,
                  cfg: DrafterTrainConfig = DrafterTrainConfig(), drafter: BlockDrafter | None = None,
                  data: RolloutData | None = None,
                  curve: Callable[[BlockDrafter], dict] | None = None) -> tuple[BlockDrafter, dict]:
    """Train a block drafter on the frozen target's own rollouts with the dense position-decayed
    token loss (TEV Eq. 15 with lambda_exit = 0; DFlash loss; App. D online rollouts).

    Steps: (1) the target decodes ``cfg.rollout_new_tokens`` response tokens for every prompt
    (greedy or at ``rollout_temperature``, :func:`impl.spec.ar.ar_decode`); (2) target features at
    the drafter's feature layers are computed once per rollout; (3) ``cfg.steps`` AdamW steps, each on
    ``batch_size`` random training rollouts with ``anchors_per_seq`` random response anchors;
    (4) held-out teacher-forced metrics before and after training (:func:`evaluate_drafter`).

    Args:
        target: frozen causal LM (not modified; its parameters get no gradients).
        prompts_token_ids: prompt id lists (non-empty, inside the target's vocabulary and context
            together with ``rollout_new_tokens``), e.g. from :func:`impl.tev.prompts.drafter_prompt_ids`.
        cfg: :class:`DrafterTrainConfig`.
        drafter: continue training this drafter instead of a new ``BlockDrafter(target, cfg.drafter)``.
        data: precomputed :class:`RolloutData` (from :func:`make_rollouts`, with the drafter's
            feature layers); then ``prompts_token_ids`` may be None and the ``rollout_*``,
            ``eos_token_id`` and ``heldout_fraction`` settings are not used. Without it the rollouts
            are made here with ``cfg`` (as before; the same generator then draws the batches).
        curve: extra held-out metrics of the learning curve, called with the drafter (in eval mode,
            no gradient) after each of :func:`curve_steps` ``(cfg.steps, cfg.curve_points)`` and before
            training (e.g. the teacher-forced tree tau of :func:`impl.tev.train.evaluate_trees`).

    Returns:
        ``(drafter, summary)`` with the drafter in eval mode and summary ``{"losses": per-step
        training loss, "seconds": {"rollouts", "features", "train", "eval", "total"},
        "heldout_before", "heldout_after": evaluate_drafter dicts, "n_train", "n_heldout",
        "rollout_tokens", "config", "curve"}`` (seconds are wall-clock; ``curve``: one
        ``{"step", "loss", "chain_tau", **curve(drafter)}`` per measured step, step 0 first, when
        ``cfg.curve_points > 0``; its time is counted in ``eval``).

    Raises:
        ValueError: fewer than 2 prompts, bad prompt ids, or non-positive steps/batch sizes; ``data``
            whose feature layers differ from the drafter's.
    """
    t_all = time.perf_counter()
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.anchors_per_seq < 1 or cfg.rollout_new_tokens < 1:
        raise ValueError("steps, batch_size, anchors_per_seq and rollout_new_tokens must be >= 1")
    if drafter is None:
        with torch.random.fork_rng(devices=[]):  # seeded initialisation, global RNG untouched
            torch.manual_seed(cfg.seed)
            drafter = BlockDrafter(target, cfg.drafter)
    dev = drafter.fc.weight.device
    gen = torch.Generator().manual_seed(cfg.seed)
    was_training = target.training
    target.eval()

    if data is None:
        if prompts_token_ids is None:
            raise ValueError("pass prompts_token_ids or precomputed rollout data")
        data = make_rollouts(target, prompts_token_ids, drafter.feature_layers, new_tokens=cfg.rollout_new_tokens,
                             temperature=cfg.rollout_temperature, eos_token_id=cfg.eos_token_id,
                             heldout_fraction=cfg.heldout_fraction, generator=gen, progress=cfg.progress)
    elif tuple(data.feature_layers) != tuple(drafter.feature_layers):
        raise ValueError(f"rollout features are for layers {list(data.feature_layers)}, the drafter reads "
                         f"{drafter.feature_layers}")
    seqs, feats = data.sequences, data.features
    t_roll, t_feat = data.seconds.get("rollouts", 0.0), data.seconds.get("features", 0.0)
    train_idx, held = list(data.train_idx), list(data.heldout_idx)
    n_held = len(held)
    log.info("drafter: %d rollouts (%d tokens) in %.1fs, features in %.1fs; %d train / %d held out",
             len(seqs), sum(len(s) - p for s, p in seqs), t_roll, t_feat, len(train_idx), n_held)

    def measure(step: int, metrics: dict) -> dict:
        extra = {}
        if curve is not None:
            drafter.eval()
            with torch.no_grad():
                extra = curve(drafter)
        return {"step": step, "loss": metrics["loss"], "chain_tau": metrics["chain_tau"], **extra}

    t0 = time.perf_counter()
    before = evaluate_drafter(drafter, [seqs[i] for i in held], [feats[i] for i in held], cfg.gamma)
    at = set(curve_steps(cfg.steps, cfg.curve_points))
    points = [measure(0, before)] if at else []
    t_eval = time.perf_counter() - t0

    H = drafter.block_size
    weights = position_weights(H, cfg.gamma, dev)
    opt, sched = drafter_optimizer(drafter, cfg)
    losses: list[float] = []
    drafter.train()
    t0 = time.perf_counter()
    try:
        bar = tqdm(range(cfg.steps), desc="train drafter", disable=not cfg.progress, mininterval=5)
    except ImportError:  # pragma: no cover
        bar = range(cfg.steps)
    for step in bar:
        pick = torch.randint(0, len(train_idx), (min(cfg.batch_size, len(train_idx)),), generator=gen).tolist()
        items = [seqs[train_idx[i]] for i in pick]
        ids, fts, lengths = _pad_batch(items, [feats[train_idx[i]] for i in pick], dev)
        anchors = _sample_anchors(items, cfg.anchors_per_seq, gen, dev)
        logits = drafter(fts, ids, anchors, lengths)
        loss = block_loss(logits, _block_labels(ids, anchors, lengths, H), weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip and cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if cfg.log_every and (step + 1) % cfg.log_every == 0:
            log.info("drafter step %d/%d loss %.4f", step + 1, cfg.steps, sum(losses[-cfg.log_every:]) / cfg.log_every)
        if step + 1 in at and step + 1 < cfg.steps:  # the last point is the final evaluation below
            te = time.perf_counter()
            points.append(measure(step + 1, evaluate_drafter(drafter, [seqs[i] for i in held], [feats[i] for i in held],
                                                             cfg.gamma)))
            log.info("drafter curve: %s", points[-1])
            drafter.train()
            t_eval += time.perf_counter() - te
            t0 += time.perf_counter() - te  # curve time is evaluation, not training
    t_train = time.perf_counter() - t0
    drafter.eval()
    t0 = time.perf_counter()
    after = evaluate_drafter(drafter, [seqs[i] for i in held], [feats[i] for i in held], cfg.gamma)
    if at:
        points.append(measure(cfg.steps, after))
    t_eval += time.perf_counter() - t0
    target.train(was_training)
    summary = {
        "losses": losses,
        "seconds": {"rollouts": t_roll, "features": t_feat, "train": t_train, "eval": t_eval,
                    "total": time.perf_counter() - t_all},
        "heldout_before": before,
        "heldout_after": after,
        "n_train": len(train_idx),
        "n_heldout": n_held,
        "rollout_tokens": data.rollout_tokens,
        "curve": points,
        "config": {**asdict(cfg), "drafter": {**asdict(drafter.config),
                                              "feature_layers": list(drafter.config.feature_layers)}},
    }
    return drafter, summary
