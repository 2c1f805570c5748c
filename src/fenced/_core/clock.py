"""The one clock fenced uses for leases, deadlines and timeouts.

``CLOCK_BOOTTIME`` is monotonic, shared by every process on the machine, and (unlike
``CLOCK_MONOTONIC``) keeps counting while the machine is suspended, so a lease measured with
it never looks longer than it really was. Wall-clock time is never used for safety.
"""

from __future__ import annotations

import time

__all__ = ["boot_id", "now"]

try:
    _CLOCK = time.CLOCK_BOOTTIME
    time.clock_gettime(_CLOCK)
except (AttributeError, OSError):  # pragma: no cover - non-Linux
    _CLOCK = time.CLOCK_MONOTONIC


def now() -> float:
    """Seconds on the machine-wide monotonic clock."""
    return time.clock_gettime(_CLOCK)


def boot_id() -> str:
    """Identifies this boot of the machine: readings of :func:`now` are comparable only within one."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:  # pragma: no cover - non-Linux: the boot time, to ten seconds
        return f"boot-{round(time.time() - now(), -1):.0f}"
