"""docs/recipes.md runs as written (paths moved into a temp dir), and its Celery task runs in
a real Celery worker process with a real Redis broker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fenced.testing.servers import RedisServer
from tests.helpers import PROCESS_START, ROOT, wait_for

RECIPES = ROOT / "docs" / "recipes.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", RECIPES.read_text(), flags=re.S)


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, TMPDIR=str(tmp_path), FENCED_URL=f"sqlite:///{tmp_path}/locks.db")
    env["HOME"] = str(tmp_path)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{ROOT}"
    return env


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_recipes(index: int, tmp_path: Path) -> None:
    pytest.importorskip("apscheduler")
    (tmp_path / "reports").mkdir()
    code = blocks("python")[index].replace("/var/lib/app", str(tmp_path))
    # Twice: on a fresh database, then on the one the first run left (a recipe is run again).
    for run in ("fresh", "existing"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env=_env(tmp_path),
        )
        assert out.returncode == 0, f"{run} database: {out.stderr}"


def test_cron_recipe_skips_a_run_while_the_last_one_holds_the_lock(tmp_path: Path) -> None:
    crontab, shell = blocks("sh")
    command = crontab.split("\n")[1].split(None, 5)[5]  # the crontab line's command
    # The first run holds the lock until the test lets it go (no sleep to outlast): "at once"
    # is then "while the first still runs", not a wall-clock bound the second's interpreter
    # start had to beat (3 s against a start that takes seconds on a loaded machine).
    held, done = tmp_path / "in", tmp_path / "done"
    slow = command.replace(
        "/usr/local/bin/nightly-report",
        f"sh -c 'touch {held}; while [ ! -e {done} ]; do sleep 0.05; done'",
    )
    env = _env(tmp_path)
    first = subprocess.Popen(["sh", "-c", slow], env=env)
    try:
        wait_for(held.exists, PROCESS_START, "the first run to start")
        second = subprocess.run(["sh", "-c", command.replace("/usr/local/bin/nightly-report", "false")],
                                env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert second.returncode == 0, second.stderr  # skipped (-n), a success (-E 0)
        assert second.stdout == second.stderr == ""  # and silent (-q): cron mails nothing
        assert first.poll() is None  # at once: not after the first run, which still holds
    finally:
        done.touch()
        assert first.wait(30) == 0
    out = subprocess.run(
        ["bash", "-euc", shell], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()  # the report, read by plain cat from .../current


CELERY_APP = textwrap.dedent(
    """
    import sys
    from celery import Celery

    sys.path.insert(0, {recipes!r})
    from recipe_celery import settle_invoice as settle

    app = Celery("recipes", broker={broker!r}, backend={broker!r})

    @app.task
    def settle_invoice(invoice_id, db_path):
        return settle(invoice_id, db_path)
    """
)


def test_celery_recipe_in_a_real_worker(tmp_path: Path) -> None:
    pytest.importorskip("celery")
    recipe = blocks("python")[1].replace("/var/lib/app", str(tmp_path))
    head = recipe.split("\ndb = sqlite3.connect")[0]  # the task, without the demo below it
    (tmp_path / "recipe_celery.py").write_text(head)
    setup = recipe.split("\n\n\ndb = ")[1].rsplit("print(", 1)[0]
    subprocess.run(
        [sys.executable, "-c", "import sqlite3\nfrom fenced.guards.sql import RowGuard\ndb = " + setup],
        check=True, cwd=tmp_path, env=_env(tmp_path), timeout=60,
    )  # fmt: skip
    with RedisServer() as redis_server:
        broker = f"redis://127.0.0.1:{redis_server.port}/0"
        (tmp_path / "tasks.py").write_text(CELERY_APP.format(recipes=str(tmp_path), broker=broker))
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--pool=solo",
             "--loglevel=WARNING", "--without-heartbeat", "--without-mingle", "--without-gossip"],
            cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            client = (
                "import sys; sys.path.insert(0, '.'); from tasks import settle_invoice\n"
                "a = settle_invoice.delay(17, 'app.db'); b = settle_invoice.delay(17, 'app.db')\n"
                "print(a.get(timeout=60), b.get(timeout=60))\n"
            )
            out = subprocess.run(
                [sys.executable, "-c", client], cwd=tmp_path, env=_env(tmp_path),
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            assert out.stdout.split() == ["invoices/17:1", "invoices/17:2"]  # in turn, fenced
        finally:
            worker.terminate()
            worker.wait(30)
