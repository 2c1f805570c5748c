"""fenced.guards.files: token-versioned files and the high-water file.

Both sides of the fencing rule, equal tokens, bad input, restarts, writers racing from
separate OS processes, writers SIGKILLed mid-write and inside the critical section, and
planted bugs (a check-then-publish without the lock, a ``>`` where ``>=`` belongs) that the
same checks must catch.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fenced import (
    ConfigurationError,
    CorruptMarkError,
    FencingToken,
    InvalidTokenError,
    ResourceNotFoundError,
    StaleTokenError,
    WrongLockError,
)
from fenced.guards._files_fs import TEMP_PREFIX
from fenced.guards.files import FileGuard, HighWaterFile, Version, VersionStore
from tests.helpers import pattern, wait_for

LOCK = "jobs"
REPO = Path(__file__).resolve().parents[2]


def tok(value: int, lock: str = LOCK) -> FencingToken:
    return FencingToken(lock, value)


def temps(guard: FileGuard, name: str) -> list[str]:
    return [n for n in os.listdir(os.path.join(guard.directory, name)) if n.startswith(TEMP_PREFIX)]


def tokens_of(guard: FileGuard, name: str) -> list[int]:
    return [v.token.value for v in guard.versions(name)]


@pytest.fixture
def guard(tmp_path: Path) -> FileGuard:
    return FileGuard(tmp_path / "store", lock=LOCK)


# -- both sides of the rule ------------------------------------------------------------------


def test_accepts_higher_and_rejects_lower_leaving_nothing_behind(guard: FileGuard) -> None:
    assert isinstance(guard, VersionStore)
    assert guard.latest("a") is None and guard.versions("a") == [] and guard.high_water("a") is None
    v5 = guard.write("a", b"five", token=tok(5))
    assert v5 == Version(tok(5), 0)
    assert guard.read("a") == (tok(5), b"five")
    guard.write("a", b"eight", token="jobs:8")  # the text form is accepted too
    assert guard.read("a") == (tok(8), b"eight")

    with pytest.raises(StaleTokenError) as info:
        guard.write("a", b"seven", token=tok(7))
    err = info.value
    assert (err.token, err.high_water, err.resource) == (tok(7), tok(8), "a")
    assert guard.read("a") == (tok(8), b"eight")
    assert tokens_of(guard, "a") == [5, 8]
    assert temps(guard, "a") == []  # the rejected writer's temp file is gone

    guard.write("a", b"nine", token=tok(9))
    assert guard.read("a") == (tok(9), b"nine")
    assert guard.read_version("a", v5) == b"five"  # old versions are immutable
    assert guard.high_water("a") == tok(9)


def test_plain_tools_read_the_newest_version_at_current(guard: FileGuard) -> None:
    """Bug: `cat report.txt` stopped working once the guard made it a directory of versions.
    ``<name>/current`` is a relative symlink that follows the newest version, and a refused
    write leaves it alone; after many racing writers it names the highest version."""
    current = Path(guard.directory) / "r" / "current"
    guard.write("r", b"one", token=tok(1))
    assert current.read_bytes() == b"one" and not os.path.isabs(os.readlink(current))
    guard.write("r", b"two", token=tok(2))
    guard.write("r", b"two again", token=tok(2))  # a sub-version of the same token
    assert current.read_bytes() == b"two again"
    with pytest.raises(StaleTokenError):
        guard.write("r", b"stale", token=tok(1))
    assert current.read_bytes() == b"two again"
    assert guard.versions("r")[-1].filename == os.readlink(current)

    def writer(i: int) -> None:
        with contextlib.suppress(StaleTokenError):
            guard.write("race", f"v{i}".encode(), token=tok(i))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(1, 21)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    race = Path(guard.directory) / "race" / "current"
    assert os.readlink(race) == guard.versions("race")[-1].filename
    assert race.read_bytes() == guard.read("race")[1]


def test_equal_token_is_accepted_as_a_new_sub_version(guard: FileGuard) -> None:
    guard.write("a", b"first", token=tok(3))
    second = guard.write("a", b"second", token=tok(3))
    assert second == Version(tok(3), 1)
    assert guard.read("a") == (tok(3), b"second")
    assert guard.versions("a") == [Version(tok(3), 0), Version(tok(3), 1)]
    assert guard.read_version("a", Version(tok(3), 0)) == b"first"
    guard.write("a", b"higher", token=tok(4))
    assert guard.latest("a") == Version(tok(4), 0)  # seq restarts for a new token


def test_resources_are_independent(guard: FileGuard) -> None:
    guard.write("a", b"x", token=tok(10))
    guard.write("b", b"y", token=tok(2))  # b has its own mark
    with pytest.raises(StaleTokenError):
        guard.write("a", b"z", token=tok(2))


def test_big_write_from_a_stale_writer_fails_before_writing(guard: FileGuard) -> None:
    guard.precheck_bytes = 16
    guard.write("a", b"x" * 32, token=tok(2))
    written: list[int] = []
    guard._write_temp = lambda fd, data: written.append(len(data))  # type: ignore[method-assign]
    with pytest.raises(StaleTokenError):
        guard.write("a", b"y" * 32, token=tok(1))
    assert written == [] and temps(guard, "a") == []


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        "jobs:0",
        "jobs:-1",
        "jobs:007",
        " jobs:7",
        "jobs:9223372036854775808",
        "jobs:99999999999999999999999",
        "jobs",
        "",
        b"\xff\xfe",
        7,
        None,
        7.0,
    ],
)
def test_malformed_tokens_are_refused_and_change_nothing(guard: FileGuard, bad: object) -> None:
    guard.write("a", b"good", token=tok(5))
    with pytest.raises(InvalidTokenError):
        guard.write("a", b"bad", token=bad)  # type: ignore[arg-type]
    assert guard.read("a") == (tok(5), b"good") and tokens_of(guard, "a") == [5]
    assert temps(guard, "a") == []


@pytest.mark.parametrize("other", [FencingToken("other", 99), "other:99", "jobs2:99"])
def test_tokens_of_another_lock_are_refused(guard: FileGuard, other: object) -> None:
    guard.write("a", b"good", token=tok(5))
    with pytest.raises(WrongLockError):
        guard.write("a", b"bad", token=other)  # type: ignore[arg-type]
    assert tokens_of(guard, "a") == [5]


def test_max_token_is_accepted(guard: FileGuard) -> None:
    guard.write("a", b"max", token=f"jobs:{2**63 - 1}")
    assert guard.read("a") == (tok(2**63 - 1), b"max")


@pytest.mark.parametrize(
    "name", ["", ".lock", "../escape", "a/b", ".hidden", "x" * 201, 5, "a\x00"]
)
def test_bad_resource_names(guard: FileGuard, name: object) -> None:
    with pytest.raises(ConfigurationError):
        guard.write(name, b"x", token=tok(1))  # type: ignore[arg-type]


@pytest.mark.parametrize("data", ["text", 5, None, [1, 2]])
def test_data_must_be_bytes(guard: FileGuard, data: object) -> None:
    with pytest.raises(TypeError):
        guard.write("a", data, token=tok(1))  # type: ignore[arg-type]


def test_bytes_like_data(guard: FileGuard) -> None:
    guard.write("a", bytearray(b"ba"), token=tok(1))
    guard.write("a", memoryview(b"mv"), token=tok(2))
    assert guard.read("a") == (tok(2), b"mv")


def test_directory_is_bound_to_its_lock(tmp_path: Path) -> None:
    FileGuard(tmp_path, lock=LOCK).write("a", b"x", token=tok(3))
    with pytest.raises(ConfigurationError):
        FileGuard(tmp_path, lock="other")
    with pytest.raises(InvalidTokenError):
        FileGuard(tmp_path / "new", lock="bad lock name")


def test_read_of_missing_resource(guard: FileGuard) -> None:
    with pytest.raises(ResourceNotFoundError):
        guard.read("nothing")
    with pytest.raises(ResourceNotFoundError):
        guard.read_version("nothing", Version(tok(1)))


def test_foreign_files_are_ignored(guard: FileGuard) -> None:
    guard.write("a", b"x", token=tok(3))
    rdir = Path(guard.directory, "a")
    (rdir / "README").write_text("not a version")
    (rdir / "99.000000").write_text("wrong width")
    assert tokens_of(guard, "a") == [3]
    guard.write("a", b"y", token=tok(4))
    assert guard.read("a") == (tok(4), b"y")


# -- prune ---------------------------------------------------------------------------------------


def test_prune_keeps_the_mark(guard: FileGuard) -> None:
    for v in range(1, 8):
        guard.write("a", str(v).encode(), token=tok(v))
    deleted = guard.prune("a", keep=3)
    assert [d.token.value for d in deleted] == [1, 2, 3, 4]
    assert tokens_of(guard, "a") == [5, 6, 7]
    assert guard.prune("a", keep=3) == []
    guard.prune("a", keep=1)
    assert tokens_of(guard, "a") == [7]
    with pytest.raises(StaleTokenError):  # the mark survived pruning
        guard.write("a", b"late", token=tok(6))
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            guard.prune("a", keep=bad)  # type: ignore[arg-type]
    assert guard.prune("never-written", keep=1) == []


# -- restart ---------------------------------------------------------------------------------


def _child(script: str, *args: str, stdin: int | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


_WRITE_ONE = """
import sys
from fenced.guards.files import FileGuard
FileGuard(sys.argv[1], lock="jobs").write(sys.argv[2], sys.argv[3].encode(), sys.argv[4])
print("ok")
"""


def test_mark_survives_a_new_guard_and_a_new_process(tmp_path: Path) -> None:
    store = tmp_path / "store"
    child = _child(_WRITE_ONE, str(store), "a", "from-child", "jobs:40")
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    fresh = FileGuard(store, lock=LOCK)
    assert fresh.read("a") == (tok(40), b"from-child")
    with pytest.raises(StaleTokenError):
        fresh.write("a", b"stale", token=tok(39))
    fresh.write("a", b"ok", token=tok(40))
    assert FileGuard(store, lock=LOCK).latest("a") == Version(tok(40), 1)


# -- history checker -----------------------------------------------------------------------------


def check_history(
    published: list[int], outcomes: list[tuple[int, bool, int | None]], on_disk: list[int]
) -> None:
    """The invariant of a fenced versioned store, from what writers saw and what is stored.

    ``published``: tokens in the order they were published (logged under the lock);
    ``outcomes``: (token, accepted, high_water reported on rejection) per write;
    ``on_disk``: the versions stored at the end.
    """
    accepted = sorted(t for t, ok, _ in outcomes if ok)
    assert sorted(published) == accepted, "published versions differ from accepted writes"
    assert sorted(on_disk) == accepted, "stored versions differ from accepted writes"
    for earlier, later in zip(published, published[1:], strict=False):
        assert later >= earlier, f"token {later} was accepted after {earlier} was published"
    for t, ok, high in outcomes:
        if not ok:
            assert high is not None and high > t and high in accepted, (t, high)


def test_history_checker_catches_bad_histories() -> None:
    check_history(
        [1, 3, 4], [(1, True, None), (3, True, None), (2, False, 3), (4, True, None)], [1, 3, 4]
    )
    with pytest.raises(AssertionError):
        check_history([3, 2], [(3, True, None), (2, True, None)], [2, 3])
    with pytest.raises(AssertionError):
        check_history([3], [(3, True, None), (2, False, 1)], [3])
    with pytest.raises(AssertionError):
        check_history([3], [(3, True, None)], [2, 3])


# -- writers racing from separate processes ------------------------------------------------------


_RACER = """
import json, os, sys
from fenced import StaleTokenError
from fenced.guards.files import FileGuard

directory, name, log_path, tokens = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])

class Logged(FileGuard):
    def _published(self, name, version):
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, f"{version.token.value}\\n".encode())
        os.close(fd)

guard = Logged(directory, lock="jobs")
print("ready", flush=True)
sys.stdin.readline()
for t in tokens:
    try:
        guard.write(name, f"payload-{t}".encode() * 50, f"jobs:{t}")
        print(json.dumps([t, True, None]), flush=True)
    except StaleTokenError as e:
        print(json.dumps([t, False, e.high_water.value]), flush=True)
"""


def test_racing_processes_publish_exactly_the_accepted_tokens(tmp_path: Path) -> None:
    store, log = tmp_path / "store", tmp_path / "published.log"
    rng = random.Random(1234)
    values = list(range(1, 121))
    shares = [values[i::3] for i in range(3)]
    for share in shares:
        rng.shuffle(share)  # out of order: plenty of stale writes
    children = [
        _child(_RACER, str(store), "r", str(log), json.dumps(share), stdin=subprocess.PIPE)
        for share in shares
    ]
    for child in children:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    outcomes = []
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        outcomes += [tuple(json.loads(line)) for line in out.splitlines()]
    assert len(outcomes) == 120
    published = [int(x) for x in log.read_text().split()]
    guard = FileGuard(store, lock=LOCK)
    check_history(published, outcomes, tokens_of(guard, "r"))  # type: ignore[arg-type]
    assert 1 < len(published) < 120  # the race really interleaved: some accepted, some not
    assert guard.read("r") == (tok(max(published)), f"payload-{max(published)}".encode() * 50)
    assert temps(guard, "r") == []


# -- planted bugs, made deterministic ----------------------------------------------------------


def flock_waiters(path: str) -> int:
    """How many flock requests are blocked on ``path`` right now (from /proc/locks)."""
    try:
        ino = os.stat(path).st_ino
    except FileNotFoundError:
        return 0
    with open("/proc/locks") as f:
        return sum(
            1
            for line in f
            if (parts := line.split())[1:2] == ["->"] and parts[6].endswith(f":{ino}")
        )


class Interleaving:
    """Writer A stops inside its write (after its check); writer B then runs.

    If B blocks on the resource's flock (the correct guards), A is let go and B follows; if
    B finishes while A is stopped (a guard without the lock), A is let go after it. Either
    way the run is deterministic: no timing decides the order.
    """

    def __init__(self) -> None:
        self.a_paused = threading.Event()
        self.a_go = threading.Event()
        self.b_done = threading.Event()
        self.errors: list[BaseException] = []

    def pause_a(self) -> None:
        self.a_paused.set()
        assert self.a_go.wait(30)

    def run(self, a: Callable[[], None], b: Callable[[], None], lock_path: str) -> bool:
        """Run both; return True if B was seen blocked on the lock."""

        def wrap(fn: Callable[[], None], done: threading.Event | None) -> Callable[[], None]:
            def run() -> None:
                try:
                    fn()
                except BaseException as exc:
                    self.errors.append(exc)
                finally:
                    if done is not None:
                        done.set()

            return run

        ta = threading.Thread(target=wrap(a, None))
        ta.start()
        assert self.a_paused.wait(30)
        tb = threading.Thread(target=wrap(b, self.b_done))
        tb.start()
        wait_for(
            lambda: self.b_done.is_set() or flock_waiters(lock_path) > 0,
            timeout=30,
            what="writer B to finish or block on the lock",
        )
        blocked = not self.b_done.is_set()
        self.a_go.set()
        ta.join(30)
        tb.join(30)
        return blocked


class LoggedGuard(FileGuard):
    """FileGuard with the test hooks wired: A pauses after its check, publishes are logged."""

    def __init__(self, *args: object, plan: Interleaving, pause_token: int, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.plan, self.pause_token, self.log = plan, pause_token, []
        self.log_lock = threading.Lock()

    def _checked(self, name: str, version: Version) -> None:
        if version.token.value == self.pause_token:
            self.plan.pause_a()

    def _published(self, name: str, version: Version) -> None:
        with self.log_lock:
            self.log.append(version.token.value)


class UnlockedGuard(LoggedGuard):
    """PLANTED BUG: checks, then publishes, without holding the resource lock."""

    def _resource_lock(self, rdir: str) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()


class StrictGreaterGuard(FileGuard):
    """PLANTED BUG: ``>`` where ``>=`` belongs (the ``<`` for ``<=`` of a SQL fence)."""

    def _accepts(self, token: int, newest: int) -> bool:
        return token > newest


def race_check(cls: type[LoggedGuard], directory: Path) -> bool:
    """A (token 7) is stopped between its check and its publish while B (token 8) writes."""
    plan = Interleaving()
    guard = cls(directory, lock=LOCK, plan=plan, pause_token=7)
    guard.write("r", b"six", token=tok(6))
    outcomes: list[tuple[int, bool, int | None]] = [(6, True, None)]

    def writer(value: int) -> Callable[[], None]:
        def write() -> None:
            try:
                guard.write("r", f"v{value}".encode(), token=tok(value))
                outcomes.append((value, True, None))
            except StaleTokenError as e:
                outcomes.append((value, False, e.high_water.value if e.high_water else None))

        return write

    blocked = plan.run(writer(7), writer(8), os.path.join(directory, "r", ".lock"))
    assert not plan.errors, plan.errors
    check_history(guard.log, outcomes, tokens_of(guard, "r"))
    assert guard.read("r") == (tok(8), b"v8")
    return blocked


def test_check_and_publish_are_one_step(tmp_path: Path) -> None:
    assert race_check(LoggedGuard, tmp_path)  # B waited on the lock while A was inside


def test_planted_bug_unlocked_check_then_publish_is_caught(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="accepted after"):
        race_check(UnlockedGuard, tmp_path)


def equal_token_check(guard: FileGuard) -> None:
    guard.write("e", b"one", token=tok(11))
    guard.write("e", b"two", token=tok(11))
    assert guard.read("e") == (tok(11), b"two")


def test_planted_bug_strict_comparison_is_caught(tmp_path: Path) -> None:
    equal_token_check(FileGuard(tmp_path / "good", lock=LOCK))
    with pytest.raises(StaleTokenError):
        equal_token_check(StrictGreaterGuard(tmp_path / "bad", lock=LOCK))


# -- readers never see partial files ---------------------------------------------------------------


def test_concurrent_reader_sees_only_complete_versions(guard: FileGuard) -> None:
    guard.write("big", pattern(1), token=tok(1))
    stop = threading.Event()
    seen: list[int] = []
    problems: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            t, data = guard.read("big")
            if data != pattern(t.value):
                problems.append(f"partial or mixed content for {t}")
            seen.append(t.value)

    th = threading.Thread(target=reader)
    th.start()
    try:
        for v in range(2, 40):
            guard.write("big", pattern(v), token=tok(v))
            if v % 10 == 0:
                guard.prune("big", keep=2)  # pruning under a reader: it retries
    finally:
        stop.set()
        th.join(30)
    assert not problems
    assert seen == sorted(seen)  # and it never went back to an older version


# -- crashes: SIGKILL ------------------------------------------------------------------------------


_SLOW_WRITER = """
import os, sys
from fenced.guards.files import FileGuard

STOP_AT = sys.argv[4]

class Stopping(FileGuard):
    def _write_temp(self, fd, data):
        if STOP_AT != "half":
            return super()._write_temp(fd, data)
        os.write(fd, data[: len(data) // 2])
        print("half", flush=True)
        sys.stdin.readline()  # blocks until killed
        os.write(fd, data[len(data) // 2 :])

    def _checked(self, name, version):
        if STOP_AT == "checked":
            print("checked", flush=True)
            sys.stdin.readline()

Stopping(sys.argv[1], lock="jobs").write(sys.argv[2], b"N" * 100000, sys.argv[3])
print("done", flush=True)
"""


@contextlib.contextmanager
def stopped_child(
    store: Path, name: str, token: str, stop_at: str
) -> Iterator[subprocess.Popen[str]]:
    child = _child(_SLOW_WRITER, str(store), name, token, stop_at, stdin=subprocess.PIPE)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        assert line == stop_at, (line, child.stderr.read() if child.stderr else "")
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=30)


def test_sigkill_mid_write_leaves_the_old_version(guard: FileGuard) -> None:
    guard.write("k", b"old", token=tok(1))
    with stopped_child(Path(guard.directory), "k", "jobs:2", "half") as child:
        assert len(temps(guard, "k")) == 1  # its half-written temp file
        assert guard.read("k") == (tok(1), b"old")  # readers ignore it
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert guard.read("k") == (tok(1), b"old") and tokens_of(guard, "k") == [1]
    assert len(temps(guard, "k")) == 1  # left behind by the dead writer
    guard.write("k", b"new", token=tok(3))  # the next write works, and collects the leftover
    assert guard.read("k") == (tok(3), b"new")
    assert temps(guard, "k") == []


def test_sigkill_inside_the_critical_section_does_not_wedge_others(guard: FileGuard) -> None:
    guard.write("k", b"old", token=tok(1))
    with stopped_child(Path(guard.directory), "k", "jobs:2", "checked") as child:
        lock_path = os.path.join(guard.directory, "k", ".lock")
        # while it holds the lock, another writer waits for it
        blocked = threading.Thread(
            target=guard.write, args=("k", b"waiting"), kwargs={"token": tok(5)}
        )
        blocked.start()
        wait_for(lambda: flock_waiters(lock_path) > 0, what="the second writer to wait")
        assert tokens_of(guard, "k") == [1]
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        blocked.join(30)
        assert not blocked.is_alive()
    assert tokens_of(guard, "k") == [1, 5]  # the killed writer published nothing
    assert guard.read("k") == (tok(5), b"waiting")
    # The killed writer's temp file is collected: by the write that waited (usually), or, if
    # the dying child's flock on it was not yet released as that write looked (the kernel
    # closes a dead process's files one by one: its .lock may go first), by the next look.
    assert guard.collect_garbage("k") in (0, 1) and temps(guard, "k") == []


def test_collect_garbage_spares_live_writers(guard: FileGuard) -> None:
    guard.write("k", b"old", token=tok(1))
    with stopped_child(Path(guard.directory), "k", "jobs:2", "half") as child:
        assert guard.collect_garbage("k") == 0  # alive: its temp file is locked
        assert len(temps(guard, "k")) == 1
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert guard.collect_garbage("k") == 1 and temps(guard, "k") == []


_LOOP_WRITER = """
import sys
from fenced.guards.files import FileGuard
from tests.helpers import pattern
guard = FileGuard(sys.argv[1], lock="jobs")
v = int(sys.argv[2])
while True:
    guard.write("loop", pattern(v), f"jobs:{v}")
    print(v, flush=True)
    v += 1
"""


def test_sigkill_at_arbitrary_points_never_leaves_a_partial_version(tmp_path: Path) -> None:
    store = tmp_path / "store"
    guard = FileGuard(store, lock=LOCK)
    rng = random.Random(7)
    next_token = 1
    for _ in range(6):
        child = _child(_LOOP_WRITER, str(store), str(next_token))
        assert child.stdout is not None
        acked = {int(child.stdout.readline()) for _ in range(rng.randint(1, 4))}
        child.send_signal(signal.SIGKILL)  # somewhere inside a later write
        # From the same reader: readline() may have buffered later lines already, which
        # communicate() (it reads the pipes' descriptors) would never see.
        rest = child.stdout.read()
        child.wait(30)
        assert child.stderr is not None
        child.stderr.close()
        acked |= {int(line) for line in rest.split()}  # acknowledged before the kill landed
        new = {v for v in tokens_of(guard, "loop") if v >= next_token}
        # every acknowledged write is there; besides them, at most the one in flight
        assert acked <= new and new - acked <= {max(acked) + 1}, (acked, new)
        for value in tokens_of(guard, "loop"):
            assert guard.read_version("loop", Version(tok(value))) == pattern(value)
        newest, data = guard.read("loop")
        assert data == pattern(newest.value)
        next_token = newest.value + 1
    guard.write("loop", pattern(next_token), token=tok(next_token))  # still writable
    assert temps(guard, "loop") == []


# -- HighWaterFile ---------------------------------------------------------------------------------


def test_high_water_file_both_sides(tmp_path: Path) -> None:
    mark = HighWaterFile(tmp_path / "mark", lock=LOCK)
    assert mark.current() is None
    assert mark.check_and_advance(token="jobs:4") == tok(4)
    assert mark.check_and_advance(token=tok(4)) == tok(4)  # equal accepted
    assert mark.check_and_advance(token=tok(9)) == tok(9)
    with pytest.raises(StaleTokenError) as info:
        mark.check_and_advance(token=tok(8))
    assert (info.value.token, info.value.high_water) == (tok(8), tok(9))
    assert (tmp_path / "mark").read_text() == "jobs:9\n"
    assert HighWaterFile(tmp_path / "mark", lock=LOCK).current() == tok(9)  # restart
    with pytest.raises(WrongLockError):
        mark.check_and_advance(token="other:100")
    with pytest.raises(InvalidTokenError):
        mark.check_and_advance(token="jobs:0")
    assert mark.current() == tok(9)


def test_high_water_file_refuses_a_foreign_or_corrupt_mark(tmp_path: Path) -> None:
    (tmp_path / "foreign").write_text("other:3\n")
    with pytest.raises(WrongLockError):
        HighWaterFile(tmp_path / "foreign", lock=LOCK).check_and_advance(token=tok(10))
    for i, text in enumerate(
        [
            "jobs:\n",
            "",
            " ",
            "jobs:-5\n",
            "jobs:+5000\n",
            "jobs:0\n",
            "jobs:0005\n",
            "jobs:9223372036854775808\n",
            "garbage",
        ]
    ):
        path = tmp_path / f"corrupt{i}"
        path.write_text(text)
        with pytest.raises(CorruptMarkError, match="high-water file") as info:
            HighWaterFile(path, lock=LOCK).check_and_advance(token=tok(10))
        assert info.value.resource == str(path)
        assert path.read_text() == text  # not "repaired" by a write


@pytest.mark.parametrize("bad", ["0000000000000000000.000000", "9999999999999999999.000000"])
def test_file_guard_refuses_a_version_name_it_never_wrote(tmp_path: Path, bad: str) -> None:
    """A version name of token 0 or above MAX_TOKEN is a damaged mark: every write refused."""
    guard = FileGuard(tmp_path, lock=LOCK)
    guard.write("r", b"ten", token=tok(10))
    (tmp_path / "r" / bad).write_bytes(b"?")
    for value in (3, 10, 11):
        with pytest.raises(CorruptMarkError):
            guard.write("r", b"late", token=tok(value))
    assert sorted(
        p.name for p in (tmp_path / "r").iterdir() if not p.name.startswith(".")
    ) == sorted(["0000000000000000010.000000", bad, "current"])
    assert os.readlink(tmp_path / "r" / "current") == "0000000000000000010.000000"


class UnlockedMark(HighWaterFile):
    """PLANTED BUG: the hold() check and the caller's write are not under one lock."""

    def _locked(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()


class StrictMark(HighWaterFile):
    """PLANTED BUG: ``>`` where ``>=`` belongs."""

    def _accepts(self, token: int, mark: int) -> bool:
        return token > mark


def in_place_race(cls: type[HighWaterFile], tmp_path: Path) -> None:
    """A (7) is stopped inside hold() writing the data in place while B (8) writes."""
    mark, data = cls(tmp_path / "mark", lock=LOCK), tmp_path / "data"
    mark.check_and_advance(token=tok(6))
    plan = Interleaving()

    def writer(value: int) -> Callable[[], None]:
        def write() -> None:
            with contextlib.suppress(StaleTokenError), mark.hold(token=tok(value)):
                if value == 7:
                    plan.pause_a()
                data.write_text(str(value))

        return write

    plan.run(writer(7), writer(8), str(tmp_path / "mark.lock"))
    assert not plan.errors, plan.errors
    assert mark.current() == tok(8)
    assert data.read_text() == "8", "a stale writer overwrote the data in place"


def test_hold_keeps_check_and_in_place_write_together(tmp_path: Path) -> None:
    in_place_race(HighWaterFile, tmp_path)


def test_planted_bug_unlocked_mark_is_caught(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="overwrote"):
        in_place_race(UnlockedMark, tmp_path)


def test_planted_bug_strict_mark_is_caught(tmp_path: Path) -> None:
    def check(mark: HighWaterFile) -> None:
        mark.check_and_advance(token=tok(3))
        mark.check_and_advance(token=tok(3))

    check(HighWaterFile(tmp_path / "good", lock=LOCK))
    with pytest.raises(StaleTokenError):
        check(StrictMark(tmp_path / "bad", lock=LOCK))


def test_high_water_file_across_processes(tmp_path: Path) -> None:
    script = """
import sys
from fenced.guards.files import HighWaterFile
HighWaterFile(sys.argv[1], lock="jobs").check_and_advance(token=sys.argv[2])
"""
    child = _child(script, str(tmp_path / "mark"), "jobs:12")
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    with pytest.raises(StaleTokenError):
        HighWaterFile(tmp_path / "mark", lock=LOCK).check_and_advance(token=tok(11))


async def test_async_file_guard_both_sides_and_concurrent_writers(tmp_path: Path) -> None:
    """The asyncio face of the one implementation: the rule both ways, and 20 concurrent
    writers on the event loop end with the highest token as the newest version."""
    import asyncio

    from fenced.guards.files import AsyncFileGuard

    guard = AsyncFileGuard(tmp_path / "store", lock=LOCK)
    await guard.write("r", b"five", token=tok(5))
    with pytest.raises(StaleTokenError):
        await guard.write("r", b"four", token=tok(4))
    assert await guard.read("r") == (tok(5), b"five")

    async def writer(i: int) -> None:
        with contextlib.suppress(StaleTokenError):
            await guard.write("race", f"v{i}".encode(), token=tok(i))

    await asyncio.gather(*(writer(i) for i in range(1, 21)))
    # The highest token is never stale, so it always lands, and last: it is the newest.
    assert await guard.read("race") == (tok(20), b"v20")
    assert await guard.high_water("race") == tok(20)


def test_claim_returns_a_stale_write_accepted_before_its_fence(guard: FileGuard) -> None:
    """A stale writer (another process) stopped inside its critical section, its write
    accepted: the claim waits for it on the resource lock, then returns that write (the
    check kit's read-modify-write once lost it: claim() had returned its own copy of the
    older version). Afterwards the stale token is refused and the holder's write accepted."""
    guard.write("r", b"v9", token=tok(9))
    with stopped_child(Path(guard.directory), "r", "jobs:10", "checked") as child:
        claimed: list[bytes | None] = []
        claimer = threading.Thread(target=lambda: claimed.append(guard.claim("r", token=tok(11))))
        claimer.start()
        lock_path = os.path.join(guard.directory, "r", ".lock")
        wait_for(lambda: flock_waiters(lock_path) > 0, what="the claim to wait for the lock")
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        claimer.join(30)
    assert claimed == [b"N" * 100000]
    assert guard.read("r") == (tok(11), b"N" * 100000)
    with pytest.raises(StaleTokenError):
        guard.write("r", b"late", token=tok(10))  # the current holder's mark stands
    assert guard.claim("r", token=tok(11)) == b"N" * 100000  # (again: unchanged, no publish)
    assert tokens_of(guard, "r") == [9, 10, 11]
    guard.write("r", b"v11", token=tok(11))  # the holder's own write is accepted
    assert guard.read("r") == (tok(11), b"v11")


_PRUNER = """
import select, sys
from fenced.guards.files import FileGuard
guard = FileGuard(sys.argv[1], lock="jobs")
guard.prune("r", keep=1)
print("ready", flush=True)
deleted = 0
while not select.select([sys.stdin], [], [], 0)[0]:  # until the test closes our stdin
    deleted += len(guard.prune("r", keep=1))
print(deleted, flush=True)
"""


def test_claim_racing_prune_in_another_process_keeps_the_newest_data(tmp_path: Path) -> None:
    """Bug (outside attack): claim() republished "the newest version below its token" after
    its publish; a prune(keep=1) from another process in between had removed it, so claim
    published b"" as the newest version and returned None (the data then lived only in an
    older version the next prune deleted), or raised ResourceNotFoundError when the version
    it was about to copy was pruned. Claims with rising tokens, each holder writing now and
    then, race a process pruning in a loop: every claim returns the newest accepted data,
    which stays the newest, and the stale token is refused each time."""
    store = tmp_path / "store"
    guard = FileGuard(store, lock=LOCK)
    guard.write("r", b"v1", token=tok(1))
    pruner = _child(_PRUNER, str(store), stdin=subprocess.PIPE)
    try:
        assert pruner.stdout is not None and pruner.stdout.readline().strip() == "ready"
        expected = b"v1"
        for t in range(2, 302):
            assert guard.claim("r", token=tok(t)) == expected, t
            assert guard.read("r") == (tok(t), expected), t
            with pytest.raises(StaleTokenError):
                guard.write("r", b"stale", token=tok(t - 1))
            if t % 3 == 0:  # the holder's own write, accepted; the next claim returns it
                expected = f"v{t}".encode()
                guard.write("r", expected, token=tok(t))
    finally:
        out, err = pruner.communicate(timeout=30)  # (closes its stdin: it stops)
    assert pruner.returncode == 0, err
    assert int(out) > 0  # the prunes really interleaved with the claims


# -- what garbage collection cannot remove ---------------------------------------------------


def _plant_strays(rdir: Path, outside: Path) -> list[Path]:
    """Entries named like temp files that no writer of the guard made: a directory, a
    symlink to a file outside, a FIFO (opening it for reading would block)."""
    outside.write_bytes(b"not yours")
    strays = [rdir / f"{TEMP_PREFIX}dir", rdir / f"{TEMP_PREFIX}link", rdir / f"{TEMP_PREFIX}fifo"]
    strays[0].mkdir()
    strays[1].symlink_to(outside)
    os.mkfifo(strays[2])
    return strays


def test_writes_stay_accepted_past_temp_names_they_cannot_collect(
    guard: FileGuard, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug (outside attack): a directory (or symlink) named ``.tmp-*`` in a resource
    directory made every later write publish its version, then raise from the garbage
    collection that follows (`fenced write` printed a traceback, exit 1, with the version
    current); a FIFO of that name would have blocked it. Now they are skipped and logged
    once; a dead writer's real temp file beside them is still collected."""
    guard.write("r", b"v1", token=tok(1))
    rdir = Path(guard.directory, "r")
    strays = _plant_strays(rdir, tmp_path / "outside")
    dead = rdir / f"{TEMP_PREFIX}{'0' * 32}"
    dead.write_bytes(b"a crashed writer's data")
    with caplog.at_level("DEBUG", logger="fenced.guards.files"):
        assert guard.write("r", b"v2", token=tok(2)) == Version(tok(2))
        assert guard.write("r", b"v3", token=tok(3)) == Version(tok(3))
        assert guard.claim("r", token=tok(4)) == b"v3"
    assert guard.read("r") == (tok(4), b"v3") and tokens_of(guard, "r") == [1, 2, 3, 4]
    with pytest.raises(StaleTokenError):
        guard.write("r", b"stale", token=tok(3))
    assert not dead.exists()  # collected
    assert all(os.path.lexists(p) for p in strays)  # left alone
    assert (tmp_path / "outside").read_bytes() == b"not yours"
    assert guard.collect_garbage("r") == 0
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert sorted(r.args[0] for r in warnings) == sorted(map(str, strays))  # type: ignore[index]


def test_fenced_write_is_not_failed_by_a_stray_temp_directory(tmp_path: Path) -> None:
    """The attacker's command: `mkdir DIR/daily.csv/.tmp-x; echo v2 | FENCING_TOKEN=reports:2
    fenced write DIR/daily.csv` printed a traceback and exited 1 while v2 was current."""
    target = tmp_path / "out" / "daily.csv"
    FileGuard(target.parent, lock="reports").write("daily.csv", b"v1\n", token="reports:1")
    (target / f"{TEMP_PREFIX}x").mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "FENCING_TOKEN": "reports:2"}
    out = subprocess.run(
        [sys.executable, "-m", "fenced", "write", str(target)],
        input="v2\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "left" in out.stderr and "in place" in out.stderr
    assert (target / "current").read_text() == "v2\n"


def test_high_water_file_never_follows_a_planted_temp_symlink(tmp_path: Path) -> None:
    """Bug (outside attack): the mark's temp file had a fixed name (``.<base>.tmp``) opened
    without O_NOFOLLOW/O_EXCL: a symlink planted there (a shared directory) had its target
    truncated and overwritten with the mark, and the mark path became that symlink. Now the
    temp name is unique and created O_EXCL | O_NOFOLLOW; the plant and its target are left
    alone, and the mark is a regular file."""
    victim = tmp_path / "victim.conf"
    victim.write_text("precious\n")
    marks = tmp_path / "marks"
    marks.mkdir()
    (marks / ".accounts.mark.tmp").symlink_to(victim)
    mark = HighWaterFile(marks / "accounts.mark", lock=LOCK)
    assert mark.check_and_advance(token=tok(7)) == tok(7)
    assert victim.read_text() == "precious\n"
    assert not (marks / "accounts.mark").is_symlink()
    assert (marks / "accounts.mark").read_text() == "jobs:7\n"
    with pytest.raises(StaleTokenError):
        mark.check_and_advance(token=tok(6))
    assert mark.check_and_advance(token=tok(8)) == tok(8)  # (the current holder, later)
    assert sorted(p.name for p in marks.iterdir()) == [
        ".accounts.mark.tmp",  # the plant, untouched
        "accounts.mark",
        "accounts.mark.lock",
    ]


def test_high_water_file_refuses_a_mark_that_is_a_symlink(tmp_path: Path) -> None:
    """A symlink at the mark's path was planted (the guard only ever renames a regular file
    there): it is refused as a corrupt mark, not followed to a file someone else chose, and
    neither it nor its target is replaced."""
    chosen = tmp_path / "chosen"
    chosen.write_text("jobs:1\n")
    (tmp_path / "mark").symlink_to(chosen)
    mark = HighWaterFile(tmp_path / "mark", lock=LOCK)
    for value in (1, 5):
        with pytest.raises(CorruptMarkError, match="symlink"):
            mark.check_and_advance(token=tok(value))
    assert (tmp_path / "mark").is_symlink() and chosen.read_text() == "jobs:1\n"


def test_high_water_file_collects_the_temp_file_of_a_writer_that_died(tmp_path: Path) -> None:
    """A writer killed between its temp file and its rename leaves ``.<base>.tmp-<hex>``:
    the next advance removes it (and only temp files of this mark, never a live writer's)."""
    script = """
import os, signal, sys
from fenced.guards import files
real_rename = os.rename
def die(src, dst):
    os.kill(os.getpid(), signal.SIGKILL)
files.os.rename = die
files.HighWaterFile(sys.argv[1], lock="jobs").check_and_advance(token="jobs:3")
"""
    child = _child(script, str(tmp_path / "mark"))
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(left) == 1 and left[0].startswith(".mark.tmp-")
    other = tmp_path / ".other.tmp-0123456789abcdef0123456789abcdef"
    other.write_text("another mark's")
    mark = HighWaterFile(tmp_path / "mark", lock=LOCK)
    assert mark.current() is None  # the dead writer published nothing
    assert mark.check_and_advance(token=tok(4)) == tok(4)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == [other.name]


async def test_async_file_guard_has_every_method_of_file_guard(tmp_path: Path) -> None:
    """Bug (outside attack): AsyncFileGuard lacked claim, fence, publish, read_version, path
    and collect_garbage, though the docs said it had the same methods. Each public method
    of FileGuard is there (a coroutine, but path(), which does no I/O), and each works
    through the one implementation: both sides of the rule included."""
    import inspect

    from fenced.guards.files import AsyncFileGuard

    public = {
        n for n in dir(FileGuard) if not n.startswith("_") and callable(getattr(FileGuard, n))
    }
    guard = AsyncFileGuard(tmp_path / "store", lock=LOCK)
    assert sorted(public - set(dir(AsyncFileGuard))) == []
    for n in public - {"path"}:
        assert inspect.iscoroutinefunction(getattr(AsyncFileGuard, n)), n

    v2 = await guard.publish("r", b"two", token=tok(2))
    assert await guard.read_version("r", v2) == b"two"
    assert Path(guard.path("r", v2)).read_bytes() == b"two"
    assert await guard.claim("r", token=tok(3)) == b"two"
    with pytest.raises(StaleTokenError):
        await guard.claim("r", token=tok(2))
    with pytest.raises(StaleTokenError):
        await guard.publish("r", b"stale", token=tok(2))
    await guard.fence(tok(4), iter(["r", "s"]))
    assert await guard.read("r") == (tok(4), b"two") and await guard.high_water("s") == tok(4)
    await guard.fence(tok(5))  # every resource of the directory
    assert await guard.high_water("r") == tok(5) == await guard.high_water("s")
    (tmp_path / "store" / "r" / f"{TEMP_PREFIX}{'0' * 32}").write_bytes(b"dead writer's")
    assert await guard.collect_garbage("r") == 1
    assert await guard.write("r", b"six", token=tok(6)) == Version(tok(6))


# -- another user on the same machine (outside attack 4) -------------------------------------
# Run as root (as the attacker's reproduction was): files are given to user nobody with
# os.chown, and the attacker's own attempts run in a child that setuid()s to nobody.

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown and setuid")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A 0755 directory other users may enter and read (pytest's tmp_path is 0700)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="fenced-files-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


_AS_NOBODY = f"""
import errno, fcntl, os, sys
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
for path in sys.argv[1:]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        print("refused" if exc.errno == errno.EACCES else f"error {{exc}}")
        continue
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (the attacker would hold it forever)
    print("locked")
"""


def lock_as_nobody(*paths: Path) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")[:-1]


@as_root
def test_another_user_cannot_hold_a_lock_file_whatever_the_umask(open_dir: Path) -> None:
    """Bug (outside attack): lock files were made 0644 and flock(LOCK_EX) works on a read-only
    descriptor: user nobody locked them and every writer blocked forever. Now 0600, set
    explicitly (a umask of 0 does not widen it): nobody cannot even open them."""
    old = os.umask(0)
    try:
        guard = FileGuard(open_dir / "fg", lock="reports")
        guard.write("daily.csv", b"v1", token="reports:1")
        mark = HighWaterFile(open_dir / "accounts.mark", lock="accounts")
        with mark.hold(token="accounts:1"):
            pass
    finally:
        os.umask(old)
    locks = [open_dir / "fg" / "daily.csv" / ".lock", open_dir / "accounts.mark.lock"]
    assert [oct(p.stat().st_mode & 0o777) for p in locks] == ["0o600", "0o600"]
    assert lock_as_nobody(*locks) == ["refused", "refused"]
    # the owner still writes (the other side)
    assert guard.write("daily.csv", b"v2", token="reports:2").token == FencingToken("reports", 2)
    with mark.hold(token="accounts:2"):
        pass
    assert mark.current() == FencingToken("accounts", 2)


def test_a_lock_file_an_older_version_left_readable_is_narrowed(tmp_path: Path) -> None:
    guard = FileGuard(tmp_path / "fg", lock=LOCK)
    (tmp_path / "fg" / "r").mkdir()
    lock_file = tmp_path / "fg" / "r" / ".lock"
    lock_file.touch(mode=0o644)
    lock_file.chmod(0o644)
    guard.write("r", b"x", token=tok(1))
    assert lock_file.stat().st_mode & 0o777 == 0o600


def one_line_refusal(info: pytest.ExceptionInfo[ConfigurationError], path: Path) -> None:
    text = str(info.value)
    assert "\n" not in text and str(path) in text and f"uid {NOBODY}" in text, text


@as_root
def test_a_lock_file_or_resource_directory_of_another_user_is_refused(open_dir: Path) -> None:
    """A lock file or resource directory owned by another user than the reader or root is
    refused in one line, before locking (its owner could hold the lock, or change the
    versions, at will); given back to its user, writes are accepted again."""
    guard = FileGuard(open_dir / "fg", lock="reports")
    guard.write("daily.csv", b"v1", token="reports:1")
    lock_file = open_dir / "fg" / "daily.csv" / ".lock"
    os.chown(lock_file, NOBODY, NOBODY)
    with pytest.raises(ConfigurationError, match=r"lock file .* owned by another user") as info:
        guard.write("daily.csv", b"v2", token="reports:2")
    one_line_refusal(info, lock_file)
    with pytest.raises(ConfigurationError, match="lock file"):
        guard.claim("daily.csv", token="reports:2")
    out = subprocess.run(
        [sys.executable, "-m", "fenced", "write", str(open_dir / "fg" / "daily.csv")],
        input="v3\n",
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), "FENCING_TOKEN": "reports:3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "owned by another user" in out.stderr and len(out.stderr.splitlines()) == 1
    os.chown(lock_file, 0, 0)
    assert guard.read("daily.csv") == (FencingToken("reports", 1), b"v1")  # nothing written
    guard.write("daily.csv", b"v2", token="reports:2")

    rdir = open_dir / "fg" / "weekly.csv"
    rdir.mkdir()
    os.chown(rdir, NOBODY, NOBODY)
    fresh = FileGuard(open_dir / "fg", lock="reports")
    for call in (
        lambda: fresh.write("weekly.csv", b"w", token="reports:2"),
        lambda: fresh.read("weekly.csv"),
    ):
        with pytest.raises(ConfigurationError, match="resource directory") as info:
            call()
        one_line_refusal(info, rdir)
    assert fresh.read("daily.csv") == (FencingToken("reports", 2), b"v2")


@as_root
def test_a_mark_or_mark_lock_of_another_user_is_refused(tmp_path: Path) -> None:
    """Bug (outside attack): in a sticky world-writable directory, a mark planted before first
    use at the maximum value refused every write for good; one planted lower let stale
    tokens in. A mark, or its lock file, owned by another user is now refused."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    planted = shared / "accounts.mark"
    planted.write_text("accounts:1\n")
    os.chown(planted, NOBODY, NOBODY)
    mark = HighWaterFile(planted, lock="accounts")
    for call in (mark.current, lambda: mark.check_and_advance(token="accounts:5")):
        with pytest.raises(
            ConfigurationError, match=r"high-water file .* owned by another"
        ) as info:
            call()
        one_line_refusal(info, planted)
    assert planted.read_text() == "accounts:1\n"
    os.chown(planted, 0, 0)  # ours: the same directory is fine (the sticky bit)
    assert mark.check_and_advance(token="accounts:5") == FencingToken("accounts", 5)
    with pytest.raises(StaleTokenError):
        mark.check_and_advance(token="accounts:3")
    os.chown(shared / "accounts.mark.lock", NOBODY, NOBODY)
    with pytest.raises(ConfigurationError, match="lock file") as info:
        mark.check_and_advance(token="accounts:6")
    one_line_refusal(info, shared / "accounts.mark.lock")


@as_root
@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_high_water_file_refuses_a_directory_others_may_rewrite(open_dir: Path, mode: int) -> None:
    """Bug (outside attack): in a 0777 directory user nobody replaced accounts.mark (at
    accounts:10) with accounts:1, and the stale token accounts:3 was accepted. A directory
    others may write without the sticky bit (they can rename anything in it) is refused."""
    shared = open_dir / "shared"
    shared.mkdir()
    mark = HighWaterFile(shared / "accounts.mark", lock="accounts")
    mark.check_and_advance(token="accounts:10")
    shared.chmod(mode)
    reset = (
        f"import os; os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY}); "
        f"p = {str(shared / 'accounts.mark')!r}; os.unlink(p); open(p, 'w').write('accounts:1')"
    )
    if mode & 0o002:  # (a 0775 directory: only its group may write; nobody is not in it)
        subprocess.run([sys.executable, "-c", reset], check=True, timeout=60)
    for call in (mark.current, lambda: mark.check_and_advance(token="accounts:3")):
        with pytest.raises(ConfigurationError, match="may be written by other users") as info:
            call()
        assert "\n" not in str(info.value) and str(shared) in str(info.value)
    shared.chmod(0o755)
    (shared / "accounts.mark").unlink()
    (shared / "accounts.mark").write_text("accounts:10\n")  # (the owner repairs it)
    with pytest.raises(StaleTokenError):
        mark.check_and_advance(token="accounts:3")
    assert mark.check_and_advance(token="accounts:11") == FencingToken("accounts", 11)


@as_root
def test_high_water_file_refuses_a_directory_of_another_user(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)  # (even sticky, its owner may rename anything in it)
    with pytest.raises(ConfigurationError, match=r"directory .* owned by another user"):
        HighWaterFile(theirs / "m", lock=LOCK).check_and_advance(token=tok(1))


def test_fence_skips_what_is_not_a_resource_and_fences_every_real_one(
    guard: FileGuard, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug (outside attack): a stray directory whose name the guard refuses (``a b``) made
    fence() raise ConfigurationError, with the resources sorted before it fenced and those
    after it not (partial fencing). Strays are now skipped and logged; every resource is
    claimed."""
    guard.write("daily.csv", b"d1", token=tok(1))
    guard.write("weekly.csv", b"w1", token=tok(1))
    directory = Path(guard.directory)
    (directory / "a b").mkdir()
    (directory / "notes.txt").write_text("a plain file")
    with caplog.at_level("WARNING", logger="fenced.guards.files"):
        guard.fence(tok(2))
    assert tokens_of(guard, "daily.csv") == [1, 2] and tokens_of(guard, "weekly.csv") == [1, 2]
    assert guard.read("weekly.csv") == (tok(2), b"w1")
    skipped = [r.getMessage() for r in caplog.records]
    assert any("a b" in m and "fence skipped" in m for m in skipped), skipped
    assert any("notes.txt" in m for m in skipped), skipped
    assert sorted(os.listdir(directory / "a b")) == []  # left as found


def test_fence_fences_every_other_resource_before_raising(guard: FileGuard) -> None:
    """A resource that cannot be fenced (a newer holder wrote it: StaleTokenError) no longer
    leaves the resources sorted after it unfenced: all the others are claimed, then the
    error is raised."""
    for name in ("a", "m", "z"):
        guard.write(name, name.encode(), token=tok(1))
    guard.write("m", b"newer", token=tok(5))
    with pytest.raises(StaleTokenError) as info:
        guard.fence(tok(3))
    assert info.value.resource == "m"
    assert [tokens_of(guard, n) for n in ("a", "m", "z")] == [[1, 3], [1, 5], [1, 3]]
    with pytest.raises(ConfigurationError, match="invalid resource name"):
        guard.fence(tok(4), ["a", "a b", "z"])  # named ones too: the others first
    assert [tokens_of(guard, n)[-1] for n in ("a", "z")] == [4, 4]


def test_no_current_link_left_behind_when_current_is_blocked(
    guard: FileGuard, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug (outside attack): with ``current`` replaced by a directory, each write left its
    ``.current-<pid>`` symlink behind. The write is still accepted (and the link logged)."""
    guard.write("r", b"v1", token=tok(1))
    rdir = Path(guard.directory) / "r"
    (rdir / "current").unlink()
    (rdir / "current").mkdir()
    (rdir / "current" / "x").write_text("y")
    with caplog.at_level("WARNING", logger="fenced.guards.files"):
        guard.write("r", b"v2", token=tok(2))
    assert guard.read("r") == (tok(2), b"v2")
    assert [n for n in os.listdir(rdir) if n.startswith(".current-")] == []
    assert (rdir / "current" / "x").read_text() == "y"
    assert any("not moved" in r.getMessage() for r in caplog.records)
