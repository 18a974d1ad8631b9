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

**Modes** (Sec. 3.3). Without a ``switch`` every request is routed in both phases (always-route). With
one, a :class:`~impl.vskipper.mode.ModeController` (the project's own, as on the transformers engine) plans
every step's rows: it is the same host-side state machine, fed the same :class:`RowMeta`, with the share
probes read from the per-(layer, phase) counters of the model's
:class:`~impl.vskipper.routed.RowContext` (the same side channel the transformers binding uses: planner,
route tape, counters). Two differences from the transformers engine,
both from SGLang's scheduler: a batch is either an extend (prefill) or a decode batch, never both, so the
decode load is the decode batch's size; and the server lives across runs, so the controller is replaced
(and the route counters zeroed) whenever a warm-up request (request id starting with
:data:`impl.serving.sglang_arm.WARMUP_PREFIX`, which :class:`~impl.serving.sglang_arm.SGLangArm` sends
after its cache flush at the start of every run) is prefilled. Warm-up rows are always dense and never
seen by the controller, as the transformers arm installs its controller after the warm-up.

The ``vskipper`` entry of ``config.json`` (written by :func:`impl.vskipper.sglang_routed.write_routed_model_dir`):
``policy`` (a :func:`~impl.vskipper.skipper.build_skipper` name), ``kwargs`` (its arguments: RandomSkip
``routed_layers``, ``r``, ``d``, ``seed``; FlexiDepth ``checkpoint``), optional ``switch`` (the
:class:`~impl.vskipper.mode.ModeSwitch` fields, ``to_dict`` form), optional ``check_kv`` (bool: after
every routed layer, read the Project-Only rows' K/V back from the KV pool at their ``out_cache_loc`` slots
and compare them with the layer's own projection of those rows, computed again on the Project-Only rows
alone: Invariant 1, at a cost of one extra K/V projection; for tests), optional ``stats_path`` (a JSON
file rewritten after every routed step with the (RUN, Project-Only) counts over routed (row, layer) pairs
per phase, the mode controller's summary and the K/V check: for tests and diagnostics), optional
``stats_modes`` (bool: the stats also carry every request's modes, ``prefill`` and ``routed_from``, which
a plain-PyTorch replay reads; grows with the requests served, so for tests).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_executor.forward_context import get_token_to_kv_pool
from sglang.srt.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import add_prefix

from impl.serving.sglang_arm import WARMUP_PREFIX
from impl.vskipper.mode import ModeController, ModeSwitch
from impl.vskipper.routed import RowContext
from impl.vskipper.skipper import Phase, RowMeta, as_run_mask, build_skipper, validate_skipper


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
                skipper=None, meta: RowMeta | None = None, kv_check: dict | None = None,
                capture_output=None) -> torch.Tensor:
        attn = self.self_attn
        normed = self.input_layernorm(hidden_states)  # [T, H]
        q, k, v = attn.forward_prepare_native(positions, normed)  # [T, q_size], [T, kv_size] x 2
        a = attn.attn(q, k, v, forward_batch)  # [T, q_size]; writes every row's K/V (Invariant 1)
        if run is None:
            mid = hidden_states + attn.o_proj(a)[0]
            return mid + self.mlp(self.post_attention_layernorm(mid), forward_batch=forward_batch)
        run_idx = run.nonzero().squeeze(1)  # [n_run]
        po_idx = (~run).nonzero().squeeze(1)  # [n_po]
        if kv_check is not None and po_idx.numel():
            self._check_project_only_kv(positions, hidden_states, forward_batch, po_idx, kv_check)
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

    def _check_project_only_kv(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch,
                               po_idx: torch.Tensor, acc: dict) -> None:
        """Invariant 1 on the KV pool: the K/V stored at the Project-Only rows' ``out_cache_loc`` slots equal
        this layer's own projection of those rows (recomputed here on the Project-Only rows alone).

        Adds to ``acc``: ``rows`` (Project-Only (row, layer) pairs checked), ``max_abs_diff`` (largest
        |stored - recomputed| over K and V) and ``max_rel_diff`` (the same over the largest |K|, |V| of the
        check: the recomputation runs on fewer rows, so a GEMM may round differently, ~1e-7 relative in
        float32)."""
        attn = self.self_attn
        h_po = hidden_states.index_select(0, po_idx)  # [n_po, H]
        _, k_po, v_po = attn.forward_prepare_native(positions.reshape(-1).index_select(0, po_idx),
                                                    self.input_layernorm(h_po))  # [n_po, kv_size] x 2
        layer_id = attn.attn.layer_id
        pool = get_token_to_kv_pool()  # the running model's KV pool (the attention backend writes into it)
        loc = forward_batch.out_cache_loc.index_select(0, po_idx).to(torch.long)  # [n_po]
        k_cache = pool.get_key_buffer(layer_id).index_select(0, loc)  # [n_po, kv_heads, head_dim]
        v_cache = pool.get_value_buffer(layer_id).index_select(0, loc)
        diff = max(float((k_cache.reshape(k_po.shape).float() - k_po.float()).abs().max()),
                   float((v_cache.reshape(v_po.shape).float() - v_po.float()).abs().max()))
        scale = max(float(k_po.float().abs().max()), float(v_po.float().abs().max()), 1e-30)
        acc["rows"] = acc.get("rows", 0) + int(po_idx.numel())
        acc["max_abs_diff"] = max(acc.get("max_abs_diff", 0.0), diff)
        acc["max_rel_diff"] = max(acc.get("max_rel_diff", 0.0), diff / scale)


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
        self._stats_modes = bool(spec.get("stats_modes"))
        self._switch = None if spec.get("switch") is None else ModeSwitch.from_fields(dict(spec["switch"]))
        self.runs = 0  # warm-ups seen: each starts a run with a fresh controller
        self.kv_check: dict | None = {} if spec.get("check_kv") else None
        # the project's row context: the planner (mode controller), the step's route tape and the
        # (layer, phase) RUN / Project-Only counters the controller's share probes read
        self.row_ctx = RowContext(record_stats=self._switch is not None or bool(self._stats_path))
        self.row_ctx.planner = None if self._switch is None else ModeController(self._switch)
        self.steps = 0

    @property
    def controller(self) -> ModeController | None:
        """The current run's mode controller (None without a switch)."""
        return self.row_ctx.planner

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def _place(self, like: torch.Tensor) -> None:
        if not self._placed:
            self.skipper.to(device=like.device, dtype=like.dtype)
            self._placed = True

    def _write_stats(self) -> None:
        body = {"steps": self.steps, "runs": self.runs, "policy": type(self.skipper).__name__,
                "counts": {ph.name.lower(): [sum(c[k] for (_, p), c in self.row_ctx.counts.items() if p == int(ph))
                                             for k in (0, 1)] for ph in (Phase.PREFILL, Phase.DECODE)},
                "mode": None if self.controller is None else self.controller.summary(),
                "modes": None if self.controller is None or not self._stats_modes else {  # replayable per request
                    "prefill": dict(self.controller.prefill_mode), "routed_from": dict(self.controller.routed_from)},
                "kv_check": self.kv_check}
        tmp = f"{self._stats_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self._stats_path)

    def _plan(self, meta: RowMeta) -> RowMeta:
        """Set each row's mode: warm-up rows dense (a warm-up prefill starts a run: fresh controller),
        the others by the mode controller, or all routed without a switch."""
        warm = [r is not None and r.startswith(WARMUP_PREFIX) for r in meta.request_ids]
        if any(warm):
            if bool((meta.phase == int(Phase.PREFILL)).any()):  # a run starts: fresh counters and controller
                self.row_ctx.planner = None if self._switch is None else ModeController(self._switch)
                self.row_ctx.reset_stats()
                self.runs += 1
            keep = torch.tensor([not w for w in warm], dtype=torch.bool, device=meta.token_idx.device)
            meta = RowMeta(meta.request_ids, meta.token_idx, meta.phase,
                           keep if meta.routed is None else meta.routed & keep, meta.request_keys)
            if not any(not w and r is not None for w, r in zip(warm, meta.request_ids)):
                return meta
        return self.row_ctx.plan(meta)

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
        ctx = self.row_ctx
        ctx.set_rows(self._plan(rows_of_forward_batch(forward_batch, positions, n_rows)))
        meta = ctx.meta
        if ctx.batch_dense:  # every row dense this step: the unmodified layers, no router call
            for layer in self.layers:
                h = layer(positions, h, forward_batch)
            return self._end_step(h)
        routed = meta.routed_mask  # [T]
        # request-hash policy: every routed layer's masks and their counts in one host sync (Sec. 3.1)
        tape = ctx.tape(skipper, meta)
        for i, layer in enumerate(self.layers):
            j = self._column.get(i)
            if j is None:
                h = layer(positions, h, forward_batch)
                continue
            if tape is not None:
                run, every = tape.run[:, j], tape.all_run[j]
            else:  # hidden-state policy: decided at this layer
                run = as_run_mask(skipper.route(i, h, meta), n_rows, layer_idx=i, who=type(skipper).__name__)
                run = run | ~routed
                every = bool(run.all())
                if ctx.record_stats:
                    ctx.record(i, run, meta)
            if every and skipper.identity_run:
                h = layer(positions, h, forward_batch)
            else:
                h = layer(positions, h, forward_batch, run=run, skipper=skipper, meta=meta, kv_check=self.kv_check)
        return self._end_step(h)

    def _end_step(self, h: torch.Tensor) -> torch.Tensor:
        self.row_ctx.clear()
        self.steps += 1
        if self._stats_path:
            self._write_stats()
        return self.norm(h)


class VSkipperLlamaForCausalLM(LlamaForCausalLM):
    """SGLang's ``LlamaForCausalLM`` (weights, LM head, logits) over :class:`VSkipperLlamaModel`."""

    def _init_model(self, config, quant_config=None, prefix: str = ""):
        return VSkipperLlamaModel(config, quant_config=quant_config, prefix=prefix)


EntryClass = VSkipperLlamaForCausalLM
