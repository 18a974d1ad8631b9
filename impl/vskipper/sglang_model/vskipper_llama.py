"""``VSkipperLlamaForCausalLM``: SGLang's Llama with routed decoder layers (vSkipper Sec. 3.1-3.2).

Served by upstream SGLang as an out-of-tree model (package docstring). The model keeps SGLang's weights,
attention backend, KV pool, scheduler and sampler; what changes is the layer stack:

- the hidden state travels between layers as the plain residual stream ``h`` ``[T, H]`` (the layers are
  built with ``stage_boundaries=False``: each completes its own sums, ``h + attn`` and ``h + mlp``);
- once per forward (one engine step) the rows of the flat batch are described as a
  :class:`~impl.vskipper.skipper.RowMeta` (request id from ``forward_batch.rids``, absolute position, phase:
  PREFILL in an extend batch, DECODE in a decode batch), and a request-hash policy's route tape
  (``Skipper.route_tape``, Sec. 3.1) gives every routed layer's RUN mask at once; a hidden-state policy
  (FlexiDepth) is asked per layer;
- at a routed layer every row's q, k, v are computed from the layer's own input and the attention
  backend writes every row's K/V into its ``out_cache_loc`` slot (Invariant 1: Project-Only rows write
  this layer's own K/V); RUN rows then take ``o_proj`` and the MLP (``skipper.run_epilogue`` on routed RUN
  rows), Project-Only rows take ``skipper.project`` instead of the attention read and the MLP. An all-RUN
  layer takes the dense path with no per-row work.

What this does not save on SGLang: the attention backend computes its output for every row of the batch
(its per-request metadata fixes the row set), so Project-Only rows' attention reads are computed and
dropped; their ``o_proj`` and MLP are skipped. Pipeline parallelism, mixed chunked prefill and speculative
forward modes are refused at start-up / at the first such step.

The ``vskipper`` entry of ``config.json`` (written by :func:`impl.vskipper.sglang_routed.write_routed_model_dir`):
``policy`` (a :func:`~impl.vskipper.skipper.build_skipper` name), ``kwargs`` (its arguments: RandomSkip
``routed_layers``, ``r``, ``d``, ``seed``; FlexiDepth ``checkpoint``), optional ``stats_path`` (a JSON file
rewritten after every routed step with the (RUN, Project-Only) counts over routed (row, layer) pairs per
phase: the realised skip share, for tests and diagnostics).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import add_prefix

from impl.vskipper.skipper import Phase, RowMeta, as_run_mask, build_skipper, check_route_tape, validate_skipper


def rows_of_forward_batch(forward_batch, positions: torch.Tensor, n_rows: int) -> RowMeta:
    """The :class:`RowMeta` of one SGLang forward's flat batch, in row order.

    Args:
        forward_batch: SGLang's ``ForwardBatch`` (``rids``, ``forward_mode``, ``extend_seq_lens_cpu``).
        positions: ``[n_rows]`` int64 absolute positions of the rows' tokens.
        n_rows: rows of the batch (graph padding rows beyond the requests' become padding rows: always RUN).

    Returns:
        RowMeta with one row per token: an extend batch gives each request ``extend_seq_lens_cpu[i]`` rows
        in phase PREFILL, a decode batch one row per request in phase DECODE.

    Raises:
        NotImplementedError: for a forward mode other than extend / decode / idle (mixed chunked prefill,
            speculative verification), where a row's phase is not known from the batch.
    """
    mode = forward_batch.forward_mode
    rids = [str(r) for r in (forward_batch.rids or [])]
    if mode.is_decode():
        per_req, phase = [1] * len(rids), int(Phase.DECODE)
    elif mode.is_extend() and not mode.is_mixed() and not mode.is_target_verify():
        per_req, phase = list(forward_batch.extend_seq_lens_cpu), int(Phase.PREFILL)
    else:
        raise NotImplementedError(f"vSkipper on SGLang routes extend and decode batches only, got {mode!r}")
    ids = tuple(r for r, n in zip(rids, per_req) for _ in range(int(n)))
    n_meta = len(ids)
    if n_meta > n_rows:
        raise RuntimeError(f"vSkipper: {n_meta} rows described by the batch's requests, the batch has {n_rows}")
    dev = positions.device
    pos = positions.reshape(-1)[:n_meta].to(torch.long)
    meta = RowMeta(ids, pos, torch.full((n_meta,), phase, dtype=torch.long, device=dev),
                   torch.ones(n_meta, dtype=torch.bool, device=dev))
    return meta.pad_to(n_rows, positions.reshape(-1)[n_meta:]) if n_meta < n_rows else meta


class VSkipperLlamaDecoderLayer(LlamaDecoderLayer):
    """One Llama decoder layer that completes its own residual sums and routes rows (Sec. 3.1).

    ``forward(positions, h, forward_batch, run=None, ...)``: ``h`` ``[T, H]`` is the residual stream entering
    the layer; returns ``[T, H]`` after it. ``run`` None: every row RUNs (the dense path); else ``run``
    ``[T]`` bool (True = RUN) with the ``skipper`` and the rows' ``meta``.
    """

    def __init__(self, config, layer_id: int = 0, quant_config=None, prefix: str = ""):
        super().__init__(config, layer_id=layer_id, start_layer=0, quant_config=quant_config, prefix=prefix,
                         stage_boundaries=False)
        self.layer_id = layer_id

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch, run=None,
                skipper=None, meta: RowMeta | None = None, capture_output=None) -> torch.Tensor:
        attn = self.self_attn
        normed = self.input_layernorm(hidden_states)  # [T, H]
        q, k, v = attn.forward_prepare_native(positions, normed)  # [T, q_size], [T, kv_size] x 2
        a = attn.attn(q, k, v, forward_batch)  # [T, q_size]; writes every row's K/V (Invariant 1)
        if run is None:
            mid = hidden_states + attn.o_proj(a)[0]
            return mid + self.mlp(self.post_attention_layernorm(mid), forward_batch=forward_batch)
        run_idx = run.nonzero().squeeze(1)  # [n_run]
        po_idx = (~run).nonzero().squeeze(1)  # [n_po]
        out = hidden_states.clone()
        if run_idx.numel():
            h_in = hidden_states.index_select(0, run_idx)  # [n_run, H]
            mid = h_in + attn.o_proj(a.index_select(0, run_idx))[0]
            mlp_out = self.mlp(self.post_attention_layernorm(mid), forward_batch=forward_batch)
            h = mid + mlp_out
            if not skipper.identity_run:  # the epilogue applies to routed RUN rows only
                sel = meta.routed_mask[run_idx].nonzero().squeeze(1)
                if sel.numel():
                    h = h.index_copy(0, sel, skipper.run_epilogue(
                        self.layer_id, h_in[sel], h[sel], meta.select(run_idx[sel]), hidden_mid=mid[sel],
                        mlp_out=mlp_out[sel]).to(h.dtype))
            out.index_copy_(0, run_idx, h.to(out.dtype))
        if po_idx.numel():
            h_po = hidden_states.index_select(0, po_idx)  # [n_po, H]
            proj = skipper.project(self.layer_id, h_po, meta.select(po_idx))
            if proj is not h_po:
                out.index_copy_(0, po_idx, proj.to(out.dtype))
        return out


class VSkipperLlamaModel(nn.Module):
    """SGLang's ``LlamaModel`` layout (``embed_tokens``, ``layers``, ``norm``: the checkpoint's names) with
    :class:`VSkipperLlamaDecoderLayer` layers and the skipper of ``config.vskipper``.

    Raises:
        NotImplementedError: under pipeline parallelism.
        ValueError: without a ``vskipper`` entry in the config, or for a policy :func:`validate_skipper` rejects.
    """

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        if get_parallel().pp_group.world_size > 1:
            raise NotImplementedError("vSkipper on SGLang: pipeline parallelism is not supported")
        spec = getattr(config, "vskipper", None)
        if not isinstance(spec, dict) or "policy" not in spec:
            raise ValueError("VSkipperLlamaForCausalLM needs a 'vskipper' entry with a 'policy' in config.json "
                             "(impl.vskipper.sglang_routed.write_routed_model_dir writes one)")
        self.config = config
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                   prefix=add_prefix("embed_tokens", prefix))
        L = config.num_hidden_layers
        self.layers = nn.ModuleList([
            VSkipperLlamaDecoderLayer(config, layer_id=i, quant_config=quant_config,
                                      prefix=add_prefix(f"layers.{i}", prefix)) for i in range(L)])
        self.start_layer, self.end_layer = 0, L
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers_to_capture = []
        skipper = build_skipper(str(spec["policy"]), **dict(spec.get("kwargs") or {}))
        validate_skipper(skipper, num_layers=L, hidden_size=config.hidden_size)
        skipper.eval()
        # kept out of the module tree: SGLang's weight loader and dtype passes see only the checkpoint's weights
        object.__setattr__(self, "skipper", skipper)
        self._column = {layer: j for j, layer in enumerate(skipper.routed_layers)}
        self._placed = False
        self._stats_path = spec.get("stats_path")
        self.counts = {int(Phase.PREFILL): [0, 0], int(Phase.DECODE): [0, 0]}  # phase -> [RUN, Project-Only]
        self.steps = 0

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def _place(self, like: torch.Tensor) -> None:
        if not self._placed:
            self.skipper.to(device=like.device, dtype=like.dtype)
            self._placed = True

    def _count(self, run: torch.Tensor, meta: RowMeta) -> None:
        routed = meta.routed_mask
        for ph in (int(Phase.PREFILL), int(Phase.DECODE)):
            sel = routed & (meta.phase == ph)
            n = int(sel.sum())
            if n:
                n_run = int((run & sel).sum())
                self.counts[ph][0] += n_run
                self.counts[ph][1] += n - n_run

    def _write_stats(self) -> None:
        body = {"steps": self.steps, "policy": type(self.skipper).__name__,
                "counts": {Phase(ph).name.lower(): c for ph, c in self.counts.items()}}
        tmp = f"{self._stats_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self._stats_path)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                input_embeds: Optional[torch.Tensor] = None, pp_proxy_tensors=None) -> torch.Tensor:
        """The layer stack of one engine step: ``input_ids`` ``[T]`` (or ``input_embeds`` ``[T, H]``) and
        ``positions`` ``[T]`` -> final-normed hidden states ``[T, H]``."""
        h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [T, H]
        n_rows = h.shape[0]
        skipper = self.skipper
        if n_rows == 0 or not self._column:
            for layer in self.layers:
                h = layer(positions, h, forward_batch)
            return self.norm(h) if n_rows else h
        self._place(h)
        meta = rows_of_forward_batch(forward_batch, positions, n_rows)
        routed = meta.routed_mask  # [T]
        raw = skipper.route_tape(meta)
        tape = all_run = None
        if raw is not None:  # request-hash policy: every routed layer's masks once per step
            raw = check_route_tape(raw, n_rows, len(self._column), who=type(skipper).__name__)
            tape = raw | ~routed[:, None]  # [T, n_routed]
            all_run = tape.all(dim=0).tolist()  # the step's one host sync
        any_routed = bool(routed.any())
        for i, layer in enumerate(self.layers):
            j = self._column.get(i)
            if j is None:
                h = layer(positions, h, forward_batch)
                continue
            if tape is not None:
                run, every = tape[:, j], all_run[j]
            else:
                run = as_run_mask(skipper.route(i, h, meta), n_rows, layer_idx=i, who=type(skipper).__name__)
                run = run | ~routed
                every = bool(run.all())
            if self._stats_path:
                self._count(run, meta)
            if every and (skipper.identity_run or not any_routed):
                h = layer(positions, h, forward_batch)
            else:
                h = layer(positions, h, forward_batch, run=run, skipper=skipper, meta=meta)
        self.steps += 1
        if self._stats_path:
            self._write_stats()
        return self.norm(h)


class VSkipperLlamaForCausalLM(LlamaForCausalLM):
    """SGLang's ``LlamaForCausalLM`` (weights, LM head, logits) over :class:`VSkipperLlamaModel`."""

    def _init_model(self, config, quant_config=None, prefix: str = ""):
        return VSkipperLlamaModel(config, quant_config=quant_config, prefix=prefix)


EntryClass = VSkipperLlamaForCausalLM
