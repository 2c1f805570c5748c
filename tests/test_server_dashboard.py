"""The dashboard at ``/``, rendered by a real headless Chromium against a real ``fenced serve``:
the DOM after its script ran (locks with holder, token, time left, waiters; counters; the
last transitions), and a screenshot with the colours that carry meaning."""

from __future__ import annotations

import html.parser
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fenced.testing.servers import FencedServer
from tests.helpers import headless
from tests.png import count_near, read_png

HELD_GREEN = (0x1F, 0x7A, 0x44)
WARN = (0xB4, 0x54, 0x1A)


def _chromium_run(*args: str) -> str:
    return headless(*args, budget_ms=4000)  # the page's first fetches and renders, then the DOM


class _Dom(html.parser.HTMLParser):
    """Rows of the locks and events tables, counters by name, and a few marked elements."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {"locks": [], "events": []}
        self.counters: dict[str, str] = {}
        self.body: dict[str, str | None] = {}
        self.auth_style = ""
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._counter: str | None = None
        self._in_value = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if tag == "table" and a.get("id") in self.tables:
            self._table = a["id"]
        if tag == "tr" and self._table:
            self._row = []
        if tag == "td" and self._row is not None:
            self._cell = []
        if tag == "div" and a.get("data-counter"):
            self._counter = a["data-counter"]
        if tag == "div" and a.get("class") == "v" and self._counter:
            self._in_value = True
        if tag == "form" and a.get("id") == "auth":
            self.auth_style = a.get("style") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        if tag == "tr" and self._row is not None and self._table:
            if self._row:
                self.tables[self._table].append(self._row)
            self._row = None
        if tag == "table":
            self._table = None
        if tag == "div" and self._in_value:
            self._in_value = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._in_value and self._counter:
            self.counters[self._counter] = data.strip()
            self._counter = None


def _dom(url: str) -> _Dom:
    dom = _Dom()
    dom.feed(_chromium_run("--dump-dom", url))
    return dom


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FencedServer]:
    with FencedServer(f"sqlite:///{tmp_path / 'locks.db'}") as s:
        yield s  # type: ignore[misc]


def _post(url: str, body: object = None) -> dict[str, object]:
    return httpx.post(url, json=body, timeout=30).json()  # type: ignore[no-any-return]


def test_the_dashboard_shows_locks_counters_and_transitions(
    server: FencedServer, tmp_path: Path
) -> None:
    u = server.url
    _post(f"{u}/v1/locks/invoices/acquire", {"ttl": 600, "owner": "billing worker 7"})
    first = _post(f"{u}/v1/locks/reports/acquire", {"ttl": 600, "request_id": "r1"})
    _post(f"{u}/v1/locks/reports/release", {"token": first["token"], "request_id": "r1"})
    _post(f"{u}/v1/locks/reports/acquire", {"ttl": 600, "request_id": "r2"})
    _post(f"{u}/v1/check", {"token": "reports:1"})  # stale: the dashboard counts it
    _post(f"{u}/v1/check", {"token": "reports:2"})
    httpx.post(f"{u}/v1/check", json={"token": "reports:x"}, timeout=10)  # invalid

    dom = _dom(u + "/")
    assert dom.body.get("data-loaded") == "yes"
    locks = {row[0]: row for row in dom.tables["locks"]}
    assert set(locks) == {"invoices", "reports"}
    _, state, token, highest, left, waiters, holder = locks["invoices"]
    assert (state, token, highest, waiters) == ("held", "1", "1", "0")
    assert holder == "billing worker 7"
    assert left.endswith(" s") and 500 < float(left.split()[0]) <= 600
    assert locks["reports"][1:4] == ["held", "2", "2"]
    assert dom.counters["fenced_checks_total{stale}"] == "1"
    assert dom.counters["fenced_checks_total{current}"] == "1"
    assert dom.counters["fenced_checks_total{invalid}"] == "1"
    assert dom.counters["fenced_grants_total"] == "3"
    events = [(e[1], e[2], e[3]) for e in dom.tables["events"]]
    assert events[:4] == [
        ("reports", "granted", "2"),
        ("reports", "released", "1"),
        ("reports", "granted", "1"),
        ("invoices", "granted", "1"),
    ]

    # the page follows the source: a change shows up at the next load
    _post(f"{u}/v1/locks/nightly/acquire", {"ttl": 60})
    assert "nightly" in {row[0] for row in _dom(u + "/").tables["locks"]}

    shot = tmp_path / "dashboard.png"
    _chromium_run("--window-size=1200,700", f"--screenshot={shot}", u + "/")
    width, height, rows = read_png(shot)
    assert (width, height) == (1200, 700)
    assert count_near(rows, HELD_GREEN, tolerance=40) > 30, "no 'held' in green"
    assert count_near(rows, WARN, tolerance=40) > 30, "the stale-check counter is not flagged"


def test_with_api_keys_the_page_asks_for_a_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[[keys]]\nid = "ops"\nsecret = "fk_ops_secret_00000000000"\nverbs = ["admin"]\n'
    )
    with FencedServer(f"sqlite:///{tmp_path / 'l.db'}", args=["--api-keys", str(keys)]) as s:
        dom = _dom(s.url + "/")
    assert "display: flex" in dom.auth_style
    assert dom.body.get("data-loaded") is None and dom.tables["locks"] == []


def test_the_dom_check_catches_a_page_that_shows_nothing(server: FencedServer) -> None:
    """Planted: the page's data request fails (a wrong path), so no lock is rendered."""
    _post(f"{server.url}/v1/locks/invoices/acquire", {"ttl": 600})
    page = httpx.get(server.url + "/", timeout=10).text.replace('"/v1/dashboard"', '"/v1/nothing"')
    broken = server.dir / "broken.html"
    broken.write_text(page.replace('fetch("/v1/', f'fetch("{server.url}/v1/'))
    dom = _dom(broken.as_uri())
    assert dom.body.get("data-loaded") is None
    with pytest.raises(KeyError):
        _ = {row[0]: row for row in dom.tables["locks"]}["invoices"]
