"""What the harness's ``torchrun`` commands share: DEX with one rank per explorer
(:mod:`impl.dex.distributed`), PEARL's target and draft ranks (:mod:`impl.spec.pearl_distributed`) and
tensor parallelism (:mod:`impl.spec.tensor_parallel`).

* :class:`Ranks`: this process's place in the job, from torchrun's environment.
* :func:`add_run_args`: the arguments every such command takes (prompts, output, budget, warm-up,
  threads, process-group timeout, device), with one meaning everywhere.
* :func:`fail`: the one-line refusal every rank prints before the process group starts (exit 2).
* :func:`select_device` / :func:`init_process_group`: one GPU per rank (NCCL) or CPU (gloo), the same
  rule in every command.
* :func:`usable_prompts`: the prompts every rank accepts, in order (the warm-up takes the first ones).

Every rank runs the same checks on the same inputs, so all ranks refuse together or none does: a rank
that refused alone would leave the others waiting in the process group until its timeout.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from .argtypes import ArgumentParser, nonneg_int, output_file, positive_float, positive_int

__all__ = ["Ranks", "add_run_args", "fail", "select_device", "init_process_group", "usable_prompts"]


@dataclass(frozen=True)
class Ranks:
    """This process in a torchrun job: global ``rank`` of ``world`` ranks, ``local_rank`` of
    ``local_world`` ranks on this node. Outside torchrun: rank 0 of 1."""

    rank: int
    world: int
    local_rank: int
    local_world: int

    @classmethod
    def from_env(cls) -> "Ranks":
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (torchrun sets all four)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(rank=int(os.environ.get("RANK", "0")), world=world,
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   local_world=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def add_run_args(ap: ArgumentParser, *, prompts_help: str = "JSONL rows with id and input_ids") -> ArgumentParser:
    """Add the arguments every torchrun command takes: ``--prompts --out --max-new-tokens --n-prompts
    --ignore-eos --warmup-prompts --threads --timeout-s --device``. Returns ``ap``."""
    ap.add_argument("--prompts", required=True, help=prompts_help)
    ap.add_argument("--out", type=output_file, required=True, help="JSONL file rank 0 writes, one row per prompt")
    ap.add_argument("--max-new-tokens", type=positive_int, default=64)
    ap.add_argument("--n-prompts", type=positive_int, default=None, help="decode only the first N prompts")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--warmup-prompts", type=nonneg_int, default=1,
                    help="decode the first N usable prompts once, unrecorded, before the recorded pass "
                         "(every prompt, these included, is then decoded and recorded)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    ap.add_argument("--timeout-s", type=positive_float, default=600.0, help="process-group timeout [s]")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="cpu hides the GPUs (gloo); cuda needs one GPU per rank on each node (NCCL); "
                         "auto: cuda when there are that many GPUs, else cpu")
    return ap


def fail(rank: int, msg: str) -> NoReturn:
    """Print ``[rank R] error: MSG`` to stderr and exit with status 2 (a usage error)."""
    print(f"[rank {rank}] error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def select_device(spec: str, ranks: Ranks) -> torch.device:
    """The device of this rank: ``cuda:<local_rank>`` when every rank on this node has a GPU of its own
    (NCCL cannot run two ranks on one GPU), else CPU with the GPUs hidden (``CUDA_VISIBLE_DEVICES=""``,
    set before anything else asks CUDA: transformers' tensor-parallel mesh follows the accelerator).

    Args:
        spec: ``cpu``, ``cuda`` (one GPU per rank required) or ``auto`` (cuda when possible).
        ranks: this process's :class:`Ranks`.

    Raises:
        ValueError: ``cuda`` without a GPU per rank on this node, or an unknown ``spec``.
    """
    if spec not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {spec!r}")
    if spec == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return torch.device("cpu")
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpu >= ranks.local_world:
        return torch.device("cuda", ranks.local_rank)
    if spec == "cuda":
        raise ValueError(f"--device cuda needs one GPU per rank: {ranks.local_world} ranks on this node, "
                         f"{n_gpu} GPUs visible (start at most that many ranks per node, or pass --device cpu)")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return torch.device("cpu")


def init_process_group(device: torch.device, timeout_s: float = 600.0) -> str:
    """Start the default process group from torchrun's environment: NCCL (bound to ``device``) for a
    CUDA device, gloo for CPU. Returns the backend's name; a no-op when the group already exists."""
    if dist.is_initialized():
        return dist.get_backend()
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return backend


def usable_prompts(prompts: list[dict], check: Callable[[dict], list[int]]) -> list[list[int]]:
    """The ids ``check`` returns for each prompt it accepts (it raises ValueError for the others), in
    prompt order. Every rank calls it with the same prompts and the same check, so all ranks agree on
    which prompts they decode (and which ones the warm-up takes)."""
    ids = []
    for p in prompts:
        try:
            ids.append(check(p))
        except ValueError:
            continue
    return ids
