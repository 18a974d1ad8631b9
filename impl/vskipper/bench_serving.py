"""SGLang's own serving benchmark (``python -m sglang.bench_serving``) against one served engine arm.

The vSkipper paper measures its arms with SGLang's ``bench_serving`` (Sec. 4.1): streaming
``/v1/completions`` requests with ``ignore_eos``, TTFT, TPOT and ITL per request. This module runs that
client, unmodified, from the Python environment that has SGLang installed (``scripts/setup_sglang.sh``
makes ``.venv-sglang``; SGLang pins its own torch, so it cannot share the project's environment), as a
subprocess against an arm served by :func:`impl.vskipper.server.serve`, and turns its result line into
a PASS / FAIL verdict:

- the client runs ``--backend vllm`` (the OpenAI completions client the paper uses) with streaming on,
  ``--dataset-name sharegpt`` over the offline ShareGPT subset (``<data_dir>/chat/sharegpt_v3_subset.jsonl``,
  converted to the JSON list the client reads; its first human turn is the prompt, with the model's
  chat template applied by the client when the model's tokenizer has one) or over a frozen workload suite
  written in that format (:func:`workload_prompts`: the knee's own prompts), a fixed output length, a
  maximum context (prompt + output, in tokens) and a concurrency cap or a Poisson rate;
- PASS when the client's result line says every request completed (``completed == num_prompts``,
  every per-request ``errors`` entry empty), produced exactly ``num_prompts * output_len`` tokens
  (``ignore_eos``), the engine served them without a failure, and TTFT / TPOT / ITL are finite.

The result columns are the client's own: mean and median TTFT, TPOT and ITL in milliseconds, output
throughput in tokens per second, the benchmark's duration in seconds. Timings are those of whatever
machine ran them; they are reported, not compared here (the knee and matched-work protocol compare arms).

Offline: the client is started with ``HF_HUB_OFFLINE=1`` and the model directory as ``--model`` and
``--tokenizer``, so it never reaches the Hub; ``--served-model-name`` is the name the arm serves.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["SHAREGPT_FILE", "RESULT_KEYS", "bench_serving", "sharegpt_json", "sharegpt_prompts", "sglang_python_ok",
           "workload_prompts"]

#: the offline ShareGPT subset, relative to the data folder (../shared/data/SOURCES.md)
SHAREGPT_FILE = "chat/sharegpt_v3_subset.jsonl"
#: the client's result keys copied into the row, with the row's column names
RESULT_KEYS = {"mean_ttft_ms": "ttft_ms", "median_ttft_ms": "ttft_ms_median", "mean_tpot_ms": "tpot_ms",
               "median_tpot_ms": "tpot_ms_median", "mean_itl_ms": "itl_ms", "output_throughput": "output_tok_s",
               "duration": "bench_s"}


def sglang_python_ok(python: str | os.PathLike, timeout_s: float = 300.0) -> str | None:
    """None when ``python -m sglang.bench_serving --help`` runs in that interpreter, else why not (one line).

    Args:
        python: path of a Python interpreter with SGLang installed.
        timeout_s: seconds the import may take (SGLang imports torch; tens of seconds on 2 cores).
    """
    p = Path(python)
    if not p.is_file():
        return f"no Python at {p} (scripts/setup_sglang.sh creates .venv-sglang/bin/python)"
    try:
        r = subprocess.run([str(p), "-m", "sglang.bench_serving", "--help"], capture_output=True, text=True,
                           timeout=timeout_s, env=_client_env())
    except subprocess.TimeoutExpired:
        return f"{p} -m sglang.bench_serving --help did not finish in {timeout_s:.0f} s"
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return f"{p} -m sglang.bench_serving --help failed (rc {r.returncode}): {tail[0][:200]}"
    return None


def sharegpt_json(data_dir: str | os.PathLike, out: str | os.PathLike, max_records: int = 400) -> Path:
    """Write the first ``max_records`` conversations of the offline ShareGPT subset as the JSON list that
    ``bench_serving --dataset-name sharegpt`` reads (records verbatim: ``id``, ``conversations``).

    Raises:
        FileNotFoundError: when ``<data_dir>/chat/sharegpt_v3_subset.jsonl`` is missing.
    """
    src = Path(data_dir) / SHAREGPT_FILE
    if not src.is_file():
        raise FileNotFoundError(f"no ShareGPT subset at {src} (data_dir/{SHAREGPT_FILE})")
    records = []
    with open(src, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                records.append(json.loads(line))
            if len(records) >= max_records:
                break
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records), encoding="utf-8")
    return out


def _kept_conversations(records: Iterable[dict], tokenizer, n: int, output_len: int, context_len: int,
                        chat_template: bool) -> tuple[list[dict], list[dict[str, Any]]]:
    """The first ``n`` conversations of ``records`` that ``bench_serving`` keeps (SGLang 0.5.23's
    ``sample_sharegpt_requests`` rule: two turns or more; the first turn, wrapped in the chat template with
    the BOS text removed when ``chat_template``; ``2 <= prompt_len`` and ``prompt_len + output_len <=
    context_len`` with ``tokenizer.encode``), and one row per kept one: ``id``, ``prompt`` (the text the
    client sends), ``input_ids`` (``tokenizer(prompt)``: the ids the server makes of that text)."""
    kept, rows = [], []
    for rec in records:
        if len(kept) == n:
            break
        turns = rec.get("conversations", rec.get("conversation", []))
        if len(turns) < 2:
            continue
        prompt = turns[0]["value"]
        if chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True, tokenize=False)
            if tokenizer.bos_token:
                prompt = prompt.replace(tokenizer.bos_token, "")
        n_tok = len(tokenizer.encode(prompt))
        if n_tok < 2 or n_tok + int(output_len) > int(context_len):
            continue
        kept.append(rec)
        rows.append({"id": rec.get("id", f"sharegpt-{len(rows)}"), "prompt": prompt,
                     "input_ids": list(tokenizer(prompt)["input_ids"])})
    return kept, rows


def _write_kept(kept: list[dict], rows: list[dict], n: int, output_len: int, context_len: int, what: str,
                out: str | os.PathLike) -> list[dict[str, Any]]:
    if len(kept) < n:
        raise ValueError(f"only {len(kept)} {what} fit context_len {context_len} with "
                         f"output_len {output_len}; bench_serving needs num_prompts = {n}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(kept), encoding="utf-8")
    return rows


def sharegpt_prompts(data_dir: str | os.PathLike, tokenizer, n: int, output_len: int, context_len: int,
                     chat_template: bool, out: str | os.PathLike) -> list[dict[str, Any]]:
    """The first ``n`` ShareGPT conversations that ``bench_serving`` keeps (SGLang 0.5.23's
    ``sample_sharegpt_requests`` rule: two turns or more; the first turn, wrapped in the chat template
    with the BOS text removed when ``chat_template``; ``2 <= prompt_len`` and ``prompt_len +
    output_len <= context_len`` with ``tokenizer.encode``), written verbatim to ``out`` as the JSON
    list the client reads. The client then sends exactly these ``n`` prompts (it shuffles them), so
    another client given the returned rows sends the same ones.

    Returns:
        one dict per kept conversation: ``id``, ``prompt`` (the text the client sends) and
        ``input_ids`` (``tokenizer(prompt)``: the ids the server makes of that text).

    Raises:
        FileNotFoundError: no ShareGPT subset under ``data_dir``.
        ValueError: fewer than ``n`` conversations fit ``context_len``.
    """
    src = Path(data_dir) / SHAREGPT_FILE
    if not src.is_file():
        raise FileNotFoundError(f"no ShareGPT subset at {src} (data_dir/{SHAREGPT_FILE})")
    with open(src, encoding="utf-8") as f:
        kept, rows = _kept_conversations((json.loads(line) for line in f if line.strip()), tokenizer, n,
                                         output_len, context_len, chat_template)
    return _write_kept(kept, rows, n, output_len, context_len, "ShareGPT conversations", out)


def workload_prompts(suite_rows: Sequence[Mapping[str, Any]], tokenizer, n: int, output_len: int, context_len: int,
                     out: str | os.PathLike) -> tuple[list[dict[str, Any]], bool]:
    """A frozen workload suite (the rows of ``results/workloads/<model>/<suite>.jsonl``: ``id``, ``text``,
    ``format``) as the ShareGPT JSON list ``bench_serving --dataset-name sharegpt`` reads, so SGLang's
    client sends the prompts the knee and the cells were measured on: one two-turn conversation per row
    (the human turn is the row's ``text``, the reply empty: the output length is fixed), the first ``n`` the
    client keeps (:func:`sharegpt_prompts`' rule). Rows of ``format: chat`` are sent through the chat
    template (``--apply-chat-template``), ``plain`` rows as they are; one suite has one format.

    Returns:
        ``(rows, chat_template)``: the kept prompts as :func:`sharegpt_prompts` returns them, and whether the
        client must apply the chat template.

    Raises:
        ValueError: rows without ``text``, mixed formats, or fewer than ``n`` prompts fit ``context_len``.
    """
    formats = {r.get("format", "plain") for r in suite_rows}
    if len(formats) != 1 or not formats <= {"plain", "chat"}:
        raise ValueError(f"bench_serving prompts: one format per suite (plain or chat), got {sorted(map(str, formats))}")
    missing = [r.get("id") for r in suite_rows if not isinstance(r.get("text"), str) or not r["text"]]
    if missing:
        raise ValueError(f"bench_serving prompts: rows {missing[:3]} have no text (the client sends text)")
    chat = formats == {"chat"}
    records = [{"id": r["id"], "conversations": [{"from": "human", "value": r["text"]}, {"from": "gpt", "value": ""}]}
               for r in suite_rows]
    kept, rows = _kept_conversations(records, tokenizer, n, output_len, context_len, chat)
    return _write_kept(kept, rows, n, output_len, context_len, "workload prompts", out), chat


def _client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def bench_serving(server, model_dir: str | os.PathLike, python: str | os.PathLike, dataset: str | os.PathLike,
                  work: str | os.PathLike, *, num_prompts: int = 8, output_len: int = 32, context_len: int = 512,
                  max_concurrency: int | None = 4, request_rate: float = math.inf, seed: int = 1234,
                  chat_template: bool = False, timeout_s: float = 1800.0,
                  prompts_label: str = "ShareGPT prompts") -> dict[str, Any]:
    """Run SGLang's ``bench_serving`` (streaming, ``--backend vllm``) against a served arm and judge it.

    Args:
        server: the running server of :func:`impl.vskipper.server.serve` (``url``, ``engine``).
        model_dir: the served model's directory (the client's tokenizer).
        python: the interpreter with SGLang installed.
        dataset: the ShareGPT JSON list (:func:`sharegpt_json`).
        work: a folder for the client's result file.
        num_prompts: requests measured (after one warm-up request).
        output_len: tokens per request (EOS ignored).
        context_len: longest prompt + output the client keeps [tokens].
        max_concurrency: requests the client keeps in flight (None: no cap, open loop).
        request_rate: Poisson arrival rate [requests/s]; ``inf`` sends them all at once.
        seed: the client's sampling seed of the dataset.
        chat_template: wrap each prompt in the model's chat template (``--apply-chat-template``; pass
            whether the model's tokenizer has one).
        timeout_s: wall-clock limit of the client [s].
        prompts_label: what ``dataset`` holds, for the detail sentence (:func:`workload_prompts` writes a
            workload suite in the same format).

    Returns:
        ``ok``, ``detail`` and the row's columns: ``requests``, ``max_tokens``, ``tokens_exact``,
        ``served_requests`` and the timing columns of :data:`RESULT_KEYS` (ms, tokens/s, s); and
        ``per_request``: the client's own per-request ``ttft_s``, ``tpot_s`` (inter-token gaps summed
        over ``output_len - 1``) and ``e2e_s`` (TTFT plus the gaps) [s], None without a result line.
    """
    eng = server.engine
    out = Path(work) / f"bench_serving_{eng.arm}_{int(time.time() * 1000)}.jsonl"
    before = int(eng.counters["requests"])
    failed_before = int(eng.counters["failed"])
    cmd = [str(python), "-m", "sglang.bench_serving", "--backend", "vllm", "--base-url", server.url,
           "--model", str(model_dir), "--served-model-name", eng.served_model_name, "--tokenizer", str(model_dir),
           "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
           "--num-prompts", str(int(num_prompts)), "--sharegpt-output-len", str(int(output_len)),
           "--sharegpt-context-len", str(int(context_len)),
           *(["--max-concurrency", str(int(max_concurrency))] if max_concurrency else []), "--request-rate", "inf" if math.isinf(request_rate) else str(float(request_rate)),
           "--seed", str(int(seed)), "--warmup-requests", "1", "--output-file", str(out), "--output-details",
           "--disable-tqdm", "--ready-check-timeout-sec", "30"]
    templated = bool(chat_template)
    if templated:
        cmd.append("--apply-chat-template")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_client_env())
    except subprocess.TimeoutExpired:
        return dict(ok=False, detail=f"bench_serving did not finish in {timeout_s:.0f} s", requests=int(num_prompts))
    res = None
    if out.is_file():
        lines = [ln for ln in out.read_text(encoding="utf-8").splitlines() if ln.strip()]
        res = json.loads(lines[-1]) if lines else None
    if r.returncode != 0 or res is None:
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])[:400]
        return dict(ok=False, detail=f"bench_serving exited {r.returncode} without a result line: {tail}",
                    requests=int(num_prompts))
    errors = [e for e in (res.get("errors") or []) if e]
    completed = int(res.get("completed") or 0)
    total_out = int(res.get("total_output_tokens") or 0)
    cols = {col: res.get(key) for key, col in RESULT_KEYS.items()}
    finite = all(isinstance(cols[c], (int, float)) and math.isfinite(cols[c])
                 for c in ("ttft_ms", "tpot_ms", "itl_ms"))
    served = int(eng.counters["requests"]) - before
    failed = int(eng.counters["failed"]) - failed_before
    want_tokens = int(num_prompts) * int(output_len)
    ok = completed == int(num_prompts) and not errors and total_out == want_tokens and finite and failed == 0
    detail = (f"sglang.bench_serving --backend vllm, streaming {prompts_label}"
              f"{' (chat template)' if templated else ''}, "
              f"{f'concurrency {int(max_concurrency)}' if max_concurrency else 'open loop'}"
              f"{'' if math.isinf(request_rate) else f' at {request_rate:g} req/s'}: {completed}/{int(num_prompts)} completed, {total_out}/{want_tokens} tokens, "
              f"mean TTFT {_ms(cols['ttft_ms'])}, mean TPOT {_ms(cols['tpot_ms'])}, {served} requests served "
              f"(1 warm-up)")
    if not ok:
        why = [f"{len(errors)} request errors: {errors[0][:160]!r}"] if errors else []
        why += [f"{failed} engine failures"] if failed else []
        why += ["a timing is not finite"] if not finite else []
        detail += "; " + ("; ".join(why) or "counts differ")
    return dict(ok=ok, detail=detail, requests=int(num_prompts), max_tokens=int(output_len),
                tokens_exact=total_out == want_tokens, served_requests=served, per_request=_per_request(res),
                **{c: (round(float(v), 3) if isinstance(v, (int, float)) else None) for c, v in cols.items()})


def _per_request(res: dict) -> dict[str, list[float]] | None:
    """Per-request TTFT, TPOT and E2E [s] from the client's ``--output-details`` lists."""
    ttfts, itls, outs = res.get("ttfts"), res.get("itls"), res.get("output_lens")
    if not (isinstance(ttfts, list) and isinstance(itls, list) and isinstance(outs, list)):
        return None
    per = {"ttft_s": [], "tpot_s": [], "e2e_s": []}
    for t, gaps, n in zip(ttfts, itls, outs):
        if not isinstance(t, (int, float)) or not t > 0 or not isinstance(gaps, list):
            continue
        per["ttft_s"].append(float(t))
        per["e2e_s"].append(float(t) + float(sum(gaps)))
        if n and n >= 2:
            per["tpot_s"].append(float(sum(gaps)) / (int(n) - 1))
    return per


def _ms(v: Any) -> str:
    return f"{float(v):.1f} ms" if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"
