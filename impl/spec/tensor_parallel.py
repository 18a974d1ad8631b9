"""Tensor parallelism: the distributed reference arm of DEX Fig. 5 (harness issue 18, item 5).

Every rank holds a shard of every decoder layer (transformers' own plan for the architecture,
``config.base_model_tp_plan``: q / k / v and the MLP's gate / up projections split by output columns,
o and down projections by input rows, one all-reduce after each of the two; transformers 5.24 also
splits the embedding by vocabulary rows (summed across ranks) and the LM head by vocabulary (its logits
gathered); the norms are replicated), and all ranks run the same greedy ``generate`` on the same ids:
every rank holds the same gathered logits, so the ranks agree token for token. Rank 0 times each
prompt (after a barrier) and checks the ids against AR on an unsharded copy of the model. The sharding
is loaded by ``from_pretrained(distributed_config=DistributedConfig(tp_size=K))`` (transformers 5.24),
gloo on CPU, NCCL on CUDA.

A K-way split needs K to divide the attention heads, the key-value heads and the MLP width
(SmolLM2-135M: 9 / 3 heads, so K = 3, not 2); the command refuses other K with one line.

Timing: ``seconds`` is rank 0's wall time of ``generate`` with every all-reduce in it: on one machine
the K ranks share its cores, so this is the measured time of K processes on those cores, not a
K-device projection (the report says which). ``ar_seconds`` is AR's wall time on the same prompt on
rank 0 (one unsharded model, ``--threads`` threads) in the same run, while the other ranks wait at the
next barrier; ``speedup_vs_ar`` their ratio.

Command line (rank 0 writes one JSONL row per prompt)::

    torchrun --nproc-per-node K -m impl.spec.tensor_parallel --model DIR --prompts FILE.jsonl \\
        --out OUT.jsonl --max-new-tokens N [--ignore-eos --threads 1 --warmup-prompts 1]

Source: Shoeybi et al., "Megatron-LM" (2019), Sec. 3 (column / row splits of the MLP and attention);
transformers 5.24 ``DistributedConfig`` and ``base_model_tp_plan``; DEX Sec. 5 (TP as the distributed
baseline of Fig. 5).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from ..argtypes import ArgumentParser
from ..models.load import load_model
from ..provenance import provenance, write_jsonl
from ..torchrun import Ranks, add_run_args, fail, init_process_group, select_device, usable_prompts
from ..workloads.prompts import read_prompts
from .ar import ar_decode
from .hf_generate import greedy_generate
from .self_spec import _check_decode_args

__all__ = ["tp_split_problem", "main"]


def tp_split_problem(config: dict, world_size: int) -> str | None:
    """Why a ``world_size``-way tensor-parallel split of a model with this ``config.json`` cannot work
    (one sentence), or None when it can: K must divide the attention heads, the key-value heads and
    the MLP width."""
    heads = int(config.get("num_attention_heads", 0))
    kv = int(config.get("num_key_value_heads") or heads)
    mlp = int(config.get("intermediate_size", 0))
    if world_size < 2:
        return f"tensor parallelism needs at least 2 ranks, got {world_size}"
    bad = [f"{name} = {v}" for name, v in (("num_attention_heads", heads), ("num_key_value_heads", kv),
                                           ("intermediate_size", mlp)) if v % world_size]
    if bad:
        ok = [k for k in range(2, heads + 1) if heads % k == 0 and kv % k == 0 and mlp % k == 0]
        return (f"a {world_size}-way split needs {world_size} to divide {', '.join(bad)}; "
                f"this model splits over {ok or 'no'} ranks")
    return None


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="torchrun --nproc-per-node K -m impl.spec.tensor_parallel",
                        description="greedy decoding with transformers' tensor-parallel plan over K ranks; rank 0 "
                                    "writes one JSONL row per prompt, checked against AR.")
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    add_run_args(ap)
    ap.add_argument("--variant", default=None, help="the model's name in the rows (default: the model directory's name)")
    ap.add_argument("--no-ar-check", action="store_true", help="skip the AR check on rank 0")
    return ap


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``torchrun --nproc-per-node K -m impl.spec.tensor_parallel`` (module docstring).

    Every rank checks the arguments and the split before the process group starts and exits with
    status 2 and a one-line error (a missing file, a K that does not divide the heads).
    """
    args = _parser().parse_args(argv)
    ranks = Ranks.from_env()
    rank, world = ranks.rank, ranks.world
    try:  # before anything else asks CUDA: transformers picks the mesh device from the accelerator
        device = select_device(args.device, ranks)
    except ValueError as e:
        fail(rank, str(e))
    cfg_path = Path(args.model) / "config.json"
    if not cfg_path.is_file():
        fail(rank, f"model directory not found or incomplete (no config.json): {args.model}")
    if not Path(args.prompts).is_file():
        fail(rank, f"no such prompt file: {args.prompts}")
    why = tp_split_problem(json.loads(cfg_path.read_text()), world)
    if why:
        fail(rank, why + " (torchrun --nproc-per-node K)")
    try:
        prompts = read_prompts(args.prompts)
    except ValueError as e:
        fail(rank, str(e))
    prompts = prompts[: args.n_prompts] if args.n_prompts else prompts
    torch.set_num_threads(args.threads)
    backend = init_process_group(device, args.timeout_s)
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=DistributedConfig(tp_size=world),
                                                     dtype=torch.float32, local_files_only=True).eval()
        plain = load_model(args.model) if rank == 0 and not args.no_ar_check else None
        eos = None if args.ignore_eos else model.config.eos_token_id
        rows = _decode_all(model, plain, prompts, args, eos, rank, world, backend)
        if rank == 0:
            prov = provenance({"method": "tensor_parallel", "world_size": world, "max_new_tokens": args.max_new_tokens},
                              device=str(device), dtype="float32")
            for r in rows:
                r.update(variant=args.variant or Path(args.model).name, model_dir=str(args.model), batch_size=1, **prov)
            write_jsonl(args.out, rows)
            bad = [r["prompt_id"] for r in rows if r.get("ar_match") is False]
            errors = sum("error" in r for r in rows)
            verdict = ("AR not checked (--no-ar-check)" if args.no_ar_check
                       else f"{len(bad)} differ from AR" + (f" ({bad})" if bad else ""))
            print(f"{args.out}: {len(rows)} rows ({errors} error rows), {verdict}", file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()


@torch.inference_mode()
def _decode_all(model, plain, prompts: list[dict], args, eos, rank: int, world: int, backend: str) -> list[dict]:
    """Every rank decodes every prompt (warm-up first, unrecorded); rank 0 returns the rows."""
    shape = SimpleNamespace(config=model.config)  # vocabulary and context: the same on every rank

    def checked(p: dict) -> list[int]:
        return _check_decode_args(shape, list(p.get("input_ids") or []), args.max_new_tokens,
                                  eos if isinstance(eos, int) else None)

    for ids in usable_prompts(prompts, checked)[: args.warmup_prompts]:
        greedy_generate(model, ids, args.max_new_tokens, eos)
    rows = []
    for p in prompts:
        base = {"prompt_id": p.get("id"), "suite": p.get("suite"), "method": "tensor_parallel",
                "executor": "distributed", "backend": backend, "world_size": world,
                "max_new_tokens": args.max_new_tokens, "temperature": 0.0}
        try:  # empty, out of the vocabulary, past the context: an error row on every rank, the rest still run
            ids = checked(p)
        except ValueError as e:
            rows.append({**base, "error": str(e)})
            continue
        dist.barrier()
        t0 = time.perf_counter()
        tokens, stopped, _ = greedy_generate(model, ids, args.max_new_tokens, eos)
        secs = time.perf_counter() - t0
        row = {**base, "n_prompt_tokens": len(ids), "token_ids": tokens, "n_new_tokens": len(tokens),
               "stopped_at_eos": stopped, "seconds": secs, "ar_match": None}
        if plain is not None:  # the other ranks wait at the next barrier meanwhile
            ta = time.perf_counter()
            ar = ar_decode(plain, ids, args.max_new_tokens, eos_token_id=eos).tokens
            row.update(ar_match=tokens == ar, ar_seconds=time.perf_counter() - ta)
            row["speedup_vs_ar"] = row["ar_seconds"] / secs if secs > 0 else None
        rows.append(row)
    return rows if rank == 0 else []


if __name__ == "__main__":
    main()
