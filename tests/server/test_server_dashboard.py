"""The dashboard at ``/``, rendered by a real headless Chromium against a real ``fenced serve``:
the DOM after its script ran (locks with holder, token, time left, waiters; counters; the
last transitions), and a screenshot with the colours that carry meaning."""

from __future__ import annotations

import html.parser
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from fenced.testing.servers import FencedServer
from tests.cdp import Browser
from tests.helpers import TLS, wait_for
from tests.png import count_near, read_png

HELD_GREEN = (0x1F, 0x7A, 0x44)
WARN = (0xB4, 0x54, 0x1A)


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


def _dom(browser: Browser, url: str) -> _Dom:
    """The page's DOM once its first poll has been answered (or failed) and drawn."""
    browser.go(url, ready="Number(document.body && document.body.dataset.polls) >= 1")
    dom = _Dom()
    dom.feed(browser.js("document.documentElement.outerHTML"))
    return dom


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    """One headless Chromium for the module (a start costs a second of CPU). Its resolver
    takes evil.test for 127.0.0.1, as a DNS-rebinding page's would (only the test of that
    names it; the others open 127.0.0.1)."""
    with Browser(1280, 800, args=["--host-resolver-rules=MAP evil.test 127.0.0.1"]) as b:
        yield b


def _blank(chromium: Browser) -> None:
    chromium.call("Page.navigate", url="about:blank")
    chromium.wait_for("location.href === 'about:blank'")


@pytest.fixture
def browser(chromium: Browser) -> Iterator[Browser]:
    """The module's Chromium on a blank page: the last test's document, scripts and timers
    are gone (each test's server is another origin: no storage is shared either). Blank
    again after the test: a dashboard left open animates its bars and polls (~0.3 s of
    Chromium's CPU a second) through the servers' stop and the next test's start."""
    _blank(chromium)
    chromium.events.clear()
    yield chromium
    # (a key the test gave a page of the module's keyed server is forgotten: the next test
    # there sees the page ask for one)
    chromium.js("try { sessionStorage.clear() } catch (e) {}")
    _blank(chromium)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FencedServer]:
    with FencedServer(f"sqlite:///{tmp_path / 'locks.db'}") as s:
        yield s  # type: ignore[misc]


ALICE, BOB, OPS = (
    "fk_alice_secret_0000000000",
    "fk_bob_secret_00000000000",
    "fk_ops_secret_00000000000",
)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FencedServer]:
    """One ``fenced serve`` with keys for the module's tests of keys (alice: ``a/``, bob:
    ``b/``, ops: admin); only the dead holder's test takes locks on it."""
    base = tmp_path_factory.mktemp("keyed")
    keys = base / "keys.toml"
    keys.write_text(
        f'[[keys]]\nid = "alice"\nsecret = "{ALICE}"\nprefixes = ["a/"]\nverbs = ["acquire"]\n'
        f'[[keys]]\nid = "bob"\nsecret = "{BOB}"\nprefixes = ["b/"]\nverbs = ["acquire"]\n'
        f'[[keys]]\nid = "ops"\nsecret = "{OPS}"\nverbs = ["admin"]\n'
    )
    with FencedServer(f"sqlite:///{base / 'l.db'}", args=["--api-keys", str(keys)]) as s:
        yield s  # type: ignore[misc]


def _post(url: str, body: object = None) -> dict[str, object]:
    return httpx.post(url, json=body, timeout=30, verify=TLS).json()  # type: ignore[no-any-return]


def test_the_dashboard_shows_locks_counters_and_transitions(
    server: FencedServer, browser: Browser, tmp_path: Path
) -> None:
    u = server.url
    _post(f"{u}/v1/locks/invoices/acquire", {"ttl": 600, "owner": "billing worker 7"})
    first = _post(f"{u}/v1/locks/reports/acquire", {"ttl": 600, "request_id": "r1"})
    _post(f"{u}/v1/locks/reports/release", {"token": first["token"], "request_id": "r1"})
    _post(f"{u}/v1/locks/reports/acquire", {"ttl": 600, "request_id": "r2"})
    late = _post(f"{u}/v1/locks/reports/-/acquire", {"ttl": 600, "request_id": "r1"})
    assert late["error"] == "lease_lost"  # (r1's copy, too late: a 410, counted)
    _post(f"{u}/v1/check", {"token": "reports:1"})  # stale: the dashboard counts it
    _post(f"{u}/v1/check", {"token": "reports:2"})
    httpx.post(f"{u}/v1/check", json={"token": "reports:x"}, timeout=10, verify=TLS)  # invalid

    dom = _dom(browser, u + "/")
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
    assert dom.counters["fenced_acquire_late_duplicates_total"] == "1"
    events = [(e[1], e[2], e[3]) for e in dom.tables["events"]]
    assert events[:4] == [
        ("reports", "granted", "2"),
        ("reports", "released", "1"),
        ("reports", "granted", "1"),
        ("invoices", "granted", "1"),
    ]

    # the page follows the source: a change shows up at the next load
    _post(f"{u}/v1/locks/nightly/acquire", {"ttl": 60})
    assert "nightly" in {row[0] for row in _dom(browser, u + "/").tables["locks"]}

    shot = browser.screenshot(tmp_path / "dashboard.png")
    width, height, rows = read_png(shot)
    assert (width, height) == (1280, 800)
    assert count_near(rows, HELD_GREEN, tolerance=40) > 30, "no 'held' in green"
    assert count_near(rows, WARN, tolerance=40) > 30, "the stale-check counter is not flagged"


def test_with_api_keys_the_page_asks_for_a_key(keyed: FencedServer, browser: Browser) -> None:
    dom = _dom(browser, keyed.url + "/")
    assert "display: flex" in dom.auth_style
    assert dom.body.get("data-loaded") is None and dom.tables["locks"] == []


def test_a_key_no_header_can_carry_is_one_clear_line_on_the_page(
    keyed: FencedServer, browser: Browser
) -> None:
    """A key pasted with a tab inside, or a character that is not ASCII: the page says what
    is wrong with it (never the key) and keeps asking — it said "server unreachable" (fetch
    refuses such a header); the rightful key then loads the page. (A line break never
    arrives: a password field drops it from its value.)"""
    browser.go(keyed.url + "/", ready="document.getElementById('auth').style.display === 'flex'")
    for bad, kind in (("fk_alice\tsecret_0000", "control"), ("fk_alicé_secret_00", "non-ASCII")):
        browser.js(
            f"document.getElementById('key').value = {json.dumps(bad)}; "
            "document.getElementById('auth').requestSubmit()"
        )
        # (the page's submit handler answers on a later turn of its event loop: wait for it)
        browser.wait_for(
            "document.getElementById('state').textContent.startsWith('the API key has') && "
            f"document.getElementById('state').textContent.includes({json.dumps(kind)})"
        )
        # and it stays said through the page's next polls (each answered 401 meanwhile: they
        # wrote the server's "send Authorization..." over it, so a user never saw it)
        polls = int(browser.js("document.body.dataset.polls || '0'"))
        browser.wait_for(f"Number(document.body.dataset.polls || '0') >= {polls + 2}")
        said = browser.js("document.getElementById('state').textContent")
        assert said.startswith("the API key has") and kind in said, said
        assert "alice" not in said and "secret" not in said, said
        assert browser.js("document.getElementById('auth').style.display") == "flex"
        assert browser.js("sessionStorage.getItem('fenced-key')") is None
    _keyed(browser, keyed.url + "/", ALICE)


def test_the_dom_check_catches_a_page_that_shows_nothing(
    server: FencedServer, browser: Browser
) -> None:
    """Planted: the page's data request fails (a wrong path), so no lock is rendered."""
    _post(f"{server.url}/v1/locks/invoices/acquire", {"ttl": 600})
    page = httpx.get(server.url + "/", timeout=10, verify=TLS).text.replace(
        '"/v1/dashboard"', '"/v1/nothing"'
    )
    broken = server.dir / "broken.html"
    broken.write_text(page.replace('fetch("/v1/', f'fetch("{server.url}/v1/'))
    dom = _dom(browser, broken.as_uri())
    assert dom.body.get("data-loaded") is None
    with pytest.raises(KeyError):
        _ = {row[0]: row for row in dom.tables["locks"]}["invoices"]


# -- issue 29 §4: the page an operator keeps open, driven live (tests/cdp.py) ---------------------

NAMES_OF = "document.querySelectorAll('#locks tbody tr')"


def _names(browser: Browser) -> list[str]:
    names: list[str] = browser.js(f"[...{NAMES_OF}].map((r) => r.dataset.lock)")
    return names


def _set(browser: Browser, element: str, value: str, event: str) -> None:
    browser.js(
        f"(() => {{ const e = document.getElementById({json.dumps(element)}); "
        f"e.value = {json.dumps(value)}; e.dispatchEvent(new Event({json.dumps(event)})); }})()"
    )


def _lines(browser: Browser) -> dict[str, Any]:
    """How the rows of both tables lie: every cell's text in line boxes (a wrapped text has
    more than one), the rows' heights, and how many lock rows are wholly above the fold."""
    result: dict[str, Any] = browser.js(
        """(() => {
        const rows = [...document.querySelectorAll('#locks tbody tr, #events tbody tr')];
        let wrapped = [];
        for (const row of rows) for (const td of row.cells) {
          const texts = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
          for (let node = texts.nextNode(); node; node = texts.nextNode()) {
            const range = document.createRange(); range.selectNodeContents(node);
            const boxes = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
            if (boxes.size > 1) wrapped.push(td.textContent);
          }
        }
        const heights = rows.map((r) => r.getBoundingClientRect().height);
        const above = [...document.querySelectorAll('#locks tbody tr')]
          .filter((r) => r.getBoundingClientRect().bottom <= innerHeight).length;
        const line = parseFloat(getComputedStyle(document.querySelector('#locks td')).lineHeight);
        return {wrapped, min: Math.min(...heights), max: Math.max(...heights), above, line,
                rows: rows.length};
      })()"""
    )
    return result


def test_a_hundred_locks_one_line_each_filtered_and_sorted(
    server: FencedServer, browser: Browser, tmp_path: Path
) -> None:
    """Issue 29 §4: at 1280×800 no lock name or transition wraps (long ones end in an
    ellipsis, whole in the title); a prefix filter (also ?prefix= to bookmark), sorting by
    time left or by name, and "showing N of M"."""
    u = server.url
    prefixes = ["jobs/", "billing/", "reports/", "queues/eu-west-1/partitions/"]
    names = [f"{prefixes[i % 4]}task-{i:03d}" for i in range(108)]
    names += ["jobs/" + "n" * 195, "reports/" + "-".join(["segment"] * 23)]  # 200 characters
    ttls = {n: 30 + 3 * i for i, n in enumerate(names)}  # (time-left order is not name order)
    with httpx.Client(timeout=30) as c:
        # (acquired in ttl order: each expiry is later than the one before however long the
        # 110 acquires take, so the "by time left" order below is certain, even under load)
        for n in sorted(names, key=ttls.__getitem__):
            owner = f"worker on host-{len(n) % 7}.example.internal pid {4000 + ttls[n]}" * 3
            r = c.post(f"{u}/v1/locks/{n}/-/acquire", json={"ttl": ttls[n], "owner": owner})
            assert r.status_code == 200, r.text
        for n in ("jobs/free-a", "billing/free-b", "reports/free-c"):
            g = c.post(f"{u}/v1/locks/{n}/-/acquire", json={"request_id": "x"}).json()
            c.post(f"{u}/v1/locks/{n}/-/release", json={"token": g["token"], "request_id": "x"})
    total = len(names) + 3

    browser.go(u + "/")
    assert browser.js("document.getElementById('count').textContent") == (
        f"showing {total} of {total}"
    )
    lines = _lines(browser)
    assert lines["rows"] == total + 30  # (the last 30 transitions)
    assert lines["wrapped"] == []
    assert lines["max"] == lines["min"] < 2 * lines["line"], lines  # one line a row
    assert lines["above"] >= 20, lines  # (11 of 21 before, names wrapping)
    long_name = "jobs/" + "n" * 195
    cut = browser.js(
        f"""(() => {{ const td = document.querySelector('tr[data-lock="{long_name}"]').cells[0];
        const h = td.querySelector('.h');
        return [td.title, td.textContent, h.scrollWidth > h.clientWidth,
                getComputedStyle(h).textOverflow]; }})()"""
    )
    assert cut == [long_name, long_name, True, "ellipsis"]  # cut on screen, whole in the title

    # by time left: the lease nearest its end first, free locks last (by name)
    free = ["billing/free-b", "jobs/free-a", "reports/free-c"]
    by_left = [*sorted(ttls, key=ttls.__getitem__), *free]
    assert _names(browser) == by_left
    _set(browser, "sort", "name", "change")
    assert _names(browser) == sorted(by_left)

    # the filter: asks the server for that prefix, and says so in the address
    _set(browser, "prefix", "jobs/", "input")
    jobs = sorted(n for n in by_left if n.startswith("jobs/"))
    browser.wait_for(
        f"document.getElementById('count').textContent === 'showing {len(jobs)} of {total}'"
    )
    assert _names(browser) == jobs
    # (the page keeps a bar's scale for the grants it shows only: it does not grow for days)
    assert browser.js("scales.size") == len([n for n in jobs if "free" not in n])
    assert browser.js("location.search") == "?prefix=jobs%2F&sort=name"
    events = browser.js(
        "[...document.querySelectorAll('#events tbody tr')].map((r) => r.cells[1].textContent)"
    )
    assert events and all(e.startswith("jobs/") for e in events)  # (the same filter)

    # a bookmarked view opens as it was left
    browser.go(u + "/?prefix=reports/")
    reports = [n for n in by_left if n.startswith("reports/")]
    assert _names(browser) == reports
    assert browser.js("document.getElementById('prefix').value") == "reports/"
    assert browser.js("document.getElementById('sort').value") == "left"

    browser.go(u + "/")
    assert browser.console_errors() == []  # (the icon is served: no 404 on each load)
    shot = browser.screenshot(tmp_path / "hundred.png")
    width, height, rows = read_png(shot)
    assert (width, height) == (1280, 800)
    assert count_near(rows, HELD_GREEN, tolerance=40) > 2000, "no 'held' or bars in green"


def _shown(browser: Browser, table: str, column: int, end: int = 8) -> list[dict[str, Any]]:
    """What a column's cells show: their text and title, whether the text's last ``end``
    characters are drawn inside the cell (not clipped), and whether it lies on one line."""
    result: list[dict[str, Any]] = browser.js(
        f"""[...document.querySelectorAll('#{table} tbody tr')].map((r) => {{
        const td = r.cells[{column}], box = td.getBoundingClientRect();
        const walk = document.createTreeWalker(td, NodeFilter.SHOW_TEXT), nodes = [];
        for (let n = walk.nextNode(); n; n = walk.nextNode()) if (n.length) nodes.push(n);
        let i = nodes.length - 1, need = Math.min({end}, td.textContent.length);
        const range = document.createRange(); range.setEnd(nodes[i], nodes[i].length);
        while (need > nodes[i].length) {{ need -= nodes[i].length; i -= 1; }}
        range.setStart(nodes[i], nodes[i].length - need);
        const rects = [...range.getClientRects()].filter((q) => q.width > 0);
        const tops = new Set(nodes.flatMap((n) => {{
          const one = document.createRange(); one.selectNodeContents(n);
          return [...one.getClientRects()].map((q) => Math.round(q.top)); }}));
        return {{title: td.title, text: td.textContent,
                 end: rects.length > 0 && rects.every((q) => q.left >= box.left - 0.5 && q.right <= box.right + 0.5),
                 lines: tops.size}}; }})"""
    )
    return result


def test_forty_names_that_differ_at_their_end_are_told_apart(
    server: FencedServer, browser: Browser, tmp_path: Path
) -> None:
    """Forty long lock names differing only in their last characters, at 1280×800: each row
    shows its name's end (the middle is cut, the whole name is in the title and the text),
    in the locks and in the transitions; one line a row; and the holder column is as wide as
    its holders need: narrow for short ones, never more than its share for long ones."""
    u = server.url
    names = [
        f"jobs/nightly-report-for-tenant-acme-holdings-international-eu-west-1-shard-{i:02d}"
        for i in range(40)
    ]
    with httpx.Client(timeout=30) as c:
        for i, n in enumerate(names):
            r = c.post(f"{u}/v1/locks/{n}/-/acquire", json={"ttl": 600, "owner": f"w{i}"})
            assert r.status_code == 200, r.text
    browser.go(u + "/?sort=name")
    for table, column in (("locks", 0), ("events", 1)):
        cells = _shown(browser, table, column)
        assert len(cells) == (40 if table == "locks" else 30)
        assert all(c["title"] == c["text"] and c["text"] in names for c in cells)
        # the end of each name ("shard-07") on screen, on one line: told apart
        assert all(c["end"] and c["lines"] == 1 for c in cells), cells[0]
    lines = _lines(browser)
    assert lines["wrapped"] == [] and lines["max"] == lines["min"] < 2 * lines["line"], lines

    def widths() -> dict[str, float]:
        got: dict[str, float] = browser.js(
            """(() => { const t = document.getElementById('locks');
            return {holder: t.tHead.rows[0].cells[6].getBoundingClientRect().width,
                    table: t.getBoundingClientRect().width}; })()"""
        )
        return got

    short = widths()
    assert short["holder"] < 0.12 * short["table"], short  # ("w7": no more than its header)
    with httpx.Client(timeout=30) as c:
        owner = "worker on host-7.example.internal pid 4242 " * 5
        r = c.post(f"{u}/v1/locks/jobs/zz/-/acquire", json={"ttl": 600, "owner": owner})
        assert r.status_code == 200
    browser.wait_for("document.querySelector('tr[data-lock=\"jobs/zz\"]')")
    long = widths()
    assert 0.2 * long["table"] < long["holder"] <= 0.23 * long["table"], long
    holders = _shown(browser, "locks", 6)
    assert holders[-1]["title"] == owner[:200]
    assert holders[-1]["end"] and holders[-1]["lines"] == 1
    browser.screenshot(tmp_path / "forty.png")


def test_the_time_left_bar_moves_between_polls_and_ends_expired(
    server: FencedServer, browser: Browser
) -> None:
    """The bar is animated by the browser from the lease's expiry: it shrinks between two
    polls (the page's poll count is the same at both moments), and a lease nobody renews
    reaches zero and is drawn as expired."""
    u = server.url
    _post(f"{u}/v1/locks/long/-/acquire", {"ttl": 60})
    _post(f"{u}/v1/locks/short/-/acquire", {"ttl": 3})
    browser.go(u + "/")
    moved = browser.js(
        """new Promise((ok, fail) => {
        const fill = document.querySelector('tr[data-lock="long"] .bar > div');
        const seen = [];
        const end = performance.now() + 20000;
        const look = () => {
          seen.push([document.body.dataset.polls, fill.getBoundingClientRect().width]);
          const [a, b] = seen.slice(-2);
          if (b && a[0] === b[0] && b[1] < a[1]) ok([a, b]);
          else if (performance.now() > end) fail(new Error("no move: " + JSON.stringify(seen.slice(-5))));
          else requestAnimationFrame(look);
        };
        requestAnimationFrame(look);
      })"""
    )
    (polls_a, width_a), (polls_b, width_b) = moved
    assert polls_a == polls_b and 0 < width_b < width_a
    full = browser.js(
        "document.querySelector('tr[data-lock=\"long\"] .bar').getBoundingClientRect().width"
    )
    assert width_a > 0.9 * full  # (60 s of 60: nearly full)

    # the short lease: to zero, then drawn as expired (its text, its state, its colour)
    browser.wait_for(
        "document.querySelector('tr[data-lock=\"short\"]').classList.contains('expired')", 20
    )
    row = browser.js(
        """(() => { const r = document.querySelector('tr[data-lock="short"]');
        return [r.querySelector('.bar > div').getBoundingClientRect().width,
                r.querySelector('.s').textContent]; })()"""
    )
    assert row[0] == 0 and row[1] == "expired"
    # the state cell says it whole, not "expi…": its text fits the column
    state = browser.js(
        """(() => { const c = document.querySelector('tr[data-lock="short"]').cells[1];
        return [c.textContent, c.scrollWidth <= c.clientWidth]; })()"""
    )
    assert state == ["expired", True], state
    assert not browser.js(
        "document.querySelector('tr[data-lock=\"long\"]').classList.contains('expired')"
    )


def test_a_lease_the_source_freed_before_the_pages_countdown_ended_is_drawn_expired(
    server: FencedServer, browser: Browser
) -> None:
    """The source frees a lease at its expiry; the page's countdown is anchored when an answer
    came, so a poll can say "free" before the page reached zero (here: an answer that came a
    second late). The row is drawn expired, and stays so (the gateway's "expired" transition
    follows) — while a lease released through this gateway is drawn free, never expired."""
    u = server.url
    _post(f"{u}/v1/locks/short/-/acquire", {"ttl": 8})
    done = _post(f"{u}/v1/locks/done/-/acquire", {"ttl": 60, "request_id": "d"})
    browser.go(u + "/")
    # The page's fetch: answers a second late while lateBy is set; requests held at a gate.
    browser.js(
        """(() => { window.lateBy = 1000; window.gate = null; const real = window.fetch;
        window.fetch = async (...a) => {
          if (window.gate) await window.gate.p;
          const late = window.lateBy, r = await real(...a);
          if (late) await new Promise((ok) => setTimeout(ok, late));
          return r; }; })()"""
    )
    polls = int(browser.js("document.body.dataset.polls"))
    browser.wait_for(f"Number(document.body.dataset.polls) >= {polls + 2}", 30)
    # no poll from now until the source freed the lease; the next one comes at once
    browser.js(
        "(() => { let open; window.gate = {p: new Promise((ok) => (open = ok))};"
        " window.openGate = () => { window.gate = null; open(); }; window.lateBy = 0; })()"
    )
    polls = int(browser.js("document.body.dataset.polls"))
    _post(f"{u}/v1/locks/done/-/release", {"token": done["token"], "request_id": "d"})

    def free() -> bool:
        return not httpx.get(f"{u}/v1/locks/short", timeout=10, verify=TLS).json()["held"]

    wait_for(free, 30, "the source to free the lease")
    left = browser.js("rows.get('short').expires - now()")
    assert left > 0, left  # (the page's countdown has not ended: the case)
    browser.js("openGate()")
    browser.wait_for(f"Number(document.body.dataset.polls) >= {polls + 1}", 30)
    look = """(() => { const r = document.querySelector('tr[data-lock="%s"]');
        return [r.cells[1].textContent, r.classList.contains('expired'),
                r.querySelector('.s').textContent]; })()"""
    assert browser.js(look % "short") == ["expired", True, "expired"]
    assert browser.js(look % "done") == ["free", False, "–"]  # (released: free)
    # and still so once the gateway noted why it ended
    browser.wait_for("document.querySelector('#events tr[data-event=\"expired\"]')", 30)
    assert browser.js(look % "short") == ["expired", True, "expired"]
    assert browser.js(look % "done") == ["free", False, "–"]


def _keyed(browser: Browser, url: str, secret: str) -> None:
    """Open the page of a server with keys and give it ``secret`` as an operator would."""
    browser.go(url, ready="document.getElementById('auth').style.display === 'flex'")
    browser.js(
        f"document.getElementById('key').value = {json.dumps(secret)}; "
        "document.getElementById('auth').requestSubmit()"
    )
    browser.wait_for("document.body.dataset.loaded === 'yes'")


def _holder(url: str, name: str, secret: str) -> subprocess.Popen[bytes]:
    """A real ``fenced lock`` process holding ``name`` through the gateway (ttl 2 s, renewed
    in the background), in a process group of its own."""
    env = {**os.environ, "FENCED_API_KEY": secret}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fenced",
            "lock",
            name,
            "--url",
            url,
            "--ttl",
            "2",
            "--",
            "sleep",
            "120",
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def test_a_holder_that_died_shows_as_expired_with_its_description(
    keyed: FencedServer, tmp_path: Path, browser: Browser
) -> None:
    """Issue 29 §4: a real ``fenced lock`` holder SIGKILLed; its lease expires at the source;
    the page shows the transition "expired" naming that holder (its user@host pid, never a
    request id) and the expiry counter at 1 — while a live holder beside it stays held. A key
    sees only the locks and transitions it may read."""
    u = keyed.url

    def status(name: str, secret: str) -> dict[str, Any]:
        r = httpx.get(
            f"{u}/v1/locks/{name}", headers={"authorization": f"Bearer {secret}"}, verify=TLS
        )
        return r.json()  # type: ignore[no-any-return]

    dying, living = _holder(u, "a/job", ALICE), _holder(u, "b/job", BOB)
    try:
        wait_for(lambda: status("a/job", ALICE)["held"], 30, "alice's holder")
        wait_for(lambda: status("b/job", BOB)["held"], 30, "bob's holder")
        request_id = status("a/job", ALICE)["holder"]  # (alice's own: her request id)
        described = status("a/job", OPS)["holder"]
        assert f"pid {dying.pid}" in described and request_id not in described
        os.killpg(dying.pid, signal.SIGKILL)  # the holder and its command, at once
        dying.wait(30)

        _keyed(browser, u + "/", OPS)
        browser.wait_for("document.querySelector('#events tr[data-event=\"expired\"]')", timeout=30)
        expired = browser.js(
            """[...document.querySelectorAll('#events tr[data-event="expired"]')]
            .map((r) => [...r.cells].slice(1).map((c) => c.textContent))"""
        )
        assert expired == [["a/job", "expired", "1", described]], expired
        assert described.startswith("alice: ") and f"pid {dying.pid}" in described
        counter = "document.querySelector('[data-counter=\"fenced_expiries_total\"] .v')"
        assert browser.js(counter + ".textContent") == "1"
        assert browser.js(counter + ".parentNode.className") == "counter bad"
        page = browser.js("document.body.innerText")
        assert request_id not in page  # (another key's capability: never shown)
        shot = browser.screenshot(tmp_path / "expired.png")
        assert count_near(read_png(shot)[2], WARN, tolerance=40) > 60, "expiry not flagged"
        # the rightful holder beside it: alive, renewed, held, never "expired"
        assert status("b/job", BOB)["held"] and living.poll() is None
        assert (
            browser.js("document.querySelector('tr[data-lock=\"b/job\"]').cells[1].textContent")
            == "held"
        )

        # bob's page: his lock only, no transition of alice's lock (in the same tab, the
        # ops key forgotten as a new tab would not have it: no second Chromium to start)
        browser.js("sessionStorage.clear()")
        _keyed(browser, u + "/", BOB)
        assert _names(browser) == ["b/job"]
        events = browser.js(
            "[...document.querySelectorAll('#events tbody tr')].map((r) => r.cells[1].textContent)"
        )
        assert "a/job" not in events and "b/job" in events
        assert "a/job" not in browser.js("document.body.innerText")
        # no counters for bob, who may not read /metrics (they count every key's requests:
        # a refusal counted for a request id another key uses told him it is in use)
        assert browser.js("document.querySelectorAll('[data-counter]').length") == 0
        assert "metrics verb" in browser.js("document.getElementById('nocounters').textContent")
    finally:
        for p in (dying, living):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(30)


def test_lock_names_and_holders_are_text_never_markup(
    server: FencedServer, browser: Browser
) -> None:
    """Lock names and holder descriptions come from clients. A name with markup is refused
    (400, nothing made); a description with markup is shown as its characters, in the locks
    and in the transitions: no element is made from it and no script runs."""
    u = server.url
    attack = "<img src=x onerror=\"document.body.dataset.pwned='yes'\"><script>document.body.dataset.pwned='yes'</script>"
    r = httpx.post(
        f"{u}/v1/locks/{quote(attack, safe='')}/-/acquire", json={}, timeout=10, verify=TLS
    )
    assert r.status_code in (400, 404) and r.json()["error"] in ("invalid_request", "not_found")
    assert httpx.get(f"{u}/v1/locks", timeout=10, verify=TLS).json()["locks"] == []
    owner = attack[:200]
    assert _post(f"{u}/v1/locks/xss/-/acquire", {"ttl": 60, "owner": owner})["token"] == "xss:1"
    browser.go(u + "/?prefix=" + quote("<b>x</b>"))
    browser.js(
        "document.getElementById('prefix').value = ''; document.getElementById('prefix').dispatchEvent(new Event('input'))"
    )
    browser.wait_for("document.querySelector('tr[data-lock=\"xss\"]')")
    shown = browser.js(
        """[document.querySelector('tr[data-lock="xss"]').cells[6].textContent,
            document.querySelector('#events tbody tr').cells[4].textContent,
            document.querySelectorAll('main img, main script, main b').length,
            document.body.dataset.pwned || null]"""
    )
    assert shown == [owner, owner, 0, None]

    # And should markup ever slip into the page, its inline handlers do not run: the page's
    # policy allows only its own script (by hash), loads nothing from elsewhere, and may not
    # be framed by another site.
    policy = httpx.get(u + "/", timeout=10, verify=TLS).headers["content-security-policy"]
    assert "script-src 'sha256-" in policy and "'unsafe-inline'" not in policy
    assert "frame-ancestors 'none'" in policy and "default-src 'none'" in policy
    slipped = browser.js(
        """new Promise((ok) => {
        // (the load error's dispatch runs the img's own handler, if allowed, before a task
        // queued from it: the answer comes after whatever the handler would have done)
        addEventListener("error", () => setTimeout(() => ok(document.body.dataset.pwned || null)),
                         { capture: true, once: true });
        document.body.insertAdjacentHTML("beforeend",
          '<img src="/no-such-image.png" onerror="document.body.dataset.pwned = 1">');
      })"""
    )
    assert slipped is None


def test_a_hundred_locks_cost_one_poll_a_second_and_little_rendering(
    server: FencedServer, browser: Browser
) -> None:
    """The page asks the server once a second whatever it shows (the bar moves in the
    browser), a poll of 120 locks takes the server well under its second, and drawing them
    takes the browser a few milliseconds (it does not spin)."""
    u = server.url
    with httpx.Client(timeout=30) as c:
        for i in range(120):
            c.post(f"{u}/v1/locks/jobs/{i:03d}/-/acquire", json={"ttl": 300})
        browser.go(u + "/")
        polls = int(browser.js("document.body.dataset.polls"))
        browser.wait_for(f"Number(document.body.dataset.polls) >= {polls + 3}", 30)
        seconds = c.get(f"{u}/metrics").text
    sums = {
        line.split("{")[0]: float(line.split()[-1])
        for line in seconds.splitlines()
        if 'route="/v1/dashboard"' in line
        and line.startswith(("fenced_request_seconds_sum", "fenced_request_seconds_count"))
    }
    count, total = sums["fenced_request_seconds_count"], sums["fenced_request_seconds_sum"]
    assert count >= 4
    print(
        f"\n/v1/dashboard with 120 locks: {1000 * total / count:.1f} ms a poll ({count:.0f} polls)"
    )
    assert total / count < 0.5
    # one request per poll: nothing per lock (the page fetched /, the icon and the polls)
    fetched = browser.js(
        "performance.getEntriesByType('resource').map((e) => new URL(e.name).pathname)"
    )
    assert set(fetched) <= {"/v1/dashboard", "/favicon.ico"}, fetched
    drawn = browser.js(
        """(() => { const t = []; for (let i = 0; i < 5; i++) {
        const s = performance.now(); render(last, lastAt); t.push(performance.now() - s); }
        return Math.min(...t); })()"""
    )
    print(f"render of 120 rows: {drawn:.1f} ms (fastest of 5)")
    # ~20 ms on a quiet machine; a wall-clock figure, so CI's load (5 workers and Chromium on
    # 2 cores) stretches it ~10x (a median of 207 ms was seen there): the bound is for a
    # page that spins or redraws per row, not for the machine's load.
    assert drawn < 500


def test_without_keys_only_loopback_hosts_are_answered(
    server: FencedServer, browser: Browser
) -> None:
    """DNS rebinding: a web page the operator opens points a name of its own (evil.test) at
    127.0.0.1; the browser then takes the server for that page's own origin and would let it
    read the dashboard's data (request ids, on a server without keys) and take or release
    locks. `fenced serve` without keys on loopback answers only requests naming loopback."""
    u, port = server.url, server.port
    grant = _post(f"{u}/v1/locks/jobs/a/-/acquire", {"ttl": 60, "request_id": "mine"})
    for host in (f"evil.test:{port}", "Evil.Test.", f"127.0.0.1.evil.test:{port}", "a.b.c"):
        h = {"host": host}
        for r in (
            httpx.get(f"{u}/v1/dashboard", headers=h, timeout=10, verify=TLS),
            httpx.get(f"{u}/", headers=h, timeout=10, verify=TLS),
            httpx.post(
                f"{u}/v1/locks/jobs/b/-/acquire", json={}, headers=h, timeout=10, verify=TLS
            ),
            httpx.post(
                f"{u}/v1/locks/jobs/a/-/release",
                json={"token": grant["token"], "request_id": "mine"},
                headers=h,
                timeout=10,
                verify=TLS,
            ),
        ):
            assert r.status_code == 403 and r.json()["error"] == "forbidden", (host, r.text)
            assert "mine" not in r.text
    names = httpx.get(f"{u}/v1/locks", timeout=10, verify=TLS).json()["locks"]
    assert names == ["jobs/a"]  # nothing made, nothing released
    for host in (
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        "LOCALHOST.",
        f"[::1]:{port}",
        "127.9.9.9",
        "x",  # (a single-label name: this machine's resolver, not the web's)
        "a.localhost",
    ):
        r = httpx.get(f"{u}/v1/dashboard", headers={"host": host}, timeout=10, verify=TLS)
        assert r.status_code == 200 and r.json()["total"] == 1, (host, r.text)
    # ... and in a real browser whose resolver says evil.test is 127.0.0.1 (the module's)
    browser.call("Page.navigate", url=f"http://evil.test:{port}/v1/dashboard")
    text = browser.wait_for("document.body && document.body.innerText", 30)
    assert '"error":"forbidden"' in text and "mine" not in text, text


def test_with_keys_any_host_is_answered_with_a_key(keyed: FencedServer) -> None:
    """With API keys the key protects (a browser sends none by itself): any Host is served."""
    h = {"host": "gateway.example:7400"}
    assert (
        httpx.get(f"{keyed.url}/v1/dashboard", headers=h, timeout=10, verify=TLS).status_code == 401
    )
    h["authorization"] = f"Bearer {OPS}"
    assert (
        httpx.get(f"{keyed.url}/v1/dashboard", headers=h, timeout=10, verify=TLS).status_code == 200
    )
