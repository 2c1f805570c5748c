"""The FUSE daemon: a filesystem in memory that survives only what was synced.

Run as ``python .../powerloss/_fs.py MOUNTPOINT STATEFILE`` (by path: it imports nothing of
fenced, so it starts fast; see the package's doc for the model and the harness that drives it). It loads the durable state from STATEFILE (if it
exists), mounts, and serves. A line ``cut`` on its standard input is the power loss: at that
instant, between two filesystem operations, it writes the durable state (never the volatile
one) to STATEFILE, answers ``cut`` on standard output, and from then on fails every operation
with EIO, as a dead disk would, until it is unmounted.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import pickle
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mfusepy

__all__ = ["Inode", "State", "serve"]

ROOT = 1


@dataclass
class Inode:
    """A file or a directory: what processes see (volatile) in :class:`State` ``live``,
    what survives power loss in its ``durable`` copy."""

    ino: int
    mode: int  # type and permission bits
    data: bytearray = field(default_factory=bytearray)  # a file's bytes
    entries: dict[str, int] = field(default_factory=dict)  # a directory's names
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    nlink: int = 1  # names in live directories (an unlinked open file: 0)

    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


@dataclass
class State:
    """The whole filesystem: ``live`` is what processes see, ``durable`` what the disk holds.

    ``fsync``/``fdatasync`` of a file copies its bytes, size and mode to ``durable``;
    ``fsync`` of a directory copies its entries (each entry to a file never synced brings that
    file's durable copy into being, empty). Power loss makes ``live`` a copy of ``durable``.
    """

    live: dict[int, Inode]
    durable: dict[int, Inode]
    next_ino: int

    @classmethod
    def fresh(cls) -> State:
        now = time.time_ns()
        root = Inode(ROOT, stat.S_IFDIR | 0o755, mtime_ns=now, nlink=2)
        return cls({ROOT: root}, {ROOT: copy.deepcopy(root)}, ROOT + 1)

    @classmethod
    def load(cls, path: str) -> State:
        """The state after a power loss: what was durable, reachable from the root."""
        if not os.path.exists(path):
            return cls.fresh()
        with open(path, "rb") as f:
            durable: dict[int, Inode] = pickle.load(f)  # (our own file, written by dump)
        live = copy.deepcopy(durable)
        return cls(live, durable, max(durable) + 1)

    def reachable_durable(self) -> dict[int, Inode]:
        seen: dict[int, Inode] = {}
        todo = [ROOT]
        while todo:
            ino = todo.pop()
            node = self.durable.get(ino)
            if node is None or ino in seen:
                continue
            seen[ino] = node
            if node.is_dir():
                todo.extend(node.entries.values())
        return seen

    def dump(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(self.reachable_durable(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def sync_file(self, ino: int) -> None:
        node = self.live[ino]
        saved = self.durable.get(ino)
        entries = saved.entries if saved is not None else {}
        self.durable[ino] = Inode(
            ino, node.mode, bytearray(node.data), dict(entries), node.uid, node.gid, node.mtime_ns
        )

    def sync_dir(self, ino: int) -> None:
        node = self.live[ino]
        self.durable[ino] = Inode(
            ino, node.mode, bytearray(), dict(node.entries), node.uid, node.gid, node.mtime_ns
        )
        for child in node.entries.values():
            if child not in self.durable:  # the name reached the disk, the bytes never did
                c = self.live[child]
                data = bytearray(c.data) if stat.S_ISLNK(c.mode) else bytearray()
                self.durable[child] = Inode(child, c.mode, data, {}, c.uid, c.gid, c.mtime_ns)


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rstrip("/").rpartition("/")
    return parent or "/", name


class PowerLossFS(mfusepy.Operations):  # type: ignore[misc]
    """The operations, on :class:`State`. One lock: the power cut falls between two operations."""

    use_ns = True

    def __init__(self, state: State, statefile: str) -> None:
        self.state = state
        self.statefile = statefile
        self._mutex = threading.Lock()
        self.dead = False
        self.counts = {"write": 0, "fsync": 0, "fsyncdir": 0}

    # -- helpers -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _live(self) -> Iterator[None]:
        """The one lock, held for an operation that the power cut refuses (EIO) from then on."""
        with self._mutex:
            if self.dead:
                raise mfusepy.FuseOSError(errno.EIO)
            yield

    def _lookup(self, path: str) -> Inode:
        node = self.state.live[ROOT]
        for part in path.split("/"):
            if not part:
                continue
            if not node.is_dir():
                raise mfusepy.FuseOSError(errno.ENOTDIR)
            child = node.entries.get(part)
            if child is None:
                raise mfusepy.FuseOSError(errno.ENOENT)
            node = self.state.live[child]
        return node

    def _node(self, path: str | None, fh: int | None) -> Inode:
        if fh:  # (an unlinked open file has no path; hard_remove)
            node = self.state.live.get(fh)
            if node is not None:
                return node
        if path is None:
            raise mfusepy.FuseOSError(errno.EBADF)
        return self._lookup(path)

    def _new(self, path: str, mode: int) -> Inode:
        parent_path, name = _split(path)
        parent = self._lookup(parent_path)
        if name in parent.entries:
            raise mfusepy.FuseOSError(errno.EEXIST)
        ino = self.state.next_ino
        self.state.next_ino += 1
        ctx = mfusepy.fuse_get_context()
        node = Inode(ino, mode, uid=ctx[0], gid=ctx[1], mtime_ns=time.time_ns())
        if node.is_dir():
            node.nlink = 2
        self.state.live[ino] = node
        parent.entries[name] = ino
        parent.mtime_ns = node.mtime_ns
        return node

    def _drop_name(self, parent: Inode, name: str) -> None:
        ino = parent.entries.pop(name)
        node = self.state.live[ino]
        node.nlink = 0 if node.is_dir() else node.nlink - 1
        parent.mtime_ns = time.time_ns()

    def _sync(self, op: str, sync: Callable[[int], None], path: str | None, fh: int | None) -> int:
        """``sync`` the node (make it durable), counted under ``op`` (the harness cuts the
        power after a number of writes and syncs)."""
        with self._live():
            sync(self._node(path, fh).ino)
            self.counts[op] += 1
            return 0

    def cut(self) -> None:
        """Power loss: keep what is durable, refuse everything from now on."""
        with self._mutex:
            self.dead = True
            self.state.dump(self.statefile)

    # -- operations --------------------------------------------------------------------------

    def init(self, path: str) -> None:
        print("ready", flush=True)  # (the harness waits for this line: mounted)

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        with self._live():
            node = self._node(path, fh)
            return {
                "st_ino": node.ino,
                "st_mode": node.mode,
                "st_nlink": node.nlink,
                "st_uid": node.uid,
                "st_gid": node.gid,
                "st_size": len(node.data),
                "st_blocks": (len(node.data) + 511) // 512,
                "st_atime": node.mtime_ns,
                "st_mtime": node.mtime_ns,
                "st_ctime": node.mtime_ns,
            }

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        with self._live():
            node = self._node(path, fh)
            # (with use_ino, each entry needs its inode number: 0 would hide it from readdir(3))
            out: list[tuple[str, dict[str, int], int]] = [
                (".", {"st_mode": node.mode, "st_ino": node.ino}, 0),
                ("..", {"st_mode": stat.S_IFDIR, "st_ino": ROOT}, 0),
            ]
            for name, ino in node.entries.items():
                out.append((name, {"st_mode": self.state.live[ino].mode, "st_ino": ino}, 0))
            return out

    def opendir(self, path: str) -> int:
        with self._live():
            node = self._lookup(path)
            if not node.is_dir():
                raise mfusepy.FuseOSError(errno.ENOTDIR)
            return node.ino

    def releasedir(self, path: str | None, fh: int) -> int:
        return 0

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        return self._sync("fsyncdir", self.state.sync_dir, path, fh)

    def mkdir(self, path: str, mode: int) -> int:
        with self._live():
            self._new(path, stat.S_IFDIR | (mode & 0o7777))
            return 0

    def rmdir(self, path: str) -> int:
        with self._live():
            node = self._lookup(path)
            if not node.is_dir():
                raise mfusepy.FuseOSError(errno.ENOTDIR)
            if node.entries:
                raise mfusepy.FuseOSError(errno.ENOTEMPTY)
            parent_path, name = _split(path)
            self._drop_name(self._lookup(parent_path), name)
            return 0

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        with self._live():
            return int(self._new(path, stat.S_IFREG | (mode & 0o7777)).ino)

    def open(self, path: str, flags: int) -> int:
        with self._live():
            if flags & getattr(os, "O_DIRECT", 0):
                raise mfusepy.FuseOSError(errno.EINVAL)  # out of the model: refused, not faked
            node = self._lookup(path)
            return node.ino

    def release(self, path: str | None, fh: int) -> int:
        with self._mutex:
            node = self.state.live.get(fh)
            if node is not None and node.nlink == 0:
                pass  # (kept: the durable state may still name it; ino numbers never reused)
            return 0

    def flush(self, path: str | None, fh: int) -> int:
        return 0  # close() is not a sync

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        with self._live():
            return bytes(self._node(path, fh).data[offset : offset + size])

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        with self._live():
            node = self._node(path, fh)
            end = offset + len(data)
            if end > len(node.data):
                node.data.extend(bytes(end - len(node.data)))
            node.data[offset:end] = data
            node.mtime_ns = time.time_ns()
            self.counts["write"] += 1
            return len(data)

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        with self._live():
            node = self._node(path, fh)
            if length < len(node.data):
                del node.data[length:]
            else:
                node.data.extend(bytes(length - len(node.data)))
            node.mtime_ns = time.time_ns()
            return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        # fdatasync as fsync: the size is part of what it must make durable
        return self._sync("fsync", self.state.sync_file, path, fh)

    def unlink(self, path: str) -> int:
        with self._live():
            node = self._lookup(path)
            if node.is_dir():
                raise mfusepy.FuseOSError(errno.EISDIR)
            parent_path, name = _split(path)
            self._drop_name(self._lookup(parent_path), name)
            return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        with self._live():
            if flags & ~1:  # RENAME_EXCHANGE, RENAME_WHITEOUT: not modelled
                raise mfusepy.FuseOSError(errno.EINVAL)
            old_parent_path, old_name = _split(old)
            new_parent_path, new_name = _split(new)
            old_parent = self._lookup(old_parent_path)
            new_parent = self._lookup(new_parent_path)
            if old_name not in old_parent.entries:
                raise mfusepy.FuseOSError(errno.ENOENT)
            moving = self.state.live[old_parent.entries[old_name]]
            target = new_parent.entries.get(new_name)
            if target is not None:
                if flags & 1:  # RENAME_NOREPLACE
                    raise mfusepy.FuseOSError(errno.EEXIST)
                if target == moving.ino:
                    return 0
                replaced = self.state.live[target]
                if replaced.is_dir() and replaced.entries:
                    raise mfusepy.FuseOSError(errno.ENOTEMPTY)
                self._drop_name(new_parent, new_name)
            del old_parent.entries[old_name]
            new_parent.entries[new_name] = moving.ino
            now = time.time_ns()
            old_parent.mtime_ns = new_parent.mtime_ns = now
            return 0

    def link(self, target: str, source: str) -> int:
        """A hard link: ``target`` becomes another name of ``source``'s inode."""
        with self._live():
            node = self._lookup(source)
            if node.is_dir():
                raise mfusepy.FuseOSError(errno.EPERM)
            parent_path, name = _split(target)
            parent = self._lookup(parent_path)
            if name in parent.entries:
                raise mfusepy.FuseOSError(errno.EEXIST)
            parent.entries[name] = node.ino
            node.nlink += 1
            parent.mtime_ns = time.time_ns()
            return 0

    def symlink(self, target: str, source: str) -> int:
        """A symbolic link at ``target`` holding ``source``. Its text is part of the name:
        durable with the directory's fsync (a symlink cannot be opened to fsync it)."""
        with self._live():
            node = self._new(target, stat.S_IFLNK | 0o777)
            node.data = bytearray(source.encode("utf-8", "surrogateescape"))
            return 0

    def readlink(self, path: str) -> str:
        with self._live():
            node = self._lookup(path)
            if not stat.S_ISLNK(node.mode):
                raise mfusepy.FuseOSError(errno.EINVAL)
            return node.data.decode("utf-8", "surrogateescape")

    def chmod(self, path: str | None, mode: int, fh: int | None = None) -> int:
        with self._live():
            node = self._node(path, fh)
            node.mode = (node.mode & ~0o7777) | (mode & 0o7777)
            return 0

    def chown(self, path: str | None, uid: int, gid: int, fh: int | None = None) -> int:
        with self._live():
            node = self._node(path, fh)
            if uid != -1 and uid != 0xFFFFFFFF:
                node.uid = uid
            if gid != -1 and gid != 0xFFFFFFFF:
                node.gid = gid
            return 0

    def utimens(self, path: str | None, times: Any = None, fh: int | None = None) -> int:
        with self._live():
            node = self._node(path, fh)
            node.mtime_ns = times[1] if times else time.time_ns()
            return 0

    def statfs(self, path: str) -> dict[str, int]:
        return {
            "f_bsize": 4096,
            "f_frsize": 4096,
            "f_blocks": 1 << 20,
            "f_bfree": 1 << 19,
            "f_bavail": 1 << 19,
            "f_files": 1 << 20,
            "f_ffree": 1 << 19,
            "f_namemax": 255,
        }


def serve(mountpoint: str, statefile: str) -> None:
    """Mount and serve until unmounted; ``cut`` on stdin is the power loss (module doc)."""
    fs = PowerLossFS(State.load(statefile), statefile)

    def control() -> None:
        for line in sys.stdin:
            if line.strip() == "cut":
                fs.cut()
                print(
                    f"cut {fs.counts['write']} {fs.counts['fsync']} {fs.counts['fsyncdir']}",
                    flush=True,
                )
        # stdin closed: the harness is gone (killed, say). Unmount, ending the loop below,
        # rather than outlive it with a mount nobody will take down.
        subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True, check=False)

    threading.Thread(target=control, daemon=True).start()
    mfusepy.FUSE(
        fs,
        mountpoint,
        foreground=True,
        nothreads=True,
        use_ino=True,
        hard_remove=True,
        default_permissions=True,
    )


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
