"""FlexiDepth-style trained gate as a vSkipper policy (vSkipper Sec. 3.1, 3.4, 4.4; FlexiDepth, Luo et
al. 2025), its checkpoint format and its stage-1 training.

**The policy.** At every routed layer l a router maps the hidden state entering the layer, ``h``
(``[n, H]``), to a weight ``w in (0, 1)``::

    z = RMSNorm_in(h)                        # the router's own input norm (weight copied from the
                                             # layer's input_layernorm when built from a model)
    z = RMSNorm_mid(tanh(enc(z)))            # bottleneck encoder H -> H/16, tanh, RMSNorm
    w = sigmoid(head(dec(z)))                # decoder H/16 -> H, head H -> 1 (with bias)

(FlexiDepth's router ``W_r . W_dec . Norm(tanh(W_enc . z))`` on the normalised input; tanh comes before
the bottleneck norm as in FlexiDepth.) A row RUNs the layer iff ``w > threshold`` (0.5), else it takes
Project-Only. The two outputs are FlexiDepth's, which vSkipper serves unchanged (Sec. 3.1 "For
FlexiDepth, the projector is the checkpoint's adapter, mixed by the router's weight"):

- RUN:          ``out = m + w * MLP(post_attention_layernorm(m))``, ``m = h + Attn(input_layernorm(h))``
                (the attention residual plus the MLP contribution scaled by w; applied in
                :meth:`FlexiDepthSkipper.run_epilogue` from the routed layer's ``hidden_mid`` and
                ``mlp_out``);
- Project-Only: ``out = h + (1 - w) * Adapter(h)``, the adapter a small SwiGLU MLP with its own RMSNorm
                (``down(silu(gate(n)) * up(n))``, ``n = RMSNorm_ad(h)``, intermediate size
                ``intermediate_size / 16``; norm weight copied from the layer's post_attention_layernorm);
                the row still writes the layer's own K/V (Invariant 1, done by the routed layer).

Dense rows (dense mode, or dense requests mixed into a routed batch) run the unmodified layer: dense
mode is the base model (Sec. 3 "Vocabulary").

**Training (stage 1).** :func:`train_flexidepth` freezes the backbone and trains routers and adapters
with the LM loss plus a skip penalty. The training forward (:func:`flexidepth_forward`) is the
inference computation itself, on full windows: at a routed layer every row computes both branches
(attention over all rows' K/V, which Project-Only rows also write, so causal attention over the
window is exactly what inference sees), the hard decision ``w > threshold`` (no gradient) selects
the branch per row, and the selected branch's output carries ``w`` (RUN) or ``1 - w`` (Project-Only)
as a factor, so the router gets gradients from either branch ("soft weights, hard routes", as
FlexiDepth). The skip penalty is FlexiDepth's squared per-token layer usage, normalised by the
number of routed layers: ``P = mean_t (mean_l w_{t,l})^2``; the loss is ``LM + skip_alpha * P``. A
larger ``skip_alpha`` pushes the weights down and so the share of skipped (row, layer) pairs up.

**Checkpoint.** A directory with ``flexidepth.safetensors`` (the skipper's state dict) and
``flexidepth.json`` (format, routed layers, sizes, threshold, base-model description, training
summary); :meth:`FlexiDepthSkipper.save`, :func:`load_flexidepth`. The policy is registered as
``"flexidepth"`` (``build_skipper("flexidepth", checkpoint=DIR)`` or with constructor arguments).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm
from transformers.masking_utils import create_causal_mask

from ..models.load import load_model
from ..schedule import lr_at
from .routed import RoutedDecoderLayer
from .schema import FlexiDepth as _FlexiDepthSection
from .skipper import RowMeta, Skipper, register_skipper

log = logging.getLogger("impl.vskipper.flexidepth")

__all__ = [
    "FlexiRouter",
    "SwiGLUAdapter",
    "FlexiDepthSkipper",
    "FlexiDepthTrainConfig",
    "FlexiForward",
    "flexidepth_forward",
    "evaluate_flexidepth",
    "train_flexidepth",
    "train_and_save",
    "load_flexidepth",
    "windows_from_tokens",
    "CHECKPOINT_FORMAT",
]

CHECKPOINT_FORMAT = "vskipper-flexidepth"
CHECKPOINT_VERSION = 1
_WEIGHTS = "flexidepth.safetensors"
_META = "flexidepth.json"


class _RMSNorm(nn.Module):
    """RMSNorm as Llama computes it (fp32 statistics, weight applied in the input dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class FlexiRouter(nn.Module):
    """FlexiDepth router: ``[..., H]`` hidden states -> ``[...]`` float32 weights in (0, 1).

    Layout: input RMSNorm(H); ``enc`` Linear(H, r) without bias; tanh; RMSNorm(r); ``dec`` Linear(r, H)
    without bias; ``head`` Linear(H, 1) with bias; sigmoid (computed in float32). ``r = H / 16`` by
    default (FlexiDepth's bottleneck).

    Args:
        hidden_size: H.
        router_dim: bottleneck width r (>= 1).
        eps: RMSNorm epsilon.
    """

    def __init__(self, hidden_size: int, router_dim: int, eps: float = 1e-5):
        super().__init__()
        self.norm = _RMSNorm(hidden_size, eps)
        self.enc = nn.Linear(hidden_size, router_dim, bias=False)
        self.mid_norm = _RMSNorm(router_dim, eps)
        self.dec = nn.Linear(router_dim, hidden_size, bias=False)
        self.head = nn.Linear(hidden_size, 1, bias=True)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid router logits ``[...]`` (float32) of hidden states ``[..., H]``."""
        z = self.enc(self.norm(hidden))
        z = self.dec(self.mid_norm(torch.tanh(z)))
        return self.head(z).squeeze(-1).float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Weights ``w = sigmoid(logits)``: ``[...]`` float32, mathematically in (0, 1) (float32 rounds
        logits beyond about +-17 to exactly 0 or 1)."""
        return torch.sigmoid(self.logits(hidden))


class SwiGLUAdapter(nn.Module):
    """The Project-Only projector: a small SwiGLU MLP with its own input RMSNorm.

    ``adapter(h) = down(silu(gate(n)) * up(n))``, ``n = RMSNorm(h)``; ``[..., H] -> [..., H]``, no biases.

    Args:
        hidden_size: H.
        adapter_dim: intermediate width (FlexiDepth: the layer's intermediate size / 16).
        eps: RMSNorm epsilon.
    """

    def __init__(self, hidden_size: int, adapter_dim: int, eps: float = 1e-5):
        super().__init__()
        self.norm = _RMSNorm(hidden_size, eps)
        self.gate_proj = nn.Linear(hidden_size, adapter_dim, bias=False)
        self.up_proj = nn.Linear(hidden_size, adapter_dim, bias=False)
        self.down_proj = nn.Linear(adapter_dim, hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., H]`` adapter output (the residual contribution, before the 1 - w factor)."""
        n = self.norm(hidden)
        return self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))


class FlexiDepthSkipper(Skipper):
    """FlexiDepth-style policy: a trained router per routed layer decides RUN iff ``w > threshold``;
    RUN rows get ``m + w * mlp``, Project-Only rows ``h + (1 - w) * adapter(h)`` (module docstring).

    Args:
        routed_layers: routed decoder layer indices (FlexiDepth on Llama-3-8B: the last 16 of 32).
        hidden_size: the model's hidden size H.
        router_dim: router bottleneck width (default ``max(1, H // 16)``).
        adapter_dim: adapter intermediate width (default ``max(1, intermediate_size // 16)``, with
            ``intermediate_size`` defaulting to ``4 H``).
        intermediate_size: the model's MLP width, used for the default ``adapter_dim``.
        threshold: RUN iff ``w > threshold`` (0.5).
        eps: RMSNorm epsilon of the router and adapter norms.
        init_logit: initial router head bias (``w`` starts near ``sigmoid(init_logit)``).
        init_spread: standard deviation of the initial router logits around ``init_logit`` for unit-RMS
            inputs (the head's weight scale).
        adapter_init_scale: scale of the adapters' initial ``down_proj`` (0: adapters start at zero, so
            a skipped row starts as the identity).
        seed: seed of the initialisation (independent of the global RNG).

    Raises:
        ValueError: for non-positive sizes or a threshold outside (0, 1).
    """

    prefix_shareable = True  # routes depend on hidden states only (a pure function of the prefix)
    identity_run = False  # RUN rows carry the w factor on the MLP contribution

    def __init__(
        self,
        routed_layers: Iterable[int],
        hidden_size: int,
        *,
        router_dim: int | None = None,
        adapter_dim: int | None = None,
        intermediate_size: int | None = None,
        threshold: float = 0.5,
        eps: float = 1e-5,
        init_logit: float = 2.0,
        init_spread: float = 0.1,
        adapter_init_scale: float = 0.0,
        seed: int = 0,
    ):
        super().__init__(routed_layers)
        H = int(hidden_size)
        if H <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        if not 0.0 < float(threshold) < 1.0:
            raise ValueError(f"threshold must lie in (0, 1), got {threshold}")
        self.hidden_size = H
        self.router_dim = int(router_dim) if router_dim is not None else max(1, H // 16)
        inter = int(intermediate_size) if intermediate_size is not None else 4 * H
        self.adapter_dim = int(adapter_dim) if adapter_dim is not None else max(1, inter // 16)
        if self.router_dim <= 0 or self.adapter_dim <= 0:
            raise ValueError(f"router_dim and adapter_dim must be positive, got {self.router_dim}, {self.adapter_dim}")
        self.threshold = float(threshold)
        self.eps = float(eps)
        self.routers = nn.ModuleDict()
        for layer in self.routed_layers:
            self.routers[str(layer)] = FlexiRouter(H, self.router_dim, eps)
            self.set_projector(layer, SwiGLUAdapter(H, self.adapter_dim, eps))
        self.reset_parameters(init_logit=init_logit, init_spread=init_spread,
                              adapter_init_scale=adapter_init_scale, seed=seed)

    # -- initialisation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, *, init_logit: float = 2.0, init_spread: float = 0.1,
                         adapter_init_scale: float = 0.0, seed: int = 0) -> None:
        """Seeded (re-)initialisation of every router and adapter (see the constructor's arguments).

        Router: ``enc ~ N(0, 1/H)``, ``dec ~ N(0, 1/r)``, ``head.weight ~ N(0, init_spread^2 / H)``,
        ``head.bias = init_logit``, norms at 1. Adapter: ``gate, up ~ N(0, 1/H)``, ``down ~
        N(0, adapter_init_scale^2 / adapter_dim)``, norm at 1.
        """
        gen = torch.Generator().manual_seed(int(seed))
        H, r, a = self.hidden_size, self.router_dim, self.adapter_dim

        def normal_(p: torch.Tensor, std: float) -> None:
            p.copy_((torch.randn(p.shape, generator=gen) * std).to(p.dtype))

        for layer in self.routed_layers:
            router = self.routers[str(layer)]
            normal_(router.enc.weight, 1.0 / math.sqrt(H))
            normal_(router.dec.weight, 1.0 / math.sqrt(r))
            normal_(router.head.weight, float(init_spread) / math.sqrt(H))
            router.head.bias.fill_(float(init_logit))
            router.norm.weight.fill_(1.0)
            router.mid_norm.weight.fill_(1.0)
            ad = self.projector(layer)
            normal_(ad.gate_proj.weight, 1.0 / math.sqrt(H))
            normal_(ad.up_proj.weight, 1.0 / math.sqrt(H))
            normal_(ad.down_proj.weight, float(adapter_init_scale) / math.sqrt(a))
            ad.norm.weight.fill_(1.0)

    @classmethod
    def for_model(cls, model, routed_layers: Iterable[int] | None = None, **kwargs) -> "FlexiDepthSkipper":
        """A freshly initialised skipper sized for ``model`` (Llama / Qwen3 family), on its device/dtype.

        Args:
            model: the causal LM (``model.config``: hidden_size, intermediate_size, rms_norm_eps,
                num_hidden_layers).
            routed_layers: default: the second half of the layers (FlexiDepth routes the last 16 of 32).
            **kwargs: constructor arguments (threshold, init_logit, router_dim, ...).

        The router input norm and the adapter norm start from the layer's ``input_layernorm`` and
        ``post_attention_layernorm`` weights (the scales the frozen layer uses on the same stream).
        """
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        L = int(cfg.num_hidden_layers)
        layers = list(range(L // 2, L)) if routed_layers is None else list(routed_layers)
        kwargs.setdefault("intermediate_size", getattr(cfg, "intermediate_size", None))
        kwargs.setdefault("eps", float(getattr(cfg, "rms_norm_eps", 1e-5)))
        sk = cls(layers, int(cfg.hidden_size), **kwargs)
        model_layers = _base_layers(model)
        with torch.no_grad():
            for layer in sk.routed_layers:
                if not 0 <= layer < L:
                    raise ValueError(f"routed layer {layer} outside the model's {L} layers")
                base = model_layers[layer]
                sk.routers[str(layer)].norm.weight.copy_(base.input_layernorm.weight.float())
                sk.projector(layer).norm.weight.copy_(base.post_attention_layernorm.weight.float())
        p = next(model.parameters())
        return sk.to(device=p.device, dtype=p.dtype)

    # -- the policy -------------------------------------------------------------------------------------
    def router(self, layer_idx: int) -> FlexiRouter:
        """The router of ``layer_idx``.

        Raises:
            KeyError: if ``layer_idx`` is not routed.
        """
        return self.routers[str(int(layer_idx))]

    def weight(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """Router weights ``w``: ``[..., H]`` hidden states entering ``layer_idx`` -> ``[...]`` float32."""
        return self.router(layer_idx)(hidden)

    def route(self, layer_idx: int, hidden: torch.Tensor, meta: RowMeta) -> torch.Tensor:
        """``[n_rows]`` bool, True = RUN iff ``w > threshold`` (ignores ``meta``: a pure function of the
        hidden state)."""
        return self.weight(layer_idx, hidden) > self.threshold

    def skip_output(self, layer_idx: int, hidden: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Project-Only output ``h + (1 - w) * adapter(h)``: ``hidden`` ``[..., H]``, ``w`` ``[...]``."""
        ad = self.projector(layer_idx)
        return hidden + (1.0 - w).to(hidden.dtype).unsqueeze(-1) * ad(hidden)

    @staticmethod
    def run_output(hidden_mid: torch.Tensor, mlp_out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RUN output ``m + w * mlp``: ``hidden_mid``, ``mlp_out`` ``[..., H]``, ``w`` ``[...]``."""
        return hidden_mid + w.to(mlp_out.dtype).unsqueeze(-1) * mlp_out

    def project(self, layer_idx: int, hidden: torch.Tensor, meta: RowMeta) -> torch.Tensor:
        """Project-Only rows ``[k, H]`` -> ``h + (1 - w) * adapter(h)`` ``[k, H]`` (Sec. 3.1)."""
        return self.skip_output(layer_idx, hidden, self.weight(layer_idx, hidden))

    def run_epilogue(self, layer_idx, hidden_in, hidden_out, meta, *, hidden_mid=None, mlp_out=None):
        """Routed RUN rows: ``hidden_mid + w * mlp_out`` ``[k, H]`` with ``w`` from ``hidden_in``.

        Raises:
            ValueError: when the caller does not pass ``hidden_mid`` and ``mlp_out``.
        """
        if hidden_mid is None or mlp_out is None:
            raise ValueError("FlexiDepthSkipper.run_epilogue needs hidden_mid and mlp_out (the MLP contribution)")
        return self.run_output(hidden_mid, mlp_out, self.weight(layer_idx, hidden_in))

    # -- checkpoint -------------------------------------------------------------------------------------
    def config_dict(self) -> dict:
        """The constructor sizes as a JSON-able dict (what :meth:`save` writes besides the weights)."""
        return {
            "routed_layers": list(self.routed_layers),
            "hidden_size": self.hidden_size,
            "router_dim": self.router_dim,
            "adapter_dim": self.adapter_dim,
            "threshold": self.threshold,
            "eps": self.eps,
        }

    def save(self, out_dir: str | Path, *, extra: dict | None = None) -> Path:
        """Write the checkpoint directory (``flexidepth.safetensors`` + ``flexidepth.json``).

        Args:
            out_dir: directory (created); existing checkpoint files are replaced atomically (tmp + rename).
            extra: JSON-able fields added to the json (e.g. ``base_model``, ``num_hidden_layers``,
                ``train``).

        Returns:
            the directory path.
        """

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "skipper": "flexidepth",
                "dtype": str(next(iter(state.values())).dtype).replace("torch.", ""), **self.config_dict()}
        if extra:
            meta.update(extra)
        tmp_w, tmp_m = out / (_WEIGHTS + ".tmp"), out / (_META + ".tmp")
        save_file(state, str(tmp_w), metadata={"format": CHECKPOINT_FORMAT})
        tmp_m.write_text(json.dumps(meta, indent=2, sort_keys=True, default=_json_default))
        tmp_w.replace(out / _WEIGHTS)
        tmp_m.replace(out / _META)
        return out

    def extra_repr(self) -> str:
        return (f"routed_layers={self.routed_layers}, hidden_size={self.hidden_size}, router_dim={self.router_dim}, "
                f"adapter_dim={self.adapter_dim}, threshold={self.threshold}")


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (tuple, set)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def load_flexidepth(path: str | Path, model=None, *, device=None, dtype: torch.dtype | None = None) -> FlexiDepthSkipper:
    """Load a FlexiDepth checkpoint directory written by :meth:`FlexiDepthSkipper.save`.

    Args:
        path: the checkpoint directory.
        model: optional causal LM to check the checkpoint against (hidden size, number of layers) and
            to take device and dtype from.
        device, dtype: where to put the skipper (default: the model's, else CPU / the saved dtype).

    Returns:
        the :class:`FlexiDepthSkipper` in eval mode; its json is in ``skipper.checkpoint_meta``.

    Raises:
        FileNotFoundError: if the directory or one of its two files is missing.
        ValueError: for another format or version, tensors that do not match the recorded sizes, or a
            checkpoint that does not fit ``model``.
    """

    p = Path(path)
    wf, mf = p / _WEIGHTS, p / _META
    if not wf.is_file() or not mf.is_file():
        raise FileNotFoundError(f"FlexiDepth checkpoint not found or incomplete: {p} (needs {_WEIGHTS} and {_META})")
    meta = json.loads(mf.read_text())
    if meta.get("format") != CHECKPOINT_FORMAT or int(meta.get("version", -1)) != CHECKPOINT_VERSION:
        raise ValueError(f"{mf}: not a {CHECKPOINT_FORMAT} v{CHECKPOINT_VERSION} checkpoint "
                         f"(format={meta.get('format')!r}, version={meta.get('version')!r})")
    if model is not None:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if int(cfg.hidden_size) != int(meta["hidden_size"]):
            raise ValueError(f"{p}: checkpoint hidden_size {meta['hidden_size']} != the model's {cfg.hidden_size}")
        L = int(cfg.num_hidden_layers)
        if "num_hidden_layers" in meta and int(meta["num_hidden_layers"]) != L:
            raise ValueError(f"{p}: checkpoint was trained for {meta['num_hidden_layers']} layers, the model has {L}")
        bad = [x for x in meta["routed_layers"] if not 0 <= int(x) < L]
        if bad:
            raise ValueError(f"{p}: routed layers {bad} outside the model's {L} layers")
    sk = FlexiDepthSkipper(
        meta["routed_layers"], int(meta["hidden_size"]), router_dim=int(meta["router_dim"]),
        adapter_dim=int(meta["adapter_dim"]), threshold=float(meta["threshold"]), eps=float(meta["eps"]),
    )
    state = load_file(str(wf))
    try:
        sk.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{wf}: tensors do not match the recorded sizes: {exc}") from exc
    if model is not None:
        prm = next(model.parameters())
        device = prm.device if device is None else device
        dtype = prm.dtype if dtype is None else dtype
    else:
        dtype = dtype or next(iter(state.values())).dtype
    sk.to(device=device or "cpu", dtype=dtype)
    sk.checkpoint_meta = meta
    return sk.eval()


@register_skipper("flexidepth")
def flexidepth_factory(checkpoint: str | Path | None = None, model=None, path: str | Path | None = None,
                      **kwargs) -> FlexiDepthSkipper:
    """Registry factory: ``checkpoint=DIR`` (or ``path=DIR``) loads a checkpoint, checked against
    ``model`` when given; otherwise the arguments go to :class:`FlexiDepthSkipper`."""
    checkpoint = checkpoint if checkpoint is not None else path
    if checkpoint is not None:
        return load_flexidepth(checkpoint, model, **kwargs)
    if not kwargs:
        raise ValueError("flexidepth needs a checkpoint directory: 'flexidepth:DIR'")
    return FlexiDepthSkipper(**kwargs)


FlexiDepthSkipper.registered_name = "flexidepth"


# ======================================================================================================
# The training forward
# ======================================================================================================
def _base_layers(model) -> list:
    """The model's original decoder layers (unwrapping installed routed layers)."""

    return [layer.layer if isinstance(layer, RoutedDecoderLayer) else layer for layer in model.model.layers]


class FlexiForward(NamedTuple):
    """Result of :func:`flexidepth_forward`.

    Attributes:
        logits: ``[B, S, V]`` float logits.
        weights: ``[B, S, n_routed]`` float32 router weights, routed layers in increasing order (empty
            last dimension for the dense forward).
        run: ``[B, S, n_routed]`` bool decisions (True = RUN).
    """

    logits: torch.Tensor
    weights: torch.Tensor
    run: torch.Tensor


def flexidepth_forward(model, skipper: FlexiDepthSkipper | None, input_ids: torch.Tensor,
                       *, grad_from_first_routed: bool = True) -> FlexiForward:
    """The FlexiDepth forward on full windows (no cache): training forward and per-row reference.

    Layers below the first routed layer run unchanged (under ``no_grad`` when
    ``grad_from_first_routed``: the backbone is frozen and nothing below needs gradients). At a routed
    layer every row computes the attention output (causal over all rows: Project-Only rows' K/V are
    their own layer's projections of their input, as in inference) and the MLP contribution, the
    router weight ``w``, the hard decision ``run = w > threshold`` (no gradient), and::

        out = where(run, m + w * mlp, h + (1 - w) * adapter(h)),   m = h + attn

    which is exactly the routed inference computation of :class:`FlexiDepthSkipper` (tested against
    the routed layer); gradients reach the router through the ``w`` factor of whichever branch a row
    takes. With ``skipper=None`` this is the dense model.

    Args:
        model: a Llama / Qwen3-family causal LM (routed layers installed or not: the original layers
            are used).
        skipper: the policy, or None for the dense forward.
        input_ids: ``[B, S]`` int64 token ids (positions 0..S-1).
        grad_from_first_routed: see above.

    Returns:
        :class:`FlexiForward`.
    """

    backbone = model.model
    layers = _base_layers(model)
    B, S = input_ids.shape
    routed = skipper.routed_layers if skipper is not None else ()
    first = min(routed) if routed else len(layers)
    pos = torch.arange(S, device=input_ids.device)[None].expand(B, S)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not grad_from_first_routed):
        h = backbone.embed_tokens(input_ids)
        mask = create_causal_mask(config=backbone.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=pos)
        pe = backbone.rotary_emb(h, pos)
        for i in range(first):
            h = layers[i](h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    ws, runs = [], []
    for i in range(first, len(layers)):
        layer = layers[i]
        if i not in routed:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
            continue
        attn_out, _ = layer.self_attn(hidden_states=layer.input_layernorm(h), position_embeddings=pe,
                                      attention_mask=mask, position_ids=pos)
        m = h + attn_out
        mlp_out = layer.mlp(layer.post_attention_layernorm(m))
        w = skipper.weight(i, h)  # [B, S] float32
        run = (w > skipper.threshold).detach()
        h = torch.where(run.unsqueeze(-1), skipper.run_output(m, mlp_out, w), skipper.skip_output(i, h, w))
        ws.append(w)
        runs.append(run)
    logits = model.lm_head(backbone.norm(h))
    if ws:
        weights, run = torch.stack(ws, -1), torch.stack(runs, -1)
    else:
        weights = torch.zeros(B, S, 0, device=input_ids.device)
        run = torch.zeros(B, S, 0, dtype=torch.bool, device=input_ids.device)
    return FlexiForward(logits, weights, run)


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1))


def skip_penalty(weights: torch.Tensor) -> torch.Tensor:
    """FlexiDepth's skip penalty normalised by the number of routed layers:
    ``mean_t (mean_l w_{t,l})^2`` for ``weights`` ``[B, S, n_routed]`` (scalar float32)."""
    if weights.shape[-1] == 0:
        return weights.sum()
    return weights.mean(-1).pow(2).mean()


@torch.no_grad()
def evaluate_flexidepth(model, skipper: FlexiDepthSkipper | None, windows, *, batch_size: int = 8) -> dict:
    """Held-out LM loss and realised skip ratio of the hard-routed forward.

    Args:
        model: the causal LM.
        skipper: the policy (None: dense model, skip ratio NaN).
        windows: ``[N, S]`` int64 token windows (tensor or array).
        batch_size: windows per forward.

    Returns:
        ``{"lm_loss": nats/token, "skip_ratio": share of (token, routed layer) pairs taking
        Project-Only, "skip_ratio_by_layer": {layer: share}, "mean_weight": mean w, "tokens": N*S}``.
    """
    x = torch.as_tensor(np.asarray(windows), dtype=torch.long)
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"windows must be a non-empty [N, S] array, got shape {tuple(x.shape)}")
    dev = next(model.parameters()).device
    was = skipper.training if skipper is not None else False
    if skipper is not None:
        skipper.eval()
    tot_loss, n_tok, skipped, pairs, wsum = 0.0, 0, None, 0, 0.0
    for s in range(0, x.shape[0], batch_size):
        ids = x[s : s + batch_size].to(dev)
        out = flexidepth_forward(model, skipper, ids)
        n = ids[:, 1:].numel()
        tot_loss += float(_lm_loss(out.logits, ids)) * n
        n_tok += n
        if out.run.shape[-1]:
            po = (~out.run).reshape(-1, out.run.shape[-1]).sum(0).double().cpu()
            skipped = po if skipped is None else skipped + po
            pairs += out.run.shape[0] * out.run.shape[1]
            wsum += float(out.weights.double().sum())
    if skipper is not None:
        skipper.train(was)
    res = {"lm_loss": tot_loss / n_tok, "tokens": int(x.numel())}
    if skipped is not None:
        res["skip_ratio"] = float(skipped.sum() / (pairs * skipped.numel()))
        res["skip_ratio_by_layer"] = {int(l): float(v / pairs) for l, v in zip(skipper.routed_layers, skipped)}
        res["mean_weight"] = wsum / (pairs * skipped.numel())
    else:
        res["skip_ratio"] = float("nan")
        res["skip_ratio_by_layer"] = {}
        res["mean_weight"] = float("nan")
    return res


# ======================================================================================================
# Training (stage 1)
# ======================================================================================================
#: the ``vskipper.flexidepth`` section's defaults (:class:`impl.vskipper.schema.FlexiDepth`): the one
#: source of the training defaults below
_F = _FlexiDepthSection()


@dataclass(frozen=True)
class FlexiDepthTrainConfig:
    """Stage-1 training of routers and adapters on a frozen backbone (FlexiDepth's first stage).

    Attributes:
        routed_layers: routed layer indices (None: the second half of the model's layers).
        steps: optimiser steps.
        batch_size: windows per step.
        seq_len: tokens per window (used by :func:`windows_from_tokens` / :func:`train_and_save` to cut
            a token stream; :func:`train_flexidepth` takes windows as they come).
        lr: peak AdamW learning rate (linear warm-up, then cosine decay to 10%).
        warmup_fraction: share of the steps of linear warm-up.
        weight_decay: AdamW weight decay.
        grad_clip: gradient-norm clip (0: none).
        skip_alpha: coefficient of the skip penalty ``mean_t (mean_l w)^2``.
        threshold: RUN iff ``w > threshold``.
        router_reduction: router bottleneck ``H / router_reduction`` (16 as FlexiDepth).
        adapter_reduction: adapter width ``intermediate_size / adapter_reduction`` (16).
        init_logit, init_spread, adapter_init_scale: initialisation (see :class:`FlexiDepthSkipper`).
        eval_windows: held-out windows (taken from the end of the windows when none are passed).
        eval_batch: windows per evaluation forward.
        seed: initialisation and data-order seed.
        threads: torch intra-op threads during training (None: leave as is).
        log_every: steps between history entries.
    """

    routed_layers: tuple[int, ...] | None = None
    steps: int = _F.steps
    batch_size: int = _F.batch_size
    seq_len: int = _F.seq_len
    lr: float = _F.lr
    warmup_fraction: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    skip_alpha: float = _F.skip_alpha
    threshold: float = 0.5
    router_reduction: int = 16
    adapter_reduction: int = 16
    init_logit: float = 2.0
    init_spread: float = 0.1
    adapter_init_scale: float = 0.0
    eval_windows: int = _F.eval_windows
    eval_batch: int = 8
    seed: int = 1234
    threads: int | None = None
    log_every: int = 25

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "router_reduction", "adapter_reduction", "eval_windows",
                     "eval_batch", "log_every"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"FlexiDepthTrainConfig.{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0 or self.skip_alpha < 0 or not 0 <= self.warmup_fraction < 1:
            raise ValueError("FlexiDepthTrainConfig: lr must be > 0, skip_alpha >= 0, warmup_fraction in [0, 1)")
        if self.routed_layers is not None:
            object.__setattr__(self, "routed_layers", tuple(int(x) for x in self.routed_layers))


def _lr_at(step: int, cfg: FlexiDepthTrainConfig) -> float:
    warm = max(1, int(round(cfg.warmup_fraction * cfg.steps)))
    return lr_at(step, lr=cfg.lr, warmup=warm, steps=cfg.steps, decay="cosine", floor=0.1)


def windows_from_tokens(tokens, seq_len: int) -> torch.Tensor:
    """Cut a token stream into non-overlapping windows.

    Args:
        tokens: 1-D token ids (list / array / tensor), or already ``[N, S]`` windows (returned as is).
        seq_len: window length.

    Returns:
        ``[N, seq_len]`` int64 tensor (the remainder is dropped).

    Raises:
        ValueError: if fewer than one window fits or the input has another rank.
    """
    t = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    if t.dim() == 2:
        return t
    if t.dim() != 1:
        raise ValueError(f"tokens must be 1-D (a stream) or 2-D (windows), got shape {tuple(t.shape)}")
    n = t.numel() // seq_len
    if n < 1:
        raise ValueError(f"{t.numel()} tokens do not fill one window of {seq_len}")
    return t[: n * seq_len].view(n, seq_len)


def train_flexidepth(model, token_windows, cfg: FlexiDepthTrainConfig = FlexiDepthTrainConfig(), *,
                     val_windows=None, skipper: FlexiDepthSkipper | None = None,
                     progress: bool = False) -> tuple[FlexiDepthSkipper, dict]:
    """Stage-1 FlexiDepth training: frozen backbone, routers + adapters on LM loss + skip penalty.

    Each step samples ``cfg.batch_size`` windows (seeded), runs :func:`flexidepth_forward` (hard routes,
    soft weight factors: module docstring) and minimises ``LM + skip_alpha * mean_t (mean_l w)^2``
    with AdamW over the skipper's parameters only. The model's parameters are frozen for the run
    (their ``requires_grad`` flags are restored afterwards) and it stays in eval mode.

    Args:
        model: a Llama / Qwen3-family causal LM (CPU or accelerator).
        token_windows: ``[N, S]`` int64 token windows (tensor or array), or a 1-D stream that is cut
            into ``cfg.seq_len`` windows.
        cfg: :class:`FlexiDepthTrainConfig`.
        val_windows: held-out windows; default: the last ``cfg.eval_windows`` windows of
            ``token_windows`` (not trained on).
        skipper: continue training this skipper (default: a fresh ``FlexiDepthSkipper.for_model``).
        progress: show a tqdm bar.

    Returns:
        ``(skipper, summary)``: the trained skipper (eval mode) and a JSON-able dict with the held-out
        LM loss and realised skip ratio before and after (``eval_lm_loss_before``, ``eval_lm_loss``,
        ``eval_skip_ratio_before``, ``eval_skip_ratio``, ``eval_skip_ratio_by_layer``,
        ``eval_mean_weight``), the dense model's held-out loss (``eval_dense_lm_loss``), train losses
        (``loss_first`` / ``loss_last``, ``lm_loss_first`` / ``lm_loss_last`` as means over the first /
        last ``log_every`` steps), ``history``, ``seconds`` (wall-clock of the optimisation loop),
        ``tokens_per_s``, ``trainable_params`` and the config.

    Raises:
        ValueError: if there are no training windows left after the hold-out, or the skipper's
            routed layers do not fit the model.
    """
    x = windows_from_tokens(token_windows, cfg.seq_len)
    if val_windows is None:
        if x.shape[0] <= cfg.eval_windows:
            raise ValueError(f"{x.shape[0]} windows: need more than eval_windows={cfg.eval_windows} to hold some out")
        x, val = x[: -cfg.eval_windows], x[-cfg.eval_windows:]
    else:
        val = windows_from_tokens(val_windows, cfg.seq_len)
    if x.shape[0] == 0:
        raise ValueError("no training windows")
    dev = next(model.parameters()).device
    prev_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    flags = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    try:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        if skipper is None:
            H = int(model.config.hidden_size)
            inter = int(getattr(model.config, "intermediate_size", 4 * H))
            skipper = FlexiDepthSkipper.for_model(
                model, cfg.routed_layers, threshold=cfg.threshold,
                router_dim=max(1, H // cfg.router_reduction), adapter_dim=max(1, inter // cfg.adapter_reduction),
                init_logit=cfg.init_logit, init_spread=cfg.init_spread,
                adapter_init_scale=cfg.adapter_init_scale, seed=cfg.seed)
        else:
            skipper.to(device=dev)
        L = len(model.model.layers)
        if any(not 0 <= l < L for l in skipper.routed_layers):
            raise ValueError(f"skipper routes {skipper.routed_layers}, the model has {L} layers")
        params = [p for p in skipper.parameters()]
        for p in params:
            p.requires_grad_(True)
        before = evaluate_flexidepth(model, skipper, val, batch_size=cfg.eval_batch)
        dense = evaluate_flexidepth(model, None, val, batch_size=cfg.eval_batch)
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        gen = torch.Generator().manual_seed(cfg.seed)
        skipper.train()
        history, losses, lms, skips = [], [], [], []
        bar = None
        if progress:
            bar = tqdm(total=cfg.steps, desc="flexidepth", leave=False)
        t0 = time.perf_counter()
        for step in range(cfg.steps):
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, cfg)
            idx = torch.randint(x.shape[0], (cfg.batch_size,), generator=gen)
            ids = x[idx].to(dev)
            out = flexidepth_forward(model, skipper, ids)
            lm = _lm_loss(out.logits, ids)
            pen = skip_penalty(out.weights)
            loss = lm + cfg.skip_alpha * pen
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            losses.append(float(loss.detach()))
            lms.append(float(lm.detach()))
            skips.append(float((~out.run).float().mean()))
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                k = min(cfg.log_every, len(losses))
                entry = {"step": step + 1, "loss": float(np.mean(losses[-k:])), "lm_loss": float(np.mean(lms[-k:])),
                         "train_skip_ratio": float(np.mean(skips[-k:])), "lr": _lr_at(step, cfg),
                         "mean_weight": float(out.weights.detach().mean())}
                history.append(entry)
                log.info("flexidepth step %d: %s", step + 1, entry)
            if bar is not None:
                bar.update(1)
        seconds = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        skipper.eval()
        after = evaluate_flexidepth(model, skipper, val, batch_size=cfg.eval_batch)
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
        model.train(was_training)
        torch.set_num_threads(prev_threads)
    for p in skipper.parameters():
        p.requires_grad_(False)
    k = min(cfg.log_every, len(losses))
    summary = {
        "steps": cfg.steps,
        "routed_layers": list(skipper.routed_layers),
        "train_windows": int(x.shape[0]),
        "eval_windows": int(val.shape[0]),
        "window_len": int(x.shape[1]),
        "loss_first": float(np.mean(losses[:k])),
        "loss_last": float(np.mean(losses[-k:])),
        "lm_loss_first": float(np.mean(lms[:k])),
        "lm_loss_last": float(np.mean(lms[-k:])),
        "train_skip_ratio_last": float(np.mean(skips[-k:])),
        "eval_lm_loss_before": before["lm_loss"],
        "eval_skip_ratio_before": before["skip_ratio"],
        "eval_lm_loss": after["lm_loss"],
        "eval_skip_ratio": after["skip_ratio"],
        "eval_skip_ratio_by_layer": after["skip_ratio_by_layer"],
        "eval_mean_weight": after["mean_weight"],
        "eval_dense_lm_loss": dense["lm_loss"],
        "seconds": seconds,
        "tokens_per_s": cfg.steps * cfg.batch_size * int(x.shape[1]) / max(seconds, 1e-9),
        "trainable_params": int(sum(p.numel() for p in skipper.parameters())),
        "device": str(dev),
        "history": history,
        "config": asdict(cfg),
    }
    return skipper, summary


def train_and_save(model_dir: str | Path, out_dir: str | Path, cfg: FlexiDepthTrainConfig,
                   data_tokens, *, val_tokens=None, progress: bool = False) -> dict:
    """Load a model directory, train a FlexiDepth skipper on it (:func:`train_flexidepth`) and write the
    checkpoint directory ``out_dir`` (e.g. beside the model: ``models/tiny-std-flexidepth``).

    Args:
        model_dir: a local Hugging Face model directory (loaded in float32 on CPU).
        out_dir: the checkpoint directory to write.
        cfg: the training configuration.
        data_tokens: a 1-D token stream (cut into ``cfg.seq_len`` windows) or ``[N, S]`` windows.
        val_tokens: optional held-out stream / windows (default: the last ``cfg.eval_windows`` windows).
        progress: show a tqdm bar.

    Returns:
        the training summary (plus ``"checkpoint"``: the directory), also stored in the json as
        ``train``.

    Raises:
        FileNotFoundError: if the model directory is missing; ValueError as :func:`train_flexidepth`.
    """

    model = load_model(model_dir)
    skipper, summary = train_flexidepth(model, data_tokens, cfg, val_windows=val_tokens, progress=progress)
    extra = {"base_model": str(model_dir), "num_hidden_layers": int(model.config.num_hidden_layers),
             "model_type": getattr(model.config, "model_type", None), "train": summary}
    skipper.save(out_dir, extra=extra)
    return dict(summary, checkpoint=str(out_dir))
