"""The campaign's report: one self-contained HTML page (no script, no external file) with an
SVG timeline — a lane per worker with its leases, accepted and refused writes, the nemesis's
pauses and kills — and the verdict, the first violation first."""

from __future__ import annotations

import html
import shlex
from pathlib import Path
from typing import Any

from ._checkers import Violation
from ._history import Event

__all__ = ["write_report"]

GREEN, RED, GREY, BLUE, INK = "#2e9d5b", "#d64545", "#9aa3ad", "#4c8bf5", "#1d2430"


_LABELS = {
    "pause": "paused",
    "stall": "stalled",
    "kill": "killed",
    "partition": "partitioned",
    "delay": "traffic delayed",
    "restart": "killed -9 and restarted",
    "clock": "wall clock stepped",
    "forge": "a forged token written",
    "race": "raced at a takeover",
    "resource-restart": "killed -9 and restarted",
    "resource-pause": "paused",
    "resource-partition": "cut off from every worker",
    "resource-delay": "traffic delayed",
}


# The nemesis' own lanes: who writes (and reads) with tokens the resource must refuse.
_OUTSIDERS = frozenset({"forger", "impostor", "burst"})

# ``fenced check``'s option for each recorded option of a run, and its default there (an
# option at its default is left out of the command line; None: always shown).
_FLAGS: dict[str, tuple[str, object]] = {
    "source": ("--source", None),
    "resource": ("--resource", None),
    "resource_cmd": ("--resource-cmd", None),
    "lock": ("--lock", "counter"),
    "workers": ("--workers", 3),
    "seconds": ("--time", None),
    "ttl": ("--ttl", 1.0),
    "nemesis": ("--nemesis", None),
    "faults": ("--faults", 0),
    "writes": ("--writes", 0),
    "plant": ("--plant", None),
    "signing": ("--signing", False),
    "seed": ("--seed", None),
}


def command_line(options: dict[str, Any]) -> str:
    """The ``fenced check`` command that runs again what ``options`` (a run's, as its
    history records them) describe: each option as the command takes it (``--time 4``,
    ``--nemesis pause,stall``, ``--signing``), quoted for a POSIX shell, those at their
    default left out; a URL as recorded (no password: ``***``)."""
    argv = ["fenced", "check"]
    order = list(_FLAGS)  # (the command's order; an option it does not know: last)
    for key, value in sorted(
        options.items(),
        key=lambda kv: (kv[0] not in _FLAGS, order.index(kv[0]) if kv[0] in _FLAGS else 0),
    ):
        flag, default = _FLAGS.get(key, (f"--{key.replace('_', '-')}", None))
        if key == "stop_at_first" or value in ("", None, []) or value == default:
            continue  # (stop_at_first: the command's --plant sets it; there is no flag)
        if value is True:
            argv.append(flag)
        elif value is not False:
            if isinstance(value, list | tuple):
                shown = ",".join(map(str, value))
            elif isinstance(value, float):
                shown = f"{value:g}"
            else:
                shown = str(value)
            argv += [flag, shown]
    return shlex.join(argv)


def _outsider(e: Event, cx: float, y: float, ringed: bool) -> str:
    """A forger's or an impostor's write or read: refused (as it must be) a dark ⊘, let in a
    red ◆ (ringed when the first violation is about it), unanswered a grey ring; a read drawn
    smaller."""
    who = "impostor" if e.get("impostor") else "forger"
    what = f"{who}'s {'write' if e['op'] == 'write' else 'fenced read'}"
    said = e.get("impostor") or "a forged token"
    header = f" ({e['header']})" if e.get("header") else ""
    # (a write above the lane's line, a read below it: an impostor sends both at once)
    r, y = (5.0, y - 4) if e["op"] == "write" else (3.5, y + 6)
    if e["ok"] is False:
        title = f"{what} refused, as it must be: {said}{header}"
        body = (
            f'<circle cx="{cx:.1f}" cy="{y}" r="{r}" fill="none" stroke="{INK}" stroke-width="1.5"/>'
            f'<line x1="{cx - r * 0.7:.1f}" x2="{cx + r * 0.7:.1f}" y1="{y + r * 0.7:.1f}" '
            f'y2="{y - r * 0.7:.1f}" stroke="{INK}" stroke-width="1.5"/>'
        )
        kind = "turned-away"
    elif e["ok"] is None:
        title = f"{what} unanswered: {said}{header}"
        body = (
            f'<circle cx="{cx:.1f}" cy="{y}" r="{r}" fill="none" stroke="{GREY}" stroke-width="2"/>'
        )
        kind = "unanswered"
    else:
        title = f"{what} let in: {said}{header}"
        d = r + 1
        body = (
            f'<path d="M{cx:.1f} {y - d:.1f} L{cx + d:.1f} {y} L{cx:.1f} {y + d:.1f} '
            f'L{cx - d:.1f} {y} Z" fill="{RED}"/>'
        )
        kind = "let-in"
    ring = ""
    if ringed:
        ring = f'<circle class="violation" cx="{cx:.1f}" cy="{y}" r="9" fill="none" stroke="{RED}" stroke-width="2.5"/>'
    return f'{ring}<g class="{kind}"><title>{html.escape(title)}</title>{body}</g>'


def write_report(
    events: list[Event],
    violations: list[Violation],
    path: str | Path,
    options: dict[str, Any] | None = None,
) -> Path:
    """The report page of a run: its verdict, its counts, its options (``options``, else the
    history's ``run`` event: the seed and all, to reproduce it) and its timeline."""
    path = Path(path)
    if options is None:
        options = next((e.get("options") for e in events if e["op"] == "run"), None)
    ran = (
        '<p id="options">Run again with: <code>'
        + html.escape(command_line(options))
        + "</code></p>"
        if options
        else ""
    )
    named = {e["worker"] for e in events if e["worker"] not in ("nemesis", "checker")}
    named |= {e["victim"] for e in events if e["op"] == "nemesis"}  # (killed before a step)
    # The workers in order, then the nemesis' own lanes (the forger's, the impostor's: what
    # they send must be refused), then the source and resource (a band across every lane).
    lane = {w: i for i, w in enumerate(sorted(named, key=lambda w: (w in _OUTSIDERS, len(w), w)))}
    times = [e["mono"] for e in events]
    t0, t1 = (min(times), max(times)) if times else (0.0, 1.0)
    width, left, row = 1000, 70, 34
    scale = (width - left - 10) / max(t1 - t0, 1e-6)

    def x(t: float) -> float:
        return left + (t - t0) * scale

    # The writes the first violation is about (token, value pairs), ringed in red.
    flagged: set[tuple[int, int]] = set()
    if violations:
        for item in violations[0].events:
            if isinstance(item, tuple) and len(item) == 2:
                flagged.add((int(item[0]), int(item[1])))
            elif isinstance(item, dict) and item.get("op") == "write":
                flagged.add((item["token"], item["value"]))
    parts: list[str] = []
    for w, i in lane.items():
        y = 20 + i * row
        parts.append(f'<text x="4" y="{y + 15}" class="lane">{html.escape(w)}</text>')
        parts.append(
            f'<line x1="{left}" x2="{width - 10}" y1="{y + 11}" y2="{y + 11}" stroke="#e3e6ea"/>'
        )
    granted: dict[tuple[str, int], float] = {}
    # A stall lasts until its worker's next step (continued: its late write, or a step of a
    # write it stopped inside), not the seconds its nemesis event carries (drawn, not used).
    until: dict[int, float] = {}
    stopped: dict[str, int] = {}
    for n, e in enumerate(events):
        if e["worker"] in stopped:  # (a step inside a write: the next stop ends this one)
            until[stopped.pop(e["worker"])] = e["mono"]
        if e["op"] == "stalled":
            stopped[e["worker"]] = n
    for n, e in enumerate(events):
        w = e["worker"]
        if w not in lane and e["op"] != "nemesis":
            continue
        if e["op"] == "stalled":  # drawn where the worker stopped, not where it was asked
            y = 20 + lane[w] * row
            span = max(4.0, (until.get(n, t1) - e["mono"]) * scale)
            what = (
                "stalled inside its write" if e.get("inside") else "stalled between read and write"
            )
            parts.append(f'<rect class="nemesis" x="{x(e["mono"]):.1f}" y="{y}" width="{span:.1f}" height="22" fill="{GREY}" fill-opacity="0.6"><title>{what}</title></rect>')  # fmt: skip
    for e in events:
        w = e["worker"]
        if w not in lane and e["op"] != "nemesis":
            continue
        if e["op"] == "grant":
            granted[(w, e["token"])] = e["mono"]
        elif e["op"] == "release" and (w, e["token"]) in granted:
            start = granted.pop((w, e["token"]))
            y = 20 + lane[w] * row
            parts.append(
                f'<rect class="lease" x="{x(start):.1f}" y="{y + 4}" width="{max(1.5, x(e["mono"]) - x(start)):.1f}" '
                f'height="14" fill="{BLUE}" fill-opacity="0.35"><title>{html.escape(w)} token {e["token"]}</title></rect>'
            )  # fmt: skip
        elif e.get("forged") and e["op"] in ("write", "read"):  # the forger's, an impostor's
            first = violations[0].events if violations else ()
            ringed = (e["token"], e.get("value")) in flagged or any(i == e for i in first)
            parts.append(_outsider(e, x(e["mono"]), 20 + lane[w] * row + 11, ringed))
        elif e["op"] == "write":
            y = 20 + lane[w] * row + 11
            cx = x(e["mono"])
            if (e["token"], e["value"]) in flagged:
                parts.append(f'<circle class="violation" cx="{cx:.1f}" cy="{y}" r="9" fill="none" stroke="{RED}" stroke-width="2.5"/>')  # fmt: skip
            if e["ok"]:
                parts.append(f'<circle class="accepted" cx="{cx:.1f}" cy="{y}" r="4" fill="{GREEN}"><title>accepted: token {e["token"]} value {e["value"]}</title></circle>')  # fmt: skip
            elif e["ok"] is None:  # no answer: it may or may not have landed
                parts.append(f'<circle class="unanswered" cx="{cx:.1f}" cy="{y}" r="4" fill="none" stroke="{GREY}" stroke-width="2"><title>unanswered: token {e["token"]} value {e["value"]}</title></circle>')  # fmt: skip
            else:
                parts.append(f'<g class="refused"><title>refused: token {e["token"]}</title><line x1="{cx - 5:.1f}" x2="{cx + 5:.1f}" y1="{y - 5}" y2="{y + 5}" stroke="{RED}" stroke-width="3"/><line x1="{cx - 5:.1f}" x2="{cx + 5:.1f}" y1="{y + 5}" y2="{y - 5}" stroke="{RED}" stroke-width="3"/></g>')  # fmt: skip
        elif e["op"] == "read" and e.get("ok") is False:  # a fenced read refused: a small ✕
            y = 20 + lane[w] * row + 11
            cx = x(e["mono"])
            if any(item is e or item == e for item in (violations[0].events if violations else ())):
                parts.append(f'<circle class="violation" cx="{cx:.1f}" cy="{y}" r="9" fill="none" stroke="{RED}" stroke-width="2.5"/>')  # fmt: skip
            parts.append(f'<g class="refused-read"><title>read refused: token {e["token"]}</title><line x1="{cx - 3:.1f}" x2="{cx + 3:.1f}" y1="{y - 3}" y2="{y + 3}" stroke="{RED}" stroke-width="1.5"/><line x1="{cx - 3:.1f}" x2="{cx + 3:.1f}" y1="{y + 3}" y2="{y - 3}" stroke="{RED}" stroke-width="1.5"/></g>')  # fmt: skip
        elif e["op"] == "stalled" or (e["op"] == "nemesis" and e["kind"] == "stall"):
            continue  # (drawn above)
        elif e["op"] == "nemesis":
            label = str(_LABELS.get(e["kind"], e["kind"]))
            span = max(4.0, e.get("seconds", 0) * scale)
            if e["victim"] in lane:
                y, tall = 20 + lane[e["victim"]] * row, 22
            else:  # the source or resource itself: a band across every lane
                y, tall = 14, len(lane) * row + 6
                label = f"{label}: {e['victim']}"
            parts.append(f'<rect class="nemesis" x="{x(e["mono"]):.1f}" y="{y}" width="{span:.1f}" height="{tall}" fill="{GREY}" fill-opacity="0.6"><title>{html.escape(label)}</title></rect>')  # fmt: skip
    height = 30 + len(lane) * row
    unsure = bool(violations) and all(v.checker == "inconclusive" for v in violations)
    verdict = (
        '<p class="ok">Every invariant held.</p>'
        if not violations
        else f'<p class="unsure">Inconclusive: {html.escape(violations[0].message)}</p>'
        if unsure
        else '<p class="bad">'
        + f"{len(violations)} violation(s); the first:</p><ol>"
        + "".join(f"<li>{html.escape(str(v))}</li>" for v in violations[:20])
        + "</ol>"
    )
    writes = [e for e in events if e["op"] == "write" and not e.get("forged")]  # (workers')
    faults = [e for e in events if e["op"] == "nemesis"]
    refused_reads = sum(
        1 for e in events if e["op"] == "read" and e.get("ok") is False and not e.get("forged")
    )
    turned_away = sum(
        1 for e in events if e["op"] in ("write", "read") and e.get("forged") and e["ok"] is False
    )
    outsiders = f", {turned_away} forged or impostor requests refused" if turned_away else ""
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fenced check</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; color: {INK}; margin: 1.2rem 1.5rem; }}
.ok {{ color: {GREEN}; font-weight: 600; }} .bad {{ color: {RED}; font-weight: 600; }}
.unsure {{ color: #a86400; font-weight: 600; }} code {{ font-size: 13px; background: #f3f4f6; padding: 1px 4px; }}
.lane {{ font-size: 12px; fill: {INK}; }} svg {{ border: 1px solid #e3e6ea; background: #fff; }}
.key span {{ margin-right: 1.2rem; white-space: nowrap; display: inline-block; }}
</style></head><body>
<h1>fenced check</h1>
<p id="summary">{sum(1 for e in events if e["op"] == "grant")} grants,
{sum(1 for e in writes if e["ok"])} writes accepted, {sum(1 for e in writes if e["ok"] is False)}
refused, {sum(1 for e in writes if e["ok"] is None)} unanswered, {refused_reads} reads refused{outsiders},
{len(faults)} faults, {t1 - t0:.1f} s.</p>
<div id="verdict">{verdict}</div>
{ran}
<p class="key"><span style="color:{BLUE}">■ lease held</span><span style="color:{GREEN}">● write accepted</span>
<span style="color:{RED}">✕ write refused (stale)</span><span style="color:{RED}">× read refused</span><span style="color:{GREY}">○ write unanswered</span><span style="color:{GREY}">▮ paused, stalled, killed, cut off, delayed, restarted, clock stepped</span>
<span style="color:{INK}">⊘ forger's or impostor's write (read: below) refused, as it must be</span><span style="color:{RED}">◆ … let in: a violation</span></p>
<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}">
{"".join(parts)}
</svg>
</body></html>
"""
    path.write_text(page)
    return path
