"""Commands of the vSkipper serving experiments (``python -m impl CMD``; vSkipper Sec. 4, Tables 2-7,
Fig. 3), registered into :mod:`impl.cli` through ``COMMANDS``. Every command reads the
``vskipper`` config section (:mod:`impl.vskipper.schema`); heavy modules are imported inside the
commands.

Pipeline (one rule per command in ``workflows/vskipper.smk``):

1. ``train-flexidepth``: stage-1 FlexiDepth training of routers + adapters on the frozen base model
   (ShareGPT tokens) -> checkpoint directory beside the model and a summary JSON.
2. ``profile-mode``: the policy's Project-Only share per phase (measured under always-route on the
   load workload's prompts for FlexiDepth; ``r * k / n_routed`` for RandomSkip), the routed-cost
   profile on this device and the rule-derived mode-switch thresholds
   (:func:`impl.vskipper.mode.derive_thresholds`, the rule's text is in the JSON).
3. ``knee``: the Q* sweep on the upstream arm (unbound model, unmodified engine) under natural
   generation. When the knee falls on the bottom or top rung of the sweep the command does not fail:
   the JSON says ``status: "bottom" | "top"`` with the rule's message, and ``q_star_used`` is that
   rung (the knee lies at or below the bottom rung / at or above the top rung), so the cells still
   run at absolute rates, labelled as not bracketed (``vskipper.knee.on_boundary: boundary``), or
   write one ``skipped`` row (``on_boundary: skip``).
4. ``serve-cell``: the paired protocol (:func:`impl.serving.protocol.run_protocol`) at one load point:
   upstream vs the served hybrid (FlexiDepth under the mode switch with the derived thresholds), and
   optionally the mechanism ablations (prefill-only, decode-only, no-promotion, always-route), in the
   matched-work and natural lanes. A lane rejected by the matched-work gate (or with failed requests)
   becomes a ``kind: "rejected"`` row (with the rows measured before) instead of failing the DAG.
5. ``randomskip-map``: Fig. 3: the r x d RandomSkip grid at one load point, each policy under
   always-route, FlexiDepth's (shared) thresholds and its own rule-derived thresholds, against
   upstream on the same schedules and replayed lengths.
6. ``quality-cell``: the quality 2x2 of one suite (Sec. 4.3, Table 5 left; :func:`impl.vskipper.quality_run.run_quality`):
   A = base model (lm-eval HF backend), B = the FlexiDepth checkpoint in plain PyTorch, C = base model
   served by the upstream arm, D = the checkpoint served always-route (C and D: the vSkipper HTTP
   server started in the command's process on 127.0.0.1, port 0, or, with ``vskipper.engines.routed:
   sglang``, upstream SGLang and vSkipper inside SGLang; lm-eval's ``local-completions`` client sending
   token ids), on the same documents and token ids -> JSONL rows (documents,
   summaries with the DiD, first-token agreement), a summary JSON and the documents' requests
   (prompt ids, stop strings, budgets) for step 7. Arms that fed different prompt token ids (the gate)
   become one ``kind: "rejected"`` row instead of failing the DAG.
7. ``quality-served``: Table 5 (right; :func:`impl.vskipper.quality_served.run_served_knee`): the documents'
   requests of step 6 (padded with the knee workload's prompts to ``vskipper.quality.served.requests``)
   as a seeded Poisson stream at ``vskipper.quality.served.point`` x Q* (from the knee JSON) to the
   hybrid server (the FlexiDepth thresholds) and to the always-route server, same schedule; cut by the
   2x2's stop rule, scored by lm-eval -> per-document rows, per-suite summaries (hybrid - always-route
   with a 95 % interval, routed share of decode rows per arm). A failed request or a prompt-id
   mismatch becomes one ``kind: "rejected"`` row.
8. ``vskipper-tables`` / ``vskipper-figures``: tables and figures from the raw rows
   (:mod:`impl.vskipper.serving_report`).
9. ``vskipper-transfer-tables``: Table 6 (cross-model) and Table 7 (hardware transfer) shapes from the raw
   files of the main run and of the extra targets (:mod:`impl.vskipper.transfer`; Sec. 4.4).
10. ``vskipper-engine-tables``: the tables of several engines' runs side by side (the main run and the
    SGLang section, ``vskipper.sglang_section``; :mod:`impl.vskipper.engine_report`).
"""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path

from ..argtypes import output_file, positive_int
from ..schema import core_config
from .schema import Engine, Quality, vskipper_section

log = logging.getLogger("impl.serving")

__all__ = ["register", "cb_config_for", "knee_outcome", "build_served_arms", "quality_options", "quality_cb_config",
           "quality_concurrency", "served_knee_fields"]

#: name of the served hybrid arm and of the baseline arm in every row
SERVED, UPSTREAM = "vskipper", "upstream"
#: the three switch settings of the RandomSkip map (Fig. 3 a, b, c)
MAP_SETTINGS = ("always-route", "shared", "per-policy")


def _cfg_threads(args) -> dict:
    from impl.runtime import config_from_args, set_threads

    cfg = config_from_args(args)
    set_threads(cfg)
    return cfg


def _read_json(path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such JSON file: {p}")
    return json.loads(p.read_text(encoding="utf-8"))


def cb_config_for(engine: Engine, requests) -> object:
    """The continuous-batching configuration every arm of a serving comparison shares: the cache of
    :func:`impl.vskipper.engine.sized_cb_config` holds every request of the run at once (prompt +
    ``max_new_tokens`` tokens each).

    Args:
        engine: the typed ``vskipper.engine`` section.
        requests: the run's :class:`~impl.serving.loadgen.Request` list.
    """
    from impl.vskipper.engine import sized_cb_config

    return sized_cb_config(engine, (len(r.input_ids) + r.max_new_tokens for r in requests))


def _requests(v: dict, prompts: str, n: int | None):
    from impl.provenance import read_jsonl

    from impl.serving.loadgen import requests_from_prompts

    return requests_from_prompts(read_jsonl(prompts), v.max_new_tokens, n=n or v.requests)


def _load_model(cfg: dict, model_dir: str):
    from impl.runtime import load_for

    return load_for(cfg, model_dir)


def _load_skipper(path: str, model):
    from impl.vskipper.flexidepth import load_flexidepth

    return load_flexidepth(path, model)


def _prov(cfg: dict) -> dict:
    from impl.runtime import run_provenance

    return run_provenance(cfg)


def upstream_arm(cfg: dict, model, model_dir, cb):
    """The upstream arm of every serving comparison, on the engine ``vskipper.engines.upstream`` names:
    ``transformers`` (the unbound ``model`` on transformers' continuous batching, in process) or
    ``sglang`` (upstream SGLang's server on ``model_dir``, started on the arm's first run, on the
    config's device, dtype and thread count, from ``vskipper.sglang``; close it with ``.close()``).

    Args:
        cfg: the validated config. model: the loaded base model (transformers only).
        model_dir: the model's Hugging Face directory (SGLang loads it itself). cb: the shared
        continuous-batching config (transformers only).

    Returns:
        an :class:`~impl.serving.arms.Arm` named ``upstream``.
    """
    v = vskipper_section(cfg)
    if v.engines.upstream == "transformers":
        from impl.serving.inprocess import ContinuousBatchingArm

        return ContinuousBatchingArm(model, UPSTREAM, cb_config=cb)
    from impl.serving.sglang_arm import SGLangArm

    return SGLangArm(sglang_launch(cfg, model_dir), name=UPSTREAM, ready_timeout_s=v.sglang.ready_timeout_s,
                     request_timeout_s=v.timeout_s, server_per_run=v.sglang.server_per_run)


def sglang_launch(cfg: dict, model_dir):
    """The :class:`~impl.serving.sglang_server.SGLangLaunch` of every SGLang arm of a config: ``model_dir``
    on the config's device, dtype and thread count, with ``vskipper.sglang``'s interpreter, attention
    backend, KV-cache size and extra arguments, and graph capture off unless ``vskipper.sglang.upstream_graphs``
    (the routed arms never capture: :func:`impl.vskipper.sglang_routed.routed_launch`)."""
    from impl.serving.sglang_server import SGLangLaunch, no_graph_capture

    core = core_config(cfg)
    sg = vskipper_section(cfg).sglang
    launch = SGLangLaunch(model_dir=model_dir, python=sg.python, device=core.device.split(":")[0],
                          dtype=core.dtype, max_total_tokens=sg.max_total_tokens,
                          attention_backend=sg.attention_backend, threads=core.threads,
                          extra_args=tuple(sg.extra_args))
    return launch if sg.upstream_graphs else no_graph_capture(launch)


def routed_arm(cfg: dict, name: str, switch, *, bound=None, cb=None, model_dir=None, policy: str = "flexidepth",
               policy_kwargs: dict | None = None):
    """One routed arm under ``switch`` on the engine ``vskipper.engines.routed`` names.

    Args:
        cfg: the validated config. name: the arm's name in rows. switch: its
            :class:`~impl.vskipper.mode.ModeSwitch` (a fresh controller per run on either engine).
        bound: transformers: the model bound to the skipper (shared by the routed arms of one cell).
        cb: transformers: the continuous-batching config.
        model_dir, policy, policy_kwargs: sglang: the base model directory and the skip policy the server
            builds (:func:`impl.vskipper.skipper.build_skipper`; FlexiDepth ``{"checkpoint": DIR}``).

    Returns:
        a :class:`~impl.serving.inprocess.ContinuousBatchingArm` or a
        :class:`~impl.vskipper.sglang_routed.RoutedSGLangArm` (close it with :func:`close_arms`).
    """
    v = vskipper_section(cfg)
    if v.engines.routed == "transformers":
        return _inprocess_routed_arm(bound, name, switch, cb)
    from impl.vskipper.sglang_routed import RoutedSGLangArm

    return RoutedSGLangArm(sglang_launch(cfg, model_dir), policy, policy_kwargs, switch=switch, name=name,
                           ready_timeout_s=v.sglang.ready_timeout_s, request_timeout_s=v.timeout_s,
                           server_per_run=v.sglang.server_per_run)


def needs_inprocess_model(cfg: dict) -> bool:
    """Whether a serving command must load the model in process (an arm family on transformers)."""
    e = vskipper_section(cfg).engines
    return "transformers" in (e.upstream, e.routed)


def close_arms(arms) -> None:
    """Shut down every arm that owns a server process (:class:`~impl.serving.sglang_arm.SGLangArm`)."""
    for arm in arms:
        close = getattr(arm, "close", None)
        if close is not None:
            close()


# --------------------------------------------------------------------------------------------- train
def cmd_train_flexidepth(args) -> None:
    """Stage-1 FlexiDepth training on the frozen base model; writes the checkpoint and a summary."""
    import torch

    from impl.models.adapter_train import sharegpt_tokens
    from impl.models.load import load_tokenizer
    from impl.provenance import atomic_path, write_json
    from impl.vskipper.flexidepth import FlexiDepthTrainConfig, train_flexidepth

    cfg = _cfg_threads(args)
    core = core_config(cfg)
    v = vskipper_section(cfg)
    f = v.flexidepth
    model = _load_model(cfg, args.model_dir)
    tok = load_tokenizer(args.model_dir)
    train, val = sharegpt_tokens(core.data_dir, tok, f.max_chars)
    tcfg = FlexiDepthTrainConfig(routed_layers=f.routed_layers, steps=f.steps, batch_size=f.batch_size,
                                 seq_len=f.seq_len, lr=f.lr, skip_alpha=f.skip_alpha, seed=core.seed,
                                 threads=f.threads, eval_windows=f.eval_windows,
                                 log_every=max(1, min(25, f.steps // 4)))
    n_val = f.eval_windows * f.seq_len
    if len(val) < n_val:
        raise ValueError(f"held-out ShareGPT text gives {len(val)} tokens, fewer than vskipper.flexidepth.eval_windows "
                         f"x seq_len = {n_val}; raise vskipper.flexidepth.max_chars")
    with torch.enable_grad():
        skipper, summary = train_flexidepth(model, train, tcfg, val_windows=val[:n_val], progress=not args.quiet)
    cfg_model = model.config
    summary.update(model=v.model, model_dir=str(args.model_dir), data="sharegpt",
                   train_tokens_available=int(len(train)), checkpoint=str(args.out), **_prov(cfg))
    extra = {"base_model": str(args.model_dir), "num_hidden_layers": int(cfg_model.num_hidden_layers),
             "model_type": getattr(cfg_model, "model_type", None), "train": summary}
    with atomic_path(args.out) as tmp:
        skipper.save(tmp, extra=extra)
    write_json(args.summary, summary)
    log.info("flexidepth on %s: held-out skip ratio %.3f, LM loss %.3f (dense %.3f) in %.0f s", v.model,
             summary["eval_skip_ratio"], summary["eval_lm_loss"], summary["eval_dense_lm_loss"], summary["seconds"])


# ------------------------------------------------------------------------------------------- profile
def _measure_share(model, prompts: list, max_new_tokens: int, cb) -> dict:
    """Project-Only share per phase of the bound skipper under always-route on ``prompts``."""
    from impl.vskipper import Phase, generate_greedy, routed_context

    ctx = routed_context(model)
    ctx.reset_stats()
    generate_greedy(model, prompts, max_new_tokens=max_new_tokens, mode="routed", cb_config=cb,
                    request_ids=[f"share_{i}" for i in range(len(prompts))])
    out = {"prefill": ctx.skip_ratio(Phase.PREFILL), "decode": ctx.skip_ratio(Phase.DECODE)}
    ctx.reset_stats()
    return out


def cmd_profile_mode(args) -> None:
    """Policy share, routed-cost profile and rule-derived thresholds of one policy -> JSON."""
    from impl.provenance import write_json
    from impl.vskipper import RandomSkip, bind_skipper, unbind_skipper
    from impl.vskipper.mode import ModeSwitch, derive_thresholds, profile_routed_cost

    cfg = _cfg_threads(args)
    core = core_config(cfg)
    v = vskipper_section(cfg)
    p = v.profile
    model = _load_model(cfg, args.model_dir)
    flexi = _load_skipper(args.flexidepth, model)
    layers = list(flexi.routed_layers)
    out: dict = {"policy": args.policy, "model": v.model, "checkpoint": str(args.flexidepth),
                 "routed_layers": layers}
    derive = dict(share_slack=p.share_slack, margin=p.margin, probe_every=p.probe_every)
    if args.policy == "flexidepth":
        if not args.prompts:
            raise SystemExit("error: --policy flexidepth needs --prompts (its share is measured on them)")
        skipper = flexi
        reqs = _requests(v, args.prompts, None)[: p.share_prompts]
        bind_skipper(model, skipper)
        share = _measure_share(model, [list(r.input_ids) for r in reqs], v.max_new_tokens,
                               cb_config_for(v.engine, reqs))
        bad = [k for k, s in share.items() if not math.isfinite(s)]
        if bad:
            raise ValueError(f"no {bad} rows were routed while measuring the share")
        out["share"] = {**share, "prompts": len(reqs), "max_new_tokens": v.max_new_tokens,
                        "method": "always-route generation through the engine on the first prompts of the load "
                                  "workload; Project-Only share of (row, routed layer) pairs per phase"}
    else:  # RandomSkip: the hash cost does not depend on (r, d); one profile serves the whole grid
        rs = v.randomskip
        skipper = RandomSkip(layers, r=0.5, d=0.5, seed=rs.seed, layer_choice=rs.layer_choice)
        bind_skipper(model, skipper)
    profile = profile_routed_cost(model, skipper, prefill_tokens=p.prefill_tokens,
                                  prefill_prompt_len=p.prefill_prompt_len, decode_requests=p.decode_requests,
                                  decode_context=p.decode_context, repeats=p.repeats, seed=core.seed)
    unbind_skipper(model)
    out["profile"] = profile
    if args.policy == "flexidepth":
        share = {"prefill": out["share"]["prefill"], "decode": out["share"]["decode"]}
        thr = derive_thresholds(profile, share, **derive)
        out["thresholds"] = thr
        out["switch"] = ModeSwitch.from_thresholds(thr).to_dict()
    else:
        grid = []
        for r in rs.r:
            for d in rs.d:
                sk = RandomSkip(layers, r=r, d=d, seed=rs.seed, layer_choice=rs.layer_choice)
                thr = derive_thresholds(profile, sk.skip_ratio, **derive)
                grid.append({"r": r, "d": d, "k": sk.k, "share": sk.skip_ratio, "thresholds": thr,
                             "switch": ModeSwitch.from_thresholds(thr).to_dict()})
        out["share"] = {"method": "analytic: r * k / n_routed (k = d * n_routed rounded half up), both phases"}
        out["grid"] = grid
    out.update(_prov(cfg))
    write_json(args.out, out)
    log.info("%s thresholds -> %s", args.policy, args.out)


# ---------------------------------------------------------------------------------------------- knee
def knee_outcome(rates, tps, eps: float) -> dict:
    """Q* by :func:`impl.serving.knee.find_knee`, or the boundary outcome when the knee falls on the
    bottom or top rung.

    Args:
        rates: offered rates, requests/s. tps: output token rate at each, tokens/s. eps: growth threshold.

    Returns:
        ``{"status": "ok" | "bottom" | "top", "q_star": Q* or None, "q_star_used": the rate the load
        points are taken from (Q*, else the boundary rung), "bracketed": bool, "message": ...,
        "knee": KneeResult dict or None}``. ``bottom``: the output token rate does not grow from the
        lowest rate (knee at or below it); ``top``: it grows at every step (knee at or above the top).

    Raises:
        ValueError: for malformed sweeps (fewer than 3 rungs, repeated rates, ...), as ``find_knee``.
    """
    from impl.serving.knee import find_knee

    try:
        k = find_knee(rates, tps, eps=eps)
    except ValueError as e:
        msg = str(e)
        if not msg.startswith("knee at the"):
            raise
        status = "bottom" if msg.startswith("knee at the bottom") else "top"
        used = min(rates) if status == "bottom" else max(rates)
        return {"status": status, "q_star": None, "q_star_used": float(used), "bracketed": False, "message": msg,
                "knee": None}
    return {"status": "ok", "q_star": k.q_star, "q_star_used": k.q_star, "bracketed": True,
            "message": k.rule + (f"; later growth at {list(k.later_growth)}" if k.later_growth else ""),
            "knee": k.to_dict()}


def cmd_knee(args) -> None:
    """Q* sweep on the upstream arm (natural generation) -> JSON with rows, status and load points."""
    cfg = _cfg_threads(args)
    core = core_config(cfg)
    v = vskipper_section(cfg)
    kn = v.knee
    model = _load_model(cfg, args.model_dir) if v.engines.upstream == "transformers" else None
    reqs = _requests(v, args.prompts, kn.requests)
    arm = upstream_arm(cfg, model, args.model_dir, cb_config_for(v.engine, reqs))
    try:
        _knee(args, cfg, core, v, arm, reqs)
    finally:
        close_arms([arm])


def _knee(args, cfg, core, v, arm, reqs) -> None:
    from impl.provenance import write_json

    from impl.serving.knee import capacity_rates, knee_sweep, load_points, serial_capacity
    from impl.serving.protocol import cell_seed

    kn = v.knee
    seed = cell_seed(core.seed, args.workload, "knee-sweep")
    probe = None
    rates = list(kn.rates)
    if kn.scale == "capacity":
        probe = serial_capacity(arm, reqs, n=min(kn.probe_requests, len(reqs)), timeout_s=v.timeout_s)
        try:
            rates = capacity_rates(probe["capacity_req_s"], kn.rates)
        except ValueError as e:
            raise ValueError(f"vskipper.knee.rates: {e}") from None
        log.info("knee %s: serial capacity %.4g req/s (mean service %.3f s over %d requests) -> rates %s",
                 args.workload, probe["capacity_req_s"], probe["service_s_mean"], probe["n"], rates)
    rows = []
    try:
        _, rows = knee_sweep(arm, reqs, rates, seed=seed, eps=kn.eps, timeout_s=v.timeout_s,
                             on_point=lambda r: log.info("knee %s: %.4g req/s -> TPS %.2f, E2E %.3f s", args.workload,
                                                         r["rate"], r["tps_window"], r["e2e_mean_s"]))
    except ValueError as e:  # a knee on a boundary rung: the rows are measured, the outcome is below
        rows = getattr(e, "rows", None)
        if rows is None:
            raise
    outcome = knee_outcome([r["rate"] for r in rows], [r["tps_window"] for r in rows], kn.eps)
    out = {"workload": args.workload, "model": v.model, "requests": len(reqs), "max_new_tokens": v.max_new_tokens,
           "rates": rates, "rate_scale": kn.scale, "rate_factors": list(kn.rates) if probe else None,
           "serial_capacity": probe, "eps": kn.eps, "schedule_seed": seed, "on_boundary": kn.on_boundary,
           **outcome, "load_points": load_points(outcome["q_star_used"], v.load_points),
           "load_factors": dict(v.load_points), "engine": v.engines.upstream, "arm_settings": arm.describe(),
           "rows": rows, **_prov(cfg)}
    if outcome["status"] != "ok":
        log.warning("knee of %s not bracketed (%s): %s", args.workload, outcome["status"], outcome["message"])
    write_json(args.out, out)
    log.info("knee %s: status %s, Q* used %.4g req/s -> %s", args.workload, outcome["status"],
             outcome["q_star_used"], args.out)


# ------------------------------------------------------------------------------------------- serving
def build_served_arms(model, skipper, switch, names, cb, *, upstream=None, cfg: dict | None = None,
                      model_dir=None, checkpoint=None) -> dict:
    """The arms of a serving cell: ``upstream`` (the unbound ``model`` on the unmodified engine) and the
    served hybrid ``vskipper`` (``switch``) and any mechanism ablation in ``names`` (``switch.ablation(name)``);
    each run of a routed arm starts with a fresh :class:`~impl.vskipper.mode.ModeController`.

    On transformers (``cfg`` None, or ``vskipper.engines.routed: transformers``) the routed arms share one
    deep copy of ``model`` bound to ``skipper`` (the controller installed after the warm-up); on SGLang
    (``engines.routed: sglang``) each is a :class:`~impl.vskipper.sglang_routed.RoutedSGLangArm` serving
    ``model_dir`` with the FlexiDepth ``checkpoint`` (``model`` and ``skipper`` are then unused).

    Args:
        model: the base causal LM (left unbound; None when no arm runs in process). skipper: the policy.
        switch: the served :class:`~impl.vskipper.mode.ModeSwitch`. names: routed arm names (``vskipper``
        and/or :data:`impl.vskipper.schema.ABLATION_ARMS`). cb: the shared continuous-batching config.
        upstream: the upstream arm (:func:`upstream_arm`); None: ``model`` on transformers.
        cfg, model_dir, checkpoint: the config and, for SGLang, the base model and checkpoint directories.

    Returns:
        ``{name: Arm}``, upstream first.
    """
    from impl.serving.inprocess import ContinuousBatchingArm
    from impl.vskipper import bind_skipper

    arms = {UPSTREAM: upstream if upstream is not None else ContinuousBatchingArm(model, UPSTREAM, cb_config=cb)}
    on_sglang = cfg is not None and vskipper_section(cfg).engines.routed == "sglang"
    bound = None if on_sglang else bind_skipper(copy.deepcopy(model), skipper)
    try:
        for name in names:
            sw = switch if name == SERVED else switch.ablation(name)
            arms[name] = (routed_arm(cfg, name, sw, model_dir=model_dir, policy="flexidepth",
                                     policy_kwargs={"checkpoint": str(checkpoint)})
                          if on_sglang else _inprocess_routed_arm(bound, name, sw, cb))
    except Exception:
        close_arms(arms.values())
        raise
    return arms


def _inprocess_routed_arm(bound, name: str, switch, cb):
    from impl.serving.inprocess import ContinuousBatchingArm
    from impl.vskipper import routed_context
    from impl.vskipper.mode import ModeController

    return ContinuousBatchingArm(bound, name, cb_config=cb, mode="routed", binding=routed_context(bound),
                                 planner_factory=lambda sw=switch: ModeController(sw))


def _knee_fields(knee: dict, point: str) -> dict:
    factor = float(knee["load_factors"][point])
    return {"point": point, "factor": factor, "rate": factor * float(knee["q_star_used"]),
            "knee_status": knee["status"], "q_star": knee["q_star"], "q_star_used": knee["q_star_used"]}


def _rejected(e: Exception, base: dict) -> list[dict]:
    from impl.serving.matched import MatchedWorkError

    rows = list(getattr(e, "rows", []) or [])
    rej = {"kind": "rejected", **base, "error": f"{type(e).__name__}: {e}",
           "reason": "matched-work gate" if isinstance(e, MatchedWorkError) else "failed requests"}
    if isinstance(e, MatchedWorkError):
        rej["mismatches"] = e.mismatches
    return [*rows, rej]


def cmd_serve_cell(args) -> None:
    """One load point: upstream vs the served hybrid (and ablations), per lane -> JSONL rows."""
    from impl.provenance import write_jsonl
    from impl.vskipper.mode import ModeSwitch

    cfg = _cfg_threads(args)
    core = core_config(cfg)
    v = vskipper_section(cfg)
    knee = _read_json(args.knee)
    if args.point not in knee["load_factors"]:
        raise ValueError(f"load point {args.point!r} is not a label of vskipper.load_points "
                         f"({', '.join(knee['load_factors'])})")
    kf = _knee_fields(knee, args.point)
    base = {"experiment": args.experiment, "workload": args.workload, "model": v.model, "policy": "flexidepth",
            "cell": args.point, "upstream_engine": v.engines.upstream, "routed_engine": v.engines.routed, **kf}
    prov = _prov(cfg)
    if knee["status"] != "ok" and knee.get("on_boundary") == "skip":
        write_jsonl(args.out, [{"kind": "skipped", **base, "reason": f"knee not bracketed ({knee['status']}): "
                                f"{knee['message']}", **prov}])
        log.warning("%s/%s skipped: knee not bracketed", args.workload, args.point)
        return
    switch = ModeSwitch.from_profile(args.thresholds)
    model = _load_model(cfg, args.model_dir) if needs_inprocess_model(cfg) else None
    skipper = _load_skipper(args.flexidepth, model) if v.engines.routed == "transformers" else None
    reqs = _requests(v, args.prompts, None)
    cb = cb_config_for(v.engine, reqs)
    names = [SERVED] + [a for a in (args.arms or []) if a != SERVED]
    arms = build_served_arms(model, skipper, switch, names, cb, upstream=upstream_arm(cfg, model, args.model_dir, cb),
                             cfg=cfg, model_dir=args.model_dir, checkpoint=args.flexidepth)
    try:
        rows = _serve_lanes(args, cfg, core, v, arms, reqs, kf, base, prov)
    finally:
        close_arms(arms.values())
    for r in rows:  # the switch each routed arm ran under, on its cell rows
        if r.get("kind") == "cell" and r["arm"] != UPSTREAM:
            r["switch"] = (switch if r["arm"] == SERVED else switch.ablation(r["arm"])).to_dict()
    write_jsonl(args.out, rows)
    log.info("%s/%s (%.4g req/s, knee %s): %d rows -> %s", args.workload, args.point, kf["rate"], knee["status"],
             len(rows), args.out)


def _serve_lanes(args, cfg, core, v, arms, reqs, kf, base, prov) -> list[dict]:
    from impl.serving.matched import MatchedWorkError
    from impl.serving.protocol import CellError, CellSpec, run_protocol, stamp_rows

    reps = args.repetitions or v.repetitions
    lanes = args.lanes or v.lanes
    spec = CellSpec(args.workload, args.point, kf["rate"], tuple(reqs))
    rows: list[dict] = []
    for lane in lanes:
        try:
            got = run_protocol(arms, [spec], repetitions=reps, seed=core.seed, baseline=UPSTREAM, lanes=(lane,),
                               out=None, config=cfg, device=core.device, dtype=core.dtype,
                               run_id=prov["run_id"], timeout_s=v.timeout_s, keep_ids=not args.drop_ids)
            rows += [{**r, **base} for r in got]
        except (CellError, MatchedWorkError) as e:
            log.error("%s/%s lane %s rejected: %s", args.workload, args.point, lane, e)
            rows += stamp_rows([{**r, **base} for r in _rejected(e, {**base, "lane": lane})], prov)
    return rows


def cmd_randomskip_map(args) -> None:
    """Fig. 3: the r x d RandomSkip grid under three switch settings against upstream -> JSONL rows."""
    from impl.provenance import write_jsonl
    from impl.vskipper import RandomSkip, bind_skipper
    from impl.vskipper.mode import ModeSwitch
    from impl.serving.matched import MatchedWorkError
    from impl.serving.protocol import CellError, cell_seed, run_cell, stamp_rows

    cfg = _cfg_threads(args)
    core = core_config(cfg)
    v = vskipper_section(cfg)
    rs = v.randomskip
    knee = _read_json(args.knee)
    kf = _knee_fields(knee, rs.point)
    base = {"experiment": "randomskip", "workload": args.workload, "model": v.model, "cell": rs.point,
            "upstream_engine": v.engines.upstream, "routed_engine": v.engines.routed, **kf}
    prov = _prov(cfg)
    if knee["status"] != "ok" and knee.get("on_boundary") == "skip":
        write_jsonl(args.out, [{"kind": "skipped", **base, "reason": f"knee not bracketed ({knee['status']})", **prov}])
        return
    shared = ModeSwitch.from_profile(args.shared_thresholds)
    rnd = _read_json(args.random_thresholds)
    grid = {(g["r"], g["d"]): g for g in rnd["grid"]}
    model = _load_model(cfg, args.model_dir) if needs_inprocess_model(cfg) else None
    on_sglang = v.engines.routed == "sglang"
    reqs = _requests(v, args.prompts, rs.requests)
    cb = cb_config_for(v.engine, reqs)
    upstream = upstream_arm(cfg, model, args.model_dir, cb)
    seed = cell_seed(core.seed, args.workload, f"randomskip-{rs.point}")
    lengths = None
    rows: list[dict] = []
    try:
        for r in rs.r:
            for d in rs.d:
                g = grid.get((r, d))
                if g is None:
                    raise ValueError(f"{args.random_thresholds} has no thresholds for r={r}, d={d}; re-run profile-mode")
                kw = {"routed_layers": list(rnd["routed_layers"]), "r": r, "d": d, "seed": rs.seed,
                      "layer_choice": rs.layer_choice}
                sk = RandomSkip(**kw)
                bound = None if on_sglang else bind_skipper(copy.deepcopy(model), sk)
                switches = {"always-route": ModeSwitch(always_route=True),
                            "shared": shared,
                            "per-policy": ModeSwitch.from_thresholds(g["thresholds"])}
                arms = {UPSTREAM: upstream}
                try:
                    for name, sw in switches.items():
                        arms[name] = routed_arm(cfg, name, sw, bound=bound, cb=cb, model_dir=args.model_dir,
                                                policy="random", policy_kwargs=kw)
                except Exception:
                    close_arms([a for n, a in arms.items() if n != UPSTREAM])
                    raise
                pol = {**base, "policy": "randomskip", "r": r, "d": d, "k": sk.k, "skip_share": sk.skip_ratio,
                       "n_routed": len(sk.routed_layers)}
                log.info("RandomSkip r=%g d=%g (s=%.3f) at %.4g req/s", r, d, sk.skip_ratio, kf["rate"])
                try:
                    res = run_cell(arms, reqs, cell=rs.point, rate=kf["rate"], repetitions=rs.repetitions, seed=seed,
                                   baseline=UPSTREAM, lane="matched", lengths=lengths, workload=args.workload,
                                   timeout_s=v.timeout_s, keep_ids=False)
                except (CellError, MatchedWorkError) as e:
                    log.error("RandomSkip r=%g d=%g rejected: %s", r, d, e)
                    rows += [{**x, **pol} for x in _rejected(e, {**pol, "lane": "matched"})]
                    continue
                finally:  # the grid point's routed servers (SGLang) stop before the next point's start
                    close_arms([a for n, a in arms.items() if n != UPSTREAM])
                lengths = res.lengths
                for x in res.rows:
                    x = {**x, **pol}
                    if x["kind"] == "cell" and x["arm"] in switches:
                        x["switch"] = switches[x["arm"]].to_dict()
                    rows.append(x)
                for x in res.rows:
                    if x["kind"] == "summary" and x["metric"] == "e2e_mean_s":
                        log.info("  %s: E2E mean %s %%", x["treatment"], x["text"])
    finally:
        close_arms([upstream])
    write_jsonl(args.out, stamp_rows(rows, prov))
    log.info("RandomSkip map: %d rows -> %s", len(rows), args.out)


# ------------------------------------------------------------------------------------------- quality
def quality_options(q: Quality, cache_dir=None):
    """:class:`impl.quality.tasks.TaskOptions` from the typed ``vskipper.quality`` section."""
    from impl.quality.tasks import TaskOptions

    g = q.max_gen_toks
    return TaskOptions(gsm8k_num_fewshot=q.gsm8k_num_fewshot, gsm8k_max_gen_toks=g.gsm8k,
                       bbh_subtasks=tuple(q.bbh_subtasks), bbh_max_gen_toks=g.bbh,
                       coqa_max_gen_toks=g.coqa, datasets_cache_dir=None if cache_dir is None else str(cache_dir))


def quality_cb_config(engine: Engine, max_length: int, n_docs: int | None):
    """Engine configuration of the served quality arms C and D (the same for both): the cache of
    :func:`impl.vskipper.engine.sized_cb_config` holds ``min(n_docs, max_requests_per_batch)`` requests
    of ``max_length`` tokens at once, so no request is evicted mid-generation."""
    from impl.vskipper.engine import sized_cb_config

    conc = engine.max_requests_per_batch
    if n_docs:
        conc = min(conc, int(n_docs))
    return sized_cb_config(engine, [int(max_length)] * conc)


def quality_concurrency(q: Quality, engine: Engine, n_docs: int | None) -> int:
    """Requests lm-eval keeps in flight against the served arms C and D: ``vskipper.quality.http_concurrency``,
    else ``vskipper.engine.max_requests_per_batch``, capped by the number of documents (``n_docs``, None:
    unknown). Requests beyond the engine's batch wait in its queue (the cache of :func:`quality_cb_config`
    holds the running ones)."""
    conc = q.http_concurrency or engine.max_requests_per_batch
    if n_docs:
        conc = min(conc, int(n_docs))
    return max(1, conc)


def cmd_quality_tasks(args) -> None:
    """Write the lm-eval task YAMLs of the quality protocol (``vskipper.quality``) for a standalone
    ``lm_eval`` run against a served arm, and print that command."""
    from impl.quality.tasks import write_task_yamls
    from impl.runtime import config_from_args

    cfg = config_from_args(args)
    core = core_config(cfg)
    q = vskipper_section(cfg).quality
    if q is None:
        raise SystemExit("error: the config has no 'vskipper.quality' section")
    suites = args.suites or list(q.tasks)
    out = Path(args.out)
    try:
        ts = write_task_yamls(core.data_dir, out, suites, quality_options(q, out / "hf_datasets"))
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    names = ",".join(ts.task_names)
    print(f"wrote {len(ts.task_names)} lm-eval tasks to {out}: {names}")
    print("run them against a served arm (python -m impl.vskipper.server ... prints its URL), e.g.:")
    print(f"  HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval --model local-completions --model_args "
          f"base_url=URL/v1/completions,model=NAME,tokenizer_backend=huggingface,tokenizer=MODEL_DIR,"
          f"tokenized_requests=True,max_length=4096,num_concurrent=1 --tasks {names} --include_path {out} --limit 5")


def cmd_quality_cell(args) -> None:
    """The quality 2x2 (A/B/C/D) of one suite with the FlexiDepth checkpoint -> JSONL rows + summary JSON."""
    import shutil
    import tempfile

    from transformers import AutoConfig

    from impl.models.load import load_tokenizer
    from impl.provenance import write_json, write_jsonl
    from impl.vskipper.quality_arms import default_max_length
    from impl.quality.did import PromptMismatchError
    from impl.vskipper.quality_run import run_quality

    cfg = _cfg_threads(args)
    core = core_config(cfg)
    v = vskipper_section(cfg)
    q = v.quality
    if q is None:
        raise SystemExit("error: the config has no 'vskipper.quality' section")
    suite = args.suite
    if suite not in q.tasks:
        raise SystemExit(f"error: suite {suite!r} is not in vskipper.quality.tasks ({', '.join(q.tasks)})")
    model = _load_model(cfg, args.model_dir)
    skipper = _load_skipper(args.flexidepth, model)  # checked against the base model's shapes
    del model
    tok = load_tokenizer(args.model_dir)
    max_length = default_max_length(AutoConfig.from_pretrained(args.model_dir, local_files_only=True), tok)
    n_tasks = len(q.bbh_subtasks) if suite == "bbh" else 1
    n_docs = None if q.limit is None else q.limit * n_tasks
    conc = quality_concurrency(q, v.engine, n_docs)
    cb = quality_cb_config(v.engine, max_length, n_docs)
    # arms C and D on the engine that serves the routed family (both on it: the DiD compares like with like)
    engine = v.engines.routed
    sg = dict(served="sglang", sglang_launch=sglang_launch(cfg, args.model_dir),
              sglang_policy=("flexidepth", {"checkpoint": str(Path(args.flexidepth).resolve())})) \
        if engine == "sglang" else dict(served="http")
    base = {"experiment": "quality", "model": v.model, "policy": "flexidepth", "checkpoint": str(args.flexidepth),
            "engine": engine}
    run_cfg = {**cfg, "quality_suite": suite}
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)
    rows: list[dict]
    with tempfile.TemporaryDirectory(prefix="vsk_quality_hf_") as cache:
        try:
            res = run_quality(args.model_dir, skipper, core.data_dir, (suite,), q.limit, work,
                              options=quality_options(q, cache), device=core.device, dtype=core.dtype,
                              max_length=max_length, cb_config=cb, first_token_docs=q.first_token_docs,
                              tol=q.tol, seed=core.seed, config=run_cfg, http_concurrency=conc, **sg)
        except PromptMismatchError as e:
            log.error("quality %s rejected by the prompt-hash gate: %s", suite, e)
            prov = _prov(run_cfg)
            rows = [{"kind": "rejected", "suite": suite, **base, "reason": "prompt-hash gate",
                     "error": f"{type(e).__name__}: {e}", **prov}]
            write_jsonl(args.out, rows)
            write_json(args.summary, {"suite": suite, **base, "gate": "FAIL", "error": str(e), "summary": [],
                                      "first_token": [], "provenance": prov})
            if args.requests:
                write_jsonl(args.requests, [])
            return
    rows = [{**r, **base} for r in res.rows]
    summary = json.loads((work / "summary.json").read_text(encoding="utf-8"))
    summary.pop("config", None)  # the whole config is hashed into every row's provenance
    summary.update(suite=suite, gate="PASS", **base, limit=q.limit, options=quality_options(q).to_dict(),
                   max_length=max_length)
    write_jsonl(args.out, rows)
    write_json(args.summary, summary)
    if args.requests:
        write_jsonl(args.requests, res.requests)
    prim = [r for r in res.summary if r.get("primary") and r.get("task") is None]
    for r in prim:
        log.info("quality %s %s: A %.1f B %.1f C %.1f D %.1f, DiD %+.2f [%+.2f, %+.2f] pp (n=%d); wall %s", suite,
                 r["metric"], r["mean_A"], r["mean_B"], r["mean_C"], r["mean_D"], r["did_mean"], r["did_ci_low"],
                 r["did_ci_high"], r["n"], {a: round(t, 1) for a, t in res.wall_s.items()})


def served_knee_fields(knee: dict, point: str) -> dict:
    """The rate of the served-at-knee pass: ``{"point", "factor", "rate" [req/s], "knee_status", "q_star",
    "q_star_used", "knee_workload"}`` from a knee JSON (rule ``vskipper_knee``) and a load-point label.

    Raises:
        ValueError: naming the label when it is not one of the knee's load points.
    """
    if point not in (knee.get("load_factors") or {}):
        raise ValueError(f"vskipper.quality.served.point = {point!r} is not a load point of the knee JSON "
                         f"({', '.join(knee.get('load_factors') or {})})")
    return {**_knee_fields(knee, point), "knee_workload": knee.get("workload")}


def cmd_quality_served(args) -> None:
    """Table 5 (right): one suite's documents served at the knee by the hybrid and by always-route."""
    import shutil
    import tempfile

    from impl.provenance import read_jsonl, write_json, write_jsonl
    from impl.quality.did import PromptMismatchError
    from impl.vskipper.quality_served import ServedStreamError, run_served_knee
    from impl.vskipper.mode import ModeSwitch

    cfg = _cfg_threads(args)
    core = core_config(cfg)
    v = vskipper_section(cfg)
    q = v.quality
    if q is None:
        raise SystemExit("error: the config has no 'vskipper.quality' section")
    sv = q.served
    if sv is None:
        raise SystemExit("error: vskipper.quality.served is null (no served-at-knee pass)")
    suite = args.suite
    if suite not in q.tasks:
        raise SystemExit(f"error: suite {suite!r} is not in vskipper.quality.tasks ({', '.join(q.tasks)})")
    knee = _read_json(args.knee)
    kf = served_knee_fields(knee, sv.point)
    base = {"experiment": "quality-served", "model": v.model, "policy": "flexidepth",
            "checkpoint": str(args.flexidepth), **kf}
    run_cfg = {**cfg, "quality_served_suite": suite}
    prov = _prov(run_cfg)

    def reject(reason: str, err: Exception, rows=()) -> None:
        log.error("quality-served %s rejected (%s): %s", suite, reason, err)
        rej = {"kind": "rejected", "suite": suite, **base, "reason": reason, "error": f"{type(err).__name__}: {err}",
               **prov}
        write_jsonl(args.out, [*rows, rej])
        write_json(args.summary, {"suite": suite, **base, "status": "rejected", "error": str(err), "summary": [],
                                  "provenance": prov})

    if knee["status"] != "ok" and knee.get("on_boundary") == "skip":
        write_jsonl(args.out, [{"kind": "skipped", "suite": suite, **base,
                                "reason": f"knee not bracketed ({knee['status']})", **prov}])
        write_json(args.summary, {"suite": suite, **base, "status": "skipped", "summary": [], "provenance": prov})
        return
    reqs = [r for r in read_jsonl(args.requests) if r.get("kind", "request") == "request"]
    if not reqs:
        reject("no requests", ValueError(f"{args.requests} has no document requests (the quality cell was rejected?)"))
        return
    switch = ModeSwitch.from_profile(args.thresholds)
    pads = read_jsonl(args.prompts) if args.prompts else []
    n_req = v.requests if sv.requests is None else int(sv.requests)
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)
    with tempfile.TemporaryDirectory(prefix="vsk_served_hf_") as cache:
        try:
            res = run_served_knee(args.model_dir, f"flexidepth:{args.flexidepth}", reqs, core.data_dir, suite,
                                  rate=kf["rate"], switch=switch, out=work, limit=q.limit,
                                  options=quality_options(q, cache), pad_prompts=pads, n_requests=n_req,
                                  pad_max_tokens=v.max_new_tokens, seed=core.seed, device=core.device,
                                  dtype=core.dtype, engine=v.engine, timeout_s=v.timeout_s,
                                  extra=base, config=run_cfg, run_id=prov["run_id"])
        except ServedStreamError as e:
            reject("failed requests", e, e.rows)
            return
        except PromptMismatchError as e:
            reject("prompt-hash gate", e)
            return
    rows = [{**r, **base} for r in res.rows]
    summary = json.loads((work / "summary.json").read_text(encoding="utf-8"))
    summary.pop("config", None)
    summary.update(suite=suite, status="ok", **base, limit=q.limit, served=sv.model_dump(), switch=switch.to_dict())
    write_jsonl(args.out, rows)
    write_json(args.summary, summary)
    for r in res.summary:
        if r.get("primary") and r.get("task") is None:
            log.info("served %s at %s (%.4g req/s): hybrid %.1f always-route %.1f, diff %+.2f [%+.2f, %+.2f] pp "
                     "(n=%d); routed decode rows %.3f / %.3f", suite, kf["point"], kf["rate"], r["mean_hybrid"],
                     r["mean_always-route"], r["diff_mean"], r["diff_ci_low"], r["diff_ci_high"], r["n"],
                     r["routed_share_hybrid"], r["routed_share_always-route"])


# --------------------------------------------------------------------------------- tables / figures
def cmd_vskipper_tables(args) -> None:
    """vSkipper tables (knee, Tables 2-4 shapes, ablation, RandomSkip map, thresholds, FlexiDepth)."""
    from impl.report.tables import write_table

    from .serving_report import vskipper_tables

    tabs = vskipper_tables(knees=args.knee, thresholds=args.thresholds, flexidepth=args.flexidepth,
                           cells=args.cells, ablations=args.ablation, randomskip=args.randomskip,
                           quality=args.quality, quality_served=args.quality_served)
    for name, df in tabs.items():
        write_table(df, Path(args.out_dir) / name)
    log.info("vSkipper tables -> %s", args.out_dir)


def _target_specs(specs, flag: str) -> list[dict]:
    """``--model`` / ``--device`` arguments (``KEY=VALUE`` words per occurrence) -> target mappings."""
    out = []
    for words in specs or []:
        t = {}
        for w in words:
            k, sep, val = w.partition("=")
            if not sep or not val:
                raise SystemExit(f"error: {flag} takes KEY=VALUE words, got {w!r}")
            t[k] = val
        missing = [k for k in ("name", "knee", "cell", "thresholds") if k not in t]
        if missing:
            raise SystemExit(f"error: {flag} {' '.join(words)}: missing {', '.join(missing)}")
        out.append(t)
    return out


def cmd_vskipper_transfer_tables(args) -> None:
    """Table 6 (cross-model) and Table 7 (hardware transfer) shapes (Sec. 4.4) from the raw files."""
    from impl.report.tables import write_table

    from .transfer import transfer_tables

    models, devices = _target_specs(args.model, "--model"), _target_specs(args.device, "--device")
    if not (models or devices):
        raise SystemExit("error: give at least one --model or --device target")
    for name, df in transfer_tables(models, devices).items():
        write_table(df, Path(args.out_dir) / name)
    log.info("vSkipper Tables 6 / 7 -> %s", args.out_dir)


def cmd_vskipper_engine_tables(args) -> None:
    """The vSkipper tables of several engines side by side (the report's SGLang section)."""
    from impl.report.tables import write_table

    from .engine_report import engine_tables

    dirs = {}
    for spec in args.engine:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"error: --engine takes LABEL=TABLES_DIR, got {spec!r}")
        if label in dirs:
            raise SystemExit(f"error: --engine {label!r} given twice")
        if not Path(path).is_dir():
            raise SystemExit(f"error: --engine {label}: {path} is not a folder")
        dirs[label] = path
    if len(dirs) < 2:
        raise SystemExit("error: give at least two --engine LABEL=TABLES_DIR")
    for name, df in engine_tables(dirs).items():
        write_table(df, Path(args.out_dir) / name)
    log.info("vSkipper engine tables (%s) -> %s", ", ".join(dirs), args.out_dir)


def cmd_vskipper_figures(args) -> None:
    """vSkipper figures (Fig. 3 RandomSkip map, knee sweeps) from the tables."""
    from .serving_report import vskipper_figures

    vskipper_figures(args.tables_dir, args.out_dir)


# --------------------------------------------------------------------------------------- registration
def register(add) -> None:
    """Register the vSkipper serving commands (``add(name, fn, help)`` returns an argparse subparser
    that already takes ``--config`` / ``--config-json`` / ``--quiet``)."""
    from .schema import ABLATION_ARMS, QUALITY_TASKS

    sp = add("train-flexidepth", cmd_train_flexidepth,
             "train a FlexiDepth-style skipper (stage 1: routers + adapters, frozen model) on ShareGPT tokens")
    sp.add_argument("--model-dir", required=True, help="the base model (vskipper.model)")
    sp.add_argument("--out", required=True, help="checkpoint directory to write (e.g. models/tiny-std-flexidepth)")
    sp.add_argument("--summary", type=output_file, required=True, help="training summary JSON to write")

    sp = add("profile-mode", cmd_profile_mode,
             "a policy's Project-Only share, the routed-cost profile and the rule-derived mode-switch thresholds")
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--flexidepth", required=True,
                    help="FlexiDepth checkpoint (its routed layers are used for RandomSkip)")
    sp.add_argument("--policy", choices=["flexidepth", "random"], default="flexidepth",
                    help="flexidepth: measured share; random: the vskipper.randomskip grid (analytic shares)")
    sp.add_argument("--prompts", help="token-id prompts of the load workload (flexidepth: share measurement)")
    sp.add_argument("--out", type=output_file, required=True, help="JSON to write")

    sp = add("knee", cmd_knee, "Q* sweep on the upstream arm under natural generation (vSkipper Sec. 4.1, App. M)")
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--prompts", required=True)
    sp.add_argument("--workload", required=True)
    sp.add_argument("--out", type=output_file, required=True, help="JSON to write (rows, status, Q*, load points)")

    sp = add("serve-cell", cmd_serve_cell,
             "paired serving cell at one load point: upstream vs the served hybrid (and ablations), matched / natural")
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--flexidepth", required=True, help="FlexiDepth checkpoint directory")
    sp.add_argument("--thresholds", required=True, help="profile-mode JSON of the FlexiDepth policy")
    sp.add_argument("--knee", required=True, help="knee JSON of the workload")
    sp.add_argument("--prompts", required=True)
    sp.add_argument("--workload", required=True)
    sp.add_argument("--point", required=True, help="a label of vskipper.load_points (e.g. knee)")
    sp.add_argument("--arms", nargs="*", choices=list(ABLATION_ARMS) + [SERVED], default=[],
                    help="extra routed arms beside the served hybrid (mechanism ablations)")
    sp.add_argument("--repetitions", type=positive_int, help="override vskipper.repetitions")
    sp.add_argument("--lanes", nargs="+", choices=["matched", "natural"], help="override vskipper.lanes")
    sp.add_argument("--experiment", default="main", help="label stored in the rows (main, ablation)")
    sp.add_argument("--drop-ids", action="store_true", help="do not keep output token ids in request rows")
    sp.add_argument("--out", type=output_file, required=True, help="JSONL to write")

    sp = add("randomskip-map", cmd_randomskip_map,
             "Fig. 3: RandomSkip r x d grid under always-route, shared and per-policy thresholds vs upstream")
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--knee", required=True)
    sp.add_argument("--shared-thresholds", required=True, help="profile-mode JSON of FlexiDepth (shared thresholds)")
    sp.add_argument("--random-thresholds", required=True, help="profile-mode --policy random JSON (per policy)")
    sp.add_argument("--prompts", required=True)
    sp.add_argument("--workload", required=True)
    sp.add_argument("--out", type=output_file, required=True, help="JSONL to write")

    sp = add("quality-tasks", cmd_quality_tasks,
             "write the quality protocol's lm-eval task YAMLs (GSM8K, BBH, CoQA over the local data) for lm_eval")
    sp.add_argument("--out", required=True, help="folder for the YAMLs (lm_eval --include_path)")
    sp.add_argument("--suites", nargs="+", choices=list(QUALITY_TASKS), default=None,
                    help="suites to write (default: vskipper.quality.tasks)")

    sp = add("quality-cell", cmd_quality_cell,
             "quality 2x2 of one suite (Table 5 left): base / FlexiDepth checkpoint x in process / served always-route")
    sp.add_argument("--model-dir", required=True, help="the base model (vskipper.model)")
    sp.add_argument("--flexidepth", required=True, help="FlexiDepth checkpoint directory (arms B and D)")
    sp.add_argument("--suite", required=True, choices=list(QUALITY_TASKS), help="a suite of vskipper.quality.tasks")
    sp.add_argument("--work-dir", required=True,
                    help="run directory (replaced): generated task YAMLs, lm-eval aggregates per arm")
    sp.add_argument("--out", type=output_file, required=True, help="JSONL rows to write (doc / summary / first_token)")
    sp.add_argument("--summary", type=output_file, required=True, help="summary JSON to write")
    sp.add_argument("--requests", default=None,
                    help="JSONL to write: each document's request (prompt ids, stop strings, budget), "
                         "for quality-served")

    sp = add("quality-served", cmd_quality_served,
             "Table 5 right: one suite's documents served at the knee by the hybrid and by always-route "
             "(Poisson stream)")
    sp.add_argument("--model-dir", required=True, help="the base model (vskipper.model)")
    sp.add_argument("--flexidepth", required=True, help="FlexiDepth checkpoint directory")
    sp.add_argument("--thresholds", required=True,
                    help="profile-mode JSON of the FlexiDepth policy (the hybrid's switch)")
    sp.add_argument("--knee", required=True, help="knee JSON of the load workload giving Q*")
    sp.add_argument("--requests", required=True, help="quality-cell --requests JSONL of the suite")
    sp.add_argument("--prompts", default=None, help="token-id prompts of the knee workload (stream padding)")
    sp.add_argument("--suite", required=True, choices=list(QUALITY_TASKS))
    sp.add_argument("--work-dir", required=True, help="run directory (replaced): task YAMLs, lm-eval aggregates")
    sp.add_argument("--out", type=output_file, required=True, help="JSONL rows to write (served_doc / _request / _arm / _summary)")
    sp.add_argument("--summary", type=output_file, required=True, help="summary JSON to write")

    sp = add("vskipper-tables", cmd_vskipper_tables,
             "vSkipper tables from the raw rows (Tables 2-4, ablation, Fig. 3 data)", config=False)
    sp.add_argument("--knee", nargs="*", default=[], help="knee JSON files")
    sp.add_argument("--thresholds", nargs="*", default=[], help="profile-mode JSON files")
    sp.add_argument("--flexidepth", nargs="*", default=[], help="FlexiDepth training summaries")
    sp.add_argument("--cells", nargs="*", default=[], help="serve-cell JSONL files (main cells)")
    sp.add_argument("--ablation", nargs="*", default=[], help="serve-cell JSONL files (ablation)")
    sp.add_argument("--randomskip", nargs="*", default=[], help="randomskip-map JSONL files")
    sp.add_argument("--quality", nargs="*", default=None,
                    help="quality-cell JSONL files (given, even empty: also write vskipper_table5 / _first_token)")
    sp.add_argument("--quality-served", nargs="*", default=None,
                    help="quality-served JSONL files (given, even empty: also write vskipper_table5_served)")
    sp.add_argument("--out-dir", required=True)

    sp = add("vskipper-transfer-tables", cmd_vskipper_transfer_tables,
             "vSkipper Table 6 (cross-model) / Table 7 (hardware transfer) shapes from the raw rows (Sec. 4.4)", config=False)
    spec = ("KEY=VALUE words: name=, role=main|extra, knee= (knee JSON), cell= (serve-cell JSONL at the point), "
            "thresholds= (profile-mode JSON)")
    sp.add_argument("--model", nargs="+", action="append", metavar="KEY=VALUE",
                    help=f"one Table 6 row (repeat; main first): {spec}, flexidepth= (training summary), "
                         "quality= (quality-cell JSONL of the workload)")
    sp.add_argument("--device", nargs="+", action="append", metavar="KEY=VALUE",
                    help=f"one Table 7 row (repeat; main first): {spec}")
    sp.add_argument("--out-dir", required=True)

    sp = add("vskipper-engine-tables", cmd_vskipper_engine_tables,
             "vSkipper tables of several engines side by side (knee, Table 2 shape, matched-work gate)", config=False)
    sp.add_argument("--engine", action="append", required=True, metavar="LABEL=TABLES_DIR",
                    help="one engine's vskipper-tables folder (repeat; the main engine first)")
    sp.add_argument("--out-dir", required=True)

    sp = add("vskipper-figures", cmd_vskipper_figures, "vSkipper figures (Fig. 3 map, knee sweeps) from the tables", config=False)
    sp.add_argument("--tables-dir", required=True)
    sp.add_argument("--out-dir", required=True)
