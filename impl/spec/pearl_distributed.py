"""PEARL on two torch.distributed ranks: the target on rank 0, the draft model on rank 1, drafting and
verification running at the same time (DEX Sec. 5, Fig. 5; harness issue 18, item 2).

The single-process executor (:mod:`impl.spec.pearl`) runs both models one after the other and projects
the two-device time; here each model has a process of its own and the overlap is real. Each round is
one phase on both ranks followed by one exchange (``all_gather`` of a small int64 message per rank:
its tokens and its compute microseconds), after which both ranks take the same decision from the same
tokens, so no further message is needed:

* **Pre-verify** (no pending block): rank 0 runs the root and decides ``y_1``; at the same time rank 1
  drafts ``d_1..d_m`` (``m = min(gamma, tokens left)``, stopping after an EOS draft) without waiting
  for the verdict, as in the paper's drafting phase. If ``d_1 != y_1``, ``y_1`` is committed and the
  draft crops what it drafted; otherwise ``d_1..d_m`` is the pending block, ``d_1`` accepted.
* **Post-verify** (a pending block): rank 0 verifies the block in one forward while rank 1 drafts
  ``e_1..e_k`` after its last token; :func:`impl.spec.pearl.post_verify` decides (the same function
  as the single-process executor), both ranks crop their caches the same way.

Every committed token is the target's decode (greedy, or Gumbel-max keyed by (seed, position)), so the
output equals AR's; the round kinds and committed counts equal the single-process executor's (rank 0
checks both). Pre-verify here drafts ``m`` tokens even when ``d_1`` is then rejected (the paper's
schedule); the single-process executor's projection assumes the draft stops after ``d_1``.

Timing (rank 0, per round): ``target_seconds`` / ``draft_seconds`` are each rank's compute,
``wall_seconds`` rank 0's wall time of the round (compute, exchange and waiting for the slower rank),
``comm_seconds = wall_seconds - max(target, draft)``. ``seconds`` is the wall time of the whole decode
(prefill included, after a barrier); ``ar_seconds`` AR's wall time on the same prompt on rank 0, in the
same run, while rank 1 waits at the next barrier. With one thread per rank on two cores the two ranks
run on separate cores: a measured two-process time, not a projection.

Command line (rank 0 writes one JSONL row per prompt)::

    torchrun --nproc-per-node 2 -m impl.spec.pearl_distributed --model DIR --draft DRAFT_DIR \\
        --prompts FILE.jsonl --out OUT.jsonl --max-new-tokens N --gamma G [--n-prompts P --ignore-eos]

Backend: gloo on CPU, NCCL on CUDA (one GPU per rank).

Source: Liu, Xu, ... "PEARL: Parallel Speculative Decoding with Adaptive Draft Length" (ICLR 2025,
arXiv:2408.11850), Sec. 3.1-3.3 and Algorithm 1 (the draft and target models on separate devices).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import AutoConfig

from ..argtypes import ArgumentParser, positive_int, temperature
from ..models.load import load_model
from ..provenance import provenance, write_jsonl
from ..torchrun import Ranks, add_run_args, fail, init_process_group, select_device, usable_prompts
from ..workloads.prompts import read_prompts
from .ar import ar_decode
from .pearl import _Committed, _Model, check_pearl, continuation_length, pearl_decode, post_verify
from .sampling import DecodeRule
from .self_spec import _check_decode_args

__all__ = ["TARGET_RANK", "DRAFT_RANK", "RankRound", "rank_pearl_decode", "main"]

TARGET_RANK, DRAFT_RANK = 0, 1


@dataclass
class RankRound:
    """One round of the two-rank executor, as rank 0 records it (times in seconds).

    Attributes:
        kind: ``pre_reject``, ``pre_accept`` or ``post`` (:data:`impl.spec.pearl.TIMELINE`).
        committed: tokens appended this round.
        target_seconds, draft_seconds: compute of rank 0 / rank 1 this round.
        wall_seconds: rank 0's wall time of the round.
        comm_seconds: ``wall_seconds - max(target_seconds, draft_seconds)`` (exchange and skew).
        drafted: draft tokens rank 1 produced this round.
    """

    kind: str
    committed: int
    target_seconds: float
    draft_seconds: float
    wall_seconds: float
    comm_seconds: float
    drafted: int


class _Exchange:
    """One ``all_gather`` of ``[compute microseconds, n, v_1..v_n, -1 padding]`` (int64, ``[width + 2]``)."""

    def __init__(self, width: int, device: torch.device):
        self.width, self.device = width + 2, device

    def __call__(self, values: list[int], seconds: float) -> tuple[list[list[int]], list[float]]:
        msg = torch.full((self.width,), -1, dtype=torch.long)
        msg[0], msg[1] = int(seconds * 1e6), len(values)
        if values:
            msg[2: 2 + len(values)] = torch.tensor(values, dtype=torch.long)
        msg = msg.to(self.device)
        out = [torch.empty_like(msg) for _ in range(dist.get_world_size())]
        dist.all_gather(out, msg)
        out = [o.cpu() for o in out]
        return [o[2: 2 + int(o[1])].tolist() for o in out], [int(o[0]) / 1e6 for o in out]


class _RankPearl(_Committed):
    """This rank's model and cache (rank 0: the target; rank 1: the draft) and the committed ids, which
    both ranks keep identical; the cache invariant is :class:`impl.spec.pearl._Pearl`'s."""

    def __init__(self, model, role: int, ids: list[int], max_new: int, gamma: int, rule: DecodeRule, eos,
                 exchange: _Exchange):
        super().__init__(ids, max_new, eos)
        self.m, self.role, self.x = _Model(model), role, exchange
        self.gamma, self.rule = gamma, rule
        self.block: list[int] | None = None
        self.rounds: list[RankRound] = []

    def prefill(self) -> None:
        if len(self.ids) > 1:
            self.m.forward(self.ids[:-1])

    def _draft(self, first: int, k: int, stop_at_eos: bool = False) -> tuple[list[int], float]:
        out, secs, tok = [], 0.0, first
        for _ in range(k):
            logits, s = self.m.forward([tok])
            tok = self.rule.decode(logits[-1], self.m.n)
            out.append(tok)
            secs += s
            if stop_at_eos and self.eos is not None and tok == self.eos:
                break
        return out, secs

    def _record(self, kind: str, committed: int, secs: list[float], t0: float, drafted: int) -> None:
        wall = time.perf_counter() - t0
        self.rounds.append(RankRound(kind, committed, secs[TARGET_RANK], secs[DRAFT_RANK], wall,
                                     max(wall - max(secs), 0.0), drafted))

    def round(self) -> None:
        t0 = time.perf_counter()
        if self.block is None:
            self._pre_verify(t0)
        else:
            self._post_verify(t0)
        if self.done:
            self.block = None

    def _pre_verify(self, t0: float) -> None:
        n = len(self.ids)
        if self.role == TARGET_RANK:
            logits, sec = self.m.forward([self.ids[-1]])
            mine = [self.rule.decode(logits[-1], n)]
        else:  # the drafting phase: m drafts from the root without waiting for the verdict on d_1
            m = min(self.gamma, self.max_new - len(self.tokens))
            mine, sec = self._draft(self.ids[-1], m, stop_at_eos=True)
        (ys, block), secs = self.x(mine, sec)
        if block[0] != ys[0]:
            if self.role == DRAFT_RANK:
                self.m.crop(n)
            self._record("pre_reject", self._commit(ys), secs, t0, len(block))
        elif len(block) == 1:  # nothing left to verify: d_1 is the last token of the budget, or EOS
            if self.role == DRAFT_RANK:
                self.m.crop(n)
            self._record("pre_accept", self._commit(block), secs, t0, 1)
        else:  # d_1 verified; the draft holds the root .. d_{m-1}, d_m pending
            self.block = block
            self._record("pre_accept", 0, secs, t0, len(block))

    def _post_verify(self, t0: float) -> None:
        block, n = self.block, len(self.ids)
        if self.role == TARGET_RANK:
            logits, sec = self.m.forward(block)
            mine = self.rule.decode_rows(logits, [n + 1 + i for i in range(len(block))])
        else:  # keep drafting after the block's last token as if all of it were accepted
            k = continuation_length(self.gamma, self.max_new, len(self.tokens), len(block))
            mine, sec = self._draft(block[-1], k)
        (ys, nxt), secs = self.x(mine, sec)
        v = post_verify(block, ys, nxt, len(self.tokens), self.max_new)
        if v.keep is not None:
            self.m.crop(n + v.keep)
        self.block = v.next_block
        self._record("post", self._commit(v.new), secs, t0, len(nxt))


@torch.inference_mode()
def rank_pearl_decode(model, input_ids: list[int], max_new_tokens: int, *, gamma: int,
                      rule: DecodeRule = DecodeRule(), eos_token_id: int | None = None,
                      device: torch.device | None = None) -> tuple[list[int], bool, list[RankRound], float]:
    """This rank's side of a two-rank PEARL decode (module docstring); every rank calls it with the same
    prompt and settings inside an initialised 2-rank process group.

    Args:
        model: rank 0: the target; rank 1: the draft model (same vocabulary), eval mode.
        input_ids: prompt token ids (checked by the caller).
        max_new_tokens: generation budget (>= 1).
        gamma: the draft window.
        rule: decoding rule of both models.
        eos_token_id: stop after committing this id (None: exactly ``max_new_tokens`` tokens).
        device: where the exchange tensors live (CUDA for NCCL; default CPU).

    Returns:
        (tokens, stopped at EOS, rounds (rank 0's records; rank 1's carry its own wall times),
        prefill seconds). ``tokens`` equal AR's under ``rule`` on both ranks.

    Raises:
        RuntimeError: the process group does not have exactly two ranks.
    """
    if not dist.is_initialized() or dist.get_world_size() != 2:
        raise RuntimeError("two-rank PEARL needs an initialised process group of exactly 2 ranks")
    role = dist.get_rank()
    eng = _RankPearl(model, role, input_ids, max_new_tokens, gamma, rule, eos_token_id,
                     _Exchange(gamma, device or torch.device("cpu")))
    t0 = time.perf_counter()
    eng.prefill()
    t_pre = time.perf_counter() - t0
    while not eng.done:
        eng.round()
    return eng.tokens, eng.stopped, eng.rounds, t_pre


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="torchrun --nproc-per-node 2 -m impl.spec.pearl_distributed",
                        description="PEARL with the target on rank 0 and the draft model on rank 1; rank 0 writes "
                                    "one JSONL row per prompt, checked against AR and the single-process executor.")
    ap.add_argument("--model", required=True, help="the target's Hugging Face model directory")
    ap.add_argument("--draft", required=True, help="the draft model's directory (rule train_draft's output)")
    add_run_args(ap)
    ap.add_argument("--gamma", type=positive_int, default=4, help="the draft window")
    ap.add_argument("--variant", default=None, help="the model's name in the rows (default: the model directory's name)")
    ap.add_argument("--temperature", type=temperature, default=0.0)
    ap.add_argument("--seed", type=int, default=0, help="Gumbel noise seed (sampling only)")
    ap.add_argument("--no-check", action="store_true", help="skip the AR and single-process checks on rank 0")
    return ap


def _vocab(d: Path) -> int | None:
    return json.loads((d / "config.json").read_text()).get("vocab_size")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``torchrun --nproc-per-node 2 -m impl.spec.pearl_distributed`` (module docstring).

    Every rank checks the arguments before the process group starts and exits with status 2 and a
    one-line error (a missing file, a world size other than 2, a draft over another vocabulary).
    """
    args = _parser().parse_args(argv)
    ranks = Ranks.from_env()
    rank = ranks.rank
    if ranks.world != 2:
        fail(rank, f"PEARL runs on exactly 2 ranks (target, draft), got {ranks.world} (torchrun --nproc-per-node 2)")
    try:
        device = select_device(args.device, ranks)
    except ValueError as e:
        fail(rank, str(e))
    for flag, d in (("--model", args.model), ("--draft", args.draft)):
        if not (Path(d) / "config.json").is_file():
            fail(rank, f"{flag}: model directory not found or incomplete (no config.json): {d}")
    if _vocab(Path(args.model)) != _vocab(Path(args.draft)):
        fail(rank, f"--draft: its vocabulary ({_vocab(Path(args.draft))} ids) is not the target's "
                   f"({_vocab(Path(args.model))})")
    try:
        prompts = read_prompts(args.prompts)
    except (FileNotFoundError, ValueError) as e:
        fail(rank, str(e))
    prompts = prompts[: args.n_prompts] if args.n_prompts else prompts
    torch.set_num_threads(args.threads)
    backend = init_process_group(device, args.timeout_s)
    try:
        model = load_model(args.model if rank == TARGET_RANK else args.draft).to(device)
        check = rank == TARGET_RANK and not args.no_check
        draft = load_model(args.draft).to(device) if check else None
        if draft is not None:
            check_pearl(model, draft, args.gamma)
        rows = _decode_all(model, draft, prompts, args, rank, device, backend)
        if rank == TARGET_RANK:
            prov = provenance({"method": "pearl", "executor": "distributed", "gamma": args.gamma,
                               "max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
                              device=str(device), dtype="float32")
            for r in rows:
                r.update(variant=args.variant or Path(args.model).name, model_dir=str(args.model), draft_dir=str(args.draft), batch_size=1, **prov)
            write_jsonl(args.out, rows)
            bad = [r["prompt_id"] for r in rows if r.get("ar_match") is False or r.get("rounds_match") is False]
            print(f"{args.out}: {len(rows)} rows, {len(bad)} differ from AR or the single-process executor"
                  + (f" ({bad})" if bad else ""), file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()


def _decode_all(model, draft, prompts: list[dict], args, rank: int, device, backend: str) -> list[dict]:
    """Every rank decodes every prompt (warm-up first, unrecorded); rank 0 checks and returns the rows.

    Both ranks validate prompts and take EOS from the *target's* config (``--model``), so they skip the
    same prompts and stop at the same token whatever the draft's config says."""
    target_cfg = AutoConfig.from_pretrained(args.model, local_files_only=True)
    shape = SimpleNamespace(config=target_cfg)  # what _check_decode_args reads: vocabulary and context
    rule = DecodeRule(temperature=args.temperature, seed=args.seed)
    eos = None if args.ignore_eos else target_cfg.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    kw = dict(gamma=args.gamma, rule=rule, eos_token_id=eos, device=device)

    def checked(p: dict) -> list[int]:
        return _check_decode_args(shape, list(p.get("input_ids") or []), args.max_new_tokens, eos)

    for ids in usable_prompts(prompts, checked)[: args.warmup_prompts]:
        rank_pearl_decode(model, ids, args.max_new_tokens, **kw)
    rows = []
    for p in prompts:
        base = {"prompt_id": p.get("id"), "suite": p.get("suite"), "method": "pearl", "executor": "distributed",
                "backend": backend, "world_size": 2, "gamma": args.gamma, "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature}
        try:
            ids = checked(p)
        except ValueError as e:  # the same on both ranks: both skip the prompt
            rows.append({**base, "error": str(e)})
            continue
        dist.barrier()
        t0 = time.perf_counter()
        tokens, stopped, rounds, t_pre = rank_pearl_decode(model, ids, args.max_new_tokens, **kw)
        secs = time.perf_counter() - t0
        if rank != TARGET_RANK:
            continue
        row = {**base, "n_prompt_tokens": len(ids), "token_ids": tokens, "n_new_tokens": len(tokens),
               "stopped_at_eos": stopped, "seconds": secs, "prefill_seconds": t_pre, "rounds": len(rounds),
               "comm_seconds": sum(r.comm_seconds for r in rounds),
               "target_seconds": sum(r.target_seconds for r in rounds),
               "draft_seconds": sum(r.draft_seconds for r in rounds),
               "tokens_per_round": len(tokens) / max(len(rounds), 1),
               "round_log": [asdict(r) for r in rounds]}
        if draft is not None:
            ta = time.perf_counter()
            ar = ar_decode(model, ids, args.max_new_tokens, eos_token_id=eos, rule=rule)
            row["ar_seconds"] = time.perf_counter() - ta
            ref = pearl_decode(model, draft, ids, args.max_new_tokens, gamma=args.gamma, rule=rule, eos_token_id=eos)
            row["ar_match"] = tokens == ar.tokens
            row["rounds_match"] = ([(r.kind, r.committed) for r in rounds]
                                   == [(r.kind, r.committed) for r in ref.rounds]) and tokens == ref.tokens
            row["speedup_vs_ar"] = row["ar_seconds"] / secs if secs > 0 else None
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
