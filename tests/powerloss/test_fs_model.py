"""The power-loss filesystem loses what a real power cut would lose, and keeps what was synced.

Attacking the harness first: every test here plants a writer that skips one sync and shows the
cut takes its data (or its name), next to the same writer with the sync, which keeps it. The
last one shows that ``kill -9`` alone (on the same filesystem, no cut) loses nothing: that is
why kill tests cannot catch a missing fsync, and why this harness exists.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fenced.testing.powerloss import PowerLossMount, unavailable

pytestmark = [
    pytest.mark.skipif(unavailable() is not None, reason=unavailable() or ""),
]


def write(path: Path, data: bytes, *, sync: bool, append: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_unsynced_write_is_lost_synced_is_kept(powerloss: PowerLossMount) -> None:
    root = powerloss.mountpoint
    write(root / "kept", b"synced", sync=True)
    sync_dir(root)
    write(root / "kept", b" + appended, never synced", sync=False, append=True)
    assert (root / "kept").read_bytes() == b"synced + appended, never synced"  # (seen before)
    powerloss.power_loss()
    assert (root / "kept").read_bytes() == b"synced"


def test_fdatasync_makes_data_and_size_durable(powerloss: PowerLossMount) -> None:
    root = powerloss.mountpoint
    with open(root / "f", "wb") as f:
        f.write(b"x" * 10_000)
        f.flush()
        os.fdatasync(f.fileno())
    sync_dir(root)
    powerloss.power_loss()
    assert (root / "f").stat().st_size == 10_000


def test_fsync_of_a_new_file_does_not_make_its_name_durable(powerloss: PowerLossMount) -> None:
    root = powerloss.mountpoint
    write(root / "new", b"data", sync=True)  # file synced, its directory not
    powerloss.power_loss()
    assert not (root / "new").exists()
    write(root / "new", b"data", sync=True)
    sync_dir(root)
    powerloss.power_loss()
    assert (root / "new").read_bytes() == b"data"


def test_a_durable_name_without_synced_bytes_is_an_empty_file(powerloss: PowerLossMount) -> None:
    root = powerloss.mountpoint
    write(root / "empty", b"never synced", sync=False)
    sync_dir(root)
    powerloss.power_loss()
    assert (root / "empty").read_bytes() == b""


def test_rename_is_durable_only_with_the_directory_fsync(powerloss: PowerLossMount) -> None:
    root = powerloss.mountpoint
    write(root / "target", b"old", sync=True)
    sync_dir(root)
    # The classic atomic replace: write a temporary file, fsync it, rename it over the target.
    write(root / "target.tmp", b"new", sync=True)
    os.rename(root / "target.tmp", root / "target")
    powerloss.power_loss()  # without the directory's fsync: the old contents
    assert (root / "target").read_bytes() == b"old"
    assert not (root / "target.tmp").exists()
    write(root / "target.tmp", b"new", sync=True)
    os.rename(root / "target.tmp", root / "target")
    sync_dir(root)
    powerloss.power_loss()
    assert (root / "target").read_bytes() == b"new"
    assert sorted(os.listdir(root)) == ["target"]


def test_rename_without_fsync_of_the_file_keeps_a_name_to_nothing(
    powerloss: PowerLossMount,
) -> None:
    """The ext4 "zero-length file" bug: rename made durable, the new file's bytes not."""
    root = powerloss.mountpoint
    write(root / "target", b"old", sync=True)
    sync_dir(root)
    write(root / "target.tmp", b"new", sync=False)
    os.rename(root / "target.tmp", root / "target")
    sync_dir(root)
    powerloss.power_loss()
    assert (root / "target").read_bytes() == b""


def test_truncation_and_unlink_are_undone_unless_synced(powerloss: PowerLossMount) -> None:
    root = powerloss.mountpoint
    write(root / "t", b"0123456789", sync=True)
    write(root / "u", b"unlinked", sync=True)
    sync_dir(root)
    os.truncate(root / "t", 3)
    os.unlink(root / "u")
    powerloss.power_loss()
    assert (root / "t").read_bytes() == b"0123456789"
    assert (root / "u").read_bytes() == b"unlinked"
    with open(root / "t", "r+b") as f:
        f.truncate(3)
        os.fsync(f.fileno())
    os.unlink(root / "u")
    sync_dir(root)
    powerloss.power_loss()
    assert (root / "t").read_bytes() == b"012"
    assert not (root / "u").exists()


def test_directories_need_their_parents_fsync(powerloss: PowerLossMount) -> None:
    root = powerloss.mountpoint
    (root / "d").mkdir()
    write(root / "d" / "f", b"x", sync=True)
    sync_dir(root / "d")  # d's entries durable, but d itself is not named in the root yet
    powerloss.power_loss()
    assert not (root / "d").exists()
    (root / "d").mkdir()
    write(root / "d" / "f", b"x", sync=True)
    sync_dir(root / "d")
    sync_dir(root)
    powerloss.power_loss()
    assert (root / "d" / "f").read_bytes() == b"x"


def test_the_disk_is_dead_after_the_cut(powerloss: PowerLossMount) -> None:
    root = powerloss.mountpoint
    write(root / "f", b"x", sync=True)
    powerloss.cut()
    with pytest.raises(OSError):
        (root / "f").read_bytes()
    powerloss.unmount()
    powerloss.mount()


def test_power_loss_does_not_wait_for_a_file_the_caller_still_holds(
    powerloss: PowerLossMount,
) -> None:
    """The caller cannot die with the machine: a file it still holds open must not keep the
    dead daemon (and the remount) waiting out the mount's timeout."""
    root = powerloss.mountpoint
    write(root / "kept", b"synced", sync=True)
    sync_dir(root)
    fd = os.open(root / "kept", os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b" + never synced")
        start = time.monotonic()
        powerloss.power_loss()
        took = time.monotonic() - start
        with pytest.raises(OSError):  # (the old disk is gone for the survivor too)
            os.write(fd, b"after the cut")
    finally:
        with contextlib.suppress(OSError):  # (ENOTCONN: its filesystem went with the power)
            os.close(fd)
    assert took < powerloss.timeout / 2, f"power_loss took {took:.1f} s"  # (before: all of it)
    assert (root / "kept").read_bytes() == b"synced"  # what was durable, and only that


def test_o_direct_is_refused(powerloss: PowerLossMount) -> None:
    write(powerloss.mountpoint / "f", b"x", sync=True)
    with pytest.raises(OSError):
        os.open(powerloss.mountpoint / "f", os.O_RDWR | os.O_DIRECT)


def test_sqlite_keeps_what_it_committed_with_fsync_and_not_more(powerloss: PowerLossMount) -> None:
    """SQLite's own discipline survives (WAL, synchronous=FULL); synchronous=OFF does not."""
    db = powerloss.mountpoint / "t.db"
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE t (x INTEGER)")
    for i in range(50):
        conn.execute("INSERT INTO t VALUES (?)", (i,))
    conn.execute("PRAGMA synchronous=OFF")  # the planted writer: commits without fsync
    for i in range(50):
        conn.execute("INSERT INTO t VALUES (?)", (i,))
    assert conn.execute("SELECT count(*) FROM t").fetchone() == (100,)
    powerloss.power_loss()
    conn.close()
    again = sqlite3.connect(db)
    try:
        assert again.execute("SELECT count(*) FROM t").fetchone() == (50,)
        assert again.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        again.close()


def test_kill_9_alone_loses_nothing(powerloss: PowerLossMount) -> None:
    """Why kill tests cannot catch a missing fsync: a killed writer's unsynced data is kept
    (the kernel, here the daemon, still holds it) until the power goes."""
    root = powerloss.mountpoint
    code = (
        "import os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)\n"
        "os.write(fd, b'written, never synced')\n"
        "print('written', flush=True)\n"
        "time.sleep(60)\n"  # (killed long before)
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(root / "w")], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"written\n"
    proc.kill()
    proc.wait(10)
    assert (root / "w").read_bytes() == b"written, never synced"
    proc.stdout.close()
    powerloss.power_loss()
    assert not (root / "w").exists()
