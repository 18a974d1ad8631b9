"""Upstream SGLang's HTTP server as a subprocess of the harness (issue "Upstream SGLang as a real engine arm").

SGLang pins its own torch, so it lives in its own environment (``scripts/setup_sglang.sh``: ``.venv-sglang``,
sglang 0.5.23) and the harness talks to it over HTTP only. :class:`SGLangServer` starts
``python -m sglang.launch_server`` from that environment, waits until it answers, and stops it with its
whole process group; :func:`launch_args` and :func:`server_env` are the command line and environment it
uses, so a user can run the same server by hand.

On ``device="cpu"`` three things are needed that a GPU cluster does not need (measured on this 2-core
CPU, sglang 0.5.23):

- ``SGLANG_USE_CPU_ENGINE=1`` and the harness's CPU import workaround first on ``PYTHONPATH``
  (:data:`CPU_SHIM_DIR`, the package docstring of ``sglang_cpu/sgl_kernel`` says what it does): the
  PyPI ``sgl_kernel`` is CUDA-only and the server otherwise dies on an import;
- ``--attention-backend torch_native --sampling-backend pytorch``;
- ``--dtype float32`` (a float32 checkpoint is otherwise served in float16), ``--max-total-tokens``
  (otherwise 0.2 of host memory becomes KV cache: 1.37M tokens for SmolLM2-135M) and ``--sleep-on-idle``
  (otherwise the scheduler spins a core while idle, which would slow every other job).

``--disable-radix-cache`` is on for every device: the vSkipper protocol compares engines on matched
work, and a prefix cache would let repeated prompts skip their prefill.

:func:`greedy_ids` reads greedy token ids and their log-probabilities back from SGLang's native
``/generate`` endpoint (token-id prompts, EOS ignored), the reference comparison of
:func:`impl.vskipper.sglang_check.check_greedy_against_transformers`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

__all__ = [
    "CPU_SHIM_DIR",
    "DEFAULT_SGLANG_PYTHON",
    "NO_GRAPHS",
    "SGLangLaunch",
    "SGLangServer",
    "greedy_ids",
    "launch_args",
    "no_graph_capture",
    "server_env",
]

#: the harness's CPU import workaround, put first on the server's PYTHONPATH on ``device="cpu"``
CPU_SHIM_DIR = Path(__file__).resolve().parent / "sglang_cpu"
#: the repository root (the folder holding ``impl``), put on the server's PYTHONPATH for an external model package
REPO_ROOT = Path(__file__).resolve().parents[2]
#: where ``scripts/setup_sglang.sh`` installs SGLang (relative to the repository root)
DEFAULT_SGLANG_PYTHON = ".venv-sglang/bin/python"
_DTYPES = ("float32", "bfloat16", "float16")
#: ``launch_server`` arguments that turn graph capture off (CUDA graphs, and SGLang's CPU graphs) for decode and
#: prefill: every step then runs the model's Python forward
NO_GRAPHS = ("--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled")


@dataclass(frozen=True)
class SGLangLaunch:
    """How to start one SGLang server.

    Attributes:
        model_dir: a Hugging Face model directory (``config.json``, weights, tokenizer).
        python: the SGLang environment's interpreter (:data:`DEFAULT_SGLANG_PYTHON`).
        device: ``cpu`` (adds the CPU flags, environment and import workaround) or ``cuda``.
        dtype: served dtype (``float32``, ``bfloat16``, ``float16``).
        host, port: where the server listens (port 0: a free port is picked before the start).
        max_total_tokens: KV-cache size in tokens (``--max-total-tokens``; None: SGLang's own sizing,
            only sensible on a GPU).
        attention_backend: ``--attention-backend`` (None: ``torch_native`` on CPU, SGLang's choice on GPU).
        threads: torch threads of the server process on CPU (``OMP_NUM_THREADS``; None: inherited).
        served_model_name: the ``model`` name the server answers to (None: the directory path).
        external_model_package: a package of out-of-tree model classes (``SGLANG_EXTERNAL_MODEL_PACKAGE``),
            importable from this repository's root, which then goes on the server's ``PYTHONPATH``
            (``impl.vskipper.sglang_model``: vSkipper's routed Llama); None: SGLang's own models only.
        extra_args: further ``launch_server`` arguments, verbatim.

    Raises:
        ValueError: for an unknown device or dtype, or a non-positive ``max_total_tokens`` / ``threads``.
    """

    model_dir: str | os.PathLike
    python: str | os.PathLike = DEFAULT_SGLANG_PYTHON
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 0
    max_total_tokens: int | None = 16384
    attention_backend: str | None = None
    threads: int | None = None
    served_model_name: str | None = None
    external_model_package: str | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"SGLangLaunch.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"SGLangLaunch.dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.max_total_tokens is not None and int(self.max_total_tokens) < 1:
            raise ValueError(f"SGLangLaunch.max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.threads is not None and int(self.threads) < 1:
            raise ValueError(f"SGLangLaunch.threads must be >= 1, got {self.threads}")


def no_graph_capture(launch: "SGLangLaunch") -> "SGLangLaunch":
    """``launch`` with graph capture off (:data:`NO_GRAPHS` appended), unless its ``extra_args`` already set a
    ``--cuda-graph-backend*`` flag (the user's choice is kept)."""
    extra = tuple(launch.extra_args)
    if any(a.startswith("--cuda-graph-backend") for a in extra):
        return launch
    return replace(launch, extra_args=extra + NO_GRAPHS)


def launch_args(launch: SGLangLaunch, port: int) -> list[str]:
    """The server's command line: ``[python, -m, sglang.launch_server, ...]`` (module docstring: which
    flags and why)."""

    args = [str(launch.python), "-m", "sglang.launch_server", "--model-path", str(launch.model_dir),
            "--host", launch.host, "--port", str(int(port)), "--dtype", launch.dtype, "--disable-radix-cache"]
    if launch.device == "cpu":
        args += ["--device", "cpu", "--attention-backend", launch.attention_backend or "torch_native",
                 "--sampling-backend", "pytorch", "--sleep-on-idle"]
    elif launch.attention_backend:
        args += ["--attention-backend", launch.attention_backend]
    if launch.max_total_tokens is not None:
        args += ["--max-total-tokens", str(int(launch.max_total_tokens))]
    if launch.served_model_name:
        args += ["--served-model-name", launch.served_model_name]
    return args + [str(a) for a in launch.extra_args]


def server_env(launch: SGLangLaunch, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default: this process's) plus, on CPU,
    ``SGLANG_USE_CPU_ENGINE=1``, :data:`CPU_SHIM_DIR` first on ``PYTHONPATH`` and ``OMP_NUM_THREADS``
    when ``threads`` is set; with ``external_model_package``, ``SGLANG_EXTERNAL_MODEL_PACKAGE`` and
    :data:`REPO_ROOT` on ``PYTHONPATH`` (after the shim); always offline (``HF_HUB_OFFLINE=1``: the model is
    a local directory)."""

    env = dict(os.environ if base is None else base)
    env["HF_HUB_OFFLINE"] = "1"
    if launch.external_model_package:
        env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = launch.external_model_package
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if launch.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(CPU_SHIM_DIR), *filter(None, [env.get("PYTHONPATH")])])
        if launch.threads is not None:
            env["OMP_NUM_THREADS"] = str(int(launch.threads))
    return env


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SGLangServer:
    """One SGLang server process (a context manager): ``with SGLangServer(launch) as srv: srv.url``.

    Args:
        launch: what to start (:class:`SGLangLaunch`).
        log_path: the server's stdout + stderr (default: a new file in the system's temporary
            directory); its tail is quoted when the start fails.
        ready_timeout_s: how long :meth:`start` waits for ``/health_generate`` to answer 200 (SGLang's
            start-up took 72-107 s on this 2-core CPU).

    Raises (from :meth:`start`):
        FileNotFoundError: for a missing interpreter or model directory; RuntimeError: when the process
            exits or does not answer within ``ready_timeout_s`` (the log's tail in the message).
    """

    def __init__(self, launch: SGLangLaunch, *, log_path: str | os.PathLike | None = None,
                 ready_timeout_s: float = 600.0):
        self.launch = launch
        self.log_path = Path(log_path) if log_path else None
        self.ready_timeout_s = float(ready_timeout_s)
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the SGLang server is not started")
        return f"http://{self.launch.host}:{self.port}"

    def start(self) -> "SGLangServer":
        """Start the process and wait until it generates (``/health_generate``); returns self."""

        py = Path(self.launch.python)
        if not py.exists():
            raise FileNotFoundError(f"no SGLang interpreter at {py} (run scripts/setup_sglang.sh)")
        if not (Path(self.launch.model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"no model directory at {self.launch.model_dir} (config.json missing)")
        self.port = int(self.launch.port) or _free_port(self.launch.host)
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="sglang_server_", suffix=".log")[1])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(launch_args(self.launch, self.port), env=server_env(self.launch),
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        try:
            self._wait_ready(t0)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the SGLang server exited with status {self.proc.returncode} during start-up; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.perf_counter() - t0 > self.ready_timeout_s:
                raise RuntimeError(f"the SGLang server did not answer within {self.ready_timeout_s:.0f} s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(1.0)

    def log_tail(self, n_chars: int = 3000) -> str:
        """The last ``n_chars`` of the server's log ('' when there is none)."""
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:] if self.log_path else ""
        except OSError:
            return ""

    def close(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server's process group (SGLang runs a scheduler and a detokenizer process),
        SIGKILL after ``grace_s``. The group is signalled even when its leader has already exited (its
        children may outlive it)."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:  # nothing left in the group
                return
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:  # the leader is gone: make sure its children are too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            return

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _post_json(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def greedy_ids(url: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, concurrent: bool = True,
               timeout_s: float = 600.0, rids: Sequence[str] | None = None) -> list[dict]:
    """Greedy completions of token-id prompts from SGLang's native ``/generate`` (temperature 0, EOS
    ignored, exactly ``max_new_tokens`` tokens each).

    Args:
        url: the server root (:attr:`SGLangServer.url`).
        prompts: token-id prompts (non-empty lists of ints).
        max_new_tokens: tokens per prompt.
        concurrent: True: every prompt in flight at once (SGLang batches them); False: one at a time.
        rids: optional request ids, one per prompt (SGLang's ``rid``; request-hash skip policies hash it).

    Returns:
        one dict per prompt, in order: ``output_ids`` (list[int]) and ``logprobs`` (list[float], the
        server's log-probability of each output token).

    Raises:
        ValueError: for an empty prompt or a response without ``max_new_tokens`` output tokens;
        urllib.error.URLError / HTTPError: when the server fails a request.
    """

    if any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_ids: every prompt needs at least one token")
    if rids is not None and (len(rids) != len(prompts) or len(set(map(str, rids))) != len(rids)):
        raise ValueError("greedy_ids: rids must be unique, one per prompt")

    def one(i: int) -> dict:
        body = {
            "input_ids": [int(t) for t in prompts[i]], "return_logprob": True, "logprob_start_len": -1,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_new_tokens), "ignore_eos": True},
        }
        if rids is not None:
            body["rid"] = str(rids[i])
        out = _post_json(f"{url.rstrip('/')}/generate", body, timeout_s)
        lp = (out.get("meta_info") or {}).get("output_token_logprobs") or []
        ids = [int(t[1]) for t in lp] if lp else [int(t) for t in out.get("output_ids") or []]
        if len(ids) != int(max_new_tokens):
            raise ValueError(f"SGLang returned {len(ids)} output tokens, expected {max_new_tokens}")
        return {"output_ids": ids, "logprobs": [float(t[0]) for t in lp]}

    if not concurrent:
        return [one(i) for i in range(len(prompts))]
    with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as ex:
        return list(ex.map(one, range(len(prompts))))
