"""Upstream SGLang against transformers on the same model: greedy token ids, alone and batched
(issue "Upstream SGLang as a real engine arm", item 4's baseline: before any routed arm runs on SGLang,
its upstream arm must produce the ids the project's transformers reference produces).

:func:`check_greedy_against_transformers` serves a model directory with
:class:`~impl.serving.sglang_server.SGLangServer`, asks for ``max_new_tokens`` greedy tokens of each prompt
(EOS ignored) once one request at a time and once with every prompt in flight (SGLang batches them), and
compares each with :func:`~impl.vskipper.routed.plain_greedy` on the model loaded by transformers (one
prefill forward, then one forward per token, float32). A row per (prompt, mode): ``ids_match``, the first
differing position, and the largest absolute difference between SGLang's log-probability of each output
token and transformers' (compared over the common prefix of the two outputs). The verdict policy:

- float32: every row's ids must equal the reference (``PASS``), the log-probability difference is
  reported, not gated (the kernels differ: SGLang's torch-native attention vs transformers' SDPA);
- bfloat16 / float16: ids agree by rate (``agreement`` = matching tokens / tokens over the common prefix
  up to the first divergence); the row says ``AGREE`` when every prompt matches and ``DIVERGED at k``
  otherwise, and the summary verdict is ``PASS`` only in float32.

Command: ``python -m impl sglang-check --config configs/default.yaml --model-dir models/smollm2
--prompts results/workloads/smollm2/gsm8k.jsonl --out rows.jsonl --summary summary.json``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

from impl.serving.sglang_server import DEFAULT_SGLANG_PYTHON, SGLangLaunch, SGLangServer, greedy_ids, launch_args

__all__ = ["check_greedy_against_transformers", "compare_greedy", "transformers_greedy", "register"]

log = logging.getLogger(__name__)
MODES = ("solo", "batched")


def transformers_greedy(model_dir: str | os.PathLike, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                        dtype: str = "float32", device: str = "cpu") -> list[dict]:
    """The transformers reference: :func:`~impl.vskipper.routed.plain_greedy` on each prompt (EOS ignored).

    Returns:
        one dict per prompt: ``output_ids`` (list[int], ``max_new_tokens`` of them) and ``logprobs``
        (list[float]: log-softmax of the float32 logits at each chosen token).
    """

    import torch

    from impl.models.load import load_model

    from .routed import plain_greedy

    model = load_model(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    out = []
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            ids, logits = plain_greedy(model, list(p), request_id=f"ref-{i}", max_new_tokens=int(max_new_tokens),
                                       return_logits=True)
            lp = [float(torch.log_softmax(lg.float(), -1)[t]) for lg, t in zip(logits, ids)]
            out.append({"output_ids": [int(t) for t in ids], "logprobs": lp})
    return out


def compare_greedy(ref: dict, got: dict) -> dict:
    """One prompt's comparison: ``ids_match`` (bool), ``first_diff`` (index of the first differing token,
    None when equal), ``agreement`` (share of the reference tokens matched before the first divergence)
    and ``max_logprob_diff`` (largest |difference| of the two log-probabilities over the matched prefix;
    None when either side has none)."""

    a, b = list(ref["output_ids"]), list(got["output_ids"])
    first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    n = len(a) if first is None else first
    la, lb = ref.get("logprobs") or [], got.get("logprobs") or []
    m = min(n, len(la), len(lb))
    return {"ids_match": first is None, "first_diff": first, "agreement": n / max(1, len(a)),
            "max_logprob_diff": max((abs(la[k] - lb[k]) for k in range(m)), default=None)}


def check_greedy_against_transformers(model_dir: str | os.PathLike, prompts: Sequence[Sequence[int]],
                                      max_new_tokens: int, launch: SGLangLaunch | None = None, *,
                                      prompt_ids: Sequence[str] | None = None,
                                      log_path: str | os.PathLike | None = None,
                                      ready_timeout_s: float = 900.0) -> tuple[list[dict], dict]:
    """Serve ``model_dir`` on upstream SGLang and compare its greedy ids with transformers' (module docstring).

    Args:
        model_dir: a Hugging Face model directory with its tokenizer.
        prompts: token-id prompts. max_new_tokens: tokens per prompt.
        launch: how to start SGLang (default: :class:`SGLangLaunch` of ``model_dir`` on CPU, float32).
            Its ``dtype`` is also the reference's.
        prompt_ids: names of the prompts in the rows (default: their index).
        log_path: the server's log file.

    Returns:
        ``(rows, summary)``: one row per (prompt, mode in :data:`MODES`) and a summary with ``verdict``
        (``PASS`` / ``FAIL`` in float32; ``AGREE`` / ``DIVERGED`` otherwise), ``startup_s``,
        the served command line, and the agreement and log-probability figures.

    Raises:
        ValueError: for no prompts or ``max_new_tokens < 1``; FileNotFoundError / RuntimeError: from
        :meth:`SGLangServer.start`.
    """

    if not prompts or int(max_new_tokens) < 1:
        raise ValueError("need at least one prompt and max_new_tokens >= 1")
    launch = launch or SGLangLaunch(model_dir=model_dir)
    names = list(prompt_ids) if prompt_ids is not None else [str(i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    ref = transformers_greedy(model_dir, prompts, max_new_tokens, dtype=launch.dtype, device=launch.device)
    ref_s = time.perf_counter() - t0
    with SGLangServer(launch, log_path=log_path, ready_timeout_s=ready_timeout_s) as srv:
        got = {"solo": greedy_ids(srv.url, prompts, max_new_tokens, concurrent=False),
               "batched": greedy_ids(srv.url, prompts, max_new_tokens, concurrent=True)}
        startup = srv.startup_s
        cmd = launch_args(launch, srv.port)
    exact = launch.dtype == "float32"
    rows = []
    for mode in MODES:
        for name, p, r, g in zip(names, prompts, ref, got[mode]):
            c = compare_greedy(r, g)
            verdict = ("PASS" if c["ids_match"] else "FAIL") if exact else \
                ("AGREE" if c["ids_match"] else f"DIVERGED at {c['first_diff']}")
            rows.append({"engine": "sglang", "arm": "upstream", "prompt": name, "mode": mode,
                         "prompt_tokens": len(p), "max_new_tokens": int(max_new_tokens), "dtype": launch.dtype,
                         "device": launch.device, "attention_backend": _backend(cmd), **c, "verdict": verdict,
                         "sglang_ids": g["output_ids"], "reference_ids": r["output_ids"]})
    diffs = [r["max_logprob_diff"] for r in rows if r["max_logprob_diff"] is not None]
    all_match = all(r["ids_match"] for r in rows)
    summary = {"verdict": ("PASS" if all_match else "FAIL") if exact else ("AGREE" if all_match else "DIVERGED"),
               "policy": "ids equal (float32)" if exact else "agreement rate (reduced precision)",
               "rows": len(rows), "ids_match": sum(r["ids_match"] for r in rows),
               "mean_agreement": sum(r["agreement"] for r in rows) / len(rows),
               "max_logprob_diff": max(diffs) if diffs else None, "startup_s": startup, "reference_s": ref_s,
               "command": cmd, "model_dir": str(model_dir)}
    return rows, summary


def _backend(cmd: list[str]) -> str | None:
    return cmd[cmd.index("--attention-backend") + 1] if "--attention-backend" in cmd else None


def cmd_sglang_check(args) -> None:
    """Upstream SGLang vs transformers greedy ids (module docstring) -> JSONL rows and a summary JSON;
    exit status 1 when the verdict is FAIL."""
    from impl.provenance import write_json, write_jsonl
    from impl.runtime import config_from_args, run_provenance, set_threads
    from impl.schema import core_config

    from .http_check import load_prompts

    cfg = config_from_args(args)
    core = core_config(cfg)
    set_threads(cfg)
    if core.device not in ("cpu", "cuda"):
        raise SystemExit(f"error: sglang-check runs on device cpu or cuda, the config says {core.device!r}")
    if not Path(args.sglang_python).exists():
        raise SystemExit(f"error: --sglang-python {args.sglang_python} does not exist (run scripts/setup_sglang.sh)")
    prompts, ids = load_prompts(args.prompts, args.n_prompts)
    launch = SGLangLaunch(model_dir=args.model_dir, python=args.sglang_python, device=core.device, dtype=core.dtype,
                          max_total_tokens=args.max_total_tokens, threads=args.server_threads)
    prov = run_provenance(cfg)
    rows, summary = check_greedy_against_transformers(args.model_dir, prompts, args.max_new_tokens, launch,
                                                      prompt_ids=ids, log_path=args.server_log)
    write_jsonl(args.out, [{**r, **prov} for r in rows])
    write_json(args.summary, {**summary, "provenance": prov})
    mlp = summary["max_logprob_diff"]
    print(f"sglang-check {summary['verdict']}: {summary['ids_match']}/{summary['rows']} (prompt, mode) rows with "
          f"equal ids; max |logprob diff| {'n/a' if mlp is None or math.isnan(mlp) else f'{mlp:.2e}'}; "
          f"start-up {summary['startup_s']:.0f} s")
    if summary["verdict"] == "FAIL":
        raise SystemExit(1)


def register(add) -> None:
    """Add ``sglang-check`` to the ``python -m impl`` parser (``add(name, fn, help)``)."""
    from impl.argtypes import positive_int

    sp = add("sglang-check", cmd_sglang_check,
             "upstream SGLang vs transformers on one model: greedy ids alone and batched (SGLang's own venv)")
    sp.add_argument("--model-dir", required=True, help="HF model directory (with its tokenizer)")
    sp.add_argument("--prompts", required=True, help="token-id workload suite JSONL (rule workload_tokens)")
    sp.add_argument("--n-prompts", type=positive_int, default=3)
    sp.add_argument("--max-new-tokens", type=positive_int, default=16)
    sp.add_argument("--sglang-python", default=DEFAULT_SGLANG_PYTHON, help="the SGLang environment's interpreter")
    sp.add_argument("--max-total-tokens", type=positive_int, default=16384, help="SGLang's KV cache [tokens]")
    sp.add_argument("--server-threads", type=positive_int, default=None, help="torch threads of the server (CPU)")
    sp.add_argument("--server-log", default=None, help="where the server's log goes (default: a temporary file)")
    sp.add_argument("--out", required=True, help="JSONL rows to write")
    sp.add_argument("--summary", required=True, help="summary JSON to write")
