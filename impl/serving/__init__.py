"""The serving evaluation protocol as a library (the vSkipper paper's, Sec. 4.1-4.2; App. F, G, M): arms,
open-loop load, knee, matched work, metrics and paired repetitions. Imports no paper package; the
vSkipper experiments built on it live in :mod:`impl.vskipper` (``serving_commands``, ``serving_report``,
``schema``, ``targets``, ``transfer``).

- :mod:`.arrivals`: seeded Poisson arrival schedules at an absolute offered rate;
- :mod:`.engine`: the one driver of transformers' continuous-batching manager (5.24), shared by the
  in-process arm and the vSkipper HTTP server;
- :mod:`.arms`: the arm interface; the in-process continuous-batching arm and the OpenAI
  ``/v1/completions`` streaming client arm;
- :mod:`.fake`: a deterministic queueing arm on a virtual clock (tests, dry runs);
- :mod:`.loadgen`: the open-loop load generator (no client concurrency cap, every request served to
  completion) and per-request records;
- :mod:`.metrics`: E2E / TTFT / TPOT, makespan, drain, TPS and RPS inside the injection window;
- :mod:`.knee`: the Q* rule and the 0.75 / 0.95 / 1.25 x Q* load points;
- :mod:`.matched`: matched-work replay and its per-request gate, the natural lane;
- :mod:`.protocol`: paired, order-alternating repetitions, percent-change summaries, JSONL rows;

Names are exported lazily (PEP 562), as in the paper packages: importing the package imports no
submodule (the engine driver imports torch), ``from impl.serving import X`` imports X's module.
"""

from __future__ import annotations

from ..registry import lazy_exports

#: exported name -> the submodule that defines it
_EXPORTS = {
    'Arm': '.arms',
    'Clock': '.arms',
    'ContinuousBatchingArm': '.inprocess',
    'HTTPCompletionsArm': '.arms',
    'RealClock': '.arms',
    'Trace': '.arms',
    'EngineDriver': '.engine',
    'EngineError': '.engine',
    'WorkloadHint': '.arms',
    'ArrivalSchedule': '.arrivals',
    'poisson_arrivals': '.arrivals',
    'FakeArm': '.fake',
    'VirtualClock': '.fake',
    'LOAD_FACTORS': '.knee',
    'KneeResult': '.knee',
    'find_knee': '.knee',
    'knee_sweep': '.knee',
    'load_points': '.knee',
    'LoadResult': '.loadgen',
    'Request': '.loadgen',
    'RequestRecord': '.loadgen',
    'hint_for': '.loadgen',
    'requests_from_prompts': '.loadgen',
    'run_load': '.loadgen',
    'MatchedWorkError': '.matched',
    'check_matched': '.matched',
    'natural_requests': '.matched',
    'record_lengths': '.matched',
    'replay_requests': '.matched',
    'cell_metrics': '.metrics',
    'distribution': '.metrics',
    'request_metrics': '.metrics',
    'COMPARED_METRICS': '.protocol',
    'CellError': '.protocol',
    'CellResult': '.protocol',
    'CellSpec': '.protocol',
    'arm_order': '.protocol',
    'cell_seed': '.protocol',
    'format_summary': '.protocol',
    'run_cell': '.protocol',
    'run_protocol': '.protocol',
    'schedule_seed': '.protocol',
    'stamp_rows': '.protocol',
    'summarize': '.protocol',
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
