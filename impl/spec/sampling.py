"""Decoding rules shared by AR and the lossless methods: greedy argmax, and Gumbel-max sampling with
noise that is a pure function of (seed, token position).

Because the noise row for position p depends only on (seed, p), any method that decodes the
final-depth logits of position p with the same row commits exactly the token AR samples there
(Gumbel-max trick, DEX Sec. 3.3 / App. C.1); that is the sampling-exactness test of every method.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def gumbel_row(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel(0, 1) noise ``[vocab_size]`` float32 for one token position.

    Args:
        seed: run seed (int >= 0).
        position: absolute token position (0-based index in the full sequence).
        vocab_size: V.

    Returns:
        float32 tensor ``[V]``; identical for identical (seed, position, V) on any device.
    """
    key = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key, "little") & ((1 << 63) - 1))
    u = torch.rand(vocab_size, generator=g, dtype=torch.float64).clamp_(1e-20, 1.0 - 1e-12)
    return (-torch.log(-torch.log(u))).to(torch.float32).to(device)


@dataclass(frozen=True)
class DecodeRule:
    """Final-depth decoding rule R.

    Attributes:
        temperature: 0 for greedy argmax; > 0 for Gumbel-max sampling of softmax(logits / T).
        seed: seed of the per-position Gumbel noise (ignored when greedy).
    """

    temperature: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def decode(self, logits: torch.Tensor, position: int, banned: list[int] | None = None) -> int:
        """Token for ``position`` from ``logits`` ``[V]`` (float), with ``banned`` ids masked to -inf.

        Greedy: argmax (ties to the lowest id). Sampling: argmax(logits / T + G[position]).
        """
        z = logits.float()
        if banned:
            z = z.clone()
            z[torch.tensor(sorted(set(banned)), device=z.device)] = float("-inf")
        if self.greedy:
            return int(torch.argmax(z))
        g = gumbel_row(self.seed, position, z.shape[-1], z.device)
        return int(torch.argmax(z / self.temperature + g))

    def decode_rows(self, logits: torch.Tensor, positions: list[int], banned: list[list[int]] | None = None) -> list[int]:
        """Vectorised :meth:`decode` over rows: ``logits`` ``[B, V]``, one position and one banned list
        per row. Returns B token ids, identical to calling :meth:`decode` row by row."""
        z = logits.float().clone()
        if banned:
            rows = [i for i, b in enumerate(banned) for _ in b]
            cols = [t for b in banned for t in b]
            if rows:
                z[torch.tensor(rows, device=z.device), torch.tensor(cols, device=z.device)] = float("-inf")
        if self.greedy:
            return z.argmax(dim=-1).tolist()
        uniq = sorted(set(positions))
        table = torch.stack([gumbel_row(self.seed, p, z.shape[-1], z.device) for p in uniq])
        idx = torch.tensor([uniq.index(p) for p in positions], device=z.device)
        return (z / self.temperature + table[idx]).argmax(dim=-1).tolist()
