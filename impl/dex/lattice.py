"""The depth-position lattice of DEX (Sec. 3.2, Fig. 2): slots, slot chains, ancestry, collapse.

A *slot* is one sampling slot: an input token at position ``pos`` (under the prefix given by its
ancestor slots) whose hidden state is carried through the explorers' stages. The exploration tokens
(ETKs) of one slot at successive depths form its *slot chain*; candidate ``cands[k]`` is the token the
slot proposes for position ``pos + 1`` at depth d_k. Each new candidate opens a child slot at the next
position (position expansion) whose input token is that candidate. The *anchor* is the slot whose
input token is the last committed token; its final-depth candidate is the commit reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Slot:
    """One sampling slot.

    Attributes:
        sid: unique id (never reused within a decode).
        parent: sid of the slot that proposed this slot's input token, or None for the anchor whose
            input token is already committed.
        pos: absolute position (0-based) of the input token.
        token: input token id.
        stage: number of explorer stages completed (0..K).
        cands: candidate ids for position ``pos + 1``, one per completed stage (depth d_k at index k).
        children: stage index -> sid of the child slot opened from ``cands[k]``.
        born_round: the explorer round in which the slot was opened.
    """

    sid: int
    parent: int | None
    pos: int
    token: int
    stage: int = 0
    cands: list[int] = field(default_factory=list)
    children: dict[int, int] = field(default_factory=dict)
    born_round: int = 0


class Lattice:
    """The explore buffer: live slots, their ancestry, expansion and collapse.

    Args:
        num_stages: K, the number of explorers (|X|).
        dedupe: if True, a candidate equal to an earlier candidate of the same slot reuses that
            earlier child instead of opening an identical one (same prefix, same input token). Off by
            default: the paper's lattice is the full binary expansion.
    """

    def __init__(self, num_stages: int, *, dedupe: bool = False):
        if num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        self.K = num_stages
        self.dedupe = dedupe
        self.slots: dict[int, Slot] = {}
        self.anchor: int | None = None
        self._next = 0

    def open(self, parent: int | None, pos: int, token: int, round_: int) -> Slot:
        """Open a slot (position expansion) and return it."""
        s = Slot(self._next, parent, pos, token, born_round=round_)
        self._next += 1
        self.slots[s.sid] = s
        return s

    def ancestors(self, sid: int) -> list[int]:
        """Sids of the live ancestors of ``sid`` (nearest first); the committed prefix is not a slot."""
        out = []
        p = self.slots[sid].parent
        while p is not None and p in self.slots:
            out.append(p)
            p = self.slots[p].parent
        return out

    def prior_tokens(self, sid: int) -> list[int]:
        """Candidates already proposed by shallower depths of this slot chain (DECS Prior(i))."""
        return list(self.slots[sid].cands)

    def active(self) -> list[Slot]:
        """Slots that still have a stage to run (stage < K), in sid order."""
        return [s for s in sorted(self.slots.values(), key=lambda s: s.sid) if s.stage < self.K]

    def record(self, sid: int, cand: int, round_: int) -> int | None:
        """Record the candidate a slot produced at its current stage, advance it, and open the
        position-expansion child. Returns the child's sid (None when deduplicated onto an existing
        child, whose sid is then stored for this stage)."""
        s = self.slots[sid]
        k = s.stage
        s.cands.append(cand)
        s.stage += 1
        if self.dedupe:
            for j in range(k):
                if s.cands[j] == cand and j in s.children:
                    s.children[k] = s.children[j]
                    return None
        child = self.open(sid, s.pos + 1, cand, round_)
        s.children[k] = child.sid
        return child.sid

    def subtree(self, sid: int) -> set[int]:
        """``sid`` and all its live descendants."""
        keep = {sid}
        changed = True
        while changed:
            changed = False
            for s in self.slots.values():
                if s.sid not in keep and s.parent in keep:
                    keep.add(s.sid)
                    changed = True
        return keep

    def collapse(self, new_anchor: int) -> list[int]:
        """Keep exactly ``new_anchor`` and its descendants (their prefixes equal the new committed
        prefix); drop everything else, including the old anchor. Returns the dropped sids."""
        keep = self.subtree(new_anchor)
        dropped = [sid for sid in self.slots if sid not in keep]
        for sid in dropped:
            del self.slots[sid]
        self.slots[new_anchor].parent = None
        self.anchor = new_anchor
        return dropped
