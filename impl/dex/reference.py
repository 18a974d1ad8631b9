"""Reference DEX executor: all explorers in one process, run one after another each round.

Explorer E_k owns layers (d_{k-1}, d_k] and their KV view: the committed prefix plus the KV of the
lattice's slots at those layers. A stage batch attends, per slot, to the committed prefix, to its
ancestor slots (which are always at least one stage ahead, so their KV at these layers exists) and
to itself, through a boolean 4D tree mask; positions are the slots' absolute positions. The wall time
of each explorer's batch is recorded so that the critical path (per round, the slowest explorer) can
be computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..ead.accounting import validate_exploration_set
from ..models.depth import embed, num_layers, readout_logits, run_layers
from ..spec.sampling import DecodeRule


@dataclass
class StageBatch:
    """Work for explorer ``stage`` in one round.

    Attributes:
        stage: explorer index k (0-based); it runs layers (d_{k-1}, d_k].
        sids: slot ids, one per row.
        positions: absolute position of each slot's input token.
        tokens: input token ids (used by stage 0 to embed).
        ancestors: per slot, the sids of its live ancestor slots.
        banned: per slot, token ids masked before decoding (DECS); empty lists for none.
    """

    stage: int
    sids: list[int]
    positions: list[int]
    tokens: list[int]
    ancestors: list[list[int]]
    banned: list[list[int]]


@dataclass
class StageResult:
    """Candidates decoded at the stage boundary d_k, one per row, and the batch's wall time (s)."""

    cands: list[int]
    seconds: float
    probs: list[float] = field(default_factory=list)


class _TreeView:
    """Duck-typed transformers Cache for one stage batch: ``update`` stores the batch's K/V under
    their slot ids and returns [committed | ancestor slots | batch] K/V for attention."""

    def __init__(self, ex: "ReferenceExecutor", sids: list[int], key_sids: list[int]):
        self.ex, self.sids, self.key_sids = ex, sids, key_sids

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        tk, tv = self.ex._tree_k[layer_idx], self.ex._tree_v[layer_idx]
        for i, sid in enumerate(self.sids):
            tk[sid] = key_states[0, :, i]
            tv[sid] = value_states[0, :, i]
        parts_k = [self.ex._ck[layer_idx]]
        parts_v = [self.ex._cv[layer_idx]]
        if self.key_sids:
            parts_k.append(torch.stack([tk[s] for s in self.key_sids], dim=1).unsqueeze(0))
            parts_v.append(torch.stack([tv[s] for s in self.key_sids], dim=1).unsqueeze(0))
        parts_k.append(key_states)
        parts_v.append(value_states)
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)


class ReferenceExecutor:
    """All K explorers in one process (batch size 1 decoding).

    Args:
        model: Hugging Face causal LM (Llama/Qwen family) in eval mode.
        exploration_set: X = (d_0 < ... < d_{K-1} = L), 1-based depths.
        rule: final-depth decoding rule (greedy or per-position Gumbel-max).
        adapters: optional inducing adapters by depth, applied before readout at non-final depths.

    Raises:
        ValueError: an invalid exploration set (not strictly increasing, not ending at L, a depth
            outside [1, L]).
        TypeError: a model without a shared final norm / LM head.
    """

    def __init__(self, model, exploration_set, rule: DecodeRule | None = None, adapters=None):
        self.model = model
        self.L = num_layers(model)
        self.X = validate_exploration_set(exploration_set, self.L)
        self.K = len(self.X)
        self.rule = rule or DecodeRule()
        self.adapters = adapters or {}
        if self.L in self.adapters:
            raise ValueError("no adapter may be attached at the final depth L (DEX App. C.2)")
        self.device = next(model.parameters()).device
        self.reset()

    def stage_layers(self, k: int) -> tuple[int, int]:
        """(start, end) depth range of explorer k: layers start+1 .. end."""
        return (0 if k == 0 else self.X[k - 1], self.X[k])

    def reset(self) -> None:
        cfg = self.model.config
        heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(self.model.parameters()).dtype
        empty = torch.zeros(1, heads, 0, hd, dtype=dtype, device=self.device)
        self._ck = [empty.clone() for _ in range(self.L)]
        self._cv = [empty.clone() for _ in range(self.L)]
        self._tree_k: list[dict[int, torch.Tensor]] = [{} for _ in range(self.L)]
        self._tree_v: list[dict[int, torch.Tensor]] = [{} for _ in range(self.L)]
        self._hidden: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def prefill(self, input_ids: list[int]) -> None:
        """Run the committed prefix ``input_ids`` through all layers into the committed KV."""

        self.reset()
        if not input_ids:
            return
        cache = DynamicCache(config=self.model.config)
        x = torch.tensor([input_ids], device=self.device)
        pos = torch.arange(len(input_ids), device=self.device).unsqueeze(0)
        run_layers(self.model, embed(self.model, x), 0, self.L, position_ids=pos, cache=cache)
        for layer in range(self.L):
            self._ck[layer], self._cv[layer] = cache.layers[layer].keys, cache.layers[layer].values

    @torch.no_grad()
    def run_stage(self, b: StageBatch) -> StageResult:
        """Run one explorer's batch: stage layers with the tree mask, readout and decode at d_k."""
        t0 = time.perf_counter()
        start, end = self.stage_layers(b.stage)
        n = len(b.sids)
        if b.stage == 0:
            h = embed(self.model, torch.tensor([b.tokens], device=self.device))
        else:
            h = torch.stack([self._hidden.pop(s) for s in b.sids]).unsqueeze(0)
        key_sids = sorted({a for anc in b.ancestors for a in anc})
        col = {s: j for j, s in enumerate(key_sids)}
        C = self._ck[0].shape[2]
        mask = torch.zeros(1, 1, n, C + len(key_sids) + n, dtype=torch.bool, device=self.device)
        mask[..., :C] = True
        for i, anc in enumerate(b.ancestors):
            for a in anc:
                mask[0, 0, i, C + col[a]] = True
            mask[0, 0, i, C + len(key_sids) + i] = True
        pos = torch.tensor([b.positions], device=self.device)
        view = _TreeView(self, b.sids, key_sids)
        backbone = self.model.model
        pe = backbone.rotary_emb(h, position_ids=pos)
        for layer in range(start, end):
            h = backbone.layers[layer](h, attention_mask=mask, position_embeddings=pe, position_ids=pos,
                                       cache=view, use_cache=True)
        final = end == self.L
        logits = readout_logits(self.model, h[0], None if final else self.adapters.get(end))
        cands = self.rule.decode_rows(logits, [q + 1 for q in b.positions], b.banned)
        if not final:
            for i, s in enumerate(b.sids):
                self._hidden[s] = h[0, i]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StageResult(cands=cands, seconds=time.perf_counter() - t0)

    def run_round(self, batches: list[StageBatch]) -> list[StageResult]:
        """Run every explorer's batch of this round in turn (they are independent within a round)."""
        return [self.run_stage(b) for b in batches]

    def commit(self, sid: int) -> None:
        """Move slot ``sid``'s KV (all layers) into the committed prefix."""
        for layer in range(self.L):
            k = self._tree_k[layer].pop(sid)
            v = self._tree_v[layer].pop(sid)
            self._ck[layer] = torch.cat([self._ck[layer], k.unsqueeze(0).unsqueeze(2)], dim=2)
            self._cv[layer] = torch.cat([self._cv[layer], v.unsqueeze(0).unsqueeze(2)], dim=2)

    def drop(self, sids) -> None:
        """Discard the KV and pending hidden states of collapsed slots."""
        for sid in sids:
            self._hidden.pop(sid, None)
            for layer in range(self.L):
                self._tree_k[layer].pop(sid, None)
                self._tree_v[layer].pop(sid, None)
