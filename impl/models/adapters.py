"""Inducing adapters (DEX App. C.2): small residual adapters at non-final explored depths that align
intermediate hidden states with the shared final norm + LM head of a standard (not early-exit
trained) model.

For a pre-norm hidden state h_l in R^h the adapter at depth l computes

    Delta h_l = alpha_l * W2_l sigma(W1_l RMSNorm(h_l)),    h~_l = h_l + Delta h_l

with W1 in R^{m x h}, W2 in R^{h x m} (both with biases), m = 2h by default, sigma the backbone's
activation and alpha_l a learnable scalar initialised to 1e-3. One adapter has
h*m + m*h + m + 2h + 1 parameters (4h^2 + 4h + 1 for m = 2h). Adapters change only intermediate
proposals: the final depth L never gets one, so a lossless decoder's committed tokens are unchanged.

An adapter set is saved as a directory with ``adapters.safetensors`` (tensors ``"{depth}.{name}"``)
and ``adapters.json`` (depths, sizes, activation, the model it was trained for, training summary).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.activations import ACT2FN

from .depth import num_layers

WEIGHTS = "adapters.safetensors"
META = "adapters.json"


def adapter_param_count(hidden: int, inner: int | None = None) -> int:
    """Parameters of one inducing adapter: h*m + m*h + m + 2h + 1 (DEX App. C.2); 4h^2+4h+1 for
    m = 2h."""
    m = 2 * hidden if inner is None else inner
    return hidden * m + m * hidden + m + 2 * hidden + 1


class InducingAdapter(nn.Module):
    """One residual inducing adapter (DEX App. C.2).

    Args:
        hidden: h, the model's hidden size.
        inner: m, the bottleneck width (default 2h).
        activation: name of the backbone activation in ``transformers.activations.ACT2FN``
            (``config.hidden_act``, e.g. ``"silu"``).
        eps: RMSNorm epsilon (the backbone's ``rms_norm_eps``).
        alpha_init: initial value of the scalar gate alpha.

    Forward: ``[..., h]`` float -> ``[..., h]`` float (same dtype), h + alpha W2 sigma(W1 RMSNorm(h)).
    """

    def __init__(self, hidden: int, inner: int | None = None, activation: str = "silu", eps: float = 1e-6,
                 alpha_init: float = 1e-3):
        super().__init__()

        m = 2 * hidden if inner is None else inner
        self.hidden, self.inner, self.activation, self.eps = hidden, m, activation, eps
        self.norm_weight = nn.Parameter(torch.ones(hidden))
        self.w1 = nn.Linear(hidden, m, bias=True)
        self.w2 = nn.Linear(m, hidden, bias=True)
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        self.act = ACT2FN[activation]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (self.norm_weight * x).to(h.dtype)
        return h + self.alpha * self.w2(self.act(self.w1(x)))


def new_adapters(model, depths, *, inner: int | None = None, alpha_init: float = 1e-3, seed: int = 0) -> dict[int, InducingAdapter]:
    """Fresh adapters for ``model`` at ``depths`` (1-based, each in [1, L-1]).

    Raises:
        ValueError: a depth outside [1, L-1] (the final depth L never gets an adapter).
    """

    L = num_layers(model)
    depths = sorted(set(int(d) for d in depths))
    bad = [d for d in depths if not 1 <= d < L]
    if bad:
        raise ValueError(f"adapter depths {bad} are outside [1, {L - 1}]: adapters attach only to non-final "
                         "explored depths (DEX App. C.2)")
    cfg = model.config
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        out = {d: InducingAdapter(cfg.hidden_size, inner, getattr(cfg, "hidden_act", "silu"),
                                  getattr(cfg, "rms_norm_eps", 1e-6), alpha_init) for d in depths}
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    return {d: a.to(device=device, dtype=dtype) for d, a in out.items()}


def model_fingerprint(model) -> str:
    """A short content hash of ``model``'s output-embedding (LM head) weights: sha256 over its shape and
    up to 65536 evenly strided entries in float32, so two models of the same architecture (e.g.
    ``tiny-ls`` and ``tiny-std``) get different fingerprints. Cheap for any model size (a strided
    sample, not the whole matrix). Returns 16 hex digits."""

    w = model.get_output_embeddings().weight.detach()
    flat = w.reshape(-1)
    step = max(1, flat.numel() // 65536)
    sample = flat[::step][:65536].to(device="cpu", dtype=torch.float32).contiguous()
    h = hashlib.sha256(repr(tuple(w.shape)).encode())
    h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def save_adapters(adapters: dict[int, InducingAdapter], out_dir: str | Path, meta: dict | None = None,
                  model=None) -> None:
    """Write ``adapters.safetensors`` and ``adapters.json`` into ``out_dir`` (created); with ``model``
    (the backbone they were trained on) its :func:`model_fingerprint` is recorded, and
    :func:`load_adapters` refuses the set for any other model."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"{d}.{k}": v.detach().cpu().contiguous() for d, a in adapters.items() for k, v in a.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS))
    any_a = next(iter(adapters.values()))
    info = {"depths": sorted(adapters), "hidden": any_a.hidden, "inner": any_a.inner,
            "activation": any_a.activation, "eps": any_a.eps,
            "parameters_per_adapter": adapter_param_count(any_a.hidden, any_a.inner), **(meta or {})}
    if model is not None:
        info["model_fingerprint"] = model_fingerprint(model)
    (out / META).write_text(json.dumps(info, indent=1))


def load_adapters(path: str | Path, model=None) -> dict[int, InducingAdapter]:
    """Load an adapter set saved by :func:`save_adapters`.

    Args:
        path: adapter directory.
        model: when given, adapters are checked against its hidden size and depth, and moved to its
            device and dtype.

    Raises:
        FileNotFoundError: missing directory or files (the message names the rule that builds them).
        ValueError: adapters that do not fit ``model`` (hidden size, or a depth outside [1, L-1]), or
            that were trained on another model (recorded :func:`model_fingerprint` differs).
    """

    p = Path(path)
    if not (p / META).is_file() or not (p / WEIGHTS).is_file():
        raise FileNotFoundError(f"inducing adapters not found at {p} (expected {META} and {WEIGHTS}; "
                                "built by the train_adapters rule / `python -m impl train-adapters`)")
    info = json.loads((p / META).read_text())
    tensors = load_file(str(p / WEIGHTS))
    out = {}
    for d in info["depths"]:
        a = InducingAdapter(info["hidden"], info["inner"], info["activation"], info["eps"])
        a.load_state_dict({k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == str(d)})
        out[int(d)] = a.eval()
    if model is not None:
        L = num_layers(model)
        fp = info.get("model_fingerprint")
        if fp is not None and fp != model_fingerprint(model):
            raise ValueError(f"adapters at {p} were trained on another model ({info.get('model_dir', 'unrecorded')}, "
                             f"fingerprint {fp}); this model's is {model_fingerprint(model)}")
        if info["hidden"] != model.config.hidden_size:
            raise ValueError(f"adapters at {p} have hidden size {info['hidden']}, the model {model.config.hidden_size}")
        bad = [d for d in out if not 1 <= d < L]
        if bad:
            raise ValueError(f"adapters at {p} sit at depths {bad} outside [1, {L - 1}] of this model")
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        out = {d: a.to(device=device, dtype=dtype) for d, a in out.items()}
    return out


def select_adapters(adapters: dict[int, InducingAdapter] | None, exploration_set) -> dict[int, InducingAdapter]:
    """The adapters a DEX run with exploration set X uses: those at X minus {L}.

    Raises:
        ValueError: a non-final depth of X without an adapter in the set.
    """
    if not adapters:
        return {}
    X = list(exploration_set)
    missing = [d for d in X[:-1] if d not in adapters]
    if missing:
        raise ValueError(f"exploration set {X} needs adapters at depths {missing}, which the adapter set "
                         f"(depths {sorted(adapters)}) does not have")
    return {d: adapters[d] for d in X[:-1]}


__all__ = ["InducingAdapter", "adapter_param_count", "new_adapters", "save_adapters", "load_adapters", "model_fingerprint",
           "select_adapters"]
