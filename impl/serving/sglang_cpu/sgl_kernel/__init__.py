"""The harness's CPU import workaround for upstream SGLang (not part of ``sgl_kernel``; issue "Upstream
SGLang as a real engine arm").

SGLang imports ``sgl_kernel`` at start-up, and the PyPI wheel of ``sgl_kernel`` is CUDA-only: loading its
native ``common_ops`` library fails on a machine without ``libcuda.so.1``, so the server dies on an import
before it reads its arguments. The CPU build of ``sgl_kernel`` is not on PyPI. This directory is put first
on ``PYTHONPATH`` of the SGLang server process (:func:`impl.serving.sglang_server.server_env`, device
``cpu`` only); the package below then stands in for ``sgl_kernel``:

- it finds the installed ``sgl_kernel`` further down ``sys.path`` and serves its modules (``__path__``);
- it wraps the native loader: the real ``_load_architecture_specific_ops`` runs first; only when it raises
  ``ImportError`` does an empty ``common_ops`` module take its place (no native op is registered, so
  ``cpu_has_amx_support()`` is False and SGLang takes its torch fallbacks); the CUDA runtime preload is
  skipped the same way when it fails;
- it then runs the installed ``__init__.py`` unchanged.

Where the real library loads (a GPU cluster, or a CPU build of ``sgl_kernel``) nothing is replaced:
``CPU_SHIM_FALLBACK`` is False and every op is the real one.
"""

import importlib
import importlib.machinery
import logging
import sys
import types
from pathlib import Path

_log = logging.getLogger("impl.sglang_cpu")
_HERE = Path(__file__).resolve().parent.parent


def _installed_spec():
    rest = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sgl_kernel", rest)
    if spec is None or spec.origin is None:
        raise ImportError("sgl_kernel is not installed: the harness's CPU shim only wraps the installed package")
    return spec


_SPEC = _installed_spec()
__path__ = [str(Path(_SPEC.origin).parent)]  # noqa: F811 - submodules come from the installed package
CPU_SHIM_FALLBACK = False  # True once the native library failed to load and the empty module stands in

_load_utils = importlib.import_module("sgl_kernel.load_utils")
_real_load, _real_preload = _load_utils._load_architecture_specific_ops, _load_utils._preload_cuda_library


def _load_or_empty():
    global CPU_SHIM_FALLBACK
    try:
        return _real_load()
    except ImportError as e:
        CPU_SHIM_FALLBACK = True
        _log.warning("sgl_kernel's native ops did not load (%s); SGLang runs on its torch fallbacks",
                     str(e).strip().splitlines()[-1][:200])
        return types.ModuleType("common_ops")


def _preload_or_skip():
    try:
        _real_preload()
    except OSError as e:
        _log.warning("CUDA runtime preload skipped: %s", e)


_load_utils._load_architecture_specific_ops = _load_or_empty
_load_utils._preload_cuda_library = _preload_or_skip
exec(compile(Path(_SPEC.origin).read_text(), _SPEC.origin, "exec"), globals())  # the installed __init__.py
