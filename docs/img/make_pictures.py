"""Draw the pictures of the README and docs as SVG, from the numbers of a real scenario.

    python docs/img/make_pictures.py          # rewrites docs/img/*.svg

tests/project/test_pictures.py runs this and fails if a committed picture differs from what it draws,
then renders each picture in headless Chromium and checks what is on the screen.

* ``paused-writer.svg``: DDIA Figure 8-5 as ``fenced demo`` plays it: client 1 takes the lock
  (token 33), is paused past its lease, client 2 takes it (token 34) and writes, client 1
  wakes and writes with 33: the guarded storage refuses it.
* ``lease-timeline.svg``: what ``lease.remaining()`` counts: from when the request was sent,
  the ttl less the safety margin; renewals every ttl/3.
* ``guard-flow.svg``: what a guard does with a write, in one atomic step.
* ``replicated.svg``: ``fenced demo --replicated``: writer 1 writes to three replicas, c
  crashes, writer 2 fences a and b and removes c (a new configuration in the token source),
  writer 1 wakes and is refused, c is copied from a and joins again.
* ``failover.svg``: ``fenced elect``'s failover: node A leads (epoch 7), freezes; its lease
  runs out; B is elected (epoch 8), fences A, and only then starts its service.
"""

from __future__ import annotations

import html
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
INK = "#1f2933"
GREY = "#9aa5b1"
LEASE_1 = "#4c8bf5"
LEASE_2 = "#2e9d5b"
REFUSED = "#d64545"
ACCEPTED = "#2e9d5b"


def _text(x: float, y: float, s: str, size: int = 14, anchor: str = "start", **style: str) -> str:
    extra = "".join(f" {k.replace('_', '-')}='{v}'" for k, v in style.items() if k != "fill")
    return (
        f"<text x='{x:g}' y='{y:g}' {FONT} font-size='{size}' fill='{style.get('fill', INK)}' "
        f"text-anchor='{anchor}'{extra}>{html.escape(s)}</text>"
    )


def _svg(width: int, height: int, title: str, body: list[str]) -> str:
    head = (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img' aria-label='{html.escape(title)}'>"
        f"<title>{html.escape(title)}</title>"
        f"<rect width='{width}' height='{height}' fill='white'/>"
    )
    return head + "".join(body) + "</svg>\n"


def _arrow(x1: float, y1: float, x2: float, y2: float, color: str) -> str:
    return (
        f"<line x1='{x1:g}' y1='{y1:g}' x2='{x2:g}' y2='{y2:g}' stroke='{color}' "
        f"stroke-width='2' marker-end='url(#head-{color[1:]})'/>"
    )


def _marker(color: str) -> str:
    return (
        f"<marker id='head-{color[1:]}' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='7' "
        f"markerHeight='7' orient='auto-start-reverse'><path d='M0,0 L10,5 L0,10 z' "
        f"fill='{color}'/></marker>"
    )


def paused_writer() -> str:
    """Three lanes (client 1, client 2, storage) on one time axis, in seconds."""
    w, h = 860, 330
    x0, x1 = 150, 820
    t_end = 10.0

    def x(t: float) -> float:
        return x0 + (x1 - x0) * t / t_end

    lanes = {"client 1": 70, "client 2": 150, "storage (guarded)": 250}
    body = ["<defs>", *(_marker(c) for c in (INK, REFUSED, ACCEPTED)), "</defs>"]
    body.append(_text(20, 28, "A paused lock holder wakes up and writes: the token stops it", 17,
                      font_weight="bold"))  # fmt: skip
    for label, y in lanes.items():
        body.append(_text(20, y + 5, label, 14))
        body.append(
            f"<line x1='{x0}' y1='{y}' x2='{x1}' y2='{y}' stroke='{GREY}' stroke-dasharray='4 4'/>"
        )
    c1, c2, st = lanes["client 1"], lanes["client 2"], lanes["storage (guarded)"]
    # client 1: lease with token 33 from t=0.5 to 4.5, paused from 1.5 to 6.5
    body.append(
        f"<rect x='{x(0.5):g}' y='{c1 - 12}' width='{x(4.5) - x(0.5):g}' height='24' "
        f"fill='{LEASE_1}' opacity='0.25' rx='4'/>"
    )
    body.append(_text(x(0.6), c1 - 18, "lease, token 33", 12, fill=LEASE_1))
    body.append(
        f"<rect x='{x(1.5):g}' y='{c1 - 6}' width='{x(6.5) - x(1.5):g}' height='12' "
        f"fill='{INK}' opacity='0.8'/>"
    )
    body.append(_text(x(4.0), c1 + 26, "paused (GC, SIGSTOP, a VM migration)", 12, "middle"))
    body.append(_text(x(4.5) + 4, c1 - 18, "lease expires", 12, fill=GREY))
    # client 2: lease with token 34 from 5.0, writes at 5.8
    body.append(
        f"<rect x='{x(5.0):g}' y='{c2 - 12}' width='{x(9.8) - x(5.0):g}' height='24' "
        f"fill='{LEASE_2}' opacity='0.25' rx='4'/>"
    )
    body.append(_text(x(5.1), c2 - 18, "lease, token 34", 12, fill=LEASE_2))
    body.append(_arrow(x(5.8), c2 + 12, x(5.8), st - 6, ACCEPTED))
    body.append(_text(x(5.8) + 6, st - 40, "write, token 34", 12, fill=ACCEPTED))
    body.append(_text(x(5.8) + 6, st + 24, "accepted: mark = 34", 12, fill=ACCEPTED))
    # client 1 wakes at 6.5 and writes with 33 at 7.2: refused
    body.append(_arrow(x(7.4), c1 + 8, x(7.4), st - 6, REFUSED))
    body.append(_text(x(7.4) + 6, st - 70, "stale write, token 33", 12, fill=REFUSED))
    body.append(_text(x1, st + 44, "refused: 33 < 34 (StaleTokenError), nothing written", 12,
                      "end", fill=REFUSED, font_weight="bold"))  # fmt: skip
    body.append(_text(x1, h - 12, "time →", 12, "end", fill=GREY))
    return _svg(w, h, "A paused lock holder's stale write is refused by the guarded storage", body)


def lease_timeline() -> str:
    w, h = 860, 220
    x0, x1 = 60, 820
    ttl = 9.0

    def x(t: float) -> float:
        return x0 + (x1 - x0) * t / 10.5

    body = ["<defs>", _marker(INK), "</defs>"]
    body.append(_text(20, 28, "What lease.remaining() counts", 17, font_weight="bold"))
    y = 110
    body.append(f"<line x1='{x0}' y1='{y}' x2='{x1}' y2='{y}' stroke='{GREY}'/>")
    sent, granted, margin = 0.5, 1.1, 0.9
    body.append(
        f"<rect x='{x(sent):g}' y='{y - 16}' width='{x(sent + ttl - margin) - x(sent):g}' "
        f"height='32' fill='{LEASE_1}' opacity='0.3' rx='4'/>"
    )
    body.append(
        f"<rect x='{x(sent + ttl - margin):g}' y='{y - 16}' width='{x(sent + ttl) - x(sent + ttl - margin):g}' "
        f"height='32' fill='{REFUSED}' opacity='0.25'/>"
    )  # fmt: skip
    for t in (sent, granted):
        body.append(
            f"<line x1='{x(t):g}' y1='{y - 40}' x2='{x(t):g}' y2='{y + 40}' stroke='{INK}'/>"
        )
    body.append(_text(x(sent), y - 46, "request sent", 12, "middle"))
    body.append(_text(x(granted), y + 56, "grant arrives", 12, "middle"))
    for k in (1, 2):
        t = sent + k * ttl / 3
        body.append(_arrow(x(t), y - 40, x(t), y - 18, INK))
        body.append(_text(x(t), y - 46, f"renew ({k}·ttl/3)", 12, "middle"))
    body.append(
        _text(x(sent + (ttl - margin) / 2), y + 5, "remaining() > 0: surely held", 13, "middle")
    )
    body.append(
        _text(x(sent + ttl - margin / 2), y + 56, "safety margin", 12, "middle", fill=REFUSED)
    )
    body.append(
        f"<line x1='{x(sent + ttl):g}' y1='{y - 40}' x2='{x(sent + ttl):g}' y2='{y + 24}' "
        f"stroke='{INK}' stroke-dasharray='3 3'/>"
    )
    body.append(_text(x(sent + ttl), y - 46, "sent + ttl", 12, "middle"))
    body.append(_text(x0, h - 14, "The source cannot have started the lease before the request was "
                      "sent, so counting from there never overstates what is left.", 12))  # fmt: skip
    return _svg(w, h, "The lease timeline: remaining() counts from the request's sending", body)


def guard_flow() -> str:
    w, h = 860, 200
    body = ["<defs>", *(_marker(c) for c in (INK, REFUSED, ACCEPTED)), "</defs>"]
    body.append(_text(20, 28, "A guarded write: check and write are one atomic step", 17,
                      font_weight="bold"))  # fmt: skip
    boxes = [
        (20, "write + token T", INK),
        (250, "T ≥ mark?", INK),
        (520, "mark := T, write the data", ACCEPTED),
    ]
    for bx, label, color in boxes:
        body.append(
            f"<rect x='{bx}' y='70' width='210' height='50' rx='8' fill='white' "
            f"stroke='{color}' stroke-width='2'/>"
        )
        body.append(_text(bx + 105, 100, label, 14, "middle", fill=color))
    body.append(_arrow(230, 95, 248, 95, INK))
    body.append(_arrow(460, 95, 518, 95, ACCEPTED))
    body.append(_text(489, 88, "yes", 12, "middle", fill=ACCEPTED))
    body.append(_arrow(355, 120, 355, 160, REFUSED))
    body.append(_text(365, 178, "no: StaleTokenError, nothing written", 13, fill=REFUSED))
    body.append(
        f"<rect x='240' y='60' width='500' height='70' rx='10' fill='none' stroke='{GREY}' "
        "stroke-dasharray='6 4'/>"
    )
    body.append(_text(745, 58, "one transaction / script / txn", 12, "end", fill=GREY))
    return _svg(
        w, h, "A guard checks the token against the mark and writes in one atomic step", body
    )


def failover() -> str:
    w, h = 860, 300
    x0, x1 = 110, 840

    def x(t: float) -> float:
        return x0 + (x1 - x0) * t / 10.0

    body = ["<defs>", *(_marker(c) for c in (INK, REFUSED, ACCEPTED)), "</defs>"]
    body.append(_text(20, 28, "fenced elect: fence the old leader before the new one starts", 17,
                      font_weight="bold"))  # fmt: skip
    ya, yb = 90, 190
    for y, label in ((ya, "node A"), (yb, "node B")):
        body.append(_text(20, y + 5, label, 14, font_weight="bold"))
        body.append(f"<line x1='{x0}' y1='{y}' x2='{x1}' y2='{y}' stroke='{GREY}'/>")
    # A: leader with epoch 7, service running, frozen at t=2.5; lease surely held until 4.2
    body.append(f"<rect x='{x(0):g}' y='{ya - 14}' width='{x(4.2) - x(0):g}' height='28' "
                f"fill='{LEASE_1}' opacity='0.3' rx='4'/>")  # fmt: skip
    body.append(_text(x(0.2), ya - 22, "leader, epoch 7: service runs", 12))
    body.append(f"<rect x='{x(2.5):g}' y='{ya - 16}' width='{x(6.2) - x(2.5):g}' height='32' "
                f"fill='{GREY}' opacity='0.55'/>")  # fmt: skip
    body.append(_text(x(4.35), ya + 34, "frozen (GC, VM pause, SIGSTOP)", 12, "middle"))
    body.append(f"<line x1='{x(4.2):g}' y1='{ya - 30}' x2='{x(4.2):g}' y2='{yb + 30}' "
                f"stroke='{INK}' stroke-dasharray='3 3'/>")  # fmt: skip
    body.append(_text(x(4.2), yb + 46, "A's lease ends at the source", 12, "middle"))
    # B: candidate, elected at 4.4 with epoch 8; fence command 4.4-5.6; service from 5.6
    body.append(_text(x(0.2), yb - 22, "candidate: waits", 12, fill=GREY))
    body.append(f"<rect x='{x(4.4):g}' y='{yb - 14}' width='{x(10) - x(4.4):g}' height='28' "
                f"fill='{LEASE_2}' opacity='0.3' rx='4'/>")  # fmt: skip
    body.append(f"<rect x='{x(4.4):g}' y='{yb - 14}' width='{x(5.6) - x(4.4):g}' height='28' "
                f"fill='{REFUSED}' opacity='0.35'/>")  # fmt: skip
    body.append(_text(x(5.0), yb + 30, "fence command", 12, "middle", fill=REFUSED))
    body.append(_arrow(x(5.0), yb - 16, x(5.9), ya + 18, REFUSED))
    body.append(_text(x(5.95), ya + 52, "power off / poison pill / marks at epoch 8", 12,
                      fill=REFUSED))  # fmt: skip
    body.append(_text(x(5.8), yb - 22, "elected, epoch 8: service starts only now", 12,
                      fill=ACCEPTED))  # fmt: skip
    body.append(_text(x0 - 90, h - 16, "Never two services: A stops itself when its lease is "
                      "no longer sure, and B starts only after A is fenced.", 12))  # fmt: skip
    return _svg(w, h, "Failover with fencing: the new leader fences the old before starting", body)


def replicated() -> str:
    w, h = 860, 360
    x0, x1 = 130, 840

    def x(t: float) -> float:
        return x0 + (x1 - x0) * t / 10.0

    body = ["<defs>", *(_marker(c) for c in (INK, REFUSED, ACCEPTED, LEASE_1)), "</defs>"]
    body.append(_text(20, 28, "fenced.replicated: epochs fence every replica; the source "
                      "orders configurations", 17, font_weight="bold"))  # fmt: skip
    lanes = {"source": 75, "a": 150, "b": 210, "c": 270}
    for name, y in lanes.items():
        label = "token source" if name == "source" else f"replica {name}"
        body.append(_text(20, y + 5, label, 14, font_weight="bold"))
        body.append(f"<line x1='{x0}' y1='{y}' x2='{x1}' y2='{y}' stroke='{GREY}'/>")
    ys = lanes["source"]
    # configurations in the source: 1 {a,b,c} until 4.6, 2 {a,b} until 8.2, then 3 {a,b,c}
    for t0, t1, label in ((0, 4.6, "config 1: a b c"), (4.6, 8.2, "config 2: a b"),
                          (8.2, 10, "config 3: a b c")):  # fmt: skip
        body.append(f"<rect x='{x(t0):g}' y='{ys - 13}' width='{x(t1) - x(t0) - 3:g}' "
                    f"height='26' fill='{LEASE_1}' opacity='0.3' rx='4'/>")  # fmt: skip
        body.append(_text(x(t0) + 8, ys + 5, label, 12))
    # writer 1 (token 1) writes to all three
    for r in "abc":
        body.append(_arrow(x(0.8), ys + 16, x(1.2), lanes[r] - 6, ACCEPTED))
    body.append(_text(x(0.3), ys - 22, "writer 1, token 1: write to a b c", 12, fill=ACCEPTED))
    # c crashes
    yc = lanes["c"]
    body.append(f"<rect x='{x(2.6):g}' y='{yc - 16}' width='{x(8.0) - x(2.6):g}' height='32' "
                f"fill='{GREY}' opacity='0.55'/>")  # fmt: skip
    body.append(_text(x(5.3), yc + 36, "c crashed", 12, "middle"))
    # writer 2 (token 2): fences a and b, removes c (config 2), writes
    body.append(_text(x(3.6), ys - 22, "writer 2, token 2: fence, remove c, write",
                      12, fill=LEASE_2))  # fmt: skip
    for r in "ab":
        body.append(_arrow(x(4.1), ys + 16, x(4.5), lanes[r] - 6, ACCEPTED))
    # writer 1 resumes: refused by a and b
    body.append(_text(x(5.2), 118, "writer 1 wakes: refused (token 1 < 2)", 12, fill=REFUSED))
    for r in "ab":
        y = lanes[r]
        body.append(_arrow(x(6.0), 124, x(6.4), y - 8, REFUSED))
        body.append(f"<path d='M{x(6.4) - 6:g},{y - 6} l12,12 M{x(6.4) + 6:g},{y - 6} l-12,12' "
                    f"stroke='{REFUSED}' stroke-width='3'/>")  # fmt: skip
    # c comes back: state copied from a, then config 3
    body.append(_arrow(x(8.25), lanes["a"] + 8, x(8.6), yc - 8, LEASE_1))
    body.append(_text(x(8.75), lanes["b"] + 30, "copy from a,", 12, fill=LEASE_1))
    body.append(_text(x(8.75), lanes["b"] + 46, "then join", 12, fill=LEASE_1))
    body.append(_text(20, h - 16, "A write is acknowledged only when every member of the "
                      "configuration took it; a change keeps a member, fences it, copies "
                      "from it.", 12))  # fmt: skip
    return _svg(w, h, "A replicated group: fenced writes and reconfiguration", body)


PICTURES = {
    "replicated.svg": replicated,
    "failover.svg": failover,
    "paused-writer.svg": paused_writer,
    "lease-timeline.svg": lease_timeline,
    "guard-flow.svg": guard_flow,
}


def main(out: Path = HERE) -> int:
    for name, draw in PICTURES.items():
        (out / name).write_text(draw(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
