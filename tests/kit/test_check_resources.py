"""``fenced check --resource``: campaigns of real worker processes on the embedded SQLite
source against each kind of resource fenced guards — SQL (SQLite, PostgreSQL), Redis, etcd,
files, an HTTP service behind the ``Fencing-Token`` header, a user's own ``python:`` adapter —
hold every invariant under stalls, pauses and kills; the HTTP service written the common
wrong way (the middleware checks, the handler writes later) is caught. One distributed
source (Redis) runs with partitions, delays and kill -9 restarts of a server the kit started."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.testing.check import CampaignResult, run_campaign
from fenced.testing.servers import EtcdServer, RedisServer, free_port, wait_until
from tests.helpers import ROOT

FAULTS = ["stall", "pause", "kill", "impostor"]
DEFAULT = ["pause", "stall", "kill", "impostor"]  # (fenced check --resource python:...'s)


def _campaign(
    tmp_path: Path,
    resource: str,
    *,
    source: str = "",
    nemesis: list[str] = FAULTS,
    faults: int = 1,
    writes: int = 10,
    workers: int = 2,
    ttl: float = 0.5,
    seed: int = 1,
    stop_at_first: bool = False,
) -> CampaignResult:
    """A run bounded by counts: each nemesis ``faults`` times and ``writes`` writes (it ends
    when they are reached; the 90 s bound fails it if they are not). Two workers by default:
    a stale writer needs one successor, and each worker is a Python process."""
    return run_campaign(
        source or f"sqlite:///{tmp_path}/locks.db",
        tmp_path / "r",
        resource=resource,
        nemesis=nemesis,
        seconds=90,
        faults=faults,
        writes=writes,
        workers=workers,
        ttl=ttl,
        seed=seed,
        stop_at_first=stop_at_first,
    )


def _holds(result: CampaignResult) -> None:
    violations = result.violations
    assert not violations, [str(v) for v in violations]
    assert result.accepted >= 5


def test_a_postgresql_table(tmp_path: Path, pg_dsn: str) -> None:
    _holds(_campaign(tmp_path, f"{pg_dsn}?table=accounts"))


def test_a_redis_key_with_signed_tokens_forged_tokens_and_clock_steps(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Signing on: the forger's tokens are refused by RedisGuard's verification; workers'
    wall clocks jump up to a minute either way, and nothing changes."""
    if redis_server.proc is None:
        redis_server.start()
    result = run_campaign(
        f"sqlite:///{tmp_path}/locks.db",
        tmp_path / "r",
        resource=f"{redis_server.url}?key=check-{tmp_path.name}",
        nemesis=["stall", "kill", "forge", "clock"],
        seconds=90,
        faults=1,
        writes=10,
        workers=2,
        ttl=0.5,
        seed=2,
        signing=True,
    )
    _holds(result)
    assert result.faults["forge"] >= 1 and result.faults["clock"] >= 1, result.faults


def test_an_etcd_key(tmp_path: Path, etcd_server: EtcdServer) -> None:
    if etcd_server.proc is None:
        etcd_server.start()
    _holds(_campaign(tmp_path, f"{etcd_server.url}?key=check-{tmp_path.name}"))


def test_a_directory_of_file_versions(tmp_path: Path) -> None:
    _holds(_campaign(tmp_path, f"file://{tmp_path}/files"))


def test_a_users_python_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHECK_ADAPTER_DB", str(tmp_path / "adapter.db"))
    monkeypatch.chdir(ROOT)  # (the workers import tests.kit.check_adapter from here)
    _holds(_campaign(tmp_path, "python:tests.kit.check_adapter:Adapter"))


def test_a_users_adapter_whose_write_is_two_steps_is_stalled_between_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter that says its write is two steps (``SplitWrite.write_steps``): the worker's
    stall lands between the check and the write, and the check-then-write it is is caught
    (stalled before the whole write, the late check would refuse it and hide the bug). The
    same adapter's one-step sibling holds (test above)."""
    monkeypatch.setenv("CHECK_ADAPTER_DB", str(tmp_path / "adapter.db"))
    monkeypatch.chdir(ROOT)  # (the workers import tests.kit.check_adapter from here)
    from fenced.testing.check import Resource, SplitWrite
    from tests.kit.check_adapter import CheckThenWrite

    made = CheckThenWrite("counter")
    assert isinstance(made, Resource) and isinstance(made, SplitWrite)
    made.close()
    for seed in (1, 2):
        result = _campaign(
            tmp_path / f"s{seed}", "python:tests.kit.check_adapter:CheckThenWrite",
            nemesis=["stall"], faults=8, workers=3, seed=seed, stop_at_first=True,
        )  # fmt: skip
        found = {v.checker for v in result.violations}
        if found:
            break
    assert found & {"lost update", "acknowledged write", "acceptance order"}, found


def test_a_users_one_step_check_then_write_is_stalled_inside_its_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same mistake inside one ``write()`` that says nothing of its steps, with no gap
    between its two transactions (an outside tester's adapter passed 4 runs in 6 with a 200 ms
    gap, and with none): the worker stops inside the write, C call by C call, until the
    successor's fenced read lands between the check and the write. Default nemeses, as
    ``fenced check --resource python:...`` runs them."""
    monkeypatch.setenv("CHECK_ADAPTER_DB", str(tmp_path / "adapter.db"))
    monkeypatch.chdir(ROOT)  # (the workers import tests.kit.check_adapter from here)
    result = _campaign(
        tmp_path, "python:tests.kit.check_adapter:PlainCheckThenWrite",
        nemesis=["pause", "stall", "kill"], faults=4, workers=3, stop_at_first=True,
    )  # fmt: skip
    found = {v.checker for v in result.violations}
    assert found & {"lost update", "acknowledged write", "acceptance order"}, [
        (v.checker, v.message) for v in result.violations
    ]


@pytest.fixture
def register_service(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    port = free_port()
    args = getattr(request, "param", [])
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "register_service.py"), "--port", str(port),
         "--db", str(tmp_path / "service.db"), *args],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
        except OSError:
            return False
        return True

    try:
        wait_until(up, 30, "register service")
        yield f"http://127.0.0.1:{port}/register"
    finally:
        proc.kill()
        proc.wait()


def test_an_http_service_that_fences_inside_its_transaction(
    tmp_path: Path, register_service: str
) -> None:
    _holds(_campaign(tmp_path, register_service))


@pytest.mark.parametrize("register_service", [["--check-then-write"]], indirect=True)
def test_an_http_service_that_checks_then_writes_is_caught(
    tmp_path: Path, register_service: str
) -> None:
    """The middleware's check and the handler's write are two steps, and reads are not
    fenced: a stalled holder's late write lands inside its successor's round."""
    for seed in (1, 2):  # (a second schedule if the first missed the window)
        (tmp_path / str(seed)).mkdir()
        result = _campaign(
            tmp_path / str(seed),
            register_service,
            nemesis=["stall"],
            faults=8,  # (it stops at its first violation: 8 stalls bound its effort)
            workers=3,
            seed=seed,
            stop_at_first=True,
        )
        found = {v.checker for v in result.violations}
        if found:
            break
    assert found & {"lost update", "acknowledged write", "acceptance order"}, found


def test_redis_source_and_resource_with_partitions_delays_and_restarts(tmp_path: Path) -> None:
    """The kit starts its own Redis as the source (and kills -9 and restarts it), and puts a
    proxy on each worker's way to the source and to the resource."""
    with RedisServer() as resource_server:
        result = _campaign(
            tmp_path,
            f"{resource_server.url}?key=check",
            source="redis",
            nemesis=["partition", "delay", "restart", "stall"],
            seed=5,
        )
    _holds(result)
    faults = result.faults
    assert all(faults[k] >= 1 for k in ("partition", "delay", "restart")), faults


def test_postgresql_clock_steps_end_leases_early_but_the_fence_holds(tmp_path: Path) -> None:
    """libfaketime steps the wall clock of a PostgreSQL the kit started; fenced's PostgreSQL
    source judges expiry by the database's clock, so a forward step ends a lease early and
    the next holder is granted while the last one believes it still holds (overlap) — the
    lease is only as good as the clock. The resource's fence is not: nothing else breaks."""
    from fenced.testing.check import faketime_library

    if faketime_library() is None:
        pytest.skip("libfaketime is not installed (make test installs it as root)")
    result = _campaign(
        tmp_path, "", source="postgresql", nemesis=["clock", "stall"], faults=2, ttl=1.0, seed=0
    )
    found = {v.checker for v in result.violations}
    assert found <= {"overlap"}, [str(v) for v in result.violations]
    assert result.faults["clock"] >= 2 and result.accepted >= 5, result.faults


def test_an_adapter_that_compares_lock_names_case_blind_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The impostor nemesis's second token of another lock differs from the run's only in
    case (``COUNTER`` for ``counter``): an adapter comparing names case-blind lets it in
    ("impostor accepted"; the first, ``counter-elsewhere``, catches a prefix test). The other
    side: the exact-compare adapter holds under the same faults."""
    monkeypatch.setenv("CHECK_ADAPTER_DB", str(tmp_path / "adapter.db"))
    monkeypatch.chdir(ROOT)  # (the workers import tests.kit.check_adapter from here)
    result = _campaign(
        tmp_path / "blind", "python:tests.kit.check_adapter:CaseBlindLock",
        nemesis=["impostor"], faults=4, workers=2, stop_at_first=True,
    )  # fmt: skip
    assert "impostor accepted" in {v.checker for v in result.violations}, result.violations
    monkeypatch.setenv("CHECK_ADAPTER_DB", str(tmp_path / "exact.db"))
    _holds(_campaign(tmp_path / "exact", "python:tests.kit.check_adapter:Adapter",
                     nemesis=["impostor"], faults=4, workers=2))  # fmt: skip


@pytest.mark.parametrize("adapter", ["ReadLockIgnored", "ReadRefusedMarkMoved"])
def test_a_fenced_read_that_lets_another_locks_token_move_the_mark_is_caught(
    adapter: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside tester's adapters: writes fenced right, the fenced read wrong — it serves
    another lock's token and raises the mark with it, or refuses it after raising the mark.
    The impostor sent only writes, and both passed; its reads now judge them (served: the
    read is the violation; refused with the mark moved: the mark read back says so). The right
    adapter holds under the same faults (test_a_users_python_adapter)."""
    monkeypatch.setenv("CHECK_ADAPTER_DB", str(tmp_path / "adapter.db"))
    monkeypatch.chdir(ROOT)  # (the workers import tests.kit.check_adapter from here)
    result = _campaign(
        tmp_path, f"python:tests.kit.check_adapter:{adapter}", nemesis=["impostor"],
        stop_at_first=True,
    )  # fmt: skip
    found = [str(v) for v in result.violations if v.checker == "impostor accepted"]
    said = "was served" if adapter == "ReadLockIgnored" else "mark moved to 1000000001"
    assert any("a fenced read with another lock's token" in v and said in v for v in found), [
        str(v) for v in result.violations
    ]


@pytest.mark.parametrize("adapter", ["ResetKeepsMark", "ResetKeepsHiddenMark"])
def test_a_reset_that_keeps_its_mark_is_a_set_up_error_before_the_run(
    adapter: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside tester's adapter whose ``reset()`` keeps the mark an earlier run left: every
    first write was refused and the verdict blamed fencing ("current holder refused"). It is
    the adapter's set-up: a ResetError naming reset(), before any worker starts (its final()
    shows the mark, or a fenced read under token 1 is refused), and on the command line exit 2,
    one line, no verdict."""
    import fenced
    from fenced.cli._common import EXIT_VIOLATION
    from fenced.testing.check import ResetError
    from tests.kit import check_adapter

    monkeypatch.setenv("CHECK_ADAPTER_DB", str(tmp_path / "adapter.db"))
    monkeypatch.chdir(ROOT)  # (the workers import tests.kit.check_adapter from here)
    earlier = getattr(check_adapter, adapter)("counter")  # (an earlier run's mark: 500)
    earlier.reset()
    earlier.write(fenced.FencingToken("counter", 500), b"[[500,1]]")
    earlier.close()
    spec = f"python:tests.kit.check_adapter:{adapter}"
    with pytest.raises(ResetError, match=r"its reset\(\) (left the mark at 500|kept a mark)"):
        _campaign(tmp_path, spec)
    assert not list((tmp_path / "r").glob("worker-*.log"))  # (no worker started)
    if adapter == "ResetKeepsHiddenMark":
        run = subprocess.run(
            [sys.executable, "-m", "fenced", "check", "--resource", spec, "--time", "2",
             "--report", str(tmp_path / "cli")],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert run.returncode not in (0, EXIT_VIOLATION), (run.returncode, run.stdout)
        assert (
            f"resource {spec}: its reset() kept a mark" in run.stderr
            and len(run.stderr.splitlines()) == 1
        ), run.stderr


@pytest.mark.parametrize("adapter", ["OffByOne", "UnfencedRead"])
def test_an_off_by_one_fence_or_an_unfenced_read_is_caught_by_the_first_stall(
    adapter: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside tester's adapters, caught only 25-29 s into a 30 s run (one of ten seeds
    not at all): the stall that opens their window came anywhere in the first round; by the
    worker's name it was taken inside the write, where neither shows, or not chained; and the
    next fault (a kill, a pause) often struck the stalled worker or its successor before the
    late write was in. Now the first fault of the default mix is a chained stall before the
    write, and no fault comes before its late write: caught at the first stall (counts, not
    seconds: one fault of each kind)."""
    from fenced.testing.check import read_history

    monkeypatch.setenv("CHECK_ADAPTER_DB", str(tmp_path / "adapter.db"))
    monkeypatch.chdir(ROOT)  # (the workers import tests.kit.check_adapter from here)
    result = _campaign(
        tmp_path, f"python:tests.kit.check_adapter:{adapter}", nemesis=DEFAULT, workers=3,
        seed=0, stop_at_first=True,
    )  # fmt: skip
    found = {v.checker for v in result.violations}
    assert found & {"acceptance order", "lost update", "acknowledged write"}, [
        str(v) for v in result.violations
    ]
    events = read_history(result.history)
    faults = [e for e in events if e["op"] == "nemesis"]
    assert faults[0]["kind"] == "stall", [e["kind"] for e in faults]
    stalled = next(e for e in events if e["op"] == "stalled")
    assert stalled["worker"] == faults[0]["victim"] and not stalled.get("inside"), stalled
    late = next(
        e for e in events if e["op"] == "write" and e["worker"] == stalled["worker"]
        and e["mono"] > stalled["mono"]
    )  # fmt: skip
    assert late["mono"] < faults[1]["mono"], (late, faults[1])  # (its window, left open)
