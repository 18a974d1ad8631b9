"""Binding vSkipper to transformers' continuous-batching engine (5.24), without editing the engine.

Where the engine prepares a batch: ``ContinuousBatchProcessor.prepare_next_batch`` (background
thread) asks the scheduler for ``requests_in_batch`` (``FutureRequestState``: ``.state.request_id``,
``.state.position_offset`` = tokens already in the cache, ``.query_length``) and calls
``ContinuousBatchingIOs.prepare_batch_tensors``, which packs the rows request by request in that
order (``position_ids = range(position_offset, position_offset + query_length)``) and then advances
``position_offset``. The batch's kwargs (``get_model_kwargs``) carry no request identity.

The binding therefore wraps, on the instances only:

- ``model.init_continuous_batching`` (every entry point - ``generate_batch``,
  ``continuous_batching_context_manager``, ``init_continuous_batching`` - goes through it), so that
- each manager's ``_create_batch_processor`` is wrapped, so that
- each batch processor's ``inputs_and_outputs.prepare_batch_tensors`` is wrapped: it reads the
  requests' ids and positions before the original call and, after it, publishes the batch's
  :class:`~impl.vskipper.skipper.RowMeta` in the model's :class:`~impl.vskipper.routed.RowContext`,
  after the context's planner (the mode switch of :mod:`impl.vskipper.mode`, when one is active)
  has assigned each row its request's mode.

Preparation and the forward run in the same background thread one after the other (synchronous
batching), so the routed layers always read the metadata of the batch they compute; they also check
it against the batch's ``position_ids`` (Invariant 2). Routed mode refuses asynchronous batching (it
prepares batch N+1 while N computes), CUDA graphs / compile (static replays of per-row routes) and,
for request-dependent policies, prefix-block sharing (DESIGN.md, last section).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Iterable, Sequence

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from .routed import RowContext, install_routed_layers, remove_routed_layers, routed_context
from .schema import Engine
from .skipper import RowMeta, Skipper, validate_skipper

__all__ = [
    "bind_skipper",
    "unbind_skipper",
    "routed_cb_config",
    "generate_greedy",
    "rows_of_batch",
]

_BOUND_ATTR = "_vskipper_orig_init_cb"
_SKIPPER_ATTR = "_vskipper_skipper"


def rows_of_batch(requests_in_batch, past_lengths: Sequence[int] | None = None) -> RowMeta:
    """The :class:`RowMeta` of a batch the engine is preparing, in the engine's packing order.

    Args:
        requests_in_batch: the scheduler's ``FutureRequestState`` list.
        past_lengths: each request's ``state.position_offset`` *before* ``prepare_batch_tensors``
            advanced it (default: read it now, i.e. call this before the preparation).

    Returns:
        RowMeta with one row per query token: request id, absolute token index, phase (PREFILL for
        tokens of the original prompt, also after a soft reset re-prefills generated tokens).
    """
    parts = []
    for i, fs in enumerate(requests_in_batch):
        st = fs.state
        past = st.position_offset if past_lengths is None else past_lengths[i]
        prompt_len = getattr(st, "_true_initial_tokens", 0) or len(st.initial_tokens)
        parts.append(RowMeta.for_sequence(st.request_id, int(past), int(fs.query_length), int(prompt_len)))
    return RowMeta.concat(parts)


def _hook_ios(ios, ctx: RowContext) -> None:
    if getattr(ios, "_vskipper_hooked", False):
        return
    if not hasattr(ios, "prepare_batch_tensors") or hasattr(ios, "io_pairs"):
        raise ValueError(
            "vSkipper routed mode needs synchronous batching (use_async_batching=False): asynchronous batching "
            "prepares batch N+1 while batch N computes, so the row side channel would be stale"
        )
    original = ios.prepare_batch_tensors

    def prepare_batch_tensors(requests_in_batch, *args, **kwargs):
        past = [fs.state.position_offset for fs in requests_in_batch]
        result = original(requests_in_batch, *args, **kwargs)
        ctx.set_rows(ctx.plan(rows_of_batch(requests_in_batch, past)))
        return result

    ios.prepare_batch_tensors = prepare_batch_tensors
    ios._vskipper_hooked = True


def _check_processor(bp, ctx: RowContext, skipper: Skipper) -> None:
    runner = bp.model_runner
    if runner.pad_inputs:
        raise ValueError(
            "vSkipper routed mode needs use_cuda_graph=False and no compile configs: captured/compiled replays "
            "would freeze per-row routes"
        )
    if bp.cache.use_prefix_sharing and not skipper.prefix_shareable:
        raise ValueError(
            f"{type(skipper).__name__} routes depend on the request, so prefix-block sharing would reuse K/V computed "
            "under another request's routes: set allow_block_sharing=False"
        )


def _check_config(cb_config, skipper: Skipper) -> None:
    """Refuse engine settings under which per-row routes would be wrong (raised in the caller's thread)."""
    if getattr(cb_config, "use_async_batching", False):
        raise ValueError(
            "vSkipper routed mode needs use_async_batching=False: asynchronous batching prepares batch N+1 while "
            "batch N computes, so the row side channel would be stale"
        )
    graphs = getattr(cb_config, "use_cuda_graph", None)
    if graphs is True or (isinstance(graphs, tuple) and any(graphs)):
        raise ValueError("vSkipper routed mode needs use_cuda_graph=False (captured replays would freeze routes)")
    if cb_config.varlen_compile_config is not None or cb_config.decode_compile_config is not None:
        raise ValueError("vSkipper routed mode does not support compiled continuous-batching forwards")
    if cb_config.allow_block_sharing and not skipper.prefix_shareable:
        raise ValueError(
            f"{type(skipper).__name__} routes depend on the request, so prefix-block sharing would reuse K/V computed "
            "under another request's routes: set allow_block_sharing=False (see routed_cb_config())"
        )


def _hook_manager(manager, ctx: RowContext, skipper: Skipper) -> None:
    if not ctx.dense:
        _check_config(manager.continuous_batching_config, skipper)
    if not getattr(manager, "_vskipper_hooked", False):
        original = manager._create_batch_processor

        def create_batch_processor():
            bp = original()
            if not ctx.dense:
                _check_processor(bp, ctx, skipper)
            _hook_ios(bp.inputs_and_outputs, ctx)
            return bp

        manager._create_batch_processor = create_batch_processor
        manager._vskipper_hooked = True
    bp = getattr(manager, "batch_processor", None)
    if bp is not None:
        if not ctx.dense:
            _check_processor(bp, ctx, skipper)
        _hook_ios(bp.inputs_and_outputs, ctx)


def bind_skipper(model, skipper: Skipper, *, validate: bool = True, fast_path: bool = True,
                 record_stats: bool = True):
    """Install ``skipper`` on ``model`` for routed execution in plain PyTorch and in the engine.

    Validates the policy (Sec. 3.4), moves it to the model's device and dtype, wraps its routed
    layers in :class:`~impl.vskipper.routed.RoutedDecoderLayer` and hooks the engine's batch
    preparation to fill the row side channel (module docstring).

    Args:
        model: a Llama / Qwen3-family causal LM with sdpa or eager attention.
        skipper: the policy.
        validate: run :func:`~impl.vskipper.skipper.validate_skipper` first (default True).
        fast_path, record_stats: see :class:`~impl.vskipper.routed.RoutedDecoderLayer` /
            :class:`~impl.vskipper.routed.RowContext`.

    Returns:
        the same ``model`` (modified in place); ``routed_context(model)`` gives its RowContext.

    Raises:
        ValueError: if the policy fails validation, the model is already bound or not a supported
            family, or its attention implementation is flash (mixed rows need sdpa / eager).
    """
    if getattr(model, _BOUND_ATTR, None) is not None or routed_context(model) is not None:
        raise ValueError("a skipper is already bound to this model; unbind_skipper(model) first")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl and "flash" in impl:
        raise ValueError(f"routed execution needs sdpa or eager attention, the model uses {impl!r}")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if validate:
        validate_skipper(skipper, cfg.num_hidden_layers, hidden_size=cfg.hidden_size)
    param = next(model.parameters())
    skipper.to(device=param.device, dtype=param.dtype)
    ctx = install_routed_layers(model, skipper, fast_path=fast_path, record_stats=record_stats)
    original_init = model.init_continuous_batching

    def init_continuous_batching(*args, **kwargs):
        manager = original_init(*args, **kwargs)
        _hook_manager(manager, ctx, skipper)
        return manager

    object.__setattr__(model, _BOUND_ATTR, original_init)
    object.__setattr__(model, _SKIPPER_ATTR, skipper)
    object.__setattr__(model, "init_continuous_batching", init_continuous_batching)
    return model


def unbind_skipper(model):
    """Undo :func:`bind_skipper`: original layers and the unmodified engine entry point. Returns the model."""
    remove_routed_layers(model)
    for attr in (_BOUND_ATTR, _SKIPPER_ATTR, "init_continuous_batching"):
        if attr in model.__dict__:
            object.__delattr__(model, attr)
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if cached is not None:
        model.destroy_cached_continuous_batching_manager()
    return model


def routed_cb_config(**overrides) -> ContinuousBatchingConfig:
    """A :class:`ContinuousBatchingConfig` safe for routed mode (and used for dense arms too, so both
    arms run the same engine settings): no CUDA graphs, no compile, synchronous batching, no flash
    auto-switch, no block-table decode path, no prefix-block sharing. ``overrides`` set any other field
    (e.g. ``page_size``, ``num_blocks``, ``max_batch_tokens``, ``max_requests_per_batch``)."""
    base = dict(
        use_cuda_graph=False,
        use_async_batching=False,
        auto_switch_to_flash=False,
        max_blocks_per_request=0,
        allow_block_sharing=False,
    )
    base.update(overrides)
    return ContinuousBatchingConfig(**base)


def sized_cb_config(engine: Engine, lengths: Iterable[int]) -> ContinuousBatchingConfig:
    """:func:`routed_cb_config` with the sizes of a typed ``vskipper.engine`` section
    (:class:`impl.vskipper.schema.Engine`), the one engine configuration every arm of a comparison shares.

    ``num_blocks: null`` sizes the paged cache to hold every listed request at once: ``ceil((n + 1) /
    page_size)`` pages for a request of ``n`` tokens (prompt + generation budget), plus 4 pages of
    headroom, so no request is evicted (the engine's own default sizes the cache from free memory:
    seconds of zero-filling per start on CPU).

    Args:
        engine: page size [tokens], ``num_blocks`` (None: sized as above), ``max_batch_tokens``,
            ``max_requests_per_batch``.
        lengths: tokens per request (prompt + generation budget) the cache must hold at once.
    """
    page = engine.page_size
    blocks = engine.num_blocks or sum(math.ceil((int(n) + 1) / page) for n in lengths) + 4
    return routed_cb_config(page_size=page, num_blocks=int(blocks), max_batch_tokens=engine.max_batch_tokens,
                            max_requests_per_batch=engine.max_requests_per_batch)


@torch.no_grad()
def generate_greedy(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    mode: str = "routed",
    request_ids: Sequence[str] | None = None,
    eos_token_id: int | None = None,
    cb_config: ContinuousBatchingConfig | None = None,
    return_logprobs: bool = False,
    timeout_s: float = 600.0,
    planner=None,
):
    """Greedy generation of several requests through the continuous-batching engine.

    Args:
        model: a causal LM; bound with :func:`bind_skipper` for ``mode="routed"``.
        prompts: token-id prompts (non-empty lists of ints).
        max_new_tokens: tokens to generate per request (fewer when ``eos_token_id`` is produced).
        mode: ``"routed"`` (the skipper decides per row) or ``"dense"`` (the unmodified engine's
            forward: a bound model runs every layer without consulting the router).
        request_ids: the requests' ids, which RandomSkip-like policies hash (default ``req_<i>``).
        eos_token_id: stop token (default: none, every request generates ``max_new_tokens``).
        cb_config: engine configuration (default :func:`routed_cb_config`).
        return_logprobs: also return each generated token's log-probability (float, as the engine
            computes it from the fp32 logits).
        timeout_s: give up after this many seconds.
        planner: with ``mode="routed"``, an optional per-batch mode planner ``planner(meta, context)
            -> RowMeta`` (e.g. a :class:`~impl.vskipper.mode.ModeController`, Sec. 3.3) installed
            as the context's planner for this call: rows it marks dense run unmodified, a batch with
            no routed row runs dense. Needs ``allow_block_sharing=False`` (the mode keys prefix reuse).

    Returns:
        the generated token ids of each request, in the order of ``prompts``; with
        ``return_logprobs`` a pair ``(ids, logprobs)`` of such lists.

    Raises:
        ValueError: for an unknown mode, ``mode="routed"`` on an unbound model, empty prompts,
            duplicated request ids, or a configuration routed mode cannot run under.
        RuntimeError: if a request fails in the engine (the engine's error is quoted) or times out.
    """
    if mode not in ("routed", "dense"):
        raise ValueError(f"mode must be 'routed' or 'dense', got {mode!r}")
    if planner is not None and mode != "routed":
        raise ValueError("a mode planner needs mode='routed' (it assigns dense rows inside the routed path)")
    ctx = routed_context(model)
    if mode == "routed" and (ctx is None or getattr(model, _BOUND_ATTR, None) is None):
        raise ValueError("mode='routed' needs a model bound with bind_skipper(model, skipper)")
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_greedy needs at least one prompt and no empty prompt")
    ids = [f"req_{i}" for i in range(len(prompts))] if request_ids is None else [str(r) for r in request_ids]
    if len(ids) != len(prompts) or len(set(ids)) != len(ids):
        raise ValueError("request_ids must be unique, one per prompt")

    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=-1 if eos_token_id is None else eos_token_id)
    # the engine resolves (mutates) the config it gets: work on a copy so callers can reuse theirs
    cb_config = routed_cb_config() if cb_config is None else copy.deepcopy(cb_config)
    if planner is not None and cb_config.allow_block_sharing:
        raise ValueError("a mode planner needs allow_block_sharing=False: a request's mode keys its prefix reuse")
    if return_logprobs:
        cb_config.return_logprobs = True
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max_new_tokens,
                          num_requests=len(prompts))

    dense_cm = ctx.dense_mode(mode == "dense") if ctx is not None else None
    if dense_cm is not None:
        dense_cm.__enter__()
    prev_planner = None
    if planner is not None:
        prev_planner, ctx.planner = ctx.planner, planner
    try:
        manager = model.init_continuous_batching(
            generation_config=gen_cfg, continuous_batching_config=cb_config, workload_hints=hints
        )
        results = {}
        manager.start()
        try:
            for rid, p in zip(ids, prompts):
                manager.add_request(p, request_id=rid, max_new_tokens=max_new_tokens, eos_token_id=gen_cfg.eos_token_id)
            deadline = time.monotonic() + timeout_s
            while len(results) < len(ids):
                res = manager.get_result(timeout=0.5)
                if res is not None and res.is_finished():
                    results[res.request_id] = res
                elif res is None and not manager.is_running():
                    break
                if time.monotonic() > deadline:
                    break
        finally:
            manager.stop(block=True, timeout=10)
            manager.destroy()
    finally:
        if dense_cm is not None:
            dense_cm.__exit__(None, None, None)
        if planner is not None:
            ctx.planner = prev_planner
        if ctx is not None:
            ctx.clear()

    failed = {r: res.error for r, res in results.items() if res.error is not None}
    missing = [r for r in ids if r not in results]
    if failed or missing:
        raise RuntimeError(f"continuous batching failed: errors={failed} missing={missing}")
    tokens = [list(results[r].generated_tokens) for r in ids]
    if return_logprobs:
        return tokens, [list(results[r].logprobs) for r in ids]
    return tokens
