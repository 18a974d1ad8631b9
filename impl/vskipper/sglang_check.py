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

**vSkipper inside SGLang** (``--routed R D``, :func:`check_routed_against_transformers`; item 4 of the
issue on the real model): two more servers of the same model with vSkipper as an out-of-tree model
(:mod:`impl.vskipper.sglang_model`), RandomSkip over ``routed_layers`` (default: the second half, as
FlexiDepth routes), each request's id its prompt's name:

- ``all-run`` (r = 0: every row RUNs through the routed layer stack) against the same transformers
  reference as upstream (the unrouted model): ids equal;
- ``randomskip`` (r, d) against :func:`~impl.vskipper.routed.plain_greedy` on the model with the same
  RandomSkip installed and the same request ids: ids equal (float32), with the server's Invariant-1
  self-check (``check_kv``: every Project-Only row's K/V in SGLang's pool equal the layer's own projection,
  largest difference reported) and its realised Project-Only share per phase.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Sequence

from impl.serving.sglang_server import DEFAULT_SGLANG_PYTHON, SGLangLaunch, SGLangServer, greedy_ids, launch_args

__all__ = ["check_greedy_against_transformers", "check_routed_against_transformers", "compare_greedy",
           "transformers_greedy", "register"]

log = logging.getLogger(__name__)
MODES = ("solo", "batched")
#: Invariant 1's tolerance on SGLang's pool: largest |stored - recomputed| K/V over the largest |K|, |V| (float32
#: GEMMs over different row counts round differently at ~1e-7 relative; a wrong slot or layer is O(1))
KV_REL_TOL = 1e-5


def transformers_greedy(model_dir: str | os.PathLike, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                        dtype: str = "float32", device: str = "cpu", skipper=None,
                        request_ids: Sequence[str] | None = None) -> list[dict]:
    """The transformers reference: :func:`~impl.vskipper.routed.plain_greedy` on each prompt (EOS ignored).

    Args:
        skipper: optional skip policy installed as routed layers (every row routed), with ``request_ids``
            (one per prompt; default ``ref-<i>``) the ids its routes hash.

    Returns:
        one dict per prompt: ``output_ids`` (list[int], ``max_new_tokens`` of them) and ``logprobs``
        (list[float]: log-softmax of the float32 logits at each chosen token).
    """

    import torch

    from impl.models.load import load_model

    from .routed import install_routed_layers, plain_greedy

    model = load_model(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    if skipper is not None:
        install_routed_layers(model, skipper.to(device=device, dtype=getattr(torch, dtype)))
    rids = list(request_ids) if request_ids is not None else [f"ref-{i}" for i in range(len(prompts))]
    out = []
    with torch.inference_mode():
        for rid, p in zip(rids, prompts):
            ids, logits = plain_greedy(model, list(p), request_id=str(rid), max_new_tokens=int(max_new_tokens),
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


def check_routed_against_transformers(model_dir: str | os.PathLike, prompts: Sequence[Sequence[int]],
                                      max_new_tokens: int, launch: SGLangLaunch, *, r: float, d: float,
                                      routed_layers: Sequence[int] | None = None, seed: int = 0,
                                      prompt_ids: Sequence[str] | None = None,
                                      log_dir: str | os.PathLike | None = None,
                                      ready_timeout_s: float = 900.0) -> tuple[list[dict], dict]:
    """vSkipper inside SGLang against the transformers references (module docstring, ``--routed``).

    Args:
        model_dir: a Llama-family Hugging Face directory. prompts, max_new_tokens: as
            :func:`check_greedy_against_transformers`. launch: the SGLang settings (its ``model_dir`` is
            replaced by the routed directories). r, d: RandomSkip's row fraction and layer fraction.
        routed_layers: the routed layers (default: the second half of the model's layers).
        seed: RandomSkip's seed. prompt_ids: the prompts' names, also their request ids on both engines.
        log_dir: where the two servers' logs go (default: temporary files).

    Returns:
        ``(rows, summary)``: one row per (arm in ``all-run`` / ``randomskip``, prompt, mode) and a summary
        per arm (``verdict`` as :func:`check_greedy_against_transformers`, the server's K/V check and its
        realised Project-Only share per phase).

    Raises:
        ValueError: for a model that is not Llama-family, bad r / d, no prompts; FileNotFoundError /
        RuntimeError: from the server start.
    """
    import tempfile

    from .random_skip import RandomSkip
    from .sglang_routed import routed_launch, write_routed_model_dir

    if not prompts or int(max_new_tokens) < 1:
        raise ValueError("need at least one prompt and max_new_tokens >= 1")
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    L = int(cfg["num_hidden_layers"])
    layers = list(routed_layers) if routed_layers is not None else list(range(L // 2, L))
    names = list(prompt_ids) if prompt_ids is not None else [f"p{i}" for i in range(len(prompts))]
    exact = launch.dtype == "float32"
    arms = {"all-run": {"routed_layers": layers, "r": 0.0, "d": float(d), "seed": int(seed)},
            "randomskip": {"routed_layers": layers, "r": float(r), "d": float(d), "seed": int(seed)}}
    skipper = RandomSkip(**arms["randomskip"])  # refuses bad r / d before any server
    t0 = time.perf_counter()
    refs = {"all-run": transformers_greedy(model_dir, prompts, max_new_tokens, dtype=launch.dtype,
                                           device=launch.device),
            "randomskip": transformers_greedy(model_dir, prompts, max_new_tokens, dtype=launch.dtype,
                                              device=launch.device, skipper=skipper, request_ids=names)}
    ref_s = time.perf_counter() - t0
    rows, per_arm = [], {}
    with tempfile.TemporaryDirectory(prefix="vskipper-sglang-check-") as tmp:
        for arm, kw in arms.items():
            stats = Path(tmp) / f"{arm}.stats.json"
            routed = write_routed_model_dir(model_dir, Path(tmp) / arm, "random", kw, check_kv=True,
                                            stats_path=stats)
            log_path = None if log_dir is None else Path(log_dir) / f"sglang-{arm}.log"
            rl = routed_launch(launch, routed)
            with SGLangServer(rl, log_path=log_path, ready_timeout_s=ready_timeout_s) as srv:
                got = {"solo": greedy_ids(srv.url, prompts, max_new_tokens, concurrent=False,
                                          rids=[f"{n}-solo" for n in names]),
                       "batched": greedy_ids(srv.url, prompts, max_new_tokens, concurrent=True, rids=names)}
                startup = srv.startup_s
            if arm == "randomskip":  # the solo requests hash their own ids: references per id
                refs["randomskip-solo"] = transformers_greedy(
                    model_dir, prompts, max_new_tokens, dtype=launch.dtype, device=launch.device, skipper=skipper,
                    request_ids=[f"{n}-solo" for n in names])
            body = json.loads(stats.read_text()) if stats.is_file() else {}
            arm_rows = []
            for mode in MODES:
                ref = refs["randomskip-solo" if arm == "randomskip" and mode == "solo" else arm]
                for name, p, rr, g in zip(names, prompts, ref, got[mode]):
                    c = compare_greedy(rr, g)
                    verdict = ("PASS" if c["ids_match"] else "FAIL") if exact else \
                        ("AGREE" if c["ids_match"] else f"DIVERGED at {c['first_diff']}")
                    arm_rows.append({"engine": "sglang", "arm": arm, "prompt": name, "mode": mode,
                                     "prompt_tokens": len(p), "max_new_tokens": int(max_new_tokens),
                                     "dtype": launch.dtype, "device": launch.device, **c, "verdict": verdict,
                                     "sglang_ids": g["output_ids"], "reference_ids": rr["output_ids"]})
            counts = body.get("counts") or {}
            kv = body.get("kv_check") or {}
            ok = all(x["ids_match"] for x in arm_rows)
            per_arm[arm] = {
                "verdict": ("PASS" if ok else "FAIL") if exact else ("AGREE" if ok else "DIVERGED"),
                "ids_match": sum(x["ids_match"] for x in arm_rows), "rows": len(arm_rows),
                "mean_agreement": sum(x["agreement"] for x in arm_rows) / len(arm_rows),
                "project_only_share": {ph: (c[1] / (c[0] + c[1]) if (c[0] + c[1]) else None)
                                       for ph, c in counts.items()},
                # phase -> [RUN, Project-Only] over routed (row, layer) pairs, SGLang's own start-up warm-up
                # request included (one request with a random id, so its routes vary from run to run)
                "route_counts": counts,
                "expected_routed_pairs": {  # the checked requests: every prompt token prefilled once, every new
                    # token but the first (it comes from the prefill) decoded once
                    "prefill": len(MODES) * len(layers) * sum(len(p) for p in prompts),
                    "decode": len(MODES) * len(layers) * len(prompts) * (int(max_new_tokens) - 1)},
                "kv_check_rows": kv.get("rows", 0), "kv_check_max_abs_diff": kv.get("max_abs_diff"),
                "kv_check_max_rel_diff": kv.get("max_rel_diff"),
                "startup_s": startup, **{k: v for k, v in kw.items() if k != "routed_layers"}}
            rows += arm_rows
    rs = per_arm["randomskip"]
    kv_ok = rs["kv_check_rows"] > 0 and (rs["kv_check_max_rel_diff"] or 0.0) <= KV_REL_TOL
    verdicts = [a["verdict"] for a in per_arm.values()]
    summary = {"verdict": ("PASS" if all(v == "PASS" for v in verdicts) and kv_ok else "FAIL") if exact else
               ("AGREE" if all(v == "AGREE" for v in verdicts) else "DIVERGED"),
               "policy": f"ids equal (float32) and Project-Only K/V equal the layer's own (relative |diff| <= "
                         f"{KV_REL_TOL:g})" if exact
               else "agreement rate (reduced precision)",
               "arms": per_arm, "routed_layers": layers, "reference_s": ref_s, "model_dir": str(model_dir),
               "command": launch_args(routed_launch(launch), 0)}
    return rows, summary


def _backend(cmd: list[str]) -> str | None:
    return cmd[cmd.index("--attention-backend") + 1] if "--attention-backend" in cmd else None


def cmd_sglang_check(args) -> None:
    """Upstream SGLang vs transformers greedy ids (module docstring) -> JSONL rows and a summary JSON;
    exit status 1 when the verdict is FAIL."""
    from impl.provenance import write_json, write_jsonl
    from impl.runtime import config_from_args, run_provenance, set_threads
    from impl.schema import core_config

    from dataclasses import replace

    from .http_check import load_prompts
    from .schema import SGLANG_ROUTED_ARCHITECTURES
    from .serving_commands import sglang_launch

    cfg = config_from_args(args)
    core = core_config(cfg)
    set_threads(cfg)
    if core.device not in ("cpu", "cuda"):
        raise SystemExit(f"error: sglang-check runs on device cpu or cuda, the config says {core.device!r}")
    # the server as the config's SGLang arms start it (serving_commands.sglang_launch, from vskipper.sglang;
    # a config without a vskipper section: SGLangLaunch's defaults), the flags taking precedence
    launch = (sglang_launch(cfg, args.model_dir) if "vskipper" in cfg
              else SGLangLaunch(model_dir=args.model_dir, device=core.device, dtype=core.dtype))
    launch = replace(launch, python=args.sglang_python or launch.python, threads=args.server_threads,
                     max_total_tokens=launch.max_total_tokens if args.max_total_tokens is None else args.max_total_tokens)
    if not Path(launch.python).exists():
        raise SystemExit(f"error: --sglang-python {launch.python} does not exist (run scripts/setup_sglang.sh, or give "
                         "--sglang-python / vskipper.sglang.python)")
    prompts, ids = load_prompts(args.prompts, args.n_prompts)
    prov = run_provenance(cfg)
    meta = {"server_threads": launch.threads, "provenance": prov}  # what every summary adds to the check's own
    if args.routed is not None:
        r, d = args.routed
        if not (0.0 <= r <= 1.0 and 0.0 < d <= 1.0):
            raise SystemExit(f"error: --routed R D needs 0 <= R <= 1 and 0 < D <= 1, got {r} {d}")
        arch = (json.loads((Path(args.model_dir) / "config.json").read_text()).get("architectures") or [None])[0]
        if arch not in SGLANG_ROUTED_ARCHITECTURES:
            raise SystemExit(f"error: --routed serves {', '.join(SGLANG_ROUTED_ARCHITECTURES)} checkpoints, "
                             f"{args.model_dir} is {arch}")
        rows, summary = check_routed_against_transformers(
            args.model_dir, prompts, args.max_new_tokens, launch, r=r, d=d, routed_layers=args.routed_layers,
            seed=cfg.get("seed", 0), prompt_ids=ids, log_dir=args.server_log_dir)
        write_jsonl(args.out, [{**x, **prov} for x in rows])
        write_json(args.summary, {**summary, **meta})
        for arm, a in summary["arms"].items():
            print(f"sglang-check --routed {arm}: {a['verdict']} {a['ids_match']}/{a['rows']} rows with equal ids; "
                  f"Project-Only share {a['project_only_share']}; K/V check {a['kv_check_rows']} rows, max |diff| "
                  f"{a['kv_check_max_abs_diff']} (relative {a['kv_check_max_rel_diff']}); start-up {a['startup_s']:.0f} s")
        print(f"sglang-check --routed: {summary['verdict']}")
        if summary["verdict"] == "FAIL":
            raise SystemExit(1)
        return
    rows, summary = check_greedy_against_transformers(args.model_dir, prompts, args.max_new_tokens, launch,
                                                      prompt_ids=ids, log_path=args.server_log)
    write_jsonl(args.out, [{**r, **prov} for r in rows])
    write_json(args.summary, {**summary, **meta})
    mlp = summary["max_logprob_diff"]
    print(f"sglang-check {summary['verdict']}: {summary['ids_match']}/{summary['rows']} (prompt, mode) rows with "
          f"equal ids; max |logprob diff| {'n/a' if mlp is None or math.isnan(mlp) else f'{mlp:.2e}'}; "
          f"start-up {summary['startup_s']:.0f} s")
    if summary["verdict"] == "FAIL":
        raise SystemExit(1)


def register(add) -> None:
    """Add ``sglang-check`` to the ``python -m impl`` parser (``add(name, fn, help)``)."""
    from impl.argtypes import output_file, positive_int

    sp = add("sglang-check", cmd_sglang_check,
             "upstream SGLang vs transformers on one model: greedy ids alone and batched (SGLang's own venv)")
    sp.add_argument("--model-dir", required=True, help="HF model directory (with its tokenizer)")
    sp.add_argument("--prompts", required=True, help="token-id workload suite JSONL (rule workload_tokens)")
    sp.add_argument("--n-prompts", type=positive_int, default=3)
    sp.add_argument("--max-new-tokens", type=positive_int, default=16)
    sp.add_argument("--sglang-python", default=None,
                    help=f"the SGLang environment's interpreter (default: the config's vskipper.sglang.python, else "
                         f"{DEFAULT_SGLANG_PYTHON}); the config's attention_backend and extra_args apply too")
    sp.add_argument("--max-total-tokens", type=positive_int, default=None,
                    help="SGLang's KV cache [tokens] (default: the config's vskipper.sglang.max_total_tokens, else 16384)")
    sp.add_argument("--server-threads", type=positive_int, default=None, help="torch threads of the server (CPU)")
    sp.add_argument("--server-log", default=None, help="where the server's log goes (default: a temporary file)")
    sp.add_argument("--routed", nargs=2, type=float, metavar=("R", "D"), default=None,
                    help="check vSkipper inside SGLang instead: all-RUN routed and RandomSkip (r=R, d=D) servers "
                         "against the transformers references (module docstring)")
    sp.add_argument("--routed-layers", type=int, nargs="+", default=None,
                    help="with --routed: the routed layers (default: the second half)")
    sp.add_argument("--server-log-dir", default=None, help="with --routed: a folder for the two servers' logs")
    sp.add_argument("--out", type=output_file, required=True, help="JSONL rows to write")
    sp.add_argument("--summary", type=output_file, required=True, help="summary JSON to write")
