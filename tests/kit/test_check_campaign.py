"""``fenced check``: a campaign of real worker processes on the embedded SQLite source with the
nemesis pausing and killing them; every invariant holds, and the same campaign with the fence
check planted out is caught (exit 65). The fault schedule is the seed's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fenced
from fenced.testing.servers import RedisServer
from tests.cdp import Browser
from tests.helpers import ROOT, headless
from tests.png import count_near, read_png


def _check(
    tmp_path: Path, *extra: str, seed: int = 3, faults: int = 1, writes: int = 10, workers: int = 2
) -> subprocess.CompletedProcess[str]:
    """A run bounded by counts (each nemesis ``faults`` times, ``writes`` writes): it ends when
    they are reached, on a loaded machine too; the 90 s bound fails it if they are not. Two
    workers unless asked: a late writer needs one successor (each worker is a Python process;
    the planted runs keep the default three)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "fenced.cli",
            "check",
            "--source",
            f"sqlite:///{tmp_path}/l.db",
            "--time",
            "90",
            "--faults",
            str(faults),
            "--writes",
            str(writes),
            "--ttl",
            "0.5",
            "--seed",
            str(seed),
            "--workers",
            str(workers),
            "--report",
            str(tmp_path / "r"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )


def _faults(tmp_path: Path) -> list[str]:
    lines = (tmp_path / "r" / "history.jsonl").read_text().splitlines()
    return [e["kind"] for e in map(json.loads, lines) if e["op"] == "nemesis"]


def test_a_campaign_with_pauses_and_kills_holds_every_invariant(tmp_path: Path) -> None:
    # Each of pause, stall and kill at least once (the first round of the deck), whatever the
    # load: the run ends at its counts, not at a number of seconds a loaded machine fills less.
    r = _check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every invariant held" in r.stdout
    faults = _faults(tmp_path)
    assert {"pause", "stall", "kill"} <= set(faults), faults
    again = _check(tmp_path / "again")
    assert again.returncode == 0, again.stdout + again.stderr
    # The seed's schedule: the same faults in the same order (the writes count may end one
    # run a round later than the other, so one run's list starts the other's; each has its
    # whole first round).
    other = _faults(tmp_path / "again")
    shorter = min(len(other), len(faults))
    assert shorter >= 3 and other[:shorter] == faults[:shorter], (faults, other)


def test_stalls_inside_the_critical_section_are_refused_and_the_plant_caught(
    tmp_path: Path,
) -> None:
    """The stall nemesis stops a worker between its read and its guarded write, past its
    lease: the guard refuses its late writes (stale), and without the fence check (planted)
    they land — lost updates, tokens out of order."""
    r = _check(tmp_path, "--nemesis", "stall", faults=2)
    assert r.returncode == 0, r.stdout + r.stderr
    refused = int(r.stdout.split(" refused")[0].rsplit(", ", 1)[1].split()[0])
    assert refused >= 1, r.stdout
    # (planted: the run stops at its first violation; the counts only bound its effort)
    planted = _check(
        tmp_path / "planted", "--nemesis", "stall", "--plant", "no-fence", faults=8, workers=3
    )
    assert planted.returncode == 65, planted.stdout + planted.stderr
    assert "VIOLATION lost update" in planted.stdout
    assert "VIOLATION acceptance order" in planted.stdout
    page = _dom(tmp_path / "planted" / "r" / "report.html")
    assert 'class="violation"' in page  # the first violation's writes, ringed
    stalls = sum(1 for k in _faults(tmp_path / "planted") if k == "stall")
    # Drawn where a worker really stopped: at most two a stall (a chained stall stops the
    # late writer's successor too).
    assert 0 < page.count('class="nemesis"') <= 2 * stalls


def _dom(page: Path) -> str:
    return headless("--dump-dom", page.as_uri())


def test_the_report_renders_the_run_and_its_verdict(tmp_path: Path) -> None:
    assert _check(tmp_path).returncode == 0
    events = [json.loads(x) for x in (tmp_path / "r" / "history.jsonl").read_text().splitlines()]
    accepted = sum(1 for e in events if e["op"] == "write" and e["ok"])
    # (one Chromium for the page's DOM and its screenshot: a process each cost ~1 s of CPU)
    with Browser(1040, 320) as browser:
        browser.go(
            (tmp_path / "r" / "report.html").as_uri(), ready="document.readyState === 'complete'"
        )
        dom = browser.js("document.documentElement.outerHTML")
        shot = browser.screenshot(tmp_path / "report.png")
    assert "Every invariant held." in dom
    assert dom.count('class="accepted"') == accepted
    # The options as the command that runs it again (no Python reprs: "signing False",
    # "nemesis ['pause', ...]"), and the impostor's requests on a lane of its own, each
    # refused as it must be (it was a "forger" lane of red crosses, as stale writes).
    assert "signing False" not in dom and "[&#x27;" not in dom and "['" not in dom
    line = dom.split("Run again with: <code>")[1].split("</code>")[0]
    assert line == (
        f"fenced check --source sqlite:///{tmp_path}/l.db --workers 2 --time 90 --ttl 0.5 "
        "--nemesis pause,stall,kill,impostor --faults 1 --writes 10 --seed 3"
    ), line
    outsiders = [e for e in events if e.get("impostor")]
    assert ">impostor</text>" in dom and ">forger</text>" not in dom and outsiders
    assert dom.count('class="turned-away"') == len(outsiders)  # (all refused: none let in)
    drawn = [k for k in _faults(tmp_path) if k != "stall"]  # stalls: where they happened
    drawn += [e for e in events if e["op"] == "stalled"]
    assert dom.count('class="nemesis"') == len(drawn)
    _, _, rows = read_png(shot)
    assert count_near(rows, (0x2E, 0x9D, 0x5B), tolerance=30) > 30  # the accepted writes

    # (the CLI gives a plant another seed itself if a schedule misses its window)
    planted = tmp_path / "planted"
    code = _check(planted, "--plant", "no-fence", faults=8, workers=3).returncode
    assert code == 65
    # (the page is static HTML, no script: the verdict is in its text; a planted page in the
    # browser, rings and all, is the stall test's)
    page = (planted / "r" / "report.html").read_text()
    assert "violation(s); the first:" in page and "Every invariant held." not in page


def test_a_campaign_on_redis_with_partitions_holds_every_invariant(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    if redis_server.proc is None:
        redis_server.start()
    source = f"{redis_server.url}?key_prefix=check-{tmp_path.name}:"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fenced.cli",
            "check",
            "--source",
            source,
            "--time",
            "90",
            "--faults",
            "1",
            "--writes",
            "10",
            "--ttl",
            "0.5",
            "--seed",
            "2",
            "--workers",
            "2",
            "--nemesis",
            "partition,pause",
            "--report",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "partition" in _faults(tmp_path)


def test_partitions_need_a_source_reached_over_tcp(tmp_path: Path) -> None:
    r = _check(tmp_path, "--nemesis", "partition")
    assert r.returncode == 2 and "host:port" in r.stderr and len(r.stderr.splitlines()) == 1


def test_worker_namespaces_that_do_not_exist_are_a_one_line_error(tmp_path: Path) -> None:
    """FENCED_CHECK_NETNS (the partition lab's: each worker in a network namespace of its
    own) naming no namespace: refused before anything starts, nothing written."""
    from fenced.testing.check import run_campaign

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FENCED_CHECK_NETNS", "fenced-no-such-namespace,../etc")
        with pytest.raises(fenced.ConfigurationError, match="no network namespace") as caught:
            run_campaign(None, tmp_path / "out")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_an_unfenced_read_is_caught_as_a_lost_update(tmp_path: Path) -> None:
    """Planted: the write is fenced, the read is not. A stalled holder's late write lands
    between the next holder's read and its write (the mark was not raised by the read), and
    the next holder's write, built on what it read, loses it. Found by this kit in its own
    first workload."""
    r = _check(tmp_path, "--nemesis", "stall", "--plant", "unfenced-read", faults=10, workers=3)
    assert r.returncode == 65, r.stdout + r.stderr
    assert "VIOLATION lost update" in r.stdout


def test_a_stall_is_drawn_as_long_as_its_worker_stood_still(tmp_path: Path) -> None:
    """A stall's bar runs from where its worker stopped to its next step (its late write),
    not for the seconds its nemesis event carries (drawn at random, never used: a 0.1 s stall
    was drawn 2.9 s long, over the worker's next leases)."""
    from fenced.testing.check._report import write_report

    def ev(op: str, mono: float, worker: str = "w1", **fields: object) -> dict[str, object]:
        return {"worker": worker, "pid": 1, "op": op, "mono": mono, "wall": mono, **fields}

    events = [
        ev("grant", 0.0, lock="counter", token=1, surely_until=1.0, remaining=1.0),
        ev("nemesis", 1.0, "nemesis", kind="stall", victim="w1", seconds=2.9),
        ev("stalled", 1.0, lock="counter", token=1),
        ev("write", 1.1, lock="counter", token=1, value=1, ok=True, sent=1.1),
        ev("release", 10.0, lock="counter", token=1, released=True, sent=10.0),
    ]
    page = write_report(events, [], tmp_path / "report.html").read_text()
    bar = page.split('<rect class="nemesis"')[1].split(">")[0]
    width = float(bar.split('width="')[1].split('"')[0])
    scale = (1000 - 70 - 10) / 10.0  # (the page's: 920 px for the run's 10 s)
    assert width == pytest.approx(max(4.0, 0.1 * scale), abs=0.2), bar
