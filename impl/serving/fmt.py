"""Table cell text of the serving tables: paired % changes with their intervals."""

from __future__ import annotations

import math

__all__ = ["fmt_change", "num"]


def num(x) -> float:
    """``float(x)``, NaN for anything that is not a number."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v


def fmt_change(mean, low, high, n, resolved) -> str:
    """Compact cell text of a paired % change: ``"-4.6 [-6.1, -3.1] *"`` (``*`` = resolved), ``"+2.0 (n=1)"``
    when there is no interval, ``"-"`` when undefined."""
    mean, low, high = num(mean), num(low), num(high)
    if not math.isfinite(mean):
        return "-"
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"{mean:+.1f} (n={int(n) if n == n else '?'})"
    return f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]" + (" *" if str(resolved).lower() == "true" else "")
