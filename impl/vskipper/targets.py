"""File layout, rule signatures and resources of the vSkipper Table 6 (cross-model) and Table 7 (hardware
transfer) targets (vSkipper Sec. 4.4): parse-time helpers of ``workflows/vskipper.smk``, kept here so the
workflow holds rules only. Imports nothing heavy (no torch, no pandas).

A *target* is one row of Table 6 or 7: the main run (``vskipper.model`` on the config's device) or an extra
one (:func:`impl.vskipper.schema.target_config`). Extra targets write under ``{vsk_dir}/models/{model}/`` and
``{vsk_dir}/devices/{name}/`` the same files the main run writes under ``{vsk_dir}/``.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from impl.provenance import config_hash

__all__ = ["target_sig", "transfer_targets", "target_files", "target_args", "device_resources"]


def target_sig(tcfg: Mapping[str, Any], top: Iterable[str], vsk_keys: Iterable[str]) -> str:
    """Rule signature (a ``params`` value: a change re-runs the job) of an extra target: the config hash of
    its effective config's top-level keys ``top`` and ``vskipper`` keys ``vsk_keys``, the same keys the main
    rule's ``sig`` covers."""

    return config_hash({**{k: tcfg.get(k) for k in top}, "vsk": {k: tcfg["vskipper"].get(k) for k in vsk_keys}})


def _target(vsk_dir: str, name: str, role: str, root: str, workload: str, point: str, *,
            flexidepth: str | None = None, quality: bool = False) -> dict[str, str]:
    d = {"name": name, "role": role, "knee": f"{root}/knee/{workload}.json",
         "cell": f"{root}/cells/{workload}/{point}.jsonl", "thresholds": f"{root}/thresholds/flexidepth.json"}
    if flexidepth:
        d["flexidepth"] = flexidepth
    if quality:
        d["quality"] = f"{root}/quality/{workload}.jsonl"
    return d


def transfer_targets(vsk_dir: str, model: str, models: Iterable[str], devices: Iterable[str], workload: str,
                     point: str, quality: bool) -> tuple[list[dict], list[dict]]:
    """The Table 6 and Table 7 targets (main first), each ``{"name", "role": "main" | "extra", "knee", "cell",
    "thresholds"[, "flexidepth", "quality"]}`` with the paths of its files.

    Args:
        vsk_dir: the main run's folder (``{results_dir}/vskipper``). model: ``vskipper.model``.
        models: ``vskipper.cross_model.models`` (empty: no Table 6). devices: the ``vskipper.devices`` names
            (empty: no Table 7). workload / point: ``cross_model.workload`` / ``point``.
        quality: whether the quality 2x2 runs on ``workload`` (served accuracy of Table 6).
    """
    models, devices = list(models), list(devices)
    t6 = [_target(vsk_dir, model, "main", vsk_dir, workload, point, flexidepth=f"{vsk_dir}/flexidepth/{model}.json",
                  quality=quality)] if models else []
    for m in models:
        root = f"{vsk_dir}/models/{m}"
        t6.append(_target(vsk_dir, m, "extra", root, workload, point, flexidepth=f"{root}/flexidepth.json",
                          quality=quality))
    t7 = [_target(vsk_dir, "main", "main", vsk_dir, workload, point)] if devices else []
    t7 += [_target(vsk_dir, d, "extra", f"{vsk_dir}/devices/{d}", workload, point) for d in devices]
    return t6, t7


def target_files(targets: Iterable[Mapping[str, str]]) -> list[str]:
    """Every input file of the targets (what the tables rule waits for)."""
    return [v for t in targets for k, v in t.items() if k not in ("name", "role")]


def target_args(t6: Iterable[Mapping[str, str]], t7: Iterable[Mapping[str, str]]) -> str:
    """The ``vskipper-transfer-tables`` arguments: one ``--model KEY=VALUE ...`` per Table 6 target and one
    ``--device KEY=VALUE ...`` per Table 7 target."""
    parts = [f"{flag} " + " ".join(f"{k}={v}" for k, v in t.items())
             for flag, ts in (("--model", t6), ("--device", t7)) for t in ts]
    return " ".join(parts)


def device_resources(devices: Mapping[str, Mapping[str, Any]], **defaults: Any) -> dict[str, dict[str, Any]]:
    """Snakemake resources of the device jobs as ``{resource: {device name: value}}``: every key any
    ``vskipper.devices[].resources`` names, plus ``defaults`` (e.g. the main rule's ``mem_mb`` / ``runtime``)
    for entries that do not set them; ``None`` (unset: the profile's default applies) where neither does."""
    keys = {k for d in devices.values() for k in (d.get("resources") or {})} | set(defaults)
    return {k: {n: (d.get("resources") or {}).get(k, defaults.get(k)) for n, d in devices.items()}
            for k in sorted(keys)}
