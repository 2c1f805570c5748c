"""``fenced check`` against a user's service it knows nothing about: ``examples/inventory_service.py``
(stdlib ``http.server`` + ``sqlite3``, ``Fencing-Token`` header, 409 when stale), run by the kit
itself (``--resource-cmd``: it kills -9 and restarts it, pauses it, and races takeovers inside
it through a proxy per worker). Each of the service's four bugs is caught by the default
campaign; the service without a bug passes.

CI runs one short campaign each. ``FENCED_CHECK_SWEEP=10`` runs the default campaign (20 s,
ttl 1) over seeds 0-9 for each, and prints per bug the seeds caught and the median time to the
first violation (``pytest -s``)."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from fenced.testing.check import CampaignResult, run_campaign
from fenced.testing.servers import free_port, wait_until
from tests.helpers import ROOT

SERVICE = ROOT / "examples" / "inventory_service.py"
# The checkers each bug must upset (any one of them).
EXPECTED = {
    "string-tokens": {"current holder refused", "mostly refused"},
    "mark-in-memory": {"acceptance order", "lost update", "acknowledged write"},
    "check-then-write": {"acknowledged write", "lost update", "acceptance order"},
    "unfenced-reads": {"lost update", "acknowledged write", "acceptance order"},
    # (shows only under a resource-restart between a successor's fenced read and its write)
    "mark-from-data": {"acknowledged write", "lost update", "acceptance order"},
}
SWEEP = int(os.environ.get("FENCED_CHECK_SWEEP", "0"))


def campaign(
    tmp: Path,
    bug: str,
    seed: int,
    *,
    ttl: float,
    seconds: float = 90,
    faults: int = 0,
    writes: int = 0,
    stop_at_first: bool = False,
    nemesis: list[str] | None = None,
    args: tuple[str, ...] = (),
) -> CampaignResult:
    """The default campaign against the service, started by the kit (a private source): for
    ``seconds``, or with counts (each nemesis ``faults`` times, ``writes`` writes) until they
    are reached, ``seconds`` then its bound (a run that reaches it first fails)."""
    port = free_port()
    cmd = [sys.executable, str(SERVICE), "--port", str(port), "--db", str(tmp / "inv.db")]
    return run_campaign(
        None,
        tmp / "r",
        resource=f"http://127.0.0.1:{port}/items/widgets",
        resource_cmd=[*cmd, *(["--bug", bug] if bug else []), *args],
        seconds=seconds,
        faults=faults,
        writes=writes,
        ttl=ttl,
        seed=seed,
        stop_at_first=stop_at_first,
        nemesis=nemesis,
    )


@pytest.mark.parametrize("bug", list(EXPECTED))
def test_each_bug_of_the_users_service_is_caught(bug: str, tmp_path: Path) -> None:
    # Up to 3 rounds of faults (each opens with race and resource-restart, aimed inside the
    # service; one round missed mark-in-memory once in 5), ended at the first violation once
    # every nemesis has struck. Tokens compared as strings are no prefix violation (the run
    # cannot stop at it) and need no fault, only tokens past 9: one round (hundreds of grants;
    # from token 10 every read is refused, so no count of writes would ever be reached, and 3
    # rounds of faults that wait for acknowledged writes took 70-105 s at load 26).
    faults = 1 if bug == "string-tokens" else 3
    if bug == "mark-from-data":  # (its fault alone: the 1st and 3rd restarts come after a read)
        result = campaign(tmp_path, bug, seed=1, faults=3, ttl=0.5, stop_at_first=True,
                          nemesis=["resource-restart"])  # fmt: skip
    else:
        result = campaign(tmp_path, bug, seed=1, faults=faults, ttl=0.5, stop_at_first=True)
        assert result.faults["race"] >= 1, result.faults
    found = {v.checker for v in result.violations}
    assert found & EXPECTED[bug], (found, result.faults)
    assert result.faults["resource-restart"] >= 1, result.faults


def test_a_check_then_write_with_no_gap_is_caught_by_the_race_burst(tmp_path: Path) -> None:
    """The handler checks the token in one SQLite transaction and writes in a second, back to
    back: a window of microseconds in the service's own threads. One stale write and the
    successor's read sent at the same instant met in it 13% of the time (the default campaign
    caught it in 0 of 6 seeds); the race's burst (the stale write sent again 24 times around
    the read, then a look at the register before the successor writes) catches it."""
    result = campaign(tmp_path, "check-then-write", seed=2, faults=2, ttl=0.5,
                      stop_at_first=True, nemesis=["race"], args=("--gap", "0"))  # fmt: skip
    found = {v.checker for v in result.violations}
    assert found & EXPECTED["check-then-write"], (found, result.faults)
    # (seen by a look after the successor's read: the same-instant race alone, before the
    # bursts, caught it 2 times in 6 with this seed and count, never so)
    assert any("landed after" in v.message for v in result.violations), result.violations
    assert result.faults["race"] >= 1, result.faults


def test_the_right_service_passes(tmp_path: Path) -> None:
    result = campaign(tmp_path, "", seed=1, faults=1, writes=20, ttl=0.5)
    assert result.ok, [str(v) for v in result.violations]
    assert result.accepted >= 10
    assert result.faults["resource-restart"] >= 1 and result.faults["race"] >= 1


def test_the_right_service_holds_with_its_path_cut_and_delayed(tmp_path: Path) -> None:
    """``resource-partition`` and ``resource-delay`` hold every worker's bytes to the resource
    (their own proxies): writes wait or go unanswered, none is refused wrongly or lost."""
    port = free_port()
    result = run_campaign(
        None,
        tmp_path / "r",
        resource=f"http://127.0.0.1:{port}/items/widgets",
        resource_cmd=[
            sys.executable,
            str(SERVICE),
            "--port",
            str(port),
            "--db",
            str(tmp_path / "d"),
        ],
        nemesis=["resource-partition", "resource-delay", "stall"],
        seconds=90,
        faults=1,
        writes=10,
        workers=2,
        ttl=0.5,
        seed=1,
    )
    assert result.ok, [str(v) for v in result.violations]
    assert result.faults["resource-partition"] >= 1 and result.faults["resource-delay"] >= 1


def test_the_cli_runs_the_users_service_and_exits_65_on_a_violation(tmp_path: Path) -> None:
    """Tokens compared as strings: with the source's counter at 8, the holder of 10 is the
    first refused ("10" < "9"), however slow the machine."""
    import fenced

    source = f"sqlite:///{tmp_path / 'locks.db'}"
    with fenced.connect(source) as locks:
        for _ in range(8):
            lease = locks.lock("counter", ttl=5)
            lease.acquire(timeout=30)
            lease.release()
    port = free_port()
    cmd = f"{sys.executable} {SERVICE} --port {port} --db {tmp_path / 'inv.db'} --bug string-tokens"
    r = subprocess.run(
        [
            sys.executable, "-m", "fenced.cli", "check",
            "--resource", f"http://127.0.0.1:{port}/items/widgets", "--resource-cmd", cmd,
            "--source", source, "--time", "90", "--faults", "2", "--ttl", "0.5", "--nemesis", "stall", "--report", str(tmp_path / "r"),
        ],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )  # fmt: skip
    assert r.returncode == 65, r.stdout + r.stderr
    assert "current holder refused" in r.stdout and "reads refused" in r.stdout, r.stdout
    page = (tmp_path / "r" / "report.html").read_text()
    assert 'class="refused-read"' in page and "current holder refused" in page


@pytest.mark.skipif(not SWEEP, reason="the 10-seed sweep: FENCED_CHECK_SWEEP=10")
@pytest.mark.parametrize("bug", ["", *EXPECTED])
def test_sweep(bug: str, tmp_path: Path) -> None:
    caught, times = [], []
    for seed in range(SWEEP):
        (tmp_path / str(seed)).mkdir()
        result = campaign(tmp_path / str(seed), bug, seed, seconds=20, ttl=1.0)
        found = {v.checker for v in result.violations}
        if (found & EXPECTED[bug]) if bug else found:
            caught.append(seed)
            times.append(result.first_violation_after or 0.0)
    median = f"{statistics.median(times):.1f} s" if times else "-"
    print(
        f"\nsweep {bug or 'right'}: caught in {len(caught)}/{SWEEP} seeds {caught}, median {median}"
    )
    if bug:
        assert len(caught) >= 0.9 * SWEEP, caught
    else:
        assert not caught, caught


def test_help_documents_the_violation_exit_status() -> None:
    """One code for "a violation was found", listed with fenced's own outcomes (never 1)."""
    out = subprocess.run(
        [sys.executable, "-m", "fenced.cli", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("65 "))
    assert "violation" in line and "check" in line and "sim" in line, line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--nemesis", "resource-restart"], "--resource-cmd"),
        (["--nemesis", "race"], "host:port"),
        (["--resource", "http://127.0.0.1:1/items/x", "--resource-cmd", "false"], "exited"),
        (["--resource-cmd", "true"], "--resource"),
    ],
)
def test_resource_faults_without_what_they_need_are_one_line_errors(
    tmp_path: Path, args: list[str], said: str
) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "fenced.cli", "check", "--time", "1", "--report", str(tmp_path), *args],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )  # fmt: skip
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_port_already_served_is_refused_not_tested(tmp_path: Path) -> None:
    """An earlier run's server still on the port would answer for the command's: refused."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable, "-m", "fenced.cli", "check", "--report", str(tmp_path),
                "--resource", f"http://127.0.0.1:{port}/items/x", "--resource-cmd", "true",
            ],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
        )  # fmt: skip
    assert r.returncode == 2 and "already accepts connections" in r.stderr, r.stderr


def test_sigterm_stops_the_campaign_and_the_resource_it_started(tmp_path: Path) -> None:
    port = free_port()
    cmd = f"{sys.executable} {SERVICE} --port {port} --db {tmp_path / 'inv.db'}"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "fenced.cli", "check", "--time", "60", "--ttl", "0.5",
            "--resource", f"http://127.0.0.1:{port}/items/x", "--resource-cmd", cmd,
            "--nemesis", "stall", "--report", str(tmp_path / "r"),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )  # fmt: skip
    history = tmp_path / "r" / "history.jsonl"
    wait_until(lambda: history.exists() and b'"op":"write"' in history.read_bytes(), 60, "writes")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 130

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
        except OSError:
            return True
        return False

    assert refused(), "the resource the campaign started outlived it"


def test_the_service_refuses_another_locks_token_a_malformed_one_and_none(
    tmp_path: Path,
) -> None:
    """The example compares a token's lock name, not only its value: a holder of another lock
    (its value far above this lock's) must not move the mark and lock the rightful holder out."""
    import httpx

    port = free_port()
    cmd = [sys.executable, str(SERVICE), "--port", str(port), "--db", str(tmp_path / "inv.db")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
            except OSError:
                return False
            return True

        wait_until(listening, 30, "the inventory service")
        url = f"http://127.0.0.1:{port}/items/w"
        with httpx.Client(timeout=30) as c:

            def put(header: str | None, body: bytes) -> int:
                headers = {} if header is None else {"Fencing-Token": header}
                return c.put(url, content=body, headers=headers).status_code

            assert put("counter:3", b"three") == 204
            assert put("some-other-lock:999999", b"FOREIGN") == 400
            assert put("counter-elsewhere:999999", b"FOREIGN") == 400  # (a prefix is no match)
            assert put("counter:+999999", b"MALFORMED") == 400
            assert put(None, b"NONE") == 428
            assert put("counter:4", b"four") == 204  # the rightful holder: still served
            assert put("counter:3", b"stale") == 409
            got = c.get(url)
            assert got.content == b"four" and got.headers["fenced-high-water"] == "4"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("bug", ["lock-ignored", "tokenless-ok"])
def test_a_service_that_takes_an_impostors_write_is_caught(bug: str, tmp_path: Path) -> None:
    """The impostor nemesis, in the default campaign: writes with another lock's token, a
    malformed one and none, over HTTP; a service that takes one fails with its own verdict."""
    port = free_port()
    cmd = [sys.executable, str(SERVICE), "--port", str(port), "--db", str(tmp_path / "inv.db")]
    result = run_campaign(
        None, tmp_path / "r", resource=f"http://127.0.0.1:{port}/items/widgets",
        resource_cmd=[*cmd, "--bug", bug], seconds=60, faults=3, ttl=0.5, seed=1,
        nemesis=["impostor"], stop_at_first=True,
    )  # fmt: skip
    found = {v.checker for v in result.violations}
    assert "impostor accepted" in found, (found, result.faults)
