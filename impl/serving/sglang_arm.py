"""Upstream SGLang as an engine arm of the serving protocol (issue "Upstream SGLang as a real engine arm",
item 2): the load generator, the knee sweep, matched-work replay and paired repetitions drive SGLang's
own server exactly as they drive the project's in-process engine.

:class:`SGLangArm` owns one :class:`~impl.serving.sglang_server.SGLangServer` for its whole life: the
server starts on the first :meth:`SGLangArm.start` (SGLang's start-up is 30-110 s on a 2-core CPU, far
too long to pay per run) and stops on :meth:`SGLangArm.close`. Every :meth:`SGLangArm.start` then gives
a run fresh state the way the in-process arm does, within what a server allows:

- ``POST /flush_cache`` (SGLang frees every cached prefix; the server runs with ``--disable-radix-cache``
  anyway, so no request of one run reuses another's K/V);
- ``warmup_requests`` requests of ``warmup_new_tokens`` tokens run to completion before the run's clock
  starts (excluded from timing, as the in-process arm's warm-up);
- a wait until :data:`RID_RELEASE_S` has passed since the previous run's last stream ended. SGLang
  (``TokenizerManager.create_abort_task``, 0.5.x) gives every streamed completion a background task that,
  2 s after the stream ends, aborts the request's ``rid`` if a request with that ``rid`` is live; the
  protocol reuses request ids on purpose (lanes and repetitions of a cell send the same ids, which
  request-hash routes depend on), so a request sent again within 2 s would be aborted by its
  predecessor's task (it ends with ``finish_reason`` "abort" and no tokens; such a request is an error,
  see :class:`~impl.serving.arms.HTTPCompletionsArm`).

Requests go to ``/v1/completions`` with ``stream: true`` (one thread per request, no concurrency cap),
the prompt as its **token ids** (never re-tokenized), ``ignore_eos: true`` on matched-work replay,
greedy, ``stream_options.include_usage`` so the output length is the server's own count, and the
request id as SGLang's ``rid`` (so a request-hash policy in a routed server sees the ids the in-process
engine sees; warm-up ids start with :data:`WARMUP_PREFIX`). A request
whose ``usage.prompt_tokens`` differs from ``len(input_ids)`` is failed with an error naming both: the
engine must have read exactly the prompt the other arms read (the serving protocol's counterpart of the
quality protocol's prompt-hash gate), so a failed request rejects the cell as any failure does.

Token times are the client's receive times of streamed chunks (``timestamp_source = "chunk"``), as for
every HTTP arm; SGLang streams one chunk per decode step (``stream_interval`` 1).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from .arms import Arm, HTTPCompletionsArm, RealClock, Trace, WorkloadHint
from .sglang_server import SGLangLaunch, SGLangServer

__all__ = ["RID_RELEASE_S", "SGLangArm", "WARMUP_PREFIX"]

log = logging.getLogger(__name__)

#: request-id prefix of the warm-up requests every :meth:`SGLangArm.start` sends after its cache flush; a
#: server-side model may read a warm-up's arrival as the start of a run (vSkipper's routed model resets its
#: mode controller there: :mod:`impl.vskipper.sglang_model`)
WARMUP_PREFIX = "__warmup_"

#: seconds a run waits after the previous run's last stream ended before it sends requests [s]: SGLang's
#: deferred disconnect-abort fires 2 s after a stream ends and aborts whatever request then holds that
#: ``rid`` (module docstring); 1 s of margin for a loaded event loop
RID_RELEASE_S = 3.0


class SGLangArm(Arm):
    """An :class:`~impl.serving.arms.Arm` served by upstream SGLang (module docstring).

    Args:
        launch: the server to start (:class:`~impl.serving.sglang_server.SGLangLaunch`).
        name: the arm's name in result rows (e.g. ``"upstream"``).
        log_path: the server's log file (default: a temporary file; its tail is quoted on failure).
        ready_timeout_s: start-up limit [s].
        request_timeout_s: socket timeout of each request [s].
        warmup_requests: requests run to completion in every :meth:`start` (0 disables).
        warmup_prompt: their prompt token ids. warmup_new_tokens: their length [tokens].
        server_per_run: False (default): the server starts on the first :meth:`start` and runs until
            :meth:`close`; True: every :meth:`start` starts it and :meth:`stop` shuts it down, so only the
            running arm's server holds the device (a GPU that cannot hold every arm's model at once), at the
            price of a start-up per run.

    Raises (from :meth:`start`):
        FileNotFoundError / RuntimeError: from :meth:`SGLangServer.start` (no SGLang interpreter, no
        model directory, the server died or did not answer; the log's tail in the message);
        RuntimeError: a warm-up request failed.
    """

    supports_ignore_eos = True

    def __init__(self, launch: SGLangLaunch, *, name: str = "upstream", log_path=None,
                 ready_timeout_s: float = 600.0, request_timeout_s: float = 600.0, warmup_requests: int = 1,
                 warmup_prompt: Sequence[int] = (1, 2, 3, 4), warmup_new_tokens: int = 2,
                 server_per_run: bool = False):
        if int(warmup_requests) < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {warmup_requests}")
        if int(warmup_requests) and not warmup_prompt:
            raise ValueError("warmup_prompt must hold at least one token id")
        self.launch = launch
        self.name = str(name)
        self.clock = RealClock()
        self.server = SGLangServer(launch, log_path=log_path, ready_timeout_s=ready_timeout_s)
        self.request_timeout_s = float(request_timeout_s)
        self.warmup_requests = int(warmup_requests)
        self.warmup_prompt = [int(t) for t in warmup_prompt]
        self.warmup_new_tokens = int(warmup_new_tokens)
        self.server_per_run = bool(server_per_run)
        self.server_starts = 0
        self.client: HTTPCompletionsArm | None = None
        self._prompt_lens: dict[str, int] = {}
        self._server_info: dict[str, Any] = {}
        self._streams_ended_at: float | None = None  # time.monotonic() when the last run's streams ended
        self.rid_release_waits_s: list[float] = []  # each start()'s wait for RID_RELEASE_S [s]
        self.runs = 0

    # ------------------------------------------------------------------ life cycle
    def start(self, hint: WorkloadHint | None = None) -> None:
        """Start the server on first use, flush its cache, run the warm-up; then accept requests."""
        if self.server.proc is None or self.server.proc.poll() is not None:
            if self.server.proc is not None:
                raise RuntimeError(f"arm {self.name!r}: the SGLang server exited with status "
                                   f"{self.server.proc.returncode}; log {self.server.log_path}:\n{self.server.log_tail()}")
            self.server.start()
            self.server_starts += 1
            self._streams_ended_at = None  # a fresh server holds no request ids
            self._server_info = self._get_json("/server_info")
            log.info("arm %s: SGLang %s up at %s after %.1f s", self.name, self._server_info.get("version"),
                     self.server.url, self.server.startup_s)
        self._post("/flush_cache")
        self.client = HTTPCompletionsArm(self.server.url, self.served_model_name, detokenize=None, name=self.name,
                                         ignore_eos_via="field", request_timeout_s=self.request_timeout_s,
                                         include_usage=True, send_rid=True)
        self.client.start(hint)
        self.runs += 1
        if self.warmup_requests:
            ids = [f"{WARMUP_PREFIX}{self.runs}_{i}" for i in range(self.warmup_requests)]
            for rid in ids:
                self.client.submit(rid, self.warmup_prompt, self.warmup_new_tokens, ignore_eos=True)
            bad = {r: t.error for r, t in self.client.wait(ids, self.request_timeout_s).items() if t.error}
            self.client.stop()
            if bad:
                raise RuntimeError(f"arm {self.name!r}: SGLang warm-up request failed: {bad}")
            self.client.start(hint)
        self._await_rid_release()
        self._prompt_lens = {}

    def _await_rid_release(self) -> None:
        """Sleep until :data:`RID_RELEASE_S` has passed since the previous run's streams ended (module
        docstring: SGLang aborts a reused ``rid`` within 2 s of its predecessor's end)."""
        waited = 0.0
        if self._streams_ended_at is not None:
            waited = max(0.0, self._streams_ended_at + RID_RELEASE_S - time.monotonic())
            if waited:
                log.info("arm %s: waiting %.2f s until SGLang has released the previous run's request ids",
                         self.name, waited)
                time.sleep(waited)
        self.rid_release_waits_s.append(round(waited, 3))

    def stop(self) -> None:
        """End the run (joins the request threads); the server keeps running until :meth:`close`, or, with
        ``server_per_run``, shuts down here (the next :meth:`start` starts a fresh one)."""
        if self.client is not None:
            self.client.stop()  # joins every request thread: each stream has ended
            self._streams_ended_at = time.monotonic()
        self.client = None
        if self.server_per_run and self.server.proc is not None:
            self.server.close()
            self.server.proc = None

    def close(self) -> None:
        """Stop the run and shut the server down (its whole process group)."""
        self.stop()
        self.server.close()

    def __enter__(self) -> "SGLangArm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ requests
    @property
    def served_model_name(self) -> str:
        """The ``model`` field of every request (SGLang's served name: the model path unless set)."""
        return self.launch.served_model_name or str(self.launch.model_dir)

    def submit(self, request_id: str, input_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool) -> None:
        """Send one streaming request with the prompt as token ids (see :meth:`HTTPCompletionsArm.submit`).

        Raises:
            RuntimeError: if not started; ValueError: an empty prompt, a duplicated id or
            ``max_new_tokens < 1``.
        """
        if self.client is None:
            raise RuntimeError(f"arm {self.name!r} is not started")
        if len(input_ids) == 0:
            raise ValueError(f"request {request_id!r}: empty prompt")
        self.client.submit(request_id, input_ids, max_new_tokens, ignore_eos)
        self._prompt_lens[str(request_id)] = len(input_ids)

    def wait(self, request_ids: Sequence[str], timeout_s: float) -> dict[str, Trace]:
        """The requests' traces (:meth:`HTTPCompletionsArm.wait`); a request whose server-side prompt
        length differs from the ids sent carries an error naming both."""
        if self.client is None:
            raise RuntimeError(f"arm {self.name!r} is not started")
        out = self.client.wait(request_ids, timeout_s)
        for rid, tr in out.items():
            sent = self._prompt_lens.get(rid)
            if tr.error is None and tr.prompt_tokens is not None and sent is not None and tr.prompt_tokens != sent:
                tr.error = (f"SGLang read {tr.prompt_tokens} prompt tokens, the request sent {sent}: the engine did "
                            "not see the prompt the other arms saw")
                tr.finish_time = None
        return out

    def describe(self) -> dict[str, Any]:
        """Engine, version, attention backend, launch flags and client settings (recorded in cell rows)."""
        info = self._server_info
        state = (info.get("internal_states") or [{}])[0] or {}
        return {"arm": self.name, "kind": type(self).__name__, "engine": "sglang",
                "sglang_version": info.get("version"),
                "attention_backend": info.get("attention_backend"),
                "sampling_backend": info.get("sampling_backend"), "dtype": info.get("dtype"),
                "device": self.launch.device, "max_total_tokens": state.get("max_total_num_tokens", info.get("max_total_tokens")),
                "startup_s": self.server.startup_s, "server_per_run": self.server_per_run,
                "server_starts": self.server_starts, "warmup_requests": self.warmup_requests,
                "rid_release_s": RID_RELEASE_S, "rid_release_waits_s": list(self.rid_release_waits_s),
                "endpoint": f"{self.server.url}/v1/completions" if self.server.port else None,
                "prompt_as": "token_ids", "ignore_eos_via": "field"}

    # ------------------------------------------------------------------ HTTP helpers
    def _get_json(self, path: str) -> dict:
        try:
            with urllib.request.urlopen(f"{self.server.url}{path}", timeout=60) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            log.warning("arm %s: GET %s failed (%s); rows will lack the server's settings", self.name, path, e)
            return {}

    def _post(self, path: str) -> None:
        req = urllib.request.Request(f"{self.server.url}{path}", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
        except urllib.error.HTTPError as e:  # SGLang answers 400 while requests are still running
            raise RuntimeError(f"arm {self.name!r}: SGLang {path} answered HTTP {e.code}: "
                               f"{e.read().decode('utf-8', 'replace')[:300]}") from None
