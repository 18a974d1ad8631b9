"""``python -m impl.vskipper.server``: load a model directory, start ONE vSkipper engine arm
(:class:`~impl.vskipper.driver.CompletionEngine`) and serve it on an OpenAI-compatible endpoint
(:mod:`impl.vskipper.api_server`: FastAPI + uvicorn; routes, fields and responses are documented there).

::

    python -m impl.vskipper.server --model DIR --arm hybrid --skipper randomskip:r=0.5,d=0.5 --port 0

prints one JSON line ``{"listening": URL, "port": N, ...}`` once the engine is warm (with the KV-cache
size, the maximum context and concurrency it was sized for, and the torch thread count) and shuts down
cleanly on SIGTERM / SIGINT (stop accepting, let in-flight requests finish for ``--grace-s`` seconds,
then stop the engine).

**Sizing.** The paged KV cache holds ``--max-model-len`` x ``--max-num-seqs`` tokens (rounded up to
whole pages), not a fraction of free memory: a 3 MB model gets a cache of a few MB, SmolLM2-135M at
the defaults (4096 x 8 tokens, float32) about 1.4 GiB. ``--max-model-len`` defaults to the model's
``max_position_embeddings`` capped at 4096. ``--threads`` defaults to half the machine's cores (at
least 1), leaving the rest to clients and other arms: on a busy 2-core machine default torch threads
made 8 requests of 32 tokens take 79 s instead of 0.7 s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import ContinuousBatchingConfig

from impl.models.load import load_model, load_tokenizer, model_num_layers

from ..argtypes import ArgumentParser, nonneg_int, port, positive_float, positive_int
from ..sections import strict_value
from .api_server import CompletionServer, make_server
from .driver import ARMS, CompletionEngine
from .engine import routed_cb_config
from .mode import ModeSwitch
from .spec import check_skipper_spec, parse_literal, parse_skipper_spec

__all__ = ["DEFAULT_MAX_MODEL_LEN", "DEFAULT_MAX_NUM_SEQS", "cb_overrides_from_args", "default_threads", "kv_cache_plan",
           "main", "serve"]

logger = logging.getLogger(__name__)

#: cap of the default maximum context (prompt + completion tokens) the cache is sized for
DEFAULT_MAX_MODEL_LEN = 4096
#: default number of concurrent requests the cache is sized for
DEFAULT_MAX_NUM_SEQS = 8


def default_threads() -> int:
    """Torch threads of a server by default: half the cores, at least 1."""
    return max(1, (os.cpu_count() or 2) // 2)


def kv_cache_plan(model, max_model_len: int, max_num_seqs: int, page_size: int, dtype: torch.dtype,
                  num_blocks: int | None = None) -> dict:
    """The paged KV cache for ``max_num_seqs`` requests of ``max_model_len`` tokens (or of ``num_blocks``
    blocks when given: what the engine resolved).

    Returns:
        dict with ``num_blocks`` (whole-model blocks of ``page_size`` tokens, transformers'
        ``ContinuousBatchingConfig.num_blocks``), ``page_size``, ``tokens`` (capacity) and ``mib``
        (K and V of every layer at ``dtype``, in MiB).
    """
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    blocks = int(num_blocks) if num_blocks else max(1, math.ceil(max_model_len * max_num_seqs / page_size))
    tokens = blocks * page_size
    nbytes = tokens * 2 * int(cfg.num_hidden_layers) * heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return {"num_blocks": blocks, "page_size": int(page_size), "tokens": tokens, "mib": round(nbytes / 2**20, 1)}


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    try:
        return table[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(table)}") from None


def serve(model_dir: str | Path, arm: str = "hybrid", skipper_spec: Any = None, host: str = "127.0.0.1",
          port: int = 0, *, served_model_name: str | None = None, switch: ModeSwitch | Mapping | None = None,
          cb_overrides: Mapping[str, Any] | None = None, dtype: str | torch.dtype = "float32", device: str = "cpu",
          max_model_len: int | None = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, max_logprobs: int = 5,
          add_special_tokens: bool = True,
          request_timeout_s: float = 600.0, threads: int | None = None, warmup: bool = True,
          block: bool = True, grace_s: float = 30.0, on_ready: Callable[[CompletionServer], None] | None = None,
          ) -> CompletionServer:
    """Serve one engine arm of a model directory on an OpenAI-compatible HTTP endpoint.

    Args:
        model_dir: a Hugging Face model directory with its tokenizer.
        arm: one of :data:`ARMS` (``upstream``, ``hybrid``, ``always-route``, ablations).
        skipper_spec: the policy (:func:`parse_skipper_spec`), e.g. ``"randomskip:r=0.5,d=0.5"`` or
            ``"flexidepth:DIR"``; required by every arm but ``upstream`` (which validates and records
            it only).
        host, port: where to listen (port 0: any free port; read ``server.port``).
        served_model_name: the served name (default: the directory's name); the directory path is
            accepted as an alias.
        switch: the mode switch of the switch arms (a :class:`ModeSwitch` or its fields as a mapping;
            default ``ModeSwitch()``).
        cb_overrides: :func:`routed_cb_config` overrides (``page_size``, ``num_blocks``,
            ``max_batch_tokens``, ``max_requests_per_batch``, ...), the same for every arm.
        dtype, device: where the model runs.
        max_model_len: longest prompt + completion accepted (default: the model's
            ``max_position_embeddings`` capped at :data:`DEFAULT_MAX_MODEL_LEN`).
        max_num_seqs: concurrent requests the KV cache is sized for (:func:`kv_cache_plan`), unless
            ``cb_overrides`` sets ``num_blocks``; more requests queue in the engine.
        max_logprobs, add_special_tokens, request_timeout_s, warmup: see :class:`CompletionEngine`.
        threads: ``torch.set_num_threads`` (None: leave the process's setting).
        block: True: serve until SIGTERM / SIGINT (signal handlers are installed when called from the
            main thread) or until the engine dies (``server.engine.error`` then says why), then shut
            down cleanly and return the closed server; False: return the
            running server at once (serving in a daemon thread; call ``server.close()``).
        grace_s: on a signal, how long in-flight requests may take to finish.
        on_ready: called with the server once it listens and the engine is warm.

    Returns:
        the :class:`CompletionServer` (running when ``block`` is False).

    Raises:
        FileNotFoundError: for a missing model directory; ValueError: for a bad arm / spec / setting.
    """

    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    if threads:
        torch.set_num_threads(int(threads))
    model_dir = Path(model_dir)
    check_skipper_spec(skipper_spec, model_num_layers(model_dir))  # before any weights are read
    model = load_model(model_dir, dtype=_dtype(dtype)).to(device)
    tokenizer = load_tokenizer(model_dir)
    if isinstance(switch, Mapping):
        switch = ModeSwitch.from_fields(switch)
    skipper = parse_skipper_spec(skipper_spec, model) if skipper_spec is not None else None
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ctx = int(getattr(cfg, "max_position_embeddings", 0) or DEFAULT_MAX_MODEL_LEN)
    if max_model_len is not None and max_model_len > ctx:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings ({ctx})")
    max_model_len = int(max_model_len or min(ctx, DEFAULT_MAX_MODEL_LEN))
    cb = dict(cb_overrides or {})
    if "num_blocks" not in cb:
        page = int(cb.get("page_size") or routed_cb_config().page_size)
        cb["num_blocks"] = kv_cache_plan(model, max_model_len, max_num_seqs, page, model.dtype)["num_blocks"]
    engine = CompletionEngine(
        model, tokenizer, arm, skipper=skipper, switch=switch, cb_config=routed_cb_config(**cb),
        served_model_name=served_model_name or model_dir.name,
        model_aliases=(str(model_dir), str(model_dir.resolve())), max_model_len=max_model_len,
        max_logprobs=max_logprobs, add_special_tokens=add_special_tokens, request_timeout_s=request_timeout_s,
        warmup=warmup)
    engine.start()
    try:
        server = make_server(engine, host, port)
    except BaseException:
        engine.stop()
        raise
    server.start_background()
    if on_ready is not None:
        on_ready(server)
    if not block:
        return server
    stop = threading.Event()
    installed = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            installed.append((sig, signal.signal(sig, lambda *_: stop.set())))
    try:
        while not stop.wait(0.5):
            if engine.error is not None:
                logger.error("engine died: %s", engine.error)
                break
    finally:
        server.close(grace_s=grace_s)
        for sig, prev in installed:
            signal.signal(sig, prev)
    return server


#: ContinuousBatchingConfig fields that count something and must be >= 1 when set
_CB_POSITIVE = ("page_size", "block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "max_queue_size")


def cb_overrides_from_args(items: Sequence[str]) -> dict[str, Any]:
    """``--cb KEY=VALUE`` items -> :func:`routed_cb_config` overrides, checked before any weights are read.

    Each KEY must be a field of transformers' ``ContinuousBatchingConfig`` and each VALUE (read by
    :func:`parse_literal`) must have the field's type (pydantic, strict, so ``num_blocks=abc`` or
    ``page_size=2.5`` are refused); counts (``page_size``, ``num_blocks``, ...) must be >= 1. Values are
    not checked beyond their type and sign (e.g. ``scheduler_type``): the engine's start refuses those.

    Returns:
        ``{key: typed value}``, for :func:`routed_cb_config` / :func:`serve`'s ``cb_overrides``.

    Raises:
        ValueError: naming ``--cb`` and the offending item, key or value.
    """
    fields = {f.name: f.type for f in dataclasses.fields(ContinuousBatchingConfig)}
    out: dict[str, Any] = {}
    for it in items or ():
        if "=" not in it:
            raise ValueError(f"argument --cb: expected KEY=VALUE, got {it!r}")
        key, raw = (x.strip() for x in it.split("=", 1))
        if key not in fields:
            raise ValueError(f"argument --cb: unknown key {key!r}; ContinuousBatchingConfig fields: "
                             + ", ".join(sorted(fields)))
        value = strict_value(fields[key], parse_literal(raw), f"argument --cb: {key}={raw!r} (type {fields[key]})")
        if key in _CB_POSITIVE and value is not None and value < 1:
            raise ValueError(f"argument --cb: {key} must be >= 1, got {raw!r}")
        out[key] = value
    routed_cb_config(**out)  # the engine's own constructor accepts the combination
    return out


def _switch_arg(switch: str | None, thresholds: str | None) -> ModeSwitch | None:
    """``--switch`` / ``--thresholds`` -> the switch (None: neither given). ``--thresholds``: a profile-mode
    JSON or a bare derive_thresholds() output (:meth:`ModeSwitch.from_profile`); ``--switch``: fields as
    a JSON object or file (None thresholds: never reached), on top of ``--thresholds`` when both are given.

    Raises:
        ValueError: naming ``--thresholds`` or ``--switch`` (unreadable file, not JSON, not an object, an
            unknown field, a value of the wrong type or out of range).
    """

    try:
        sw = ModeSwitch.from_profile(thresholds) if thresholds else None
    except ValueError as e:
        raise ValueError(f"argument --thresholds: {e}") from None
    if switch:
        try:
            fields = json.loads(Path(switch).read_text() if Path(switch).is_file() else switch)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"argument --switch: not a JSON object or a readable JSON file ({e}): {switch!r}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"argument --switch: expected a JSON object of ModeSwitch fields, got {type(fields).__name__}")
        if sw is not None:
            fields = {**sw.to_dict(), **fields}
        try:
            sw = ModeSwitch.from_fields(fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"argument --switch: {e}") from None
    return sw


def _check_device(name: str) -> str:
    """``--device`` -> the name, when torch knows it and the device is present here.

    Raises:
        ValueError: naming ``--device``.
    """
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"argument --device: {e}") from None
    if dev.type == "cuda" and (not torch.cuda.is_available()
                               or (dev.index is not None and dev.index >= torch.cuda.device_count())):
        raise ValueError(f"argument --device: {name!r} is not available here (this torch sees "
                         f"{torch.cuda.device_count()} CUDA device(s); torch {torch.__version__})")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"argument --device: {name!r} is not available here")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"argument --device: {name!r}: only cpu, cuda[:N] and mps are supported")
    return name


def _check_listen(host: str, port: int) -> None:
    """Bind ``host:port`` once before the model loads, so a taken port fails in seconds, not after the
    weights are read (port 0 always binds).

    Raises:
        ValueError: naming ``--host`` / ``--port`` and the OS's reason.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"argument --host: cannot resolve {host!r}: {e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise ValueError(f"argument --port: cannot listen on {host}:{port}: {e.strerror or e}") from None


def _check_ready_file(path: str | None) -> None:
    """``--ready-file``: its folder must exist and be writable (checked before the model loads).

    Raises:
        ValueError: naming ``--ready-file``.
    """
    if path is None:
        return
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"argument --ready-file: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"argument --ready-file: folder {folder} is not writable")
    if Path(path).is_dir():
        raise ValueError(f"argument --ready-file: {path} is a directory")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m impl.vskipper.server --model DIR --arm ARM [--skipper SPEC] [--port N]``.
    Prints one JSON line with the bound URL and port once the engine is warm; SIGTERM / SIGINT shut
    it down cleanly. Returns the exit status (0 after a signal, 1 when the engine died, 2 for a bad
    argument)."""
    ap = ArgumentParser(prog="python -m impl.vskipper.server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory (with tokenizer)")
    ap.add_argument("--arm", default="hybrid", choices=ARMS)
    ap.add_argument("--skipper", default=None,
                    help="randomskip:r=R,d=D[,seed=S,layers=A-B] | flexidepth:DIR | static:n_run=N[,layers=A-B] (alias static-depth:) | NAME:k=v,...")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=port, default=0, help="0: any free port (printed)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--switch", default=None, help="ModeSwitch fields as a JSON object or a JSON file")
    ap.add_argument("--thresholds", default=None,
                    help="profile-mode JSON (or a bare derive_thresholds() output) for the switch")
    ap.add_argument("--cb", action="append", default=[], metavar="KEY=VALUE",
                    help="continuous-batching config override (repeatable), e.g. --cb num_blocks=512")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=positive_int, default=default_threads(),
                    help="torch threads (default: half the cores, here %(default)s)")
    ap.add_argument("--max-model-len", type=positive_int, default=None,
                    help=f"longest prompt + completion (default: the model's context, at most {DEFAULT_MAX_MODEL_LEN})")
    ap.add_argument("--max-num-seqs", type=positive_int, default=DEFAULT_MAX_NUM_SEQS,
                    help="concurrent requests the KV cache is sized for (default %(default)s)")
    ap.add_argument("--max-logprobs", type=nonneg_int, default=5)
    ap.add_argument("--no-special-tokens", action="store_true", help="tokenize prompts without special tokens")
    ap.add_argument("--request-timeout-s", type=positive_float, default=600.0)
    ap.add_argument("--grace-s", type=positive_float, default=30.0, help="shutdown grace for in-flight requests")
    ap.add_argument("--ready-file", default=None, help="write the bound port to this file once ready")
    ap.add_argument("--log-level", default="WARNING", type=str.upper,
                    choices=["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"])
    args = ap.parse_args(argv)
    if args.arm == "upstream":  # the dense arm binds no skipper and switches nothing: say so, do not ignore
        given = [f for f, v in (("--skipper", args.skipper), ("--switch", args.switch),
                                ("--thresholds", args.thresholds)) if v is not None]
        if given:
            ap.error(f"{', '.join(given)}: --arm upstream serves the unmodified (dense) model; skippers and the mode "
                     "switch apply to the routed arms (e.g. --arm hybrid)")
    try:  # every argument checked before any weights are read
        cb_overrides = cb_overrides_from_args(args.cb)
        switch = _switch_arg(args.switch, args.thresholds)
        _check_device(args.device)
        _check_ready_file(args.ready_file)
        _check_listen(args.host, args.port)
    except ValueError as exc:
        ap.error(str(exc))
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(server: CompletionServer) -> None:
        eng = server.engine
        resolved = eng.describe()["cb_config"]
        page = resolved.get("page_size") if isinstance(resolved.get("page_size"), int) else 256
        nb = resolved.get("num_blocks") if isinstance(resolved.get("num_blocks"), int) else None
        cache = kv_cache_plan(eng.model, eng.max_model_len, args.max_num_seqs, page, eng.model.dtype, nb)
        print(json.dumps({"listening": server.url, "host": server.host, "port": server.port, "arm": eng.arm,
                          "model": eng.served_model_name, "max_model_len": eng.max_model_len,
                          "max_num_seqs": args.max_num_seqs, "kv_cache": cache,
                          "torch_threads": torch.get_num_threads()}), flush=True)
        if args.ready_file:
            tmp = Path(args.ready_file).with_suffix(".tmp")
            tmp.write_text(f"{server.port}\n")
            tmp.replace(args.ready_file)

    try:
        server = serve(args.model, args.arm, args.skipper, args.host, args.port,
                       served_model_name=args.served_model_name, switch=switch,
                       cb_overrides=cb_overrides, dtype=args.dtype, device=args.device,
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_logprobs=args.max_logprobs,
                       add_special_tokens=not args.no_special_tokens, request_timeout_s=args.request_timeout_s,
                       threads=args.threads, block=True, grace_s=args.grace_s, on_ready=ready)
    except (OSError, ValueError) as exc:  # a missing model directory, a bad spec, a port taken since the check
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if server.engine.error is not None:
        print(f"error: {server.engine.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
