"""Distributed DEX executor: one torch.distributed rank per depth explorer (DEX Sec. 3.1-3.2, App. B, D).

Rank k is explorer E_k. It owns layers (d_{k-1}, d_k] of the exploration set X and keeps only those
layers' KV: the committed prefix and the lattice slots' tree KV (its *KV view*, Algorithm 1 line 3).
Rank 0 also runs the :class:`~impl.dex.decoder.DEXDecoder` (lattice, FSM, commit/collapse); the other
ranks run :meth:`DistributedExecutor.serve` until rank 0 sends a stop message.

One explorer round (``run_round``):

1. rank 0 broadcasts the round's *plan*, a packed int64 tensor: the KV instructions queued since the
   last round (commits and drops of the previous collapse, in call order) and every stage batch (sids,
   positions, tokens, ancestors, DECS-banned ids);
2. every rank applies the queued KV instructions to its view (rank 0 applied them when called), posts a
   receive for the hidden states stage k-1 produces this round, runs its own stage batch (the
   single-process code of :meth:`ReferenceExecutor.run_stage`, restricted to its layers), and sends
   its non-final hidden states to rank k+1 (point-to-point, float tensors of the model dtype), which
   consumes them in the next round;
3. candidates, compute seconds, KV-instruction seconds and point-to-point wait seconds are gathered to
   rank 0.

Because each rank runs exactly the reference executor's computation on bit-identical inputs (hidden
states travel as raw bytes), the decoder commits the same tokens, with the same rounds and match
indices, as with :class:`~impl.dex.reference.ReferenceExecutor`, and hence as AR (Sec. 3.2, "Lossless
invariant").

Timing (per round, recorded in :attr:`DistributedExecutor.rounds`): ``explorer_seconds[k]`` is E_k's
batch compute (0 when idle; CUDA synchronised), ``collapse_seconds[k]`` the time rank k spent applying
the queued commits/drops at the round start (0 on rank 0, whose share the decoder times as collapse),
``wall_seconds`` rank 0's wall time of the whole round, and ``comm_seconds = wall_seconds -
max_k(collapse_seconds[k] + explorer_seconds[k])`` the communication and synchronisation overhead on
top of the slowest explorer (plan broadcast, hidden-state transfer, gather, skew). The sum over rounds
of ``max_k explorer_seconds[k] + comm_seconds`` is the critical path of explorer times plus
communication (App. B's expansion + communication components).

Command line (rank 0 writes one JSONL row per prompt)::

    torchrun --nproc-per-node K -m impl.dex.distributed --model DIR --prompts FILE.jsonl \\
        --out OUT.jsonl --max-new-tokens N [--temperature T --seed S --decs --exploration-set 4,8,12]

Backend: gloo on CPU, NCCL on CUDA (chosen from the device).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import DynamicCache

from ..argtypes import ArgumentParser, nonneg_int, temperature
from ..ead.accounting import uniform_exploration_set, validate_exploration_set
from ..models.depth import embed, num_layers, run_layers
from ..models.load import load_model, load_tokenizer
from ..provenance import provenance, write_jsonl
from ..spec.ar import ar_decode
from ..spec.sampling import DecodeRule
from ..torchrun import Ranks, add_run_args, fail, init_process_group, select_device
from ..workloads.prompts import read_prompts
from .decoder import DEXDecoder
from .reference import ReferenceExecutor, StageBatch, StageResult

# --- plan messages ----------------------------------------------------------------------------------

OP_STOP, OP_PREFILL, OP_ROUND = 0, 1, 2
KV_COMMIT, KV_DROP = 0, 1
_OPS = {OP_STOP: "stop", OP_PREFILL: "prefill", OP_ROUND: "round"}
_KV = {KV_COMMIT: "commit", KV_DROP: "drop"}
# The plan travels in one broadcast of this many int64 when it fits (slot 0 holds the length), else
# in two (the rest follows).
PLAN_CAPACITY = 4096


@dataclass
class Plan:
    """One message from rank 0 to every explorer.

    Attributes:
        op: ``"stop"``, ``"prefill"`` or ``"round"``.
        kv_ops: queued KV instructions, in call order: ``("commit", [sid])`` or ``("drop", sids)``.
        input_ids: the committed prefix to prefill (op ``"prefill"`` only).
        batches: the round's stage batches, at most one per stage (op ``"round"`` only).
    """

    op: str
    kv_ops: list[tuple[str, list[int]]] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    batches: list[StageBatch] = field(default_factory=list)


def encode_plan(plan: Plan) -> list[int]:
    """Pack a :class:`Plan` into a flat list of ints (every field is an int: sids, positions, ids).

    Layout: ``[op, n_kv, (kind, n, sids...)*, payload]``; payload is ``[n, ids...]`` for prefill and
    ``[n_batches, (stage, n, sids(n), positions(n), tokens(n), (len, ancestors...)*n,
    (len, banned...)*n)*]`` for a round.

    Raises:
        ValueError: an unknown op or KV instruction.
    """
    codes = {v: k for k, v in _OPS.items()}
    kv_codes = {v: k for k, v in _KV.items()}
    if plan.op not in codes:
        raise ValueError(f"unknown plan op {plan.op!r}")
    out = [codes[plan.op], len(plan.kv_ops)]
    for kind, sids in plan.kv_ops:
        if kind not in kv_codes:
            raise ValueError(f"unknown KV instruction {kind!r}")
        out += [kv_codes[kind], len(sids), *sids]
    if plan.op == "prefill":
        out += [len(plan.input_ids), *plan.input_ids]
    elif plan.op == "round":
        out.append(len(plan.batches))
        for b in plan.batches:
            n = len(b.sids)
            out += [b.stage, n, *b.sids, *b.positions, *b.tokens]
            for lists in (b.ancestors, b.banned):
                for xs in lists:
                    out += [len(xs), *xs]
    return [int(x) for x in out]


def decode_plan(ints: list[int]) -> Plan:
    """Inverse of :func:`encode_plan`.

    Raises:
        ValueError: a malformed message (unknown op, truncated, or trailing ints).
    """
    it = iter(ints)

    def take(n: int = 1) -> list[int]:
        xs = [next(it) for _ in range(n)]
        return xs

    try:
        op = _OPS[next(it)]
        kv_ops = []
        for _ in range(next(it)):
            kind = _KV[next(it)]
            kv_ops.append((kind, take(next(it))))
        plan = Plan(op, kv_ops)
        if op == "prefill":
            plan.input_ids = take(next(it))
        elif op == "round":
            for _ in range(next(it)):
                stage, n = next(it), next(it)
                sids, positions, tokens = take(n), take(n), take(n)
                ancestors = [take(next(it)) for _ in range(n)]
                banned = [take(next(it)) for _ in range(n)]
                plan.batches.append(StageBatch(stage, sids, positions, tokens, ancestors, banned))
    except (StopIteration, KeyError) as e:
        raise ValueError(f"malformed DEX plan message ({type(e).__name__})") from None
    if next(it, None) is not None:
        raise ValueError("malformed DEX plan message (trailing ints)")
    return plan


# --- one explorer's stage, reusing the reference executor ------------------------------------------

class _RemoteLayer(torch.nn.Module):
    """Placeholder for a decoder layer owned by another explorer (its weights are not held here)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"decoder layer {self.index} is owned by another explorer rank")


def keep_stage_layers(model, lo: int, hi: int):
    """Release the decoder layers outside ``layers[lo:hi]`` (0-based, python slice) in place.

    The embeddings, rotary embedding, final norm and LM head are kept (every explorer reads out at
    its boundary; stage 0 embeds). Returns ``model``. Use it on ranks that need no other layer
    (rank 0 keeps all layers when it checks against AR).

    Raises:
        ValueError: a range outside [0, L].
    """
    layers = model.model.layers
    if not 0 <= lo < hi <= len(layers):
        raise ValueError(f"layer range ({lo}, {hi}] is outside [0, {len(layers)}]")
    for i in range(len(layers)):
        if not lo <= i < hi:
            layers[i] = _RemoteLayer(i)
    return model


class StageExecutor(ReferenceExecutor):
    """Explorer E_k alone: layers (d_{k-1}, d_k] and only their KV view (DEX Algorithm 1, line 3).

    It is a :class:`ReferenceExecutor` whose committed and tree KV exist only for its own layers, so
    :meth:`run_stage` (inherited unchanged) computes exactly what the reference executor computes for
    this stage. Layers of other explorers hold zero-width placeholders ``[1, H_kv, C, 0]`` that carry
    only the committed length C (the inherited ``run_stage`` reads C from layer 0's view).

    Args:
        model: Hugging Face causal LM (Llama/Qwen family), eval mode; layers outside this stage may
            have been released with :func:`keep_stage_layers`.
        exploration_set: X, 1-based depths ending at L.
        stage: k in [0, K-1].
        rule: final-depth decoding rule (must be the same on every explorer).
        adapters: optional inducing adapters by depth (only the one at d_k is used here).

    Raises:
        ValueError: an invalid exploration set or stage index.
    """

    def __init__(self, model, exploration_set, stage: int, rule: DecodeRule | None = None, adapters=None):
        self.stage = int(stage)
        super().__init__(model, exploration_set, rule=rule, adapters=adapters)

    @property
    def layer_range(self) -> tuple[int, int]:
        """(lo, hi): this explorer runs python layers ``lo .. hi-1`` (depths lo+1 .. hi)."""
        return self.stage_layers(self.stage)

    def _owns(self, layer: int) -> bool:
        lo, hi = self.layer_range
        return lo <= layer < hi

    def reset(self) -> None:
        """Empty KV view: no committed prefix, no slots, no pending hidden states."""
        if not 0 <= self.stage < self.K:
            raise ValueError(f"stage {self.stage} is outside [0, {self.K - 1}] for X={list(self.X)}")
        super().reset()
        for layer in range(self.L):
            if not self._owns(layer):
                self._ck[layer] = self._cv[layer] = self._ck[layer][..., :0]

    def _placeholder(self, length: int) -> torch.Tensor:
        return self._ck[self.layer_range[0]].new_empty(1, self._ck[0].shape[1], length, 0)

    @torch.no_grad()
    def prefill(self, input_ids: list[int], hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """Prefill this stage's layers with the committed prefix ``input_ids`` (n tokens).

        Args:
            input_ids: the committed prefix (list of int; may be empty).
            hidden: ``[n, H]`` hidden states entering layer d_{k-1}+1 (from explorer k-1); ignored
                (None) for stage 0, which embeds ``input_ids``.

        Returns:
            ``[n, H]`` hidden states after layer d_k (model dtype, model device), or None when n = 0.

        Raises:
            ValueError: a stage k > 0 without ``hidden`` of n rows.
        """

        self.reset()
        n = len(input_ids)
        if n == 0:
            return None
        lo, hi = self.layer_range
        if lo == 0:
            h = embed(self.model, torch.tensor([list(input_ids)], device=self.device))
        else:
            if hidden is None or hidden.shape[0] != n:
                raise ValueError(f"stage {self.stage} prefill needs [{n}, H] hidden states from stage {self.stage - 1}")
            h = hidden.unsqueeze(0)
        cache = DynamicCache(config=self.model.config)
        pos = torch.arange(n, device=self.device).unsqueeze(0)
        h = run_layers(self.model, h, lo, hi, position_ids=pos, cache=cache)
        for layer in range(self.L):
            if self._owns(layer):
                self._ck[layer], self._cv[layer] = cache.layers[layer].keys, cache.layers[layer].values
            else:
                self._ck[layer] = self._cv[layer] = self._placeholder(n)
        return h[0]

    def commit(self, sid: int) -> None:
        """Move slot ``sid``'s KV at this stage's layers into the committed prefix."""
        C = self._ck[self.layer_range[0]].shape[2]
        for layer in range(self.L):
            if self._owns(layer):
                k = self._tree_k[layer].pop(sid)
                v = self._tree_v[layer].pop(sid)
                self._ck[layer] = torch.cat([self._ck[layer], k.unsqueeze(0).unsqueeze(2)], dim=2)
                self._cv[layer] = torch.cat([self._cv[layer], v.unsqueeze(0).unsqueeze(2)], dim=2)
            else:
                self._ck[layer] = self._cv[layer] = self._placeholder(C + 1)

    @property
    def committed_length(self) -> int:
        """Number of committed tokens in this explorer's KV view."""
        return self._ck[self.layer_range[0]].shape[2]

    def kv_bytes(self) -> int:
        """Bytes of KV held by this explorer (committed + tree), for checking the KV-view ownership."""
        n = sum(t.numel() * t.element_size() for t in self._ck + self._cv)
        for d in self._tree_k + self._tree_v:
            n += sum(t.numel() * t.element_size() for t in d.values())
        return n


# --- the distributed executor ----------------------------------------------------------------------

@dataclass
class DistStageResult(StageResult):
    """A :class:`StageResult` with the explorer's rank and its per-round overheads.

    Attributes:
        cands: candidates at d_k, one per row (token ids).
        seconds: E_k's batch compute (s).
        rank: the explorer's rank (= stage index k).
        p2p_seconds: time (s) rank k waited, after its compute, for its hidden-state send to k+1 and
            receive from k-1 to complete (includes waiting for a slower neighbour).
        collapse_seconds: time (s) rank k spent applying the queued commits/drops this round.
    """

    rank: int = 0
    p2p_seconds: float = 0.0
    collapse_seconds: float = 0.0


@dataclass
class RoundStats:
    """Timing of one explorer round (seconds), measured on rank 0 and gathered from every rank.

    Attributes:
        explorer_seconds: per rank k, E_k's batch compute (0 when idle).
        collapse_seconds: per rank k, time applying queued commits/drops (0 on rank 0, see module doc).
        p2p_seconds: per rank k, post-compute wait for hidden-state send/receive.
        plan_seconds: rank 0's time to pack and broadcast the plan.
        wall_seconds: rank 0's wall time of the round (plan to gathered results).
    """

    explorer_seconds: list[float]
    collapse_seconds: list[float]
    p2p_seconds: list[float]
    plan_seconds: float
    wall_seconds: float

    @property
    def critical_seconds(self) -> float:
        """max_k (collapse_k + explorer_k): the slowest explorer's work this round."""
        return max(c + e for c, e in zip(self.collapse_seconds, self.explorer_seconds))

    @property
    def comm_seconds(self) -> float:
        """Communication and synchronisation overhead: wall minus the slowest explorer's work (>= 0)."""
        return max(0.0, self.wall_seconds - self.critical_seconds)


@dataclass
class PrefillStats:
    """Timing of the pipelined prefill (seconds).

    Attributes:
        explorer_seconds: per rank, its stage's prefill compute.
        wall_seconds: rank 0's wall time from the plan to the gathered acknowledgements.
        n_tokens: committed prefix length.
    """

    explorer_seconds: list[float]
    wall_seconds: float
    n_tokens: int

    @property
    def comm_seconds(self) -> float:
        """Wall minus the sum of stage computes (the prefill is a sequential pipeline), >= 0."""
        return max(0.0, self.wall_seconds - sum(self.explorer_seconds))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DistributedExecutor:
    """DEX executor with one torch.distributed rank per explorer (DEX Sec. 3.1, App. D).

    Every rank constructs it with the same model, exploration set, rule and adapters, after
    ``torch.distributed`` is initialised with world size K = |X|. Rank 0 hands it to
    :class:`~impl.dex.decoder.DEXDecoder` (interface: ``model``, ``X``, ``K``, ``prefill``,
    ``run_round``, ``commit``, ``drop``) and calls :meth:`close` when done; every other rank calls
    :meth:`serve`, which returns when rank 0 closes. The constructor is collective: it checks that all
    ranks agree on X, the rule and the model shape.

    Args:
        model: Hugging Face causal LM on this rank's device (eval mode). Ranks other than 0 may
            release the layers they do not own (:func:`keep_stage_layers`).
        exploration_set: X = (d_0 < ... < d_{K-1} = L), 1-based depths; rank k owns (d_{k-1}, d_k].
        rule: final-depth decoding rule (greedy or per-position Gumbel-max).
        adapters: optional inducing adapters by non-final depth.

    Attributes:
        rounds: :class:`RoundStats` of every round since the last :meth:`prefill` (rank 0).
        prefill_stats: :class:`PrefillStats` of the last prefill (rank 0).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: an invalid exploration set, |X| different from the world size, an NCCL group with
            a CPU model, or ranks that disagree on X / rule / model shape.
    """

    def __init__(self, model, exploration_set, rule: DecodeRule | None = None, adapters=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: launch with torchrun and call "
                               "init_distributed() (or dist.init_process_group) first")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        X = validate_exploration_set(exploration_set, num_layers(model))
        check_world_size(X, self.world_size)
        self.stage_ex = StageExecutor(model, X, self.rank, rule=rule, adapters=adapters)
        self.model = model
        self.X = self.stage_ex.X
        self.K = self.stage_ex.K
        self.L = self.stage_ex.L
        self.rule = self.stage_ex.rule
        self.device = self.stage_ex.device
        self.backend = dist.get_backend()
        if self.backend == "nccl" and self.device.type != "cuda":
            raise ValueError("the NCCL backend needs the model on a CUDA device; use gloo on CPU")
        self.hidden_size = model.config.hidden_size
        self.dtype = next(model.parameters()).dtype
        self._pending: list[tuple[str, list[int]]] = []
        self._busy = False
        self._closed = False
        self.rounds: list[RoundStats] = []
        self.prefill_stats: PrefillStats | None = None
        self._handshake(adapters or {})

    # -- collectives ---------------------------------------------------------------------------------

    def _handshake(self, adapters) -> None:
        fp = [float(self.K), *map(float, self.X), float(self.L), float(self.rule.temperature),
              float(self.rule.seed), float(self.hidden_size), float(self.model.config.vocab_size),
              float(len(adapters)), float(sum(adapters))]
        mine = torch.tensor(fp, dtype=torch.float64, device=self.device)
        alls = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(alls, mine)
        bad = [r for r, t in enumerate(alls) if not torch.equal(t, alls[0])]
        if bad:
            raise ValueError(f"explorer ranks {bad} disagree with rank 0 on the exploration set, decoding rule "
                             "or model shape; every rank must be started with the same arguments")

    def _bcast_plan(self, plan: Plan | None) -> Plan:
        """Broadcast the plan from rank 0 (one broadcast when it fits PLAN_CAPACITY - 1 ints)."""
        head = torch.zeros(PLAN_CAPACITY, dtype=torch.int64, device=self.device)
        ints: list[int] = []
        if self.rank == 0:
            ints = encode_plan(plan)
            first = ints[: PLAN_CAPACITY - 1]
            head[0] = len(ints)
            head[1: 1 + len(first)] = torch.tensor(first, dtype=torch.int64)
        dist.broadcast(head, src=0)
        n = int(head[0])
        if n > PLAN_CAPACITY - 1:
            rest = torch.empty(n - (PLAN_CAPACITY - 1), dtype=torch.int64, device=self.device)
            if self.rank == 0:
                rest.copy_(torch.tensor(ints[PLAN_CAPACITY - 1:], dtype=torch.int64))
            dist.broadcast(rest, src=0)
            if self.rank != 0:
                ints = head[1:].tolist() + rest.tolist()
        elif self.rank != 0:
            ints = head[1: 1 + n].tolist()
        return plan if self.rank == 0 else decode_plan(ints)

    def _gather(self, values: list[float], width: int) -> list[list[float]] | None:
        """Gather one float64 row of ``width`` from every rank to rank 0 (None elsewhere)."""
        t = torch.zeros(width, dtype=torch.float64, device=self.device)
        if values:
            t[: len(values)] = torch.tensor(values, dtype=torch.float64)
        if self.rank == 0:
            rows = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.gather(t, rows, dst=0)
            return [r.tolist() for r in rows]
        dist.gather(t, None, dst=0)
        return None

    # -- per-rank work ---------------------------------------------------------------------------------

    def _apply_kv(self, kv_ops) -> float:
        t = time.perf_counter()
        for kind, sids in kv_ops:
            if kind == "commit":
                self.stage_ex.commit(sids[0])
            else:
                self.stage_ex.drop(sids)
        _sync(self.device)
        return time.perf_counter() - t

    def _local_prefill(self, input_ids: list[int]) -> list[list[float]] | None:
        k, n = self.rank, len(input_ids)
        h_in = None
        if k > 0 and n > 0:
            h_in = torch.empty(n, self.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(h_in, src=k - 1)
        _sync(self.device)
        t = time.perf_counter()
        h = self.stage_ex.prefill(input_ids, h_in)
        _sync(self.device)
        secs = time.perf_counter() - t
        if k < self.K - 1 and n > 0:
            dist.send(h.contiguous(), dst=k + 1)
        return self._gather([secs], 1)

    def _local_round(self, plan: Plan) -> list[list[float]] | None:
        k = self.rank
        collapse = self._apply_kv(plan.kv_ops) if k != 0 else 0.0
        by_stage = {b.stage: b for b in plan.batches}
        width = 4 + max((len(b.sids) for b in plan.batches), default=0)
        own, prev = by_stage.get(k), by_stage.get(k - 1)
        reqs, buf = [], None
        if prev is not None and k > 0:
            buf = torch.empty(len(prev.sids), self.hidden_size, dtype=self.dtype, device=self.device)
            reqs.append(dist.irecv(buf, src=k - 1))
        secs, cands = 0.0, []
        if own is not None:
            r = self.stage_ex.run_stage(own)
            secs, cands = r.seconds, r.cands
            if k < self.K - 1:
                out = torch.stack([self.stage_ex._hidden.pop(s) for s in own.sids]).contiguous()
                reqs.append(dist.isend(out, dst=k + 1))
        t = time.perf_counter()
        for q in reqs:
            q.wait()
        _sync(self.device)
        if buf is not None:
            for i, s in enumerate(prev.sids):
                self.stage_ex._hidden[s] = buf[i]
        p2p = time.perf_counter() - t
        return self._gather([secs, p2p, collapse, float(len(cands)), *map(float, cands)], width)

    # -- the executor interface (rank 0) ---------------------------------------------------------------

    def _require_rank0(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{what} is called on rank 0 only; rank {self.rank} runs serve()")
        if self._closed:
            raise RuntimeError("the executor is closed")

    def prefill(self, input_ids: list[int]) -> None:
        """Prefill every explorer's layers with the committed prefix (pipelined: rank k receives the
        prefix's ``[n, H]`` hidden states at its stage boundary from rank k-1). Resets the lattice KV
        and the round log. Rank 0 only; collective with the serving ranks."""
        self._require_rank0("prefill")
        self._busy = True
        self._pending = []
        self.rounds = []
        t0 = time.perf_counter()
        self._bcast_plan(Plan("prefill", input_ids=list(input_ids)))
        rows = self._local_prefill(list(input_ids))
        self.prefill_stats = PrefillStats([r[0] for r in rows], time.perf_counter() - t0, len(input_ids))
        self._busy = False

    def run_round(self, batches: list[StageBatch]) -> list[DistStageResult]:
        """Run one explorer round: every explorer runs its stage batch in parallel on its rank.

        Args:
            batches: at most one :class:`StageBatch` per stage (any order).

        Returns:
            one :class:`DistStageResult` per batch, in the order given; the round's timing is appended
            to :attr:`rounds`.

        Raises:
            ValueError: a stage outside [0, K-1] or two batches for one stage.
        """
        self._require_rank0("run_round")
        stages = [b.stage for b in batches]
        if len(set(stages)) != len(stages) or any(not 0 <= s < self.K for s in stages):
            raise ValueError(f"stage batches {stages} must be distinct stages in [0, {self.K - 1}]")
        self._busy = True
        t0 = time.perf_counter()
        plan = Plan("round", kv_ops=self._pending, batches=list(batches))
        self._pending = []
        self._bcast_plan(plan)
        t_plan = time.perf_counter() - t0
        rows = self._local_round(plan)
        wall = time.perf_counter() - t0
        self._busy = False
        self.rounds.append(RoundStats(
            explorer_seconds=[r[0] for r in rows], collapse_seconds=[r[2] for r in rows],
            p2p_seconds=[r[1] for r in rows], plan_seconds=t_plan, wall_seconds=wall))
        out = []
        for b in batches:
            r = rows[b.stage]
            n = int(r[3])
            if n != len(b.sids):
                raise RuntimeError(f"explorer {b.stage} returned {n} candidates for {len(b.sids)} slots")
            out.append(DistStageResult(cands=[int(c) for c in r[4: 4 + n]], seconds=r[0], rank=b.stage,
                                       p2p_seconds=r[1], collapse_seconds=r[2]))
        return out

    def commit(self, sid: int) -> None:
        """Commit slot ``sid``: applied on rank 0 now, on the other ranks at the next plan."""
        self._require_rank0("commit")
        self.stage_ex.commit(sid)
        self._pending.append(("commit", [int(sid)]))

    def drop(self, sids) -> None:
        """Discard collapsed slots: applied on rank 0 now, on the other ranks at the next plan."""
        self._require_rank0("drop")
        sids = [int(s) for s in sids]
        self.stage_ex.drop(sids)
        if sids:
            self._pending.append(("drop", sids))

    def close(self) -> None:
        """Send the stop message (rank 0; idempotent). Not sent when a round failed half-way (the
        ranks would not be at a plan broadcast): then the launcher tears the group down."""
        if self.rank != 0 or self._closed:
            return
        self._closed = True
        if not self._busy:
            self._bcast_plan(Plan("stop"))

    def __enter__(self) -> "DistributedExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the serving loop (ranks 1..K-1) -----------------------------------------------------------------

    def serve(self) -> int:
        """Serve rank 0's plans until it sends stop (ranks other than 0). Returns the rounds served.

        Raises:
            RuntimeError: called on rank 0.
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 drives the decoder; serve() runs on the other ranks")
        served = 0
        while True:
            plan = self._bcast_plan(None)
            if plan.op == "stop":
                return served
            if plan.op == "prefill":
                self._local_prefill(plan.input_ids)
            else:
                self._local_round(plan)
                served += 1

    # -- summaries -------------------------------------------------------------------------------------

    def timing_summary(self) -> dict:
        """JSON-ready timing of the decode since the last prefill (rank 0; seconds).

        Keys: ``round_explorer_seconds`` [R][K], ``round_collapse_seconds`` [R][K],
        ``round_p2p_seconds`` [R][K], ``round_plan_seconds`` [R], ``round_wall_seconds`` [R],
        ``round_comm_seconds`` [R], ``critical_path_seconds`` (sum of per-round max explorer),
        ``comm_seconds`` (sum of round comm), ``critical_path_plus_comm_seconds``,
        ``rounds_wall_seconds``, ``prefill_seconds``, ``prefill_explorer_seconds`` [K],
        ``prefill_comm_seconds``.
        """
        R = self.rounds
        crit = sum(max(r.explorer_seconds) for r in R)
        comm = sum(r.comm_seconds for r in R)
        p = self.prefill_stats
        return {
            "round_explorer_seconds": [r.explorer_seconds for r in R],
            "round_collapse_seconds": [r.collapse_seconds for r in R],
            "round_p2p_seconds": [r.p2p_seconds for r in R],
            "round_plan_seconds": [r.plan_seconds for r in R],
            "round_wall_seconds": [r.wall_seconds for r in R],
            "round_comm_seconds": [r.comm_seconds for r in R],
            "critical_path_seconds": crit,
            "comm_seconds": comm,
            "critical_path_plus_comm_seconds": crit + comm,
            "rounds_wall_seconds": sum(r.wall_seconds for r in R),
            "prefill_seconds": p.wall_seconds if p else 0.0,
            "prefill_explorer_seconds": p.explorer_seconds if p else [0.0] * self.K,
            "prefill_comm_seconds": p.comm_seconds if p else 0.0,
        }


# --- launching --------------------------------------------------------------------------------------

def check_world_size(X, world_size: int) -> None:
    """One rank per explorer: raise unless |X| equals the world size.

    Raises:
        ValueError: naming both numbers and the torchrun flag to change.
    """
    if len(X) != world_size:
        raise ValueError(
            f"exploration set {list(X)} has {len(X)} depths but the world size is {world_size}: DEX runs one "
            f"rank per explorer, so launch torchrun with --nproc-per-node {len(X)} or give {world_size} depths")


def exploration_set_for_world(text: str | None, world_size: int, L: int) -> tuple[int, ...]:
    """The exploration set for a launch: ``text`` ("4,8,12") or DEX-1/K with K = world size.

    Raises:
        ValueError: a malformed or invalid set, a length different from the world size, or a world
            size that does not divide L (no uniform set).
    """
    if text is None:
        try:
            return uniform_exploration_set(L, world_size)
        except ValueError as e:
            raise ValueError(f"world size {world_size} means K={world_size} explorers, but {e}; "
                             "pass --exploration-set with one depth per rank") from None
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"exploration set {text!r} is not a comma-separated list of depths") from None
    check_world_size(xs, world_size)
    return validate_exploration_set(xs, L)


def _prompt_ids(p: dict, tokenizer_loader) -> list[int] | None:
    """Same rule as :func:`impl.methods.decode_prompts`: ``input_ids``, else ``text`` tokenized with
    the model's tokenizer (BOS prepended when it has one)."""
    ids = p.get("input_ids")
    if ids is None and isinstance(p.get("text"), str):
        tok = tokenizer_loader()
        ids = tok(p["text"], add_special_tokens=False)["input_ids"]
        if ids and tok.bos_token_id is not None:
            ids = [tok.bos_token_id] + ids
    return list(ids) if ids else None


def _parser() -> ArgumentParser:
    ap = ArgumentParser(
        prog="torchrun --nproc-per-node K -m impl.dex.distributed",
        description="DEX with one torch.distributed rank per explorer; rank 0 writes one JSONL row per prompt, "
                    "checked against AR.")
    ap.add_argument("--model", required=True, help="Hugging Face model directory (tokenizer inside for text rows)")
    add_run_args(ap, prompts_help="JSONL rows with id and input_ids or text")
    ap.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=nonneg_int, default=0, help="seed of the per-position Gumbel noise")
    ap.add_argument("--exploration-set", help="comma-separated depths ending at L, one per rank (default: "
                                              "uniform DEX-1/K with K = world size)")
    ap.add_argument("--decs", action="store_true", help="depth-coupled sampling (Algorithm 2)")
    ap.add_argument("--single-exit", action="store_true", help="ablation: branch only from d_0 and L")
    ap.add_argument("--dedupe", action="store_true", help="reuse children of repeated candidates")
    ap.add_argument("--no-ar-check", action="store_true",
                    help="skip the AR check (then rank 0 also holds only its own layers)")
    return ap


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``torchrun --nproc-per-node K -m impl.dex.distributed`` (see the module doc).

    Every rank validates the arguments before the process group starts and exits with status 2 and
    a one-line error (a missing file, a bad exploration set, |X| different from the world size).
    """
    args = _parser().parse_args(argv)
    ranks = Ranks.from_env()
    rank, world = ranks.rank, ranks.world
    cfg_path = Path(args.model) / "config.json"
    if not cfg_path.is_file():
        fail(rank, f"model directory not found or incomplete (no config.json): {args.model}")
    if not Path(args.prompts).is_file():
        fail(rank, f"no such prompt file: {args.prompts}")
    if args.max_new_tokens < 1:
        fail(rank, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        fail(rank, f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    L = int(json.loads(cfg_path.read_text()).get("num_hidden_layers", 0))
    try:
        X = exploration_set_for_world(args.exploration_set, world, L)
        device = select_device(args.device, ranks)
    except ValueError as e:
        fail(rank, str(e))

    torch.set_num_threads(args.threads)
    backend = init_process_group(device, args.timeout_s)
    try:
        model = load_model(args.model)
        lo, hi = (0 if rank == 0 else X[rank - 1]), X[rank]
        if rank != 0 or args.no_ar_check:
            keep_stage_layers(model, lo, hi)
        model.to(device)
        rule = DecodeRule(temperature=args.temperature, seed=args.seed)
        ex = DistributedExecutor(model, X, rule=rule)
        if rank != 0:
            ex.serve()
            return
        with ex:
            prompts = read_prompts(args.prompts)
            rows = _decode_all(ex, args, prompts[: args.n_prompts] if args.n_prompts else prompts, rule, X, backend,
                               lambda: load_tokenizer(args.model))
        prov = provenance({"method": "dex", "executor": "distributed", "exploration_set": list(X),
                           "decs": args.decs, "single_exit": args.single_exit, "dedupe": args.dedupe,
                           "temperature": args.temperature, "world_size": world},
                          seed=args.seed, device=str(device), dtype=str(ex.dtype).removeprefix("torch."))
        for r in rows:
            r.update(model_dir=str(args.model), batch_size=1, **prov)
        write_jsonl(args.out, rows)
        bad = [r["prompt_id"] for r in rows if r.get("ar_match") is False]
        errs = [r["prompt_id"] for r in rows if "error" in r]
        print(f"{args.out}: {len(rows)} rows, {len(errs)} errors, {len(bad)} differ from AR"
              + (f" ({bad})" if bad else ""), file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()


def _decode_all(ex: DistributedExecutor, args, prompts, rule, X, backend, tok_loader) -> list[dict]:
    """Rank 0: warm up on the first ``args.warmup_prompts`` usable prompts (unrecorded), then decode every prompt
    row, those included, into a result row (errors become rows): ``len(prompts)`` rows."""
    K = len(X)
    dec = DEXDecoder(ex, decs=args.decs, branch_stages={0, K - 1} if args.single_exit else None,
                     dedupe=args.dedupe)
    eos = None if args.ignore_eos else ex.model.config.eos_token_id
    tok_cache: list = []

    def tok():
        if not tok_cache:
            tok_cache.append(tok_loader())
        return tok_cache[0]

    warm = 0
    for p in prompts:  # warm-up, not recorded
        if warm >= args.warmup_prompts:
            break
        try:
            ids = _prompt_ids(p, tok)
            if ids:
                dec.decode(ids, args.max_new_tokens, eos_token_id=eos)
                warm += 1
        except (ValueError, OSError):
            continue
    rows = []
    for p in prompts:
        base = {"prompt_id": p.get("id"), "suite": p.get("suite"), "method": "dex", "executor": "distributed",
                "backend": backend, "world_size": K, "exploration_set": list(X), "decs": args.decs,
                "single_exit": args.single_exit, "dedupe": args.dedupe, "temperature": rule.temperature,
                "seed": rule.seed, "max_new_tokens": args.max_new_tokens}
        try:
            ids = _prompt_ids(p, tok)
        except OSError as e:
            rows.append({**base, "error": f"cannot tokenize text: {e}"})
            continue
        if not ids:
            rows.append({**base, "error": "empty prompt (no input_ids and no non-empty text)"})
            continue
        try:
            t0 = time.perf_counter()
            res = dec.decode(ids, args.max_new_tokens, eos_token_id=eos)
            secs = time.perf_counter() - t0
        except ValueError as e:
            rows.append({**base, "error": str(e)})
            continue
        ar = None
        if not args.no_ar_check:
            ar = ar_decode(ex.model, ids, args.max_new_tokens, eos_token_id=eos, rule=rule).tokens
        m = res.metrics
        row = {**base, "n_prompt_tokens": len(ids), "token_ids": res.tokens, "n_new_tokens": len(res.tokens),
               "stopped_at_eos": res.stopped_at_eos, "seconds": secs,
               "rounds": [x.rounds for x in m], "match_index": [x.match_index for x in m],
               "match_depth": [x.match_depth for x in m], "critical_layers": [x.critical_layers for x in m],
               "max_lattice": [max(x.lattice_sizes) for x in m], "etks": [x.etks for x in m],
               "profile": res.profile, "sequential_seconds": res.sequential_seconds,
               **ex.timing_summary(),
               "ar_match": (res.tokens == ar) if ar is not None else None}
        if p.get("input_ids") is None:
            row["input_ids"] = ids
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
