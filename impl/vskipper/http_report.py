"""REPORT.md section "engine arms over HTTP" from the rows of ``python -m impl vskipper-http-check``
(:mod:`impl.vskipper.http_check`): per model, arm and skipper, the verdict of each check (OpenAI-style
client with ``ignore_eos`` + streaming, greedy ids vs in process, lm-eval ``local-completions``,
endpoints), the routed share, the realised Project-Only share and lm-eval's GSM8K value; failing
rows are listed with their detail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

__all__ = ["load_rows", "verdict_table", "bench_serving_table", "clients_table", "report_section"]

_CHECK_TITLES = {"client_stream": "OpenAI client (ignore_eos, stream)", "greedy_ids": "greedy ids = in-process",
                 "openai_sdk": "OpenAI SDK (completions, stream + usage, chat)",
                 "lm_eval": "lm-eval local-completions", "endpoints": "health / models / 4xx",
                 "bench_serving": "SGLang bench_serving"}
#: ``bench_serving`` timing columns of the rows -> table titles
_BENCH_COLUMNS = {"ttft_ms": "TTFT mean [ms]", "ttft_ms_median": "TTFT median [ms]", "tpot_ms": "TPOT mean [ms]",
                  "tpot_ms_median": "TPOT median [ms]", "itl_ms": "ITL mean [ms]", "output_tok_s": "output [tok/s]",
                  "bench_s": "duration [s]"}


def _short(spec) -> str:
    s = "" if spec is None or (isinstance(spec, float) and pd.isna(spec)) else str(spec)
    if not s:
        return "-"
    if s.startswith("flexidepth:"):
        return f"FlexiDepth ({Path(s.split(':', 1)[1]).name})"
    if s.startswith("randomskip:"):
        kv = dict(x.split("=", 1) for x in s.split(":", 1)[1].split(",") if "=" in x)
        return f"RandomSkip r={kv.get('r')} d={kv.get('d')}"
    return s


def load_rows(rows_dir: str | os.PathLike) -> pd.DataFrame:
    """Every ``*.csv`` of ``vskipper-http-check`` in ``rows_dir`` as one frame (empty when none)."""
    files = sorted(Path(rows_dir).glob("*.csv"))
    frames = [pd.read_csv(f, keep_default_na=False, na_values=[""]) for f in files if f.stat().st_size > 1]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def verdict_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (model, arm, skipper): each check's verdict, the routed and Project-Only shares
    (after the greedy-ids check), lm-eval's metric value and the requests it served. A check no row ran
    gets no column."""
    out = []
    titles = {c: t for c, t in _CHECK_TITLES.items() if (rows["check"] == c).any()}
    for (model, arm, sk), g in rows.groupby(["model", "arm", "skipper"], sort=False, dropna=False):
        line = {"model": model, "arm": arm, "skipper": _short(sk)}
        by = {r["check"]: r for _, r in g.iterrows()}
        for c, title in titles.items():
            line[title] = by[c]["verdict"] if c in by else "-"
        ref = by.get("greedy_ids", g.iloc[0])
        line["routed share"] = ref.get("routed_share")
        line["Project-Only share"] = ref.get("skip_share")
        lm = by.get("lm_eval")
        line["GSM8K EM (lm-eval)"] = None if lm is None else lm.get("metric_value")
        line["lm-eval requests"] = None if lm is None else lm.get("served_requests")
        out.append(line)
    df = pd.DataFrame(out)
    for c in ("routed share", "Project-Only share", "GSM8K EM (lm-eval)"):
        df[c] = [_num(v, "{:.3f}") for v in df[c]]
    df["lm-eval requests"] = [_num(v, "{:.0f}") for v in df["lm-eval requests"]]
    return df


def bench_serving_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per ``bench_serving`` row (model, arm, skipper): the verdict, requests completed and
    SGLang's TTFT / TPOT / ITL [ms], output throughput [tokens/s] and duration [s]; empty when none ran."""
    b = rows[rows["check"] == "bench_serving"]
    if not len(b):
        return pd.DataFrame()
    df = pd.DataFrame({"model": b["model"], "arm": b["arm"], "skipper": [_short(s) for s in b["skipper"]],
                       "verdict": b["verdict"], "requests": [_num(v, "{:.0f}") for v in b["requests"]]})
    for col, title in _BENCH_COLUMNS.items():
        df[title] = [_num(v, "{:.1f}") for v in (b[col] if col in b else [None] * len(b))]
    return df.reset_index(drop=True)


def clients_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per ``bench_serving`` row where the project's load generator was compared with SGLang's
    client on the same prompts at the same rate: both clients' mean E2E / TTFT / TPOT [ms] and whether
    they agree (every Welch 95% interval of the difference contains 0); empty when none was compared."""
    if "clients_agree" not in rows:
        return pd.DataFrame()
    b = rows[(rows["check"] == "bench_serving") & rows["clients_agree"].notna()]
    if not len(b):
        return pd.DataFrame()
    df = pd.DataFrame({"model": b["model"], "arm": b["arm"], "skipper": [_short(s) for s in b["skipper"]]})
    for m in ("e2e", "ttft", "tpot"):
        df[f"{m.upper()} bench_serving [ms]"] = [_num(v, "{:.1f}") for v in b[f"bench_{m}_ms"]]
        df[f"{m.upper()} load generator [ms]"] = [_num(v, "{:.1f}") for v in b[f"loadgen_{m}_ms"]]
    df["clients agree"] = ["yes" if str(v).lower() in ("true", "1", "1.0") else "NO" for v in b["clients_agree"]]
    return df.reset_index(drop=True)


def _num(v, fmt: str) -> str:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return "-"
    return "-" if pd.isna(x) else fmt.format(x)


def report_section(tables_dir, figures_dir, base) -> list[str]:
    """Markdown lines of the "engine arms over HTTP" section of REPORT.md; ``tables_dir`` is the
    folder of the per-model CSV rows and summary JSONs (``results/vskipper/http``)."""
    td, base = Path(tables_dir), Path(base)
    rel = lambda p: os.path.relpath(p, base).replace(os.sep, "/")  # noqa: E731
    rows = load_rows(td)
    lines = ["## vSkipper: engine arms over HTTP", "",
             "Each arm (upstream, hybrid, always-route) of each tiny model is served in-process behind the "
             "OpenAI-compatible server (impl/vskipper/server.py) and checked against real clients "
             "(impl/vskipper/http_check.py): the load generator's client (HTTPCompletionsArm) with `ignore_eos` and "
             "streaming on workload prompts (exactly `max_tokens` tokens, text equal to in-process), the streamed "
             "token ids against `generate_greedy` of the same arm in process, lm-eval `local-completions` on the "
             "offline GSM8K task, and /health, /v1/models and malformed requests (4xx, still serving). "
             "The hybrid arm's switch is set to route at this load (no prefill minimum, decode routed from one "
             "request); routed share = rows run in routed mode, Project-Only share = realised skip share of the "
             "routed layers (cumulative per server). The tiny models' GSM8K values are near zero by construction: "
             "the row shows the client completed, not quality.", ""]
    if not len(rows):
        return lines + ["(no rows)", ""]
    n_pass = int((rows["verdict"] == "PASS").sum())
    for model, g in rows.groupby("model", sort=False):
        ok = int((g["verdict"] == "PASS").sum())
        wall = None
        sj = td / f"{model}.json"
        if sj.is_file():
            try:
                wall = json.loads(sj.read_text(encoding="utf-8")).get("wall_s")
            except (OSError, ValueError):
                wall = None
        lines.append(f"- **{model}**: {ok}/{len(g)} checks PASS over {g['arm'].nunique()} arms"
                     + (f" ({wall:.0f} s)" if isinstance(wall, (int, float)) else ""))
    lines += ["", f"All checks: **{'PASS' if n_pass == len(rows) else 'FAIL'}** ({n_pass}/{len(rows)}).", ""]
    lines += ["### Engine arms over HTTP: verdicts", "",
              verdict_table(rows).to_markdown(index=False, disable_numparse=True), ""]
    bench = bench_serving_table(rows)
    if len(bench):
        lines += ["### SGLang bench_serving against every arm", "",
                  "SGLang's own benchmark client, unmodified (`python -m sglang.bench_serving --backend vllm`, from "
                  "the SGLang environment of scripts/setup_sglang.sh; impl/vskipper/bench_serving.py), streaming "
                  "`ignore_eos` requests of the offline ShareGPT subset with the model's chat template, one warm-up "
                  "request; PASS = every request completed with its full output and finite TTFT / TPOT. Timings are "
                  "this machine's, arms served one after another, not a paired comparison.", "",
                  bench.to_markdown(index=False, disable_numparse=True), ""]
    agree = clients_table(rows)
    if len(agree):
        n_ok = int((agree["clients agree"] == "yes").sum())
        lines += ["### SGLang's client and the project's load generator on the same arm", "",
                  "At a Poisson rate with no concurrency cap (`vskipper.http.bench_serving.request_rate`, "
                  "`max_concurrency: null`), right after `bench_serving` the project's load generator "
                  "(impl/serving/loadgen.py, token-id OpenAI client) replays the same prompts (the ids the server "
                  "made of the text `bench_serving` sent) at the same rate against the same server. Means over "
                  "requests; agree = the Welch 95% interval of each difference contains 0. Different request ids "
                  "give RandomSkip other routes, and the two schedules are independent draws of the same process.", "",
                  f"The clients agree on **{n_ok}/{len(agree)}** arms.", "",
                  agree.to_markdown(index=False, disable_numparse=True), ""]
    bad = rows[rows["verdict"] != "PASS"]
    if len(bad):
        lines += ["### Failing checks", "",
                  bad[["model", "arm", "skipper", "check", "detail"]].to_markdown(index=False), ""]
    lines += ["Rows: " + ", ".join(f"[{p.stem}]({rel(p)})" for p in sorted(td.glob("*.csv"))), ""]
    return lines
