"""``fenced group``: status from the source alone, members' marks when given, changes."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import fenced
from fenced.cli import main
from fenced.guards.sql import SQLGuard
from fenced.replicated import Group


@pytest.fixture
def setup(tmp_path: Path) -> tuple[str, list[str]]:
    for n in "abc":
        sqlite3.connect(tmp_path / f"{n}.db").close()
    url = f"sqlite:///{tmp_path}/locks.db"
    with fenced.connect(url) as locks:
        members = {
            n: SQLGuard("orders").fencer(
                lambda n=n: sqlite3.connect(tmp_path / f"{n}.db", check_same_thread=False)
            )
            for n in "abc"
        }
        g = Group("orders", locks, members)
        with locks.lock("orders", ttl=5) as lease:
            g.writer(lease).set("k", "v")
        g.close()
    args = [f"--member={n}=sqlite:///{tmp_path}/{n}.db" for n in "abc"]
    return url, ["--url", url, *args]


def test_status_shows_the_configuration_and_each_members_marks(
    setup: tuple[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, args = setup
    assert main(["group", "status", "orders", "--url", url]) == 0
    assert "configuration 1 (from 0): a, b, c" in capsys.readouterr().out
    assert main(["group", "status", "orders", *args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["epoch"] == 1 and out["members"] == ["a", "b", "c"]
    assert [(m["name"], m["token"], m["keys"]) for m in out["member_status"]] == [
        ("a", 1, 1), ("b", 1, 1), ("c", 1, 1)
    ]  # fmt: skip


def test_remove_and_add_change_the_configuration_in_order(
    setup: tuple[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    _, args = setup
    assert main(["group", "remove", "orders", "b", *args]) == 0
    assert "configuration 2: a, c" in capsys.readouterr().out
    assert main(["group", "add", "orders", "b", *args]) == 0
    assert "configuration 3: a, c, b" in capsys.readouterr().out


def test_bad_input_is_one_line_and_changes_nothing(
    setup: tuple[str, list[str]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url, args = setup
    assert main(["group", "remove", "orders", "a", "b", "c", *args]) == 2
    assert main(["group", "status", "orders", "--url", url, "--member", "x=ftp://h"]) == 2
    assert main(["group", "status", "orders", "--url", url, "--member", "nonsense"]) == 2
    missing = f"--member=a=sqlite:///{tmp_path}/nope.db"
    assert main(["group", "remove", "orders", "b", "--url", url, missing]) == 69  # unavailable
    err = capsys.readouterr().err
    assert all(line.startswith("fenced: ") for line in err.strip().splitlines()), err
    assert not (tmp_path / "nope.db").exists()  # a typo makes no new database
    assert main(["group", "status", "orders", "--url", url]) == 0
    assert "configuration 1 (from 0)" in capsys.readouterr().out


def test_a_removal_refused_for_safety_exits_65_and_changes_nothing(
    setup: tuple[str, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Removing the two members that hold the writes, keeping only one that came back empty,
    is refused (ChangeRefusedError): a data error of the request (65, as the exit-status table
    says), one line, not "unavailable" (69: every member answered) — and nothing changed. The
    rightful removal of the empty one goes through."""
    _, args = setup
    (tmp_path / "c.db").unlink()  # c restarted empty
    sqlite3.connect(tmp_path / "c.db").close()
    assert main(["group", "remove", "orders", "a", "b", *args]) == 65
    err = capsys.readouterr().err.strip()
    assert err.startswith("fenced: ") and "\n" not in err and "lost their state" in err, err
    assert main(["group", "status", "orders", *args]) == 0
    assert "configuration 1 (from 0): a, b, c" in capsys.readouterr().out
    assert main(["group", "remove", "orders", "c", *args]) == 0
    assert "configuration 2: a, b" in capsys.readouterr().out


def test_status_shows_a_member_that_came_back_empty_and_add_copies_the_data_to_it(
    setup: tuple[str, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, args = setup
    (tmp_path / "c.db").unlink()  # c restarted empty
    sqlite3.connect(tmp_path / "c.db").close()
    assert main(["group", "status", "orders", *args]) == 0
    out = capsys.readouterr().out
    assert "c          member       token 0  epoch 0  0 keys  BEHIND: lost its state" in out
    assert main(["group", "status", "orders", *args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["member_status"]
    assert [(m["name"], m["behind"]) for m in rows] == [("a", False), ("b", False), ("c", True)]
    assert main(["group", "add", "orders", "c", *args]) == 0
    assert "configuration 2: a, b, c" in capsys.readouterr().out
    assert main(["group", "status", "orders", *args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["member_status"]
    assert [(m["name"], m["keys"], m["behind"]) for m in rows] == [
        ("a", 1, False),
        ("b", 1, False),
        ("c", 1, False),
    ]


def test_a_mysql_member_by_its_url_refuses_the_stale_writer_and_keeps_its_marks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--member m=mysql://...`` reaches a MariaDB member through the one guard registry (the
    URL the library's groups take too): the stale writer is refused there, the current one
    applied, and the marks and data survive a kill -9 of the server."""
    from fenced.cli._group import member_from_url
    from fenced.replicated import Item, stamp
    from fenced.replicated._members import as_member
    from fenced.testing.servers import MariaDBServer

    with MariaDBServer() as maria:
        sqlite3.connect(tmp_path / "a.db").close()
        url = f"sqlite:///{tmp_path}/locks.db"
        urls = {"a": f"sqlite:///{tmp_path}/a.db", "m": maria.url}
        args = ["--url", url, *(f"--member={n}={u}" for n, u in urls.items())]
        with fenced.connect(url) as locks:
            members = {n: member_from_url(u, "orders")[0] for n, u in urls.items()}
            group = Group("orders", locks, members, timeout=10)
            try:
                assert type(group.aio.member("m")).__name__ == "SQLMember"
                with locks.lock("orders", ttl=30) as first:
                    old = group.writer(first)
                    old.set("k", b"old")
                with locks.lock("orders", ttl=30) as second:
                    group.writer(second).set("k", b"new")
                    with pytest.raises(fenced.StaleTokenError):
                        old.set("k", b"late")
                    assert group.read("k") == b"new"
            finally:
                group.close()
        maria.restart(kill=True)
        assert main(["group", "status", "orders", *args, "--json"]) == 0
        rows = {m["name"]: m for m in json.loads(capsys.readouterr().out)["member_status"]}
        assert (rows["m"]["reachable"], rows["m"]["token"], rows["m"]["keys"]) == (
            True, second.token.value, 1,
        )  # fmt: skip

        async def after_restart() -> tuple[Any, ...]:
            member = as_member(member_from_url(maria.url, "orders")[0], "orders")
            try:
                with pytest.raises(fenced.StaleTokenError):
                    await member.apply(
                        first.token, 1, [Item("k", stamp(first.token.value, 9), b"x")]
                    )
                snap = await member.read(["k"])
                return snap.token, snap.items["k"].value
            finally:
                await member.aclose()

        assert asyncio.run(after_restart()) == (second.token.value, b"new")
        assert main(["group", "remove", "orders", "a", *args]) == 0
        assert "configuration 2: m" in capsys.readouterr().out


@pytest.mark.parametrize(
    "url",
    ["mysql://root@127.0.0.1:3306", "mysql://root@h:port/db", "mysql://u:hunter2@h/db?x=1"],
)
def test_a_bad_mysql_member_url_is_one_line_without_the_password(url: str) -> None:
    from fenced.cli._group import member_from_url

    with pytest.raises(fenced.ConfigurationError) as err:
        member_from_url(url, "orders")
    assert "\n" not in str(err.value) and "hunter2" not in str(err.value)
