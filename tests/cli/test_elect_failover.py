"""``fenced elect``: two nodes (each a `fenced elect` process and its service, in process
groups of their own) run a service that appends to one shared log, only while leader. The
leader is SIGSTOPped, or cut off the token source (a TCP proxy); the log shows that the
successor's service started only after the fence command on the old leader completed, and
that the old service never wrote after the successor's first write. A failing fence command
means the successor never starts; without self-fencing (planted) the log checker catches the
overlap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fenced.testing.proxy import TcpProxy
from fenced.testing.servers import RedisServer
from tests.helpers import ROOT, unique_name, wait_for

SERVICE = """
import os, sys, time
log, node, inventory = sys.argv[1:4]
with open(os.path.join(inventory, node + ".pids"), "a") as f:
    f.write(f"{os.getpid()}\\n")
fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
i = 0
while True:
    os.write(fd, f"{node} {os.environ['FENCING_TOKEN']} {i}\\n".encode())
    i += 1
    time.sleep(0.02)
"""

# A power-off hook (what IPMI or a cloud API does to a machine): kill -9 the old leader's
# fenced elect and its service, from an inventory of which processes make up which node.
POWER_OFF = """
import os, signal, sys
log, inventory = sys.argv[1:3]
node, pid = os.environ["FENCED_PREVIOUS_VALUE"], os.environ["FENCED_PREVIOUS_PID"]
if node:
    for p in [pid, *open(os.path.join(inventory, node + ".pids")).read().split()]:
        try:
            os.killpg(int(p), signal.SIGKILL)
        except ProcessLookupError:
            pass
fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
os.write(fd, f"FENCED {node or '-'} by {os.environ['FENCING_TOKEN']}\\n".encode())
"""

NO_SELF_FENCING = (  # the planted bug: the supervisor only waits for the service
    "import fenced.cli._elect as e\ne._supervise = lambda leader, child, *a: child.proc.wait()\n"
)


class Nodes:
    def __init__(self, tmp: Path, url: str) -> None:
        self.tmp, self.url = tmp, url
        self.log = tmp / "service.log"
        self.inventory = tmp / "inventory"
        self.inventory.mkdir()
        (tmp / "service.py").write_text(SERVICE)
        (tmp / "power_off.py").write_text(POWER_OFF)
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(
        self,
        node: str,
        *,
        url: str | None = None,
        fence: str | None = "power-off",
        prelude: str = "",
        extra: tuple[str, ...] = (),
    ) -> subprocess.Popen[str]:
        args = ["elect", "svc", "--value", node, "--ttl", "1", "--term-grace", "0.3", *extra]
        args += ["--url", url or self.url, "--fence-timeout", "3"]
        if fence == "power-off":
            args += [
                "--fence-cmd",
                f"{sys.executable} {self.tmp}/power_off.py {self.log} {self.inventory}",
            ]
        elif fence is None:
            args += ["--no-fence"]
        else:
            args += ["--fence-cmd", fence]
        code = f"import sys\n{prelude}\nfrom fenced.cli import main\nsys.exit(main())"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args, "--",
             sys.executable, str(self.tmp / "service.py"), str(self.log), node, str(self.inventory)],
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        with open(self.inventory / f"{node}.pids", "a") as f:
            f.write(f"{proc.pid}\n")
        self.procs[node] = proc
        return proc

    def lines(self) -> list[list[str]]:
        return (
            [line.split() for line in self.log.read_text().splitlines()]
            if self.log.exists()
            else []
        )

    def wrote(self, node: str) -> bool:
        return any(line[0] == node for line in self.lines())

    def stop_all(self) -> None:
        for node in self.procs:
            for pid in (self.inventory / f"{node}.pids").read_text().split():
                try:
                    os.killpg(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.procs.values():
            proc.wait(10)


def check_log(lines: list[list[str]], old: str, new: str) -> list[str]:
    """The failover's invariants, from the shared log alone."""
    problems = []
    first_new = next((i for i, line in enumerate(lines) if line[0] == new), None)
    fenced_at = next(
        (i for i, line in enumerate(lines) if line[:2] == ["FENCED", old]), None
    )  # (the successor's fence command on the old leader)
    if first_new is None:
        return ["the successor never wrote"]
    if fenced_at is not None and first_new < fenced_at:
        problems.append("the successor's service wrote before the old leader was fenced")
    late = [i for i, line in enumerate(lines) if line[0] == old and i > first_new]
    if late:
        problems.append(f"the old service wrote {len(late)} line(s) after the successor's first")
    return problems


@pytest.fixture
def nodes(tmp_path: Path) -> Nodes:
    n = Nodes(tmp_path, f"sqlite:///{tmp_path}/locks.db")
    yield n
    n.stop_all()


def _lines_of(nodes: Nodes, node: str) -> int:
    return sum(1 for line in nodes.lines() if line[0] == node)


def _group_signal(nodes: Nodes, node: str, signum: int) -> None:
    for pid in (nodes.inventory / f"{node}.pids").read_text().split():
        os.killpg(int(pid), signum)


def test_a_paused_leader_is_powered_off_before_the_successor_starts(nodes: Nodes) -> None:
    nodes.start("a")
    wait_for(lambda: nodes.wrote("a"), timeout=30)
    nodes.start("b")
    _group_signal(nodes, "a", signal.SIGSTOP)  # a whole node frozen: supervisor and service
    wait_for(lambda: nodes.wrote("b"), timeout=30)
    assert nodes.procs["a"].wait(10) == -signal.SIGKILL  # powered off by b's fence command
    lines = nodes.lines()
    assert check_log(lines, "a", "b") == []
    assert any(line[:3] == ["FENCED", "a", "by"] for line in lines)
    epochs = {line[0]: line[1] for line in lines if line[0] in "ab"}
    assert int(epochs["b"].split(":")[1]) > int(epochs["a"].split(":")[1])


def test_a_leader_cut_off_the_source_stops_its_service_before_it_can_be_replaced(
    nodes: Nodes, redis_server: RedisServer
) -> None:
    """Self-fencing: the old leader's renewals cannot reach the source; its service is
    stopped while the lease is still surely its own, so the successor, elected only after the
    lease expired, finds it already stopped."""
    if redis_server.proc is None:
        redis_server.start()
    url = f"{redis_server.url}?key_prefix={unique_name('elect')}:"
    with TcpProxy("127.0.0.1", redis_server.port) as proxy:
        cut_url = url.replace(f":{redis_server.port}/", f":{proxy.port}/")
        nodes.start("a", url=cut_url)
        wait_for(lambda: nodes.wrote("a"), timeout=30)
        nodes.start("b", url=url)
        proxy.partition()
        wait_for(lambda: nodes.wrote("b"), timeout=30)
        assert nodes.procs["a"].wait(10) in (75, -signal.SIGKILL)
        assert check_log(nodes.lines(), "a", "b") == []


def test_a_fence_command_that_fails_means_the_successor_never_starts(nodes: Nodes) -> None:
    nodes.start("a", fence="exit 0")
    wait_for(lambda: nodes.wrote("a"), timeout=30)
    b = nodes.start("b", fence="echo cannot reach the old node's power switch >&2; exit 1")
    _group_signal(nodes, "a", signal.SIGKILL)  # a dead leader nobody could fence
    assert b.wait(60) == 79
    assert not nodes.wrote("b")
    assert "not starting the command" in (b.stderr.read() if b.stderr else "")


def test_without_self_fencing_the_log_checker_catches_the_overlap(
    nodes: Nodes, redis_server: RedisServer
) -> None:
    """The planted bug: the supervisor never stops its service. Cut off the source, the old
    leader's service runs on while the successor's starts: two writers, and the checker says
    so (with --no-fence, nothing else stops it)."""
    if redis_server.proc is None:
        redis_server.start()
    url = f"{redis_server.url}?key_prefix={unique_name('elect')}:"
    with TcpProxy("127.0.0.1", redis_server.port) as proxy:
        cut_url = url.replace(f":{redis_server.port}/", f":{proxy.port}/")
        nodes.start("a", url=cut_url, fence=None, prelude=NO_SELF_FENCING)
        wait_for(lambda: nodes.wrote("a"), timeout=30)
        nodes.start("b", url=url, fence=None)
        proxy.partition()
        wait_for(lambda: nodes.wrote("b"), timeout=30)
        wait_for(lambda: len(nodes.lines()) > 0 and nodes.lines()[-1][0] in "ab" and
                 sum(1 for x in nodes.lines() if x[0] == "b") > 10, timeout=30)  # fmt: skip
        assert any("after the successor's first" in p for p in check_log(nodes.lines(), "a", "b"))


def test_elect_refuses_to_run_without_a_fence_command(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "fenced.cli", "elect", "svc", "--url", f"sqlite:///{tmp_path}/l.db",
         "--", "true"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert (
        r.returncode == 2 and "--no-fence" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    )


BELIEVES_IT_LEADS = (  # the planted fault: a leader whose view of its lease never runs down
    "import fenced.election as el\nel.Leadership.remaining = lambda self: 10.0\n"
)


def test_a_poison_pill_stops_a_leader_that_believes_it_still_leads(
    nodes: Nodes, redis_server: RedisServer
) -> None:
    """SBD-style: the successor's fence command writes a pill with its epoch to shared
    storage and waits; the old leader's fenced elect (--poison) sees a later epoch and kills
    its service — even though its own view (planted: never runs down) says it still leads."""
    if redis_server.proc is None:
        redis_server.start()
    pills = nodes.tmp / "pills"
    pills.mkdir()
    url = f"{redis_server.url}?key_prefix={unique_name('elect')}:"
    poison = f'{sys.executable} -m fenced.cli poison {pills} "$FENCED_LOCK" --epoch "$FENCED_EPOCH" --wait 1'
    with TcpProxy("127.0.0.1", redis_server.port) as proxy:
        cut_url = url.replace(f":{redis_server.port}/", f":{proxy.port}/")
        a = nodes.start(
            "a",
            url=cut_url,
            fence="true",
            prelude=BELIEVES_IT_LEADS,
            extra=("--poison", str(pills)),
        )
        wait_for(lambda: nodes.wrote("a"), timeout=30)
        nodes.start("b", url=url, fence=poison)
        proxy.partition()
        wait_for(lambda: nodes.wrote("b"), timeout=30)
        b_wrote = time.monotonic()
        assert a.wait(30) == 75
        # Its exit: resign()'s one release through the partition, bounded by Redis's
        # socket_timeout (10 s; the pill was seen ~1 s before b wrote): 9.3 s after b wrote.
        # close() then waited its release bound (5 s) out again on that same release of a
        # lease lost by expiry: 14.3 s (was 9 s before session 9's bounded close).
        assert time.monotonic() - b_wrote < 12.5, time.monotonic() - b_wrote
        assert check_log(nodes.lines(), "a", "b") == []


def test_a_wall_clock_step_on_the_leader_changes_nothing(nodes: Nodes, tmp_path: Path) -> None:
    """The leader's wall clock (``time.time()`` in its Python, stepped an hour either way on
    SIGWINCH, as the check kit's clock nemesis does it; libfaketime would make Python's sleep
    fail) jumps back and forth: leadership runs on monotonic clocks, so it neither ends nor
    doubles — the candidate never starts while the leader lives, and takes over once it dies."""
    offset = tmp_path / "offset"
    offset.write_text("0")
    prelude = (
        "import os\nos.environ['FENCED_CHECK_CLOCK'] = " + repr(str(offset)) + "\n"
        "from fenced.testing.check._worker import _wall_clock_steps\n"
        "_wall_clock_steps(os.environ['FENCED_CHECK_CLOCK'])\n"
    )
    a = nodes.start("a", fence="true", prelude=prelude)
    wait_for(lambda: nodes.wrote("a"), timeout=30)
    nodes.start("b", fence="true")
    for step in ("3600", "-3600", "86400", "-86400"):
        offset.write_text(step)
        os.kill(a.pid, signal.SIGWINCH)
        goal = _lines_of(nodes, "a") + 25  # (half a second more of its service, at least)
        wait_for(lambda goal=goal: _lines_of(nodes, "a") > goal, timeout=30)
    # Some 2 s of steps, over two ttls: no failover, no second service.
    assert not nodes.wrote("b") and a.poll() is None
    _group_signal(nodes, "a", signal.SIGKILL)
    wait_for(lambda: nodes.wrote("b"), timeout=30)
    assert check_log(nodes.lines(), "a", "b") == []
