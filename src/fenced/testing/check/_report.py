"""The campaign's report: one self-contained HTML page (no script, no external file) with an
SVG timeline — a lane per worker with its leases, accepted and refused writes, the nemesis's
pauses and kills — and the verdict, the first violation first."""

from __future__ import annotations

import html
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
        '<p id="options">'
        + html.escape(
            "; ".join(
                f"{k.replace('_', '-')} {v}" for k, v in options.items() if v not in ("", None)
            )
        )
        + "</p>"
        if options
        else ""
    )
    named = {e["worker"] for e in events if e["worker"] not in ("nemesis", "checker")}
    named |= {e["victim"] for e in events if e["op"] == "nemesis"}  # (killed before a step)
    lane = {w: i for i, w in enumerate(sorted(named, key=lambda w: (len(w), w)))}
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
    stall_for: dict[str, float] = {}
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
        elif e["op"] == "stalled":  # drawn where the worker stopped, not where it was asked
            y = 20 + lane[w] * row
            span = max(4.0, stall_for.get(w, 0.0) * scale)
            parts.append(f'<rect class="nemesis" x="{x(e["mono"]):.1f}" y="{y}" width="{span:.1f}" height="22" fill="{GREY}" fill-opacity="0.6"><title>stalled between read and write</title></rect>')  # fmt: skip
        elif e["op"] == "nemesis" and e["kind"] == "stall":
            stall_for[e["victim"]] = e.get("seconds", 0.0)
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
    verdict = (
        '<p class="ok">Every invariant held.</p>'
        if not violations
        else '<p class="bad">'
        + f"{len(violations)} violation(s); the first:</p><ol>"
        + "".join(f"<li>{html.escape(str(v))}</li>" for v in violations[:20])
        + "</ol>"
    )
    writes = [e for e in events if e["op"] == "write"]
    faults = [e for e in events if e["op"] == "nemesis"]
    refused_reads = sum(1 for e in events if e["op"] == "read" and e.get("ok") is False)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fenced check</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; color: {INK}; margin: 1.2rem 1.5rem; }}
.ok {{ color: {GREEN}; font-weight: 600; }} .bad {{ color: {RED}; font-weight: 600; }}
.lane {{ font-size: 12px; fill: {INK}; }} svg {{ border: 1px solid #e3e6ea; background: #fff; }}
.key span {{ margin-right: 1.2rem; }}
</style></head><body>
<h1>fenced check</h1>
<p id="summary">{sum(1 for e in events if e["op"] == "grant")} grants,
{sum(1 for e in writes if e["ok"])} writes accepted, {sum(1 for e in writes if e["ok"] is False)}
refused, {sum(1 for e in writes if e["ok"] is None)} unanswered, {refused_reads} reads refused,
{len(faults)} faults, {t1 - t0:.1f} s.</p>
<div id="verdict">{verdict}</div>
{ran}
<p class="key"><span style="color:{BLUE}">■ lease held</span><span style="color:{GREEN}">● write accepted</span>
<span style="color:{RED}">✕ write refused (stale)</span><span style="color:{RED}">× read refused</span><span style="color:{GREY}">○ write unanswered</span><span style="color:{GREY}">▮ paused, stalled, killed, cut off, delayed, restarted, clock stepped</span></p>
<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}">
{"".join(parts)}
</svg>
</body></html>
"""
    path.write_text(page)
    return path
