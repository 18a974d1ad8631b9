"""Routed vSkipper arms on upstream SGLang: the model directory, the launch and the arm (harness side).

:mod:`impl.vskipper.sglang_model` is the out-of-tree model SGLang serves; this module, which never imports
SGLang, prepares what that server reads: a model directory whose ``config.json`` names
``VSkipperLlamaForCausalLM`` and carries the skip policy and mode switch, and the
:class:`~impl.serving.sglang_server.SGLangLaunch` that registers the package (``SGLANG_EXTERNAL_MODEL_PACKAGE``)
with this repository on the server's path. :class:`RoutedSGLangArm` is a serving-protocol arm on such a
server: the served hybrid, always-route or a mechanism ablation of vSkipper Sec. 4 on SGLang, as
:class:`impl.serving.sglang_arm.SGLangArm` is the upstream arm.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from impl.serving.sglang_arm import SGLangArm
from impl.serving.sglang_server import NO_GRAPHS, SGLangLaunch, no_graph_capture
from impl.vskipper.mode import ModeSwitch
from impl.vskipper.schema import SGLANG_ROUTED_ARCHITECTURES

__all__ = ["ARCHITECTURE", "PACKAGE", "NO_GRAPHS", "write_routed_model_dir", "routed_launch", "RoutedSGLangArm"]

#: the class name SGLang looks up in the checkpoint's ``architectures``
ARCHITECTURE = "VSkipperLlamaForCausalLM"
#: the package SGLang imports model classes from (``SGLANG_EXTERNAL_MODEL_PACKAGE``)
PACKAGE = "impl.vskipper.sglang_model"


def write_routed_model_dir(model_dir: str | os.PathLike, out_dir: str | os.PathLike, policy: str,
                           kwargs: Mapping[str, Any] | None = None, *, switch: ModeSwitch | None = None,
                           check_kv: bool = False, stats_path: str | os.PathLike | None = None,
                           stats_modes: bool = False) -> Path:
    """Write ``out_dir``: the files of ``model_dir`` as symbolic links, and its ``config.json`` with
    ``architectures = ["VSkipperLlamaForCausalLM"]`` and a ``vskipper`` entry (``policy``, ``kwargs``,
    ``switch``, ``check_kv``, ``stats_path``; :mod:`impl.vskipper.sglang_model.vskipper_llama`).

    Args:
        model_dir: a Hugging Face Llama-family directory (``architectures`` ``LlamaForCausalLM``).
        out_dir: the routed directory to write (created; its previous links and config are replaced).
        policy: a skip-policy name of :func:`impl.vskipper.skipper.build_skipper` (``random``, ``flexidepth``...).
        kwargs: the policy's arguments, JSON-serialisable (RandomSkip: ``routed_layers``, ``r``, ``d``,
            ``seed``; FlexiDepth: ``checkpoint``, an absolute path).
        switch: the mode switch the server runs (vSkipper Sec. 3.3: the served hybrid, or an ablation's
            switch); None: every request routed in both phases (always-route).
        check_kv: check Invariant 1 on the server's KV pool after every routed layer (costs one extra
            K/V projection of the Project-Only rows; for tests and diagnostics).
        stats_path: optional JSON file the server rewrites after every step with its (RUN, Project-Only)
            counts per phase, the mode controller's summary and the K/V check.
        stats_modes: with ``stats_path``, also every request's modes (prefill mode, first routed decode
            position), for a plain-PyTorch replay; grows with the requests served.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        FileNotFoundError: when ``model_dir`` has no ``config.json``.
        ValueError: for a model that is not ``LlamaForCausalLM`` or ``kwargs`` that are not JSON.
    """
    src, out = Path(model_dir).resolve(), Path(out_dir)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{src}: no config.json (a Hugging Face model directory is needed)")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in SGLANG_ROUTED_ARCHITECTURES:
        raise ValueError(f"{src}: vSkipper on SGLang serves LlamaForCausalLM checkpoints, got architectures {archs}")
    spec: dict[str, Any] = {"policy": str(policy), "kwargs": dict(kwargs or {})}
    if switch is not None:
        spec["switch"] = switch.to_dict()
    if check_kv:
        spec["check_kv"] = True
    if stats_path is not None:
        spec["stats_path"] = str(Path(stats_path).resolve())
        if stats_modes:
            spec["stats_modes"] = True
    try:
        json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"vSkipper policy arguments must be plain JSON: {e}") from e
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.name == "config.json":
            continue
        link = out / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f)
    cfg["architectures"] = [ARCHITECTURE]
    cfg["vskipper"] = spec
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


# Every routed server runs with graph capture off (NO_GRAPHS, impl.serving.sglang_server): a routed step's control
# flow depends on the batch (the route tape's all-RUN flags, the cohorts' sizes, the mode controller's decisions
# on the host), so a captured graph would replay the routes of the step it was captured on.


def routed_launch(launch: SGLangLaunch, routed_dir: str | os.PathLike | None = None) -> SGLangLaunch:
    """``launch`` with the vSkipper model package registered and graph capture off (:data:`NO_GRAPHS`).

    Args:
        launch: the server settings; its ``model_dir`` is a directory from :func:`write_routed_model_dir`
            unless ``routed_dir`` is given.
        routed_dir: serve this routed directory (from :func:`write_routed_model_dir`) instead, answering to
            the name ``launch`` answers to (its ``served_model_name``, else its ``model_dir``), so requests
            name the base model on every arm.
    """
    launch = no_graph_capture(launch)
    if routed_dir is not None:
        launch = replace(launch, model_dir=Path(routed_dir),
                         served_model_name=launch.served_model_name or str(launch.model_dir))
    return replace(launch, external_model_package=PACKAGE)


class RoutedSGLangArm(SGLangArm):
    """A routed vSkipper arm served by upstream SGLang (vSkipper Sec. 3 inside SGLang, Sec. 4's arms).

    At construction it writes a routed model directory for ``launch.model_dir`` into a private temporary
    folder (removed by :meth:`close`) with the policy, the switch and a stats file; the server starts on
    the first :meth:`start`, as for :class:`~impl.serving.sglang_arm.SGLangArm`, and every
    :meth:`start`'s warm-up gives the server's mode controller a fresh state (one run, one controller, as
    the in-process arm installs a fresh planner after its warm-up). The server answers to the base
    model's name, so requests name the same ``model`` on every arm.

    Args:
        launch: the server settings for the *base* model directory (a Llama-family checkpoint).
        policy, kwargs: the skip policy (:func:`impl.vskipper.skipper.build_skipper`; FlexiDepth:
            ``{"checkpoint": DIR}``, made absolute here; RandomSkip: ``routed_layers``, ``r``, ``d``, ``seed``).
        switch: the mode switch (None: always-route).
        name: the arm's name in result rows. Further keyword arguments go to ``SGLangArm``.

    Raises:
        FileNotFoundError / ValueError: from :func:`write_routed_model_dir`, before any server starts.
    """

    def __init__(self, launch: SGLangLaunch, policy: str, kwargs: Mapping[str, Any] | None = None, *,
                 switch: ModeSwitch | None = None, name: str = "vskipper", **arm_kwargs):
        kw = dict(kwargs or {})
        if "checkpoint" in kw:
            kw["checkpoint"] = str(Path(kw["checkpoint"]).resolve())
        self._workdir = tempfile.TemporaryDirectory(prefix=f"vskipper-sglang-{name}-")
        work = Path(self._workdir.name)
        self.stats_path = work / "route_stats.json"
        try:
            routed = write_routed_model_dir(launch.model_dir, work / "model", policy, kw, switch=switch,
                                            stats_path=self.stats_path)
        except Exception:
            self._workdir.cleanup()
            raise
        self.policy, self.policy_kwargs, self.switch = str(policy), kw, switch
        super().__init__(routed_launch(launch, routed), name=name, **arm_kwargs)

    def route_stats(self) -> dict | None:
        """The server's latest stats (counts per phase since the last run started, the mode controller's
        summary), or None before the first routed step."""
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return None

    def describe(self) -> dict[str, Any]:
        """:meth:`SGLangArm.describe` plus the policy, the switch, and, as the in-process arm records its
        planner's, the mode controller's ``planner_summary`` of the last run and the routed (RUN,
        Project-Only) counts per phase."""
        stats = self.route_stats() or {}
        out = {**super().describe(), "mode": "routed", "policy": self.policy, "policy_kwargs": self.policy_kwargs,
               "planner": None if self.switch is None else "ModeController",
               "switch": None if self.switch is None else self.switch.to_dict(),
               "route_counts": stats.get("counts")}
        if stats.get("mode") is not None:
            out["planner_summary"] = stats["mode"]
        return out

    def close(self) -> None:
        """Shut the server down and remove the routed model directory."""
        try:
            super().close()
        finally:
            self._workdir.cleanup()
