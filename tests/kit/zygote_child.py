"""A worker for tests/kit/test_zygote.py, forked by the check kit's zygote: it says what it
sees, then waits for its stdin to close and exits with the status it was given."""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    seen = {
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "ppid": os.getppid(),
        "cwd": os.getcwd(),
        "env": os.environ.get("ZYGOTE_TEST"),
        "argv": sys.argv[1:],
    }
    print(json.dumps(seen), flush=True)
    sys.stdin.read()
    print("stdin closed", file=sys.stderr, flush=True)
    if argv[0] == "raise":
        raise RuntimeError("a worker's failure, as a traceback in its log")
    return int(argv[0])
