"""The check kit's use of the testing room's fork server (:mod:`fenced.testing.forkserver`).

A campaign starts dozens of workers (hundreds with the ``kill`` nemesis): as ``python -m``
each paid a Python start-up and ``import fenced`` (~0.15 s of CPU of its ~0.25 s). They are
forked from a zygote instead: ``fenced check`` forks it from itself before it has a thread
(:func:`start_fork_server`); a process that runs campaigns in-process starts one with
``python -m`` at its first worker. ``FENCED_CHECK_FORKSERVER=0`` (or ``FENCED_FORKSERVER=0``)
starts workers with ``subprocess.Popen`` instead.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import IO

from .. import forkserver, parentdeath
from ..forkserver import Child, forked

__all__ = ["FORKSERVER_ENV", "WARM", "Child", "Worker", "forked", "spawn", "start_fork_server"]

FORKSERVER_ENV = "FENCED_CHECK_FORKSERVER"

WARM = ("fenced.backends.sqlite", "fenced.guards.registry", "fenced.guards.sql")
"""Imported by the zygote at its start, besides each worker's module: what a worker of the
default campaign (SQLite source and register) imports only once it runs (~60 ms of CPU each)."""

Worker = forkserver.Process
"""A worker process, as the campaigns hold it."""


def start_fork_server() -> bool:
    """Fork this process into the zygote its campaigns' workers will be forked from, if it has
    no thread yet (else False: the first spawn starts one with ``python -m``). Called first
    thing by ``fenced check``: the zygote then costs no start-up and no import of its own (the
    command has imported fenced; the worker's modules are imported here, once for both)."""
    if not forkserver.enabled(FORKSERVER_ENV):
        return False
    if os.environ.get("FENCED_CHECK_NETNS"):  # (its workers start in namespaces: ip netns exec)
        return False
    return forkserver.fork_this_process(("fenced.testing.check._worker", *WARM))


def spawn(
    module: str, argv: Sequence[str], *, env: Mapping[str, str], stderr: IO[bytes],
    stdin_pipe: bool,
) -> Worker:  # fmt: skip
    """Worker ``python -m module *argv`` in a process group of its own (its stdout a pipe, its
    stdin a pipe or /dev/null), forked by this process's zygote (started at the first spawn), or
    by ``subprocess.Popen`` when ``FENCED_CHECK_FORKSERVER=0``. Either way it is SIGKILLed when
    its parent dies (:mod:`fenced.testing.parentdeath`): a worker the nemesis stopped is not
    left stopped for ever by a kill -9 of the kit."""
    return forkserver.popen(
        module, argv, env=env, stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=stderr, opt_out=FORKSERVER_ENV, warm=WARM,
        prelude=parentdeath.PRELUDE if parentdeath.supported() else None,
    )  # fmt: skip
