"""A deterministic stand-in arm on a virtual clock, for tests and dry runs of the protocol.

:class:`FakeArm` models a FIFO queue served by ``slots`` identical servers, one request per server
at a time: a request that arrives at ``a`` starts at ``s = max(a, earliest free server)``, its first
token comes ``prefill = (ttft_s + prefill_s_per_token * prompt_len) * f`` seconds later, and each next
token ``tpot_s * f`` seconds after the previous one (``f`` = 1, or a seeded per-run factor in
``[1 - jitter, 1 + jitter)`` so repetitions differ). Its output token rate therefore grows with the
offered rate until the servers saturate (about ``slots / tpot_s`` tokens/s for long outputs) and
then stays flat, which makes a knee. On :class:`VirtualClock` nothing sleeps: a whole cell runs in
milliseconds with exact, hand-checkable times.
"""

from __future__ import annotations

import copy
import heapq
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .arms import Arm, Clock, Trace, WorkloadHint

__all__ = ["VirtualClock", "FakeArm"]


class VirtualClock(Clock):
    """A clock that only moves when told: ``sleep_until(t)`` jumps to ``t`` at once.

    Args:
        t: initial time in seconds.
    """

    def __init__(self, t: float = 0.0):
        self.t = float(t)

    def now(self) -> float:
        """Current virtual time in seconds."""
        return self.t

    def sleep_until(self, t: float) -> None:
        """Advance the virtual time to ``t`` (never backwards)."""
        self.t = max(self.t, float(t))


class FakeArm(Arm):
    """Deterministic FIFO multi-server arm (module docstring); implements :class:`~impl.serving.arms.Arm`.

    Args:
        name: arm name.
        slots: servers working in parallel (>= 1).
        ttft_s: fixed prefill time per request, seconds.
        prefill_s_per_token: extra prefill time per prompt token, seconds.
        tpot_s: time between consecutive output tokens, seconds.
        natural_length: natural output length of a request (natural lane), a mapping
            ``request_id -> tokens`` or a callable ``(request_id, input_ids) -> tokens``; capped by
            ``max_new_tokens``. Default: ``max_new_tokens`` (never stops early).
        miscount: ``request_id -> delta`` added to the generated length in *every* lane (an engine
            that does not honour ``max_new_tokens`` / ignore-EOS exactly; for gate tests).
        fail: request ids that fail (error, no tokens).
        jitter: relative spread of the per-run service-time factor (0 = exactly deterministic).
        seed: seed of the per-run factor (run ``k`` uses ``default_rng([seed, k])``).
        clock: the arm's clock (default: a fresh :class:`VirtualClock`).
    """

    def __init__(self, name: str = "fake", *, slots: int = 1, ttft_s: float = 0.01, prefill_s_per_token: float = 0.0,
                 tpot_s: float = 0.005, natural_length: Mapping[str, int] | Callable[[str, list[int]], int] | None = None,
                 miscount: Mapping[str, int] | None = None, fail: Sequence[str] = (), jitter: float = 0.0,
                 seed: int = 0, clock: Clock | None = None):
        if int(slots) < 1:
            raise ValueError(f"slots must be >= 1, got {slots!r}")
        if not 0.0 <= float(jitter) < 1.0:
            raise ValueError(f"jitter must be in [0, 1), got {jitter!r}")
        self.name = str(name)
        self.slots = int(slots)
        self.ttft_s = float(ttft_s)
        self.prefill_s_per_token = float(prefill_s_per_token)
        self.tpot_s = float(tpot_s)
        self.natural_length = natural_length
        self.miscount = dict(miscount or {})
        self.fail = set(map(str, fail))
        self.jitter = float(jitter)
        self.seed = int(seed)
        self.clock = clock if clock is not None else VirtualClock()
        self.supports_ignore_eos = True
        self.runs = 0
        self.factor = 1.0
        self.submitted: list[tuple[str, int, bool]] = []  # (request_id, max_new_tokens, ignore_eos) of the last run
        self._free: list[float] | None = None
        self._traces: dict[str, Trace] = {}

    def start(self, hint: WorkloadHint | None = None) -> None:
        """Reset the queue (all servers free now) and draw this run's service-time factor."""
        if self._free is not None:
            raise RuntimeError(f"arm {self.name!r} is already started")
        self.runs += 1
        u = float(np.random.default_rng([self.seed, self.runs]).random())
        self.factor = 1.0 + self.jitter * (2.0 * u - 1.0)
        now = self.clock.now()
        self._free = [now] * self.slots
        self._traces = {}
        self.submitted = []

    def _length(self, rid: str, ids: list[int], max_new: int, ignore_eos: bool) -> int:
        n = max_new
        if not ignore_eos and self.natural_length is not None:
            nat = (self.natural_length.get(rid, max_new) if isinstance(self.natural_length, Mapping)
                   else self.natural_length(rid, ids))
            n = min(max_new, int(nat))
        return max(0, n + int(self.miscount.get(rid, 0)))

    def submit(self, request_id: str, input_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool) -> None:
        """Schedule the request on the earliest free server; its trace is known at once.

        Raises:
            RuntimeError: if not started; ValueError: for a duplicated id or ``max_new_tokens < 1``.
        """
        if self._free is None:
            raise RuntimeError(f"arm {self.name!r} is not started")
        rid = str(request_id)
        if rid in self._traces:
            raise ValueError(f"duplicate request id {rid!r}")
        if int(max_new_tokens) < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens must be >= 1")
        ids = [int(t) for t in input_ids]
        self.submitted.append((rid, int(max_new_tokens), bool(ignore_eos)))
        tr = Trace(rid, prompt_tokens=len(ids), max_new_tokens=int(max_new_tokens), timestamp_source="model", done=True)
        if rid in self.fail:
            tr.error = "injected failure"
            self._traces[rid] = tr
            return
        a = self.clock.now()
        start = max(a, heapq.heappop(self._free))
        n = self._length(rid, ids, int(max_new_tokens), bool(ignore_eos))
        first = start + (self.ttft_s + self.prefill_s_per_token * len(ids)) * self.factor
        step = self.tpot_s * self.factor
        tr.token_times = [first + k * step for k in range(n)]
        tr.token_ids = [(sum(ids) + k) % 97 for k in range(n)]
        tr.output_tokens = n
        tr.finish_time = tr.token_times[-1] if n else first
        tr.finish_reason = "length" if n >= int(max_new_tokens) else "stop"
        heapq.heappush(self._free, tr.finish_time)
        self._traces[rid] = tr

    def wait(self, request_ids: Sequence[str], timeout_s: float) -> dict[str, Trace]:
        """Advance the clock to the last finish among the requests (capped at ``timeout_s`` from
        now; later ones then carry a timeout error) and return copies of their traces.

        Raises:
            KeyError: for an id never submitted.
        """
        ids = [str(r) for r in request_ids]
        missing = [r for r in ids if r not in self._traces]
        if missing:
            raise KeyError(f"never submitted to arm {self.name!r}: {missing[:10]}")
        deadline = self.clock.now() + float(timeout_s)
        finishes = [self._traces[r].finish_time for r in ids if self._traces[r].finish_time is not None]
        self.clock.sleep_until(min(max(finishes, default=self.clock.now()), deadline))
        out = {}
        for r in ids:
            tr = copy.deepcopy(self._traces[r])
            if tr.finish_time is not None and tr.finish_time > deadline:
                tr.error, tr.finish_time = f"not finished within {timeout_s:.1f} s", None
            out[r] = tr
        return out

    def stop(self) -> None:
        """Forget the queue (safe when not started)."""
        self._free = None

    def describe(self) -> dict[str, Any]:
        """Declared settings: the model parameters and this run's factor."""
        return {"arm": self.name, "kind": type(self).__name__, "slots": self.slots, "ttft_s": self.ttft_s,
                "prefill_s_per_token": self.prefill_s_per_token, "tpot_s": self.tpot_s, "jitter": self.jitter,
                "seed": self.seed, "factor": self.factor}
