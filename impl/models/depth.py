"""Layer-range execution and intermediate-depth readout.

The candidate token at depth l (1-based, l in [1, L]) is the shared final norm and LM head applied to
the hidden state after decoder layer l (DEX paper, Sec. 2.1 and Def. 1; DESIGN.md "Intermediate
readout"). This module is the one place that implements it, for every method. Layers are run by
hand (``model.model.layers[a:b]`` with ``create_causal_mask`` and ``rotary_emb``), which reproduces
``model()`` exactly in transformers 5.24 (tested in tests/test_models.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.masking_utils import create_causal_mask


def _backbone(model):
    """Return ``(backbone, norm, lm_head)`` of a causal LM with a shared final norm and LM head.

    Raises:
        TypeError: if the model has no ``.model.layers`` / ``.model.norm`` / ``lm_head``.
    """
    backbone = getattr(model, "model", None)
    if backbone is None or not hasattr(backbone, "layers") or not hasattr(backbone, "norm"):
        raise TypeError(
            f"{type(model).__name__} has no .model.layers/.model.norm: intermediate readout needs a "
            "decoder-only causal LM with a shared final norm (Llama/Qwen families)"
        )
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise TypeError(f"{type(model).__name__} has no LM head (get_output_embeddings() is None)")
    return backbone, backbone.norm, lm_head


def num_layers(model) -> int:
    """Number of decoder layers L of a causal LM."""
    return len(_backbone(model)[0].layers)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The L decoder layers of a causal LM (index l-1 = layer l), e.g. to attach forward hooks.

    Raises:
        TypeError: as :func:`num_layers`.
    """
    return _backbone(model)[0].layers


def run_layers(
    model,
    hidden: torch.Tensor,
    start: int,
    end: int,
    *,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cache=None,
    on_layer: Callable[[int, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Run decoder layers ``start+1 .. end`` (1-based depths; python slice ``layers[start:end]``).

    Args:
        model: a Hugging Face causal LM (Llama/Qwen family).
        hidden: ``[B, S, H]`` float hidden states entering layer ``start+1`` (the embeddings when
            ``start == 0``).
        start, end: depth range, ``0 <= start <= end <= L``.
        position_ids: ``[B, S]`` int64 absolute positions of the S query tokens.
        attention_mask: None (causal over cache + queries), a 2D padding mask, or a prepared 4D
            additive/boolean mask ``[B, 1, S, past+S]`` (tree verification).
        cache: a transformers ``Cache`` (updated in place for the layers run) or None.
        on_layer: called as ``on_layer(depth, hidden)`` after each layer with the pre-norm hidden
            state ``[B, S, H]`` at that 1-based depth.

    Returns:
        ``[B, S, H]`` pre-norm hidden state after layer ``end``.

    Raises:
        ValueError: on a depth range outside ``[0, L]``.
    """
    backbone, _, _ = _backbone(model)
    n = len(backbone.layers)
    if not 0 <= start <= end <= n:
        raise ValueError(f"layer range ({start}, {end}] is outside [0, {n}]")
    mask = create_causal_mask(
        config=backbone.config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
    )
    pos_emb = backbone.rotary_emb(hidden, position_ids=position_ids)
    for i in range(start, end):
        hidden = backbone.layers[i](
            hidden,
            attention_mask=mask,
            position_embeddings=pos_emb,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
        )
        if on_layer is not None:
            on_layer(i + 1, hidden)
    return hidden


def readout_logits(model, hidden: torch.Tensor, adapter: torch.nn.Module | None = None) -> torch.Tensor:
    """Candidate logits at an intermediate (or the final) depth.

    Args:
        model: the causal LM whose shared final norm and LM head are applied.
        hidden: ``[..., H]`` pre-norm hidden state after some layer l.
        adapter: optional inducing adapter at depth l (DEX App. C.2), applied before the norm.

    Returns:
        ``[..., V]`` float logits (final norm + LM head).
    """
    _, norm, lm_head = _backbone(model)
    if adapter is not None:
        hidden = adapter(hidden)
    return lm_head(norm(hidden))


def embed(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings ``[B, S, H]`` for ``input_ids`` ``[B, S]`` (int64)."""
    return _backbone(model)[0].embed_tokens(input_ids)


def hidden_states_by_depth(
    model,
    input_ids: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    cache=None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pre-norm hidden states after every decoder layer, in one forward pass.

    Args:
        input_ids: ``[B, S]`` int64 token ids (the new tokens; earlier ones live in ``cache``).
        position_ids: ``[B, S]`` int64; defaults to ``past_len + arange(S)``.
        cache: transformers Cache, updated in place, or None.
        attention_mask: as in :func:`run_layers`.

    Returns:
        ``[L, B, S, H]`` float tensor; index ``l-1`` holds the state after layer ``l``.
    """
    if position_ids is None:
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + past).unsqueeze(0)
        position_ids = position_ids.expand(input_ids.shape[0], -1)
    states: list[torch.Tensor] = []
    run_layers(
        model,
        embed(model, input_ids),
        0,
        num_layers(model),
        position_ids=position_ids,
        attention_mask=attention_mask,
        cache=cache,
        on_layer=lambda _d, h: states.append(h),
    )
    return torch.stack(states, dim=0)
