"""Real servers on 127.0.0.1, random free ports, temp dirs: start, stop, kill -9, pause, restart.

Each server keeps its data directory across :meth:`Server.restart`, so tests can show that a
restart loses no high-water mark and reuses no token. Readiness is awaited by polling the
server's own protocol with a bound, never by sleeping a fixed time.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Final

from fenced._core.backoff import Backoff

from . import forkserver, parentdeath

__all__ = [
    "EtcdCluster",
    "EtcdServer",
    "FencedServer",
    "MariaDBServer",
    "MotoServer",
    "PostgresServer",
    "RedisServer",
    "Server",
    "ServerUnavailable",
    "ZooKeeperServer",
    "free_port",
    "python_env",
    "zookeeper_cds_args",
]


def _answers(port: int, probe: bytes, expected: bytes) -> bool:
    """A server's readiness: it answers ``probe`` on loopback with ``expected`` first."""
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
        s.sendall(probe)
        return s.recv(len(expected) + 8).startswith(expected)


class ServerUnavailable(RuntimeError):
    """The server binary is not installed, or the server did not become ready in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    *,
    interval: tuple[float, float] = (0.01, 0.2),
    ignore: tuple[type[Exception], ...] = (Exception,),
) -> None:
    """Poll ``check`` (with a back-off from ``interval``'s first to its second, in seconds)
    until it is true or ``timeout`` passes. A check that raises one of ``ignore`` counts as
    not yet (anything else, and :class:`ServerUnavailable` always, is raised)."""
    deadline = time.monotonic() + timeout
    backoff = Backoff(*interval)
    while True:
        try:
            if check():
                return
        except ServerUnavailable:
            raise  # (the process died: waiting longer cannot help)
        except ignore:
            pass
        if time.monotonic() >= deadline:
            raise ServerUnavailable(f"{what} not ready after {timeout:g} s")
        time.sleep(
            backoff.next(deadline - time.monotonic()) or 0
        )  # (the last poll: at the deadline)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Server:
    """One server process. Subclasses set :meth:`command` and :meth:`ready`."""

    name = "server"
    start_timeout = 30.0

    def __init__(self, base_dir: str | None = None, port: int | None = None) -> None:
        self._own_dir = base_dir is None
        self.dir = Path(base_dir or tempfile.mkdtemp(prefix=f"fenced-{self.name}-"))
        self._auto_ports = port is None  # chosen here: another may be picked if it is taken
        self._started = False
        self.port = port or free_port()
        self.proc: forkserver.Process | None = None
        self.log_path = self.dir / f"{self.name}.log"
        self.extra_env: dict[str, str] = {}  # added to its environment (the check kit's faketime)
        # SIGKILLed when the thread that started it ends (fenced.testing.parentdeath): the check
        # kit's servers, so a kill -9 of ``fenced check`` leaves none behind
        self.die_with_parent = False

    # subclass hooks
    def command(self) -> Sequence[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        return _port_open(self.port)

    def prepare(self) -> None:
        """Create the data directory on first start."""

    def env(self) -> dict[str, str] | None:
        return None

    def popen_user(self) -> str | None:
        """Run the server as this user (PostgreSQL refuses to run as root)."""
        return None

    def new_ports(self) -> None:
        """Pick fresh ports (a free port can be taken between finding it and binding it)."""
        self.port = free_port()

    # lifecycle
    def start(self) -> Server:
        """Start the server; a running one is left as it is (a second process would take over
        ``proc`` and outlive every later stop, kill and close)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        for attempt in range(3):
            try:
                self._start_once()
            except ServerUnavailable as exc:
                retry = self._auto_ports and not self._started and attempt < 2
                if retry and "address already in use" in str(exc).lower():
                    self.new_ports()
                    continue
                raise
            self._started = True
            return self
        raise AssertionError("unreachable")  # pragma: no cover

    def spawn(self, log: IO[bytes]) -> forkserver.Process:
        """Start the server's process with stdout and stderr ``log``, stdin /dev/null, in a
        process group of its own."""
        command = list(self.command())
        return subprocess.Popen(
            parentdeath.argv(command, other_user=self.popen_user() is not None)
            if self.die_with_parent
            else command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.full_env(),
            start_new_session=True,
            user=self.popen_user(),
            group=self.popen_user(),
        )

    def full_env(self) -> dict[str, str] | None:
        """Its environment: :meth:`env` plus ``extra_env`` (None: this process's)."""
        return {**(self.env() or os.environ), **self.extra_env} if self.extra_env else self.env()

    def _start_once(self) -> None:
        self.prepare()
        with open(self.log_path, "ab") as log:
            self.proc = self.spawn(log)
        try:
            wait_until(
                self._ready_and_alive, self.start_timeout, f"{self.name} on port {self.port}"
            )
        except ServerUnavailable:
            tail = self.log_tail()
            self.kill()
            raise ServerUnavailable(f"{self.name} did not start; log:\n{tail}") from None

    def _ready_and_alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerUnavailable(
                f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
            )
        return self.ready()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        """Graceful stop (SIGTERM), then SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc = None

    def kill(self) -> None:
        """kill -9 the server (and its process group): a crash, with no chance to clean up."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def restart(self, kill: bool = False) -> Server:
        """Stop (or kill -9) and start again on the same port and data."""
        if kill:
            self.kill()
        else:
            self.stop()
        return self.start()

    def close(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _require(path: str | None, what: str, package: str) -> str:
    if not path:
        raise ServerUnavailable(f"{what} not found: install the Debian package {package!r}")
    return path


class RedisServer(Server):
    """redis-server with AOF ``appendfsync always``: every acknowledged write survives kill -9."""

    name = "redis"

    def __init__(
        self, base_dir: str | None = None, port: int | None = None, *, extra: Sequence[str] = ()
    ) -> None:
        super().__init__(base_dir, port)
        self.extra = list(extra)
        self.binary = _require(shutil.which("redis-server"), "redis-server", "redis-server")

    def command(self) -> Sequence[str]:
        return [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--protected-mode",
            "no",
            *self.extra,
        ]

    def ready(self) -> bool:
        return _answers(self.port, b"PING\r\n", b"+PONG")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class EtcdServer(Server):
    """A one-member etcd cluster (or a member of :class:`EtcdCluster`)."""

    name = "etcd"

    def __init__(
        self,
        base_dir: str | None = None,
        port: int | None = None,
        *,
        member: str = "e1",
        peer_port: int | None = None,
        initial_cluster: str | None = None,
        cluster_token: str = "fenced-test",
    ) -> None:
        super().__init__(base_dir, port)
        self.binary = _require(shutil.which("etcd"), "etcd", "etcd-server")
        self.member = member
        self._auto_ports = self._auto_ports and peer_port is None and initial_cluster is None
        self.peer_port = peer_port or free_port()
        self.initial_cluster = initial_cluster or f"{member}=http://127.0.0.1:{self.peer_port}"
        self.cluster_token = cluster_token

    def new_ports(self) -> None:
        super().new_ports()
        self.peer_port = free_port()
        self.initial_cluster = f"{self.member}=http://127.0.0.1:{self.peer_port}"

    def command(self) -> Sequence[str]:
        client = f"http://127.0.0.1:{self.port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name",
            self.member,
            "--data-dir",
            str(self.dir / "data"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            self.initial_cluster,
            "--initial-cluster-token",
            self.cluster_token,
            "--initial-cluster-state",
            "new",
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["ETCD_UNSUPPORTED_ARCH"] = env.get("ETCD_UNSUPPORTED_ARCH", "")
        return env

    def ready(self) -> bool:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
            return b'"health":"true"' in r.read().replace(b" ", b"")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"


class EtcdCluster:
    """Three (or ``size``) etcd members on loopback, started together."""

    def __init__(self, size: int = 3) -> None:
        self.size = size
        self.dir = Path(tempfile.mkdtemp(prefix="fenced-etcd-cluster-"))
        self._members()

    def _members(self) -> None:
        size = self.size
        peers = [free_port() for _ in range(size)]
        names = [f"e{i + 1}" for i in range(size)]
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(names, peers, strict=True))
        self.members = [
            EtcdServer(
                str(self.dir / n),
                member=n,
                peer_port=p,
                initial_cluster=initial,
                cluster_token=f"fenced-{os.getpid()}-{peers[0]}",
            )
            for n, p in zip(names, peers, strict=True)
        ]
        for m in self.members:
            m.dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> EtcdCluster:
        for attempt in range(3):
            try:
                return self._start_once()
            except ServerUnavailable as exc:
                taken = "address already in use" in str(exc).lower() or any(
                    "address already in use" in m.log_tail().lower() for m in self.members
                )
                for m in self.members:
                    m.kill()
                if not taken or attempt == 2:
                    raise
                # A port was taken between choosing it and binding it: new ports, new dirs.
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir.mkdir(parents=True)
                self._members()
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_once(self) -> EtcdCluster:
        for m in self.members:
            m.prepare()
            log = open(m.log_path, "ab")  # noqa: SIM115
            m.proc = subprocess.Popen(
                list(m.command()),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            log.close()
        for m in self.members:
            wait_until(m._ready_and_alive, 30, f"etcd member {m.member}")
        return self

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(m.endpoint for m in self.members)

    def close(self) -> None:
        for m in self.members:
            m.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _zookeeper_classpath() -> str:
    jars = [
        "/usr/share/java/zookeeper.jar",
        "/usr/share/java/zookeeper-jute.jar",
        "/usr/share/java/slf4j-api.jar",
        "/usr/share/java/slf4j-log4j12.jar",
        "/usr/share/java/log4j-1.2.jar",
    ]
    jars += sorted(glob.glob("/usr/share/java/netty-*.jar"))
    jars += ["/usr/share/java/commons-cli.jar", "/usr/share/java/commons-io.jar"]
    present = [j for j in jars if os.path.exists(j)]
    if "/usr/share/java/zookeeper.jar" not in present:
        raise ServerUnavailable("ZooKeeper not found: install the Debian package 'zookeeper'")
    return ":".join(present)


def zookeeper_cds_args(classpath: str) -> list[str]:
    """JVM flags that map the classes a ZooKeeper server loads from one class-data archive
    made once for the test run (AppCDS, JDK 13+), or none outside a run that keeps
    templates (``FENCED_TEST_TEMPLATES``: see :func:`_from_template`) or where no archive
    could be made. Each JVM otherwise loads and verifies the same classes from the
    jars again: with the archive a start plus 50 writes costs 0.76-0.79 s of CPU, not
    1.04-1.11 s (session 10, JDK 17). An archive that does not fit (another JDK or class
    path) is ignored by the JVM (``-Xshare:auto``): the server starts as without it."""
    root = os.environ.get("FENCED_TEST_TEMPLATES")
    if not root or not os.access(root, os.W_OK | os.X_OK):
        return []
    import fcntl

    archive = Path(root) / "zookeeper.jsa"
    with open(Path(root) / "zookeeper.jsa.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (the run's other workers wait for the first's)
        tried = Path(root) / "zookeeper.jsa.tried"
        if not tried.exists():
            tried.touch()  # (one try a run: a JVM that cannot make one is not asked again)
            _make_zookeeper_archive(archive, classpath)
    return [f"-XX:SharedArchiveFile={archive}", "-Xshare:auto"] if archive.exists() else []


def _make_zookeeper_archive(archive: Path, classpath: str) -> None:
    """A throwaway standalone ZooKeeper that writes the classes it loaded to ``archive``
    when it exits (``-XX:ArchiveClassesAtExit``: on a SIGTERM's orderly exit too)."""
    partial = archive.with_name(archive.name + ".partial")
    server = ZooKeeperServer(classpath=classpath, jvm_args=[f"-XX:ArchiveClassesAtExit={partial}"])
    try:
        server.start()
        server.stop()
        if partial.exists():
            partial.rename(archive)  # (whole or not at all: a JVM never maps half of one)
    except ServerUnavailable:
        pass  # (the servers start without an archive, as before)
    finally:
        server.close()


class ZooKeeperServer(Server):
    """A standalone ZooKeeper; ``tick_ms`` sets the minimum session timeout (2 × tick)."""

    name = "zookeeper"

    def __init__(
        self,
        base_dir: str | None = None,
        port: int | None = None,
        *,
        tick_ms: int = 200,
        classpath: str | None = None,
        jvm_args: Sequence[str] | None = None,
    ) -> None:
        super().__init__(base_dir, port)
        self.java = _require(shutil.which("java"), "java", "default-jre-headless")
        self.classpath = classpath or _zookeeper_classpath()
        self.tick_ms = tick_ms
        # (None: the run's class-data archive, if there is one: zookeeper_cds_args)
        self.jvm_args = list(jvm_args) if jvm_args is not None else None

    def prepare(self) -> None:
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        (self.dir / "zoo.cfg").write_text(
            f"tickTime={self.tick_ms}\n"
            f"dataDir={self.dir / 'data'}\n"
            f"clientPort={self.port}\n"
            "clientPortAddress=127.0.0.1\n"
            "admin.enableServer=false\n"
            "4lw.commands.whitelist=ruok,srvr,stat,mntr,conf\n"
            "maxSessionTimeout=60000\n"
            "forceSync=yes\n"
        )
        (self.dir / "log4j.properties").write_text(
            "log4j.rootLogger=WARN, CONSOLE\n"
            "log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender\n"
            "log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout\n"
            "log4j.appender.CONSOLE.layout.ConversionPattern=%d %-5p [%t] %c: %m%n\n"
        )

    def command(self) -> Sequence[str]:
        return [
            self.java,
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:-UsePerfData",
            # A test server lives seconds to minutes: C2's compiles never pay back. C1 only
            # cut a start plus 600 writes from 1.6 to 1.2 s of CPU (session 9, JDK 17).
            "-XX:TieredStopAtLevel=1",
            "-Xshare:auto",
            *(self.jvm_args if self.jvm_args is not None else zookeeper_cds_args(self.classpath)),
            f"-Dlog4j.configuration=file:{self.dir / 'log4j.properties'}",
            "-Dzookeeper.admin.enableServer=false",
            "-cp",
            self.classpath,
            "org.apache.zookeeper.server.ZooKeeperServerMain",
            str(self.dir / "zoo.cfg"),
        ]

    def ready(self) -> bool:
        return _answers(self.port, b"ruok", b"imok")

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"zookeeper://{self.hosts}"


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces, so split after the last ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"  # a zombie holds nothing
    except OSError:
        return True


def _pg_bin(tool: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    if found:
        return found[-1]
    return _require(shutil.which(tool), tool, "postgresql")


def _from_template(kind: str, data: Path, make: Callable[[Path], None], user: str | None) -> None:
    """Make the data directory ``data`` with ``make`` (initdb, mariadb-install-db), or, when
    ``FENCED_TEST_TEMPLATES`` names a directory (the test suite sets one per run), copy the
    one ``make`` made there once for every server of the run: the same bytes, without the
    0.4-0.7 s of CPU each new server's bootstrap cost (session 9: 21 initdb, 16 MariaDB
    bootstraps in a suite run). ``user`` (as root: the server's) owns the template's parent."""
    root = os.environ.get("FENCED_TEST_TEMPLATES")
    if not root or not os.access(root, os.W_OK | os.X_OK):  # (none, or not this user's)
        make(data)
        return
    import fcntl

    base = Path(root) / kind
    with open(Path(root) / f"{kind}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (the run's other workers wait for the first's)
        done = Path(root) / f"{kind}.done"
        if not done.exists():
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir()
            if user is not None:
                os.chmod(base, 0o755)
                shutil.chown(base, user, user)
            make(base / "data")
            done.touch()
    # (cp -a: the owner, modes and links as the bootstrap left them)
    subprocess.run(["cp", "-a", str(base / "data"), str(data)], check=True)


class PostgresServer(Server):
    """PostgreSQL with ``fsync=on``; runs as the ``postgres`` user when started by root."""

    name = "postgresql"
    start_timeout = 60.0

    def __init__(self, base_dir: str | None = None, port: int | None = None) -> None:
        super().__init__(base_dir, port)
        self.initdb = _pg_bin("initdb")
        self.postgres = _pg_bin("postgres")
        self.as_root = os.geteuid() == 0
        if self.as_root:
            os.chmod(self.dir, 0o755)
            shutil.chown(self.dir, "postgres", "postgres")

    def popen_user(self) -> str | None:
        return "postgres" if self.as_root else None

    def prepare(self) -> None:
        data = self.dir / "data"
        if (data / "PG_VERSION").exists():
            return
        _from_template("postgresql", data, self._initdb, self.popen_user())

    def _initdb(self, data: Path) -> None:
        subprocess.run(
            [
                self.initdb,
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            user=self.popen_user(),
            group=self.popen_user(),
            cwd=data.parent,
        )

    def command(self) -> Sequence[str]:
        return [
            self.postgres,
            "-D",
            str(self.dir / "data"),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-k",
            str(self.dir),
            "-c",
            "fsync=on",
            "-c",
            "synchronous_commit=on",
            "-c",
            "max_connections=200",
            "-c",
            "shared_buffers=32MB",
        ]

    def ready(self) -> bool:
        import psycopg

        with psycopg.connect(self.dsn, connect_timeout=1) as conn:
            conn.execute("select 1")
        return True

    def kill(self) -> None:
        """kill -9 the postmaster and every backend: they setsid(), so killpg alone misses them."""
        if self.proc is None:
            return
        postmaster = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(postmaster, signal.SIGSTOP)  # no new children from here on
        children = _children(postmaster)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        super().kill()
        wait_until(lambda: all(_gone(p) for p in children), 10, "PostgreSQL backends to exit")

    def stop(self, timeout: float = 20.0) -> None:
        # SIGINT is PostgreSQL's "fast shutdown"; SIGTERM waits for clients to leave.
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def url(self) -> str:
        return self.dsn


def python_env() -> dict[str, str]:
    """This environment, for a child Python process that must import this very fenced (a
    checkout's ``src`` first on its path)."""
    import fenced

    src = str(Path(fenced.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{path}" if path else src}


# A 16 MB redo log, not the default 96 MB: each new server's data directory is 34 MB to write,
# not 114 MB (a test writes little; every commit is still fsynced, flush-log-at-trx-commit=1).
_MARIADB_LOG: Final = "--innodb-log-file-size=16M"


class MariaDBServer(Server):
    """MariaDB (Debian ``mariadb-server``) on loopback with InnoDB's durable defaults (a
    committed transaction survives kill -9); as root it runs as the ``mysql`` user. ``url``
    is ``mysql://root@127.0.0.1:PORT/fenced`` (the database is made at the first start)."""

    name = "mariadb"
    start_timeout = 60.0

    def __init__(self, base_dir: str | None = None, port: int | None = None) -> None:
        super().__init__(base_dir, port)
        self.mariadbd = _require(
            shutil.which("mariadbd", path=_SBIN_PATH), "mariadbd", "mariadb-server"
        )
        self.install_db = _require(shutil.which("mariadb-install-db", path=_SBIN_PATH), "mariadb-install-db", "mariadb-server")  # fmt: skip
        self.as_root = os.geteuid() == 0
        if self.as_root:
            os.chmod(self.dir, 0o755)
            shutil.chown(self.dir, "mysql", "mysql")

    def _user_args(self) -> list[str]:
        return ["--user=mysql"] if self.as_root else []

    def prepare(self) -> None:
        data = self.dir / "data"
        if (data / "mysql").exists():
            return
        _from_template("mariadb", data, self._install_db, "mysql" if self.as_root else None)

    def _install_db(self, data: Path) -> None:
        for attempt in range(3):
            done = subprocess.run(
                [self.install_db, "--no-defaults", f"--datadir={data}", *self._user_args(),
                 "--auth-root-authentication-method=normal", "--skip-test-db", _MARIADB_LOG],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=data.parent,
            )  # fmt: skip
            if done.returncode == 0:
                return
            # (CI saw it fail once, under load, with the reason unrecorded: start afresh)
            shutil.rmtree(data, ignore_errors=True)
            time.sleep(0.5 * (attempt + 1))
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-5:]
        raise ServerUnavailable(
            f"mariadb-install-db failed (exit {done.returncode}): {' | '.join(tail)}"
        )

    def command(self) -> Sequence[str]:
        # Its own temp dir: in the shared /tmp, a temp table's file was once deleted under the
        # server by another process's clean-up (CI: "Error on delete of '/tmp/#sql-temptable-…'
        # (Errcode: 2)", a guarded statement refused).
        tmp = self.dir / "tmp"
        if not tmp.exists():
            tmp.mkdir()
            if self.as_root:
                shutil.chown(tmp, "mysql", "mysql")
        return [
            self.mariadbd, "--no-defaults", f"--datadir={self.dir / 'data'}", *self._user_args(),
            f"--tmpdir={self.dir / 'tmp'}",
            "--bind-address=127.0.0.1", f"--port={self.port}", f"--socket={self.dir / 'sock'}",
            # (1000: since the xdist groups work again, one worker's server serves every MySQL
            # test of a run, and under load the clients' closed connections end on the server
            # after the next test's have opened: 200 ran out, "Too many connections", once)
            "--skip-name-resolve", "--innodb-flush-log-at-trx-commit=1", "--max-connections=1000",
            _MARIADB_LOG,
        ]  # fmt: skip

    def ready(self) -> bool:
        import pymysql

        # (polled: each PyMySQL connection in its default TLS mode read the CA bundle, ~30 ms
        # of CPU, for a server that serves no TLS)
        conn = pymysql.connect(
            host="127.0.0.1", port=self.port, user="root", connect_timeout=1, ssl_disabled=True
        )
        try:
            with conn.cursor() as cur:
                cur.execute("CREATE DATABASE IF NOT EXISTS fenced")
            conn.commit()
        finally:
            conn.close()
        return True

    @property
    def url(self) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/fenced"


# A thread per connection (a keep-alive client must not hold the server: racing clients
# interleave request by request), and one request applied at a time.
# moto 5 looks each request's host up in list_of_moto_modules(): a listdir of its package
# and a stat per entry, every request (a quarter of the emulator's CPU); the list is fixed.
_MOTO_SERIAL: Final = """
import sys, threading
import moto.backends
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication, MotoRequestHandler, create_backend_app)
if hasattr(moto.backends, "list_of_moto_modules"):
    modules = tuple(moto.backends.list_of_moto_modules())
    moto.backends.list_of_moto_modules = lambda: modules
app, one = DomainDispatcherApplication(create_backend_app), threading.Lock()
def serial(environ, start_response):
    with one:
        return list(app(environ, start_response))
run_simple("127.0.0.1", int(sys.argv[1]), serial, threaded=True,
           request_handler=MotoRequestHandler)
"""


class MotoServer(Server):
    """moto's server mode: an emulator of AWS APIs (DynamoDB, S3) on loopback, in its own
    process, for the guards no real server can be run for here. State is in memory: a
    restart loses it (durability of the real services is AWS's; tests do not claim it).

    It applies one request at a time. moto's own ``moto_server`` is threaded, and there two
    racing conditional writes to one item can both pass their condition (its check and write
    are not isolated); DynamoDB and S3 apply a conditional write atomically. Applying requests
    one by one makes the emulator keep that promise, so the guards' racing tests test the
    guards, not the emulator's race. Connections are served by threads, so racing clients on
    keep-alive connections interleave request by request (a single-threaded server would
    serve one client's connection to its end first: no race at all)."""

    name = "moto"

    def command(self) -> Sequence[str]:
        return [sys.executable, "-c", _MOTO_SERIAL, str(self.port)]

    def ready(self) -> bool:
        return _answers(
            self.port, b"GET /moto-api/ HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", b"HTTP/1."
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# What `fenced serve` imports before it answers (its zygote imports them once, not each start):
# the command, the server, uvicorn's parts it picks at run time, the SQLite source (most tests').
_SERVE_WARM: Final = (
    "fenced.cli",
    "uvicorn",
    "fenced.server",
    "fenced.backends.sqlite",
    "uvicorn.lifespan.on",
    "uvicorn.loops.auto",
    "uvicorn.loops.uvloop",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.auto",
    "pydantic.v1",
    "concurrent.futures.thread",
)


class FencedServer(Server):
    """``fenced serve`` (this process's Python and fenced) in front of the token source
    ``source_url``: a real OS process on loopback, killable like any other server; forked
    from this process's zygote (:mod:`fenced.testing.forkserver`) unless ``fork`` is off."""

    name = "fenced-serve"
    start_timeout = 30.0

    def __init__(
        self,
        source_url: str,
        base_dir: str | None = None,
        port: int | None = None,
        *,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        prelude: str = "",
        fork: bool = True,
    ) -> None:
        super().__init__(base_dir, port)
        self.source_url = source_url
        self.args = list(args)
        self._env = env
        self.prelude = prelude  # Python run first (a test plants a broken source this way)
        # Forked from a zygote that has imported `fenced serve`'s modules (False: a real exec,
        # for the tests of the command's own start-up).
        self.fork = fork

    def _argv(self) -> list[str]:
        listen = f"127.0.0.1:{self.port}"
        return ["serve", "--url", self.source_url, "--listen", listen, *self.args]

    def command(self) -> Sequence[str]:
        return [
            sys.executable,
            "-c",
            f"import sys\n{self.prelude}\nfrom fenced.cli import main\nsys.exit(main())",
            *self._argv(),
        ]

    def env(self) -> dict[str, str]:
        return {**python_env(), **(self._env or {})}

    def spawn(self, log: IO[bytes]) -> forkserver.Process:
        """As :meth:`command` runs it (its prelude first, then ``fenced.cli.main`` with its
        argv), forked from this process's zygote for ``fenced serve``: ~0.1 s of CPU a start,
        not ~0.8 s. A real exec when ``fork`` is off, ``FENCED_FORKSERVER=0``, or its start-up
        environment (``PYTHON*``, ``LD_PRELOAD``: libfaketime) is not the zygote's."""
        env, cwd, plain = self.full_env() or dict(os.environ), os.getcwd(), python_env()
        home = forkserver.startup_key(plain, cwd)
        if not (self.fork and forkserver.enabled() and forkserver.startup_key(env, cwd) == home):
            return super().spawn(log)
        # (the zygote in this process's environment, not in the first server's variables)
        zygote = forkserver.server_for(plain, cwd, warm=_SERVE_WARM, here=False)
        with open(os.devnull, "rb") as devnull:
            fds = (devnull.fileno(), log.fileno(), log.fileno())
            argv, prelude = self._argv(), self.prelude
            try:
                pid = zygote.spawn(
                    "fenced.cli", argv, env, cwd, fds, prelude=prelude, warm=_SERVE_WARM
                )
            except forkserver.Unfit:  # (a module it imported started a thread: it forks no more)
                return super().spawn(log)
        return forkserver.Child(zygote, pid, None, None)

    def ready(self) -> bool:
        # The line `fenced serve` prints once the source is open and the socket listens.
        try:
            return (
                "fenced serve: listening on"
                in self.log_path.read_text(errors="replace")[self._log_start :]
            )
        except OSError:
            return False

    def _start_once(self) -> None:
        try:
            self._log_start = len(self.log_path.read_text(errors="replace"))
        except OSError:
            self._log_start = 0
        super()._start_once()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
