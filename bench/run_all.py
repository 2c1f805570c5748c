"""Run every benchmark script in bench/ one after another and print their tables.

    .venv/bin/python bench/run_all.py [NAME_SUBSTRING ...]

Each script starts its own servers on loopback and runs fenced and the peer side by side.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    scripts = sorted(p for p in HERE.glob("bench_*.py"))
    if argv:
        scripts = [p for p in scripts if any(a in p.name for a in argv)]
    failed = []
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        start = time.monotonic()
        code = subprocess.call([sys.executable, str(script)], cwd=HERE.parent)
        print(f"--- {script.name}: exit {code} in {time.monotonic() - start:.0f} s", flush=True)
        if code:
            failed.append(script.name)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
