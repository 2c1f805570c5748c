"""A filesystem that loses power: what a real disk keeps, and nothing more.

:class:`PowerLossMount` mounts a FUSE filesystem (a child process, ``fenced.testing.powerloss._fs``)
whose contents live in memory in two copies: what processes see, and what is *durable*.

**What it models** (the strict reading of fsync(2), as LazyFS and ALICE do):

* A file's bytes, size (a truncation or an extension) and mode become durable only when the
  file itself is ``fsync``\\ ed or ``fdatasync``\\ ed. ``close()`` is not a sync.
* A directory's entries (create, unlink, rename, mkdir, rmdir in it) become durable only when
  the *directory* is ``fsync``\\ ed (open it ``O_RDONLY``, fsync the descriptor). fsync of a new
  file does not make its name durable: without the directory's fsync, the file is gone after a
  power loss, bytes and all. A name made durable for a file whose bytes were never synced
  survives as an empty file.
* A rename is atomic within one directory (one directory fsync records it or not); across two
  directories each side is durable on its own (after a crash the file may be under both names
  or, if only the source directory was synced, under neither: fsync both).
* Power loss (:meth:`PowerLossMount.power_loss`) happens between two filesystem operations:
  the daemon keeps the durable copy, fails every later operation with EIO (a dead disk), the
  processes using it are killed, the mount goes, and the next mount shows the durable copy.

**Out of scope**: ``O_DIRECT`` (refused with EINVAL), torn writes (a synced write is all there,
an unsynced one all gone: real disks may keep part of it, or reorder unsynced writes), hard
links and symlinks (ENOSYS), extended attributes, and the kernel's page cache of a *real*
filesystem (here every write goes to the daemon; reads may be served from the kernel's cache
of this mount, which is dropped with it). Timestamps are not durable state.

Requires Linux, ``/dev/fuse``, ``fusermount3`` (Debian: ``fuse3``) and the ``mfusepy`` package
(``pip install 'fenced[powerloss]'``); :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

__all__ = ["PowerLossMount", "unavailable"]


def unavailable() -> str | None:
    """Why a power-loss mount cannot be made on this machine, or None if it can."""
    if not sys.platform.startswith("linux"):
        return "power-loss filesystem: Linux only (FUSE)"
    if not os.path.exists("/dev/fuse"):
        return "power-loss filesystem: no /dev/fuse on this machine"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "power-loss filesystem: /dev/fuse is not readable and writable by this user"
    if shutil.which("fusermount3") is None:
        return "power-loss filesystem: no fusermount3 (Debian: apt-get install fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:  # (OSError: mfusepy found no libfuse3)
        return f"power-loss filesystem: mfusepy unusable ({exc}); pip install 'fenced[powerloss]'"
    return None


class PowerLossMount:
    """A power-loss filesystem mounted at ``mountpoint``; its durable state lives in
    ``statefile`` between two mounts (the disk), nowhere else.

    Use as a context manager, or :meth:`mount` / :meth:`unmount`. :meth:`power_loss` is the
    crash: the disk freezes at one instant, ``victims`` (processes using the mount) are killed,
    the mount is dropped and made again on what was durable.
    """

    def __init__(
        self,
        mountpoint: str | os.PathLike[str],
        statefile: str | os.PathLike[str] | None = None,
        *,
        timeout: float = 20.0,
    ) -> None:
        self.mountpoint = Path(mountpoint)
        self._own_state = statefile is None
        self.statefile = (
            Path(statefile)
            if statefile is not None
            else Path(tempfile.mkdtemp(prefix="fenced-powerloss-")) / "disk.pickle"
        )
        self.timeout = timeout
        self._proc: subprocess.Popen[str] | None = None
        self._lines: list[str] = []
        self._dead = False  # (this daemon was cut: its durable state is already on disk)
        self._cond = threading.Condition()
        self.cuts = 0
        self.last_counts: tuple[int, int, int] | None = None  # writes, fsyncs, dir fsyncs

    def __enter__(self) -> PowerLossMount:
        self.mount()
        return self

    def __exit__(self, *exc: object) -> None:
        self.unmount()
        if self._own_state:
            shutil.rmtree(self.statefile.parent, ignore_errors=True)

    def _reader(self, out: IO[str], lines: list[str]) -> None:
        # (each daemon its own list: the last one's end must not be read as the next one's)
        for line in out:
            with self._cond:
                lines.append(line.strip())
                self._cond.notify_all()
        with self._cond:
            lines.append("<eof>")
            self._cond.notify_all()

    def _await_line(self, prefix: str) -> str:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                for i, line in enumerate(self._lines):
                    if line.startswith(prefix):
                        del self._lines[: i + 1]
                        return line
                    if line == "<eof>":
                        raise RuntimeError(f"power-loss filesystem exited (waiting for {prefix!r})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"power-loss filesystem: no {prefix!r} in {self.timeout} s")
                self._cond.wait(left)

    def mount(self) -> None:
        """Mount, showing what the disk holds (nothing, the first time)."""
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self._lines = []
        self._proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("_fs.py")),
                str(self.mountpoint),
                str(self.statefile),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self._proc.stdout is not None
        threading.Thread(
            target=self._reader, args=(self._proc.stdout, self._lines), daemon=True
        ).start()
        try:
            self._await_line("ready")
        except BaseException:
            self.unmount()
            raise

    def cut(self) -> tuple[int, int, int]:
        """The power goes: the disk keeps what was durable at this instant and no more, and
        fails every operation from now on. Returns the writes, fsyncs and directory fsyncs the
        daemon served since it mounted."""
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write("cut\n")
        self._proc.stdin.flush()
        _, writes, fsyncs, dirs = self._await_line("cut").split()
        self.cuts += 1
        self._dead = True
        self.last_counts = (int(writes), int(fsyncs), int(dirs))
        return self.last_counts

    def unmount(self) -> None:
        """Unmount (lazily, if something still has it open) and wait for the daemon."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        dead, self._dead = self._dead, False
        subprocess.run(
            ["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, check=False
        )
        if dead:
            # After the cut the daemon is a dead disk whose durable state is already in the
            # statefile; a lazy unmount does not end it while a survivor (the caller itself,
            # say) still holds a file open, so waiting would only run out the timeout.
            proc.kill()
        try:
            proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(self.timeout)
        # Again, now that the daemon is gone: a daemon that mounted after the first call (it
        # was still starting) would otherwise leave a dead mount behind.
        subprocess.run(
            ["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, check=False
        )
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()

    def remount(self) -> None:
        """After :meth:`cut` and the death of everything using it: mount what was durable."""
        self.unmount()
        self.mount()

    def power_loss(
        self, victims: Iterable[subprocess.Popen[bytes] | subprocess.Popen[str] | int] = ()
    ) -> tuple[int, int, int]:
        """Cut the power, SIGKILL ``victims`` (they died with the machine), and mount again on
        what was durable. Returns :meth:`cut`'s counts."""
        counts = self.cut()
        for victim in victims:
            pid = victim if isinstance(victim, int) else victim.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if not isinstance(victim, int):
                victim.wait(self.timeout)
        self.remount()
        return counts
