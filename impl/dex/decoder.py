"""DEX decoding loop (Algorithm 1): expand -> DECS -> insert -> validate_and_commit -> collapse.

The FSM state q is the number of explorer rounds since the last commit. Each round every live slot
runs its next stage on its explorer; each candidate opens a child slot (position expansion). When the
anchor reaches the final depth, its final-depth candidate is committed (exactly AR's token under the
same decoding rule), the shallowest non-final anchor candidate equal to it selects the child to keep
(falling back to the final-depth child), and everything whose prefix differs is discarded.

Greedy without DECS, the rounds between the commits of tokens t and t+1 equal 1 + k_t, where k_t is
the index in X of the shallowest anchor candidate equal to token t (K-1 on fallback); the first
token takes K rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..spec.ar import check_prompt_ids
from ..spec.result import DecodeResult
from .lattice import Lattice
from .reference import StageBatch


@dataclass
class TokenMetrics:
    """Per committed token.

    Attributes:
        t: index of the generated token (0-based).
        token_id: committed token (the final-depth reference).
        rounds: explorer rounds from the previous commit (or the start) to this commit.
        match_index: k_t, index in X of the shallowest anchor candidate equal to the token (K-1 on
            fallback); it selects the branch kept for the next token.
        match_depth: d_{k_t} in layers.
        anchor_cands: the anchor's candidates at every explored depth (DECS-masked where applied).
        critical_layers: sum over this token's rounds of the widest stage that ran (layers): the
            depth-side critical path charged to this token (Prop. 7 accounting).
        lattice_sizes: live slots after each of this token's rounds.
        etks: exploration tokens computed in this token's rounds.
    """

    t: int
    token_id: int
    rounds: int
    match_index: int
    match_depth: int
    anchor_cands: list[int]
    critical_layers: int
    lattice_sizes: list[int] = field(default_factory=list)
    etks: int = 0


@dataclass(kw_only=True)
class DEXResult(DecodeResult):
    """Output of :meth:`DEXDecoder.decode`: the :class:`~impl.spec.result.DecodeResult` fields (``tokens``:
    the committed ids; ``prefill_seconds``: the prompt prefill through all L layers, sequential through
    the stages on K devices too, so part of the critical path, as it is part of AR's wall time) plus

    Attributes:
        metrics: one :class:`TokenMetrics` per token.
        round_seconds: per round, the wall time (s) of each explorer's batch (0 when idle).
        profile: seconds spent in expansion (explorer batches), commit+collapse, and bookkeeping.
    """

    metrics: list[TokenMetrics]
    round_seconds: list[list[float]]
    profile: dict[str, float]

    @property
    def critical_path_seconds(self) -> float:
        """Sum over rounds of the slowest explorer (the walltime of K parallel explorers, without
        communication)."""
        return sum(max(r) for r in self.round_seconds if r)

    @property
    def sequential_seconds(self) -> float:
        """Sum of every explorer batch (the single-process walltime of expansion)."""
        return sum(sum(r) for r in self.round_seconds)


class DEXDecoder:
    """Lossless depth exploration decoding over an executor.

    Args:
        executor: a :class:`impl.dex.reference.ReferenceExecutor` (or one with its interface:
            ``X``, ``K``, ``prefill``, ``run_round``, ``commit``, ``drop``).
        decs: Depth-Coupled Sampling (Algorithm 2): mask the tokens shallower depths of the same slot
            chain proposed before decoding a non-final candidate; the final depth is never masked.
        branch_stages: stage indices whose candidates open branches (position expansion); None for
            all (DEX). ``{0, K-1}`` is the single-exit ablation of Fig. 4 (right-top).
        dedupe: reuse an existing child for a repeated candidate of the same slot (see
            :class:`impl.dex.lattice.Lattice`).
    """

    def __init__(self, executor, *, decs: bool = False, branch_stages=None, dedupe: bool = False):
        self.ex = executor
        self.K = executor.K
        self.decs = decs
        self.dedupe = dedupe
        self.branch = set(range(self.K)) if branch_stages is None else set(branch_stages)
        if not self.branch <= set(range(self.K)) or (self.K - 1) not in self.branch:
            raise ValueError(f"branch_stages {sorted(self.branch)} must be stage indices in [0, {self.K - 1}] "
                             "including the final stage")

    def decode(self, input_ids: list[int], max_new_tokens: int, *, eos_token_id: int | None = None) -> DEXResult:
        """Decode up to ``max_new_tokens`` tokens after ``input_ids`` (batch 1).

        Raises:
            ValueError: empty prompt, max_new_tokens < 1, or prompt + new tokens beyond the context.
        """
        check_prompt_ids(self.ex.model, list(input_ids))
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        ctx = getattr(self.ex.model.config, "max_position_embeddings", None)
        if ctx is not None and len(input_ids) + max_new_tokens > ctx:
            raise ValueError(
                f"prompt of {len(input_ids)} tokens + {max_new_tokens} new tokens exceeds the context of {ctx}")
        X, K = self.ex.X, self.K
        widths = [X[0]] + [X[k] - X[k - 1] for k in range(1, K)]
        prof = {"expansion": 0.0, "collapse": 0.0, "bookkeeping": 0.0}
        t0 = time.perf_counter()
        self.ex.prefill(list(input_ids[:-1]))
        prefill_s = time.perf_counter() - t0
        prof["expansion"] += prefill_s
        lat = Lattice(K, dedupe=self.dedupe)
        anchor = lat.open(None, len(input_ids) - 1, input_ids[-1], 0)
        lat.anchor = anchor.sid
        tokens: list[int] = []
        metrics: list[TokenMetrics] = []
        round_seconds: list[list[float]] = []
        rnd = 0
        since, crit, sizes, etks = 0, 0, [], 0
        stopped = False
        while len(tokens) < max_new_tokens:
            tb = time.perf_counter()
            rnd += 1
            since += 1
            by_stage: dict[int, list] = {}
            for s in lat.active():
                by_stage.setdefault(s.stage, []).append(s)
            batches = []
            for k in sorted(by_stage):
                ss = by_stage[k]
                batches.append(StageBatch(
                    stage=k,
                    sids=[s.sid for s in ss],
                    positions=[s.pos for s in ss],
                    tokens=[s.token for s in ss],
                    ancestors=[lat.ancestors(s.sid) for s in ss],
                    banned=[lat.prior_tokens(s.sid) if self.decs and k < K - 1 else [] for s in ss],
                ))
            prof["bookkeeping"] += time.perf_counter() - tb
            results = self.ex.run_round(batches)
            secs = [0.0] * K
            for b, r in zip(batches, results):
                secs[b.stage] = r.seconds
                prof["expansion"] += r.seconds
            round_seconds.append(secs)
            crit += max(widths[b.stage] for b in batches)
            etks += sum(len(b.sids) for b in batches)
            tb = time.perf_counter()
            for b, r in zip(batches, results):
                for sid, cand in zip(b.sids, r.cands):
                    if b.stage in self.branch:
                        lat.record(sid, cand, rnd)
                    else:  # no position expansion from this depth (single-exit ablation)
                        s = lat.slots[sid]
                        s.cands.append(cand)
                        s.stage += 1
            sizes.append(len(lat.slots))
            a = lat.slots[lat.anchor]
            prof["bookkeeping"] += time.perf_counter() - tb
            if a.stage < K:
                continue
            tc = time.perf_counter()
            y = a.cands[K - 1]
            k_t = next(k for k in sorted(self.branch) if a.cands[k] == y)
            keep = a.children[k_t]
            self.ex.commit(a.sid)
            self.ex.drop(lat.collapse(keep))
            prof["collapse"] += time.perf_counter() - tc
            metrics.append(TokenMetrics(
                t=len(tokens), token_id=y, rounds=since, match_index=k_t, match_depth=X[k_t],
                anchor_cands=list(a.cands), critical_layers=crit, lattice_sizes=sizes, etks=etks))
            tokens.append(y)
            since, crit, sizes, etks = 0, 0, [], 0
            if eos_token_id is not None and y == eos_token_id:
                stopped = True
                break
        return DEXResult(tokens=tokens, metrics=metrics, round_seconds=round_seconds, profile=prof,
                         stopped_at_eos=stopped, prefill_seconds=prefill_s)
