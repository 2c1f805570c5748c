"""A history damaged or hand-typed (a field of the wrong type, a missing token or time, NaN)
is refused by :func:`read_history` with a typed :class:`HistoryError` naming the line: no
verdict on it, rather than a TypeError/KeyError inside a checker or a value misread."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fenced.testing.check import History, check_all, read_history
from fenced.testing.check._history import HistoryError


def _write_good(path: Path) -> None:
    """A small right history, written by the kit's own writer (fsynced, O_APPEND)."""
    with History(path, "w1") as h:
        h.append("grant", lock="c", token=1, surely_until=1e9, remaining=5.0)
        h.append("read", lock="c", token=1, ok=True, value=0)
        h.append(
            "write", lock="c", token=1, value=1, ok=True, sent=1.0, remaining=4.0,
            lost=False, promised=None,
        )  # fmt: skip
        h.append("releasing", lock="c", token=1)
        h.append("release", lock="c", token=1, released=True, sent=2.0)
    with History(path, "final") as h:
        h.append("final", lock="c", mark=1, log=[[1, 1]])


def _edited(path: Path, n: int, change: Any) -> None:
    lines = path.read_text().splitlines()
    event = json.loads(lines[n])
    lines[n] = json.dumps(change(event))
    path.write_text("\n".join(lines) + "\n")


EDITS: list[tuple[str, int, Any]] = [
    ("token as text", 0, lambda e: {**e, "token": "1"}),
    ("token a bool", 2, lambda e: {**e, "token": True}),
    ("grant without token", 0, lambda e: {k: v for k, v in e.items() if k != "token"}),
    ("write without ok", 2, lambda e: {k: v for k, v in e.items() if k != "ok"}),
    ("ok as text", 2, lambda e: {**e, "ok": "true"}),
    ("ok as 1", 2, lambda e: {**e, "ok": 1}),
    ("no mono", 1, lambda e: {k: v for k, v in e.items() if k != "mono"}),
    ("mono NaN", 1, lambda e: {**e, "mono": float("nan")}),
    ("sent as text", 2, lambda e: {**e, "sent": "1.0"}),
    ("mark as text", 5, lambda e: {**e, "mark": "1"}),
    ("log entry not a pair", 5, lambda e: {**e, "log": [[1]]}),
    ("lock not text", 4, lambda e: {**e, "lock": 7}),
]


@pytest.mark.parametrize("n,change", [(n, c) for _, n, c in EDITS], ids=[i for i, _, _ in EDITS])
def test_a_damaged_event_is_refused_with_its_line(tmp_path: Path, n: int, change: Any) -> None:
    # Before: a TypeError or KeyError from inside a checker (token "1", mark "1", no mono, no
    # token), or the event misread ("ok": 1, a NaN time), judged as if nothing were wrong.
    path = tmp_path / "history.jsonl"
    _write_good(path)
    assert check_all(read_history(path)) == []  # the right history: read, and it passes
    _edited(path, n, change)
    with pytest.raises(HistoryError, match=rf"history.jsonl:{n + 1}: a '\w+' event"):
        read_history(path)
