"""The GPU path, checked in one short run: every method measured on a CUDA machine in under 8 minutes.

``python -m impl.gpu_check --out results/gpu`` (``scripts/gpu_check.sh`` on the device) writes
``rows.jsonl`` (one row per check or timing, strict JSON) and ``summary.md``. ``--small`` runs the same
code on tiny shapes (CPU, seconds): CI runs it, so the script cannot rot. Sections, each timed and
guarded (an exception becomes an ``error`` row and the run goes on):

1. **exactness** (float32 and bfloat16), the three tiers of the test suite on models built here:
   tier 1 hand-built rows (one-hot target rows on a hand-built tree: every TEV verifier returns the
   argmax-follow path); tier 2 seeded distributions (random trees: each verifier's mean committed
   block length equals ``1 + C_p`` (TEV Eq. 11) and node acceptance frequencies equal ``P(u)`` (Eq. 58)
   within sampling error, and a deliberately wrong verifier fails the same check); tier 3 end to end
   (DEX DEX-1/K greedy and sampled, the depth-selection baselines LayerSkip self-speculation, AdaDecode
   and DEL, and TEV tree decoding with every verifier, token ids against AR). **Tolerance policy**:
   in float32 every comparison is exact (ids equal AR); in bfloat16 batched GEMMs round differently
   for different batch shapes (the DEX lattice, the speculative verify passes and the tree forward
   batch rows that AR computes one at a time), so a near-tie can flip an argmax: bfloat16 rows record
   the agreement rate (prompts whose ids equal AR, and the mean matched prefix) and are not pass/fail.
2. **vskipper_bench**: the routed engine's per-step benchmark (:func:`impl.vskipper.bench.step_benchmark`)
   on randomly initialised models of real shapes (SmolLM2-135M; a 1B-class Llama, Llama-3.2-1B's
   shape), bfloat16: upstream, all-RUN and the RandomSkip r x d grid, prefill 2048 tokens and decode
   at 32 and 128 requests, measured vs FLOP-predicted ratios (timings on random weights).
3. **tev_latency**: TEV vs predraw (exact inverse-CDF sampler and DDTree's ``torch.multinomial``) vs
   sequential residual on the same trees at V = 49152, B in {64, 128}
   (:func:`impl.tev.latency.verifier_latency`, CUDA synchronised before every clock read).
4. **dex_critical_path**: DEX explorer batch times per K on the 1B-class shape and the projected
   K-device speedup ``t_AR / (prefill + critical path)`` from the measured per-round slowest explorer
   (one GPU cannot run NCCL ranks, so communication is not measured here).

Imports torch, transformers, numpy and the project's method packages (pydantic through their config
sections); nothing else, so a device with its own torch needs only small wheels. The versions of
torch, transformers and CUDA are written into every row; a section that fails on a version difference
is reported with its error, not hidden.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .provenance import strict_json

__all__ = ["SECTIONS", "SHAPES", "main", "run_check"]

#: model shapes of the timed sections (random weights): name -> LlamaConfig fields
SHAPES: dict[str, dict[str, int]] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_llama(shape: dict[str, int], device, dtype: torch.dtype, *, seed: int = 0, wide_init: bool = False,
                 max_position_embeddings: int = 4096):
    """A randomly initialised ``LlamaForCausalLM`` of ``shape`` built directly on ``device`` in ``dtype``
    (eval mode, sdpa attention, tied embeddings). ``wide_init`` scales the init (std 0.2, MLP outputs
    x4) so that argmaxes differ across depths, as the test suite's tiny models do: every branch of the
    depth methods is exercised."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
                      eos_token_id=0, bos_token_id=0, initializer_range=0.2 if wide_init else 0.02)
    cfg._attn_implementation = "sdpa"
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.random.set_rng_state(state)
    if wide_init:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.down_proj.weight.mul_(4.0)
    return model.to(dtype).eval()


# ---------------------------------------------------------------------------------------- exactness
def tier1(device: torch.device) -> list[dict]:
    """Tier 1 rows: one-hot target rows on a hand-built tree; ``passed`` iff every verifier returns the
    hand-derived argmax-follow path and bonus token (TEV Sec. 2, greedy limit)."""
    from .tev.tree import DraftTree
    from .tev.verify import VERIFIERS, greedy_follow

    #   0 -1-> 1 -2-> 2 ;  1 -3-> 3 -0-> 4 ;  0 -4-> 5
    tree = DraftTree.from_paths([[1, 2], [1, 3, 0], [4]], root_token=9)
    cases = [([0] * 6, [0], 0), ([4, 0, 0, 0, 0, 0], [0, 5], 0), ([1, 3, 0, 1, 0, 0], [0, 1, 3], 1),
             ([1, 3, 0, 0, 2, 0], [0, 1, 3, 4], 2), ([1, 2, 7, 0, 0, 0], [0, 1, 2], 7)]
    rows = []
    for name, f in VERIFIERS.items():
        ok = True
        for argmax, path, bonus in cases:
            probs = torch.nn.functional.one_hot(torch.tensor(argmax), 10).float().to(device)
            ok &= tuple(greedy_follow(tree.parents, tree.tokens, argmax)) == (path, bonus)
            for seed in range(2):
                g = torch.Generator(device=device).manual_seed(seed)
                ok &= tuple(f(tree.parents, tree.tokens, probs, g)) == (path, bonus)
        rows.append(dict(tier=1, check=f"hand_tree/{name}", passed=bool(ok), cases=len(cases)))
    return rows


def _random_case(seed: int, n: int, v_size: int, device):
    from .tev.tree import DraftTree

    g = torch.Generator().manual_seed(seed)
    t = DraftTree.root_only(0)
    while len(t) < n:
        cand = [u for u in range(len(t)) if t.depths[u] < 3 and len(t.children[u]) < v_size - 1]
        u = cand[int(torch.randint(len(cand), (), generator=g))]
        used = {t.tokens[c] for c in t.children[u]}
        free = [a for a in range(v_size) if a not in used]
        t.add_child(u, free[int(torch.randint(len(free), (), generator=g))])
    logits = torch.randn(n, v_size, generator=g)
    for u in range(1, n):
        logits[t.parents[u], t.tokens[u]] += 1.5  # a decent drafter: deep nodes are reached often
    return t, torch.softmax(logits, -1).to(device)


def _argmax_verifier(parents, tokens, probs, generator, **kw):
    """A deliberately wrong verifier (follows the argmax whatever the temperature): it must fail tier 2."""
    from .tev.verify import greedy_follow

    return greedy_follow(parents, tokens, probs.argmax(-1).tolist())


def tier2(device: torch.device, draws: int) -> list[dict]:
    """Tier 2 rows: per verifier, the mean committed block length against ``1 + C_p`` (Eq. 11) and every
    node's acceptance frequency against ``P(u)`` (Eq. 58), within 4.5 standard errors; the wrong
    verifier must fail (the check has power)."""
    from .tev.exit_law import exit_law, target_coverage
    from .tev.verify import VERIFIERS

    tree, probs = _random_case(11, 8, 6, device)
    P, _, _ = exit_law(tree.parents, tree.tokens, probs)
    P = [float(x) for x in P]
    anc = tree.ancestor_mask()
    expect_len = 1.0 + target_coverage(tree.parents, tree.tokens, probs)
    rows = []
    for name, f in {**VERIFIERS, "wrong_argmax": _argmax_verifier}.items():
        g = torch.Generator(device=device).manual_seed(2024)
        lengths, exits = [], [0] * len(tree)
        for _ in range(draws):
            path, _bonus = f(tree.parents, tree.tokens, probs, g)
            lengths.append(len(path))  # accepted nodes + the root = block length (bonus counted)
            exits[path[-1]] += 1
        mean = sum(lengths) / draws
        sd = math.sqrt(sum((x - mean) ** 2 for x in lengths) / max(1, draws - 1))
        len_ok = abs(mean - expect_len) < 4.5 * max(sd, 1e-9) / math.sqrt(draws)
        acc_ok = True
        for u in range(1, len(tree)):
            acc = sum(c for v, c in enumerate(exits) if anc[v, u]) / draws
            acc_ok &= abs(acc - P[u]) < 4.5 * math.sqrt(P[u] * (1 - P[u]) / draws) + 1e-9
        ok = bool(len_ok and acc_ok)
        rows.append(dict(tier=2, check=f"distribution/{name}", passed=(not ok) if name == "wrong_argmax" else ok,
                         draws=draws, mean_block=mean, expected_block=expect_len,
                         note="must fail: the check has power" if name == "wrong_argmax" else None))
    return rows


def _agreement(got: list[int], want: list[int]) -> int:
    n = 0
    for a, b in zip(got, want):
        if a != b:
            break
        n += 1
    return n


def tier3(device: torch.device, dtype: torch.dtype, *, small: bool, n_prompts: int, n_new: int) -> list[dict]:
    """Tier 3 rows: token ids of every method against AR on a wide-initialised random Llama (the test
    suite's 12-layer tiny shape). float32: ``passed`` iff every prompt equals AR; bfloat16: agreement
    rate, ``passed`` None (tolerance policy in the module docstring)."""
    from .dex import DEXDecoder, ReferenceExecutor
    from .ead.accounting import uniform_exploration_set
    from .methods import build_method
    from .spec.ar import ar_decode
    from .spec.sampling import DecodeRule
    from .tev.decode import tev_decode
    from .tev.latency import bigram_drafter
    from .tev.verify import VERIFIERS

    L = 12
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=97)
    model = random_llama(shape, device, dtype, seed=0, wide_init=True, max_position_embeddings=128)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 97, (int(torch.randint(3, 12, (), generator=g)),), generator=g).tolist()
               for _ in range(n_prompts)]
    greedy, sampled = DecodeRule(0.0), DecodeRule(1.0, seed=3)
    ar = {r: [ar_decode(model, p, n_new, rule=r).tokens for p in prompts] for r in (greedy, sampled)}
    arms: list[tuple[str, DecodeRule, Callable[[list[int]], list[int]]]] = []
    for K in ((2, 3) if small else (2, 3, 4, 6)):
        X = uniform_exploration_set(L, K)
        for rule in (greedy, sampled):
            arms.append((f"dex_K{K}", rule, lambda p, X=X, rule=rule: DEXDecoder(
                ReferenceExecutor(model, X, rule=rule)).decode(p, n_new).tokens))
    baselines = {"self_spec": dict(exit_layer=L // 2, num_speculations=3),
                 "adadecode": dict(shortcut_layers=[L // 4, L // 2], threshold=0.5, num_speculations=3),
                 "dynamic_exit": dict(exit_layers=[L // 4, L // 2], num_speculations=3)}
    for name, params in baselines.items():
        for rule in (greedy, sampled):
            run = build_method(name, model, rule, params)
            arms.append((name, rule, lambda p, run=run: run(p, n_new, None)["token_ids"]))
    drafter = bigram_drafter(model, block_size=4)
    for name in VERIFIERS:
        arms.append((f"tev_tree/{name}", greedy, lambda p, name=name: tev_decode(
            model, drafter, p, n_new, budget=8, depth=4, verifier=name, temperature=0.0).tokens))
    rows = []
    exact = dtype == torch.float32
    for name, rule, run in arms:
        got = [run(p) for p in prompts]
        want = ar[rule]
        equal = sum(a == b for a, b in zip(got, want))
        prefix = sum(_agreement(a, b) for a, b in zip(got, want)) / len(prompts)
        rows.append(dict(tier=3, check=f"ar_equality/{name}", temperature=rule.temperature,
                         passed=(equal == len(prompts)) if exact else None, prompts=len(prompts),
                         prompts_equal=equal, agreement_rate=equal / len(prompts), mean_matched_prefix=prefix,
                         new_tokens=n_new, policy="exact" if exact else "agreement rate"))
    return rows


def section_exactness(device: torch.device, small: bool) -> list[dict]:
    rows = [dict(r, dtype="float32") for r in tier1(device)]
    rows += [dict(r, dtype="float32") for r in tier2(device, 300 if small else 3000)]
    for dname, dtype in DTYPES.items():
        rows += [dict(r, dtype=dname) for r in tier3(device, dtype, small=small, n_prompts=3 if small else 8,
                                                     n_new=8 if small else 24)]
    return rows


# ---------------------------------------------------------------------------------------- timings
def section_vskipper_bench(device: torch.device, small: bool) -> list[dict]:
    from .vskipper.bench import DEFAULT_GRID, step_benchmark

    dtype = torch.float32 if small else torch.bfloat16
    shapes = ["tiny"] if small else ["smollm2-135m", "llama-1b"]
    cells = ([dict(phase="prefill", tokens=128, prompt_len=32), dict(phase="decode", requests=4, context=16)]
             if small else [dict(phase="prefill", tokens=2048, prompt_len=256),
                            dict(phase="decode", requests=32, context=512),
                            dict(phase="decode", requests=128, context=512)])
    rows = []
    for name in shapes:
        model = random_llama(SHAPES[name], device, dtype, seed=0)
        L = SHAPES[name]["num_hidden_layers"]
        got = step_benchmark(model, cells, routed_layers=list(range(L // 2, L)),
                             grid=[(0.5, 0.5)] if small else list(DEFAULT_GRID), hybrid=False,
                             repeats=2 if small else 5, warmup=1 if small else 2, seed=0, label=name)
        for r in got:
            r.pop("t_steps_s", None)
            rows.append(dict(r, shape=name, dtype=str(dtype).removeprefix("torch."), weights="random (timings only)"))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def section_tev_latency(device: torch.device, small: bool) -> list[dict]:
    from .tev.latency import bigram_drafter, verifier_latency
    from .tev.verify import predraw_follow, sequential_residual, tev

    shape = SHAPES["tiny" if small else "smollm2-135m"]
    model = random_llama(shape, device, torch.float32, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, shape["vocab_size"], (32,), generator=g).tolist() for _ in range(2)]
    verifiers = {"predraw_follow": predraw_follow,
                 "predraw_ddtree_multinomial": lambda *a, **k: predraw_follow(*a, sampler="multinomial", **k),
                 "sequential_residual": sequential_residual, "tev": tev}
    rows = verifier_latency(model, bigram_drafter(model, block_size=8), prompts,
                            budgets=(16,) if small else (64, 128), depth=8, temperature=1.0,
                            n_trees=3 if small else 12, repeats=2 if small else 5, seed=0, verifiers=verifiers,
                            isolated=("predraw_ddtree_multinomial",), rounds_per_prompt=4)
    out = []
    for r in rows:
        r = {k: v for k, v in r.items() if k != "tree_us"}
        out.append(dict(r, vocab_size=shape["vocab_size"], weights="random (timings only)"))
    return out


def section_dex_critical_path(device: torch.device, small: bool) -> list[dict]:
    from .dex import DEXDecoder, ReferenceExecutor
    from .ead.accounting import uniform_exploration_set
    from .spec.ar import ar_decode

    name = "tiny" if small else "llama-1b"
    shape = SHAPES[name]
    dtype = torch.float32 if small else torch.bfloat16
    model = random_llama(shape, device, dtype, seed=0)
    L = shape["num_hidden_layers"]
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, shape["vocab_size"], (64,), generator=g).tolist()
    n_new = 8 if small else 32
    ar_decode(model, prompt, 2)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    ref = ar_decode(model, prompt, n_new).tokens
    _sync(device)
    t_ar = time.perf_counter() - t0
    rows = []
    for K in ((2,) if small else (2, 4, 8)):
        dec = DEXDecoder(ReferenceExecutor(model, uniform_exploration_set(L, K)))
        dec.decode(prompt, 2)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        r = dec.decode(prompt, n_new)
        _sync(device)
        wall = time.perf_counter() - t0
        crit = float(r.critical_path_seconds) + float(r.prefill_seconds)
        rows.append(dict(shape=name, dtype=str(dtype).removeprefix("torch."), K=K, new_tokens=n_new,
                         ar_match=r.tokens == ref, t_ar_s=t_ar, wall_s=wall, prefill_s=float(r.prefill_seconds),
                         critical_path_s=float(r.critical_path_seconds),
                         sequential_s=float(r.sequential_seconds), rounds=len(r.metrics),
                         projected_speedup=t_ar / crit if crit > 0 else float("nan"),
                         note="projected K-device speedup from the slowest explorer per round; one GPU: no NCCL "
                              "ranks, communication not measured; random weights"))
    return rows


#: the sections in run order: name -> function(device, small) -> rows
SECTIONS: dict[str, Callable[[torch.device, bool], list[dict]]] = {
    "exactness": section_exactness,
    "vskipper_bench": section_vskipper_bench,
    "tev_latency": section_tev_latency,
    "dex_critical_path": section_dex_critical_path,
}


# ---------------------------------------------------------------------------------------- driver
def _versions(device: torch.device) -> dict[str, Any]:
    import transformers

    out = dict(torch_version=torch.__version__, transformers_version=transformers.__version__,
               python_version=platform.python_version(), device=str(device), cuda_version=torch.version.cuda)
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
    return out


def run_check(device: torch.device, *, small: bool, sections: Sequence[str] = tuple(SECTIONS),
              log: Callable[[str], None] = print) -> tuple[list[dict], dict[str, dict]]:
    """Run ``sections`` on ``device``; returns (rows, per-section status ``{seconds, rows, error}``).
    A section that raises is recorded with its error (type, message, last frame) and the next one runs."""
    vers = _versions(device)
    rows: list[dict] = []
    status: dict[str, dict] = {}
    for name in sections:
        t0 = time.perf_counter()
        log(f"[gpu-check] {name} ...")
        try:
            got = SECTIONS[name](device, small)
            err = None
        except Exception as e:  # noqa: BLE001 - a failing section is a result, reported with its error
            got = []
            tb = traceback.extract_tb(e.__traceback__)[-1]
            err = f"{type(e).__name__}: {e} (at {Path(tb.filename).name}:{tb.lineno})"
            log(f"[gpu-check] {name} FAILED: {err}")
        secs = time.perf_counter() - t0
        rows += [dict(r, section=name, small=small, **vers) for r in got]
        if err:
            rows.append(dict(section=name, error=err, small=small, **vers))
        status[name] = dict(seconds=round(secs, 1), rows=len(got), error=err)
        log(f"[gpu-check] {name}: {len(got)} rows in {secs:.1f} s")
    return rows, status


def _f(x, spec: str) -> str:
    """``format(x, spec)``, or ``n/a`` for a missing or non-finite value."""
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _summary(rows: list[dict], status: dict[str, dict], device: torch.device, small: bool, total_s: float) -> str:
    vers = _versions(device)
    lines = [f"# GPU check ({'small, ' if small else ''}{vers.get('device_name', vers['device'])})", "",
             f"torch {vers['torch_version']}, transformers {vers['transformers_version']}, CUDA "
             f"{vers['cuda_version']}, Python {vers['python_version']}; {total_s:.0f} s in all.", "",
             "| section | seconds | rows | error |", "|---|---:|---:|---|"]
    lines += [f"| {k} | {v['seconds']} | {v['rows']} | {v['error'] or ''} |" for k, v in status.items()]
    ex = [r for r in rows if r.get("section") == "exactness" and "error" not in r]
    if ex:
        f32 = [r for r in ex if r["dtype"] == "float32"]
        bad = [r["check"] for r in f32 if r["passed"] is False]
        lines += ["", f"**Exactness (float32, exact):** {sum(r['passed'] is True for r in f32)}/{len(f32)} checks "
                      f"pass" + (f"; failing: {', '.join(bad)}" if bad else ".")]
        bf = [r for r in ex if r["dtype"] == "bfloat16"]
        if bf:
            rate = sum(r["agreement_rate"] or 0.0 for r in bf) / len(bf)
            lines.append(f"**bfloat16 (agreement rate, not pass/fail):** mean share of prompts equal to AR "
                         f"{rate:.2f} over {len(bf)} method arms.")
    vb = [r for r in rows if r.get("section") == "vskipper_bench" and "error" not in r]
    if vb:
        lines += ["", "**vSkipper per step (random weights):** measured / FLOP-predicted ratio vs upstream", "",
                  "| shape | cell | arm | measured | predicted |", "|---|---|---|---:|---:|"]
        lines += [f"| {r['shape']} | {r['cell']} | {r['arm']} | {_f(r['measured_ratio'], '.3f')} | "
                  f"{_f(r['flop_pred_ratio'], '.3f')} |" for r in vb if r["arm"] in ("all_run", "random_r0.5_d0.5")]
    tl = [r for r in rows if r.get("section") == "tev_latency" and "error" not in r]
    if tl:
        lines += ["", "**TEV verifier latency:** median per tree, ratio to predraw", "",
                  "| B | verifier | median us | ratio |", "|---:|---|---:|---:|"]
        lines += [f"| {r['budget']} | {r['verifier']} | {_f(r['median_us'], '.0f')} | {_f(r['ratio_median'], '.2f')} |" for r in tl]
    dx = [r for r in rows if r.get("section") == "dex_critical_path" and "error" not in r]
    if dx:
        lines += ["", "**DEX critical path (projected K-device speedup, random weights):**", "",
                  "| shape | K | AR match | t_AR s | prefill + critical s | projected |", "|---|---:|---|---:|---:|---:|"]
        lines += [f"| {r['shape']} | {r['K']} | {r['ar_match']} | {_f(r['t_ar_s'], '.3f')} | "
                  f"{_f(r['prefill_s'] + r['critical_path_s'], '.3f')} | {_f(r['projected_speedup'], '.2f')} |" for r in dx]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m impl.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for rows.jsonl and summary.md")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU, seconds): what CI runs")
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available here")
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows, status = run_check(device, small=args.small, sections=args.sections,
                             log=lambda s: print(s, file=sys.stderr, flush=True))
    total = time.perf_counter() - t0
    (out / "rows.jsonl").write_text("".join(strict_json(r) + "\n" for r in rows))
    (out / "summary.md").write_text(_summary(rows, status, device, args.small, total))
    print(f"[gpu-check] {len(rows)} rows -> {out}/rows.jsonl, {out}/summary.md ({total:.0f} s)", file=sys.stderr)
    failed = [r for r in rows if r.get("section") == "exactness" and r.get("passed") is False]
    return 1 if failed or any(s["error"] for s in status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
