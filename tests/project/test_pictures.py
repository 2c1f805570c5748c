"""The README's and docs' pictures: drawn by docs/img/make_pictures.py, checked in Chromium.

Each committed SVG must be exactly what the script draws (so the pictures follow the code),
and must render in a real headless Chromium as a picture, not as the browser's XML error
page, with the colours that carry its meaning on the screen.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.cdp import Browser
from tests.helpers import ROOT
from tests.png import count_near, read_png

IMG = ROOT / "docs" / "img"
RED, GREEN, BLUE = (0xD6, 0x45, 0x45), (0x2E, 0x9D, 0x5B), (0x4C, 0x8B, 0xF5)
ERROR_BANNER = (0xFF, 0xDD, 0xDD)  # Chromium's "This page contains the following errors"


def _pictures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_pictures", IMG / "make_pictures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_pictures_are_what_the_script_draws(tmp_path: Path) -> None:
    pictures = _pictures()
    assert pictures.main(tmp_path) == 0
    for name in pictures.PICTURES:
        assert (tmp_path / name).read_text() == (IMG / name).read_text(), (
            f"docs/img/{name} is out of date: run python docs/img/make_pictures.py"
        )
    assert "docs/img/paused-writer.svg" in (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium for the module's screenshots (a Chromium started per picture
    cost ~0.9 s of CPU and ~2 s each)."""
    with Browser(860, 400) as b:
        yield b


def _screenshot(browser: Browser, svg: Path, out: Path, height: int) -> list[bytes]:
    browser.call(
        "Emulation.setDeviceMetricsOverride", width=860, height=height, deviceScaleFactor=1,
        mobile=False,
    )  # fmt: skip
    # (an SVG document has no body: loaded is the document's own state)
    browser.go(svg.as_uri(), ready="document.readyState === 'complete'")
    width, got_height, rows = read_png(browser.screenshot(out))
    assert (width, got_height) == (860, height)
    return rows


EXPECTED = {  # picture: (height, colours that must be on the screen)
    "paused-writer.svg": (330, [RED, GREEN, BLUE]),
    "lease-timeline.svg": (220, [RED, (0xC9, 0xDC, 0xFC)]),  # the lease: blue at 30 %
    "guard-flow.svg": (200, [RED, GREEN]),
    "failover.svg": (300, [RED, (0xC9, 0xDC, 0xFC)]),
    "replicated.svg": (360, [RED, GREEN, (0xC9, 0xDC, 0xFC)]),
}


def _check_rendered(rows: list[bytes], colours: list[tuple[int, int, int]]) -> None:
    assert count_near(rows, ERROR_BANNER, tolerance=6) < 500, "Chromium shows an XML error"
    for colour in colours:
        assert count_near(rows, colour) > 50, f"colour {colour} missing from the rendering"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_picture_renders_in_chromium(name: str, tmp_path: Path, browser: Browser) -> None:
    height, colours = EXPECTED[name]
    _check_rendered(_screenshot(browser, IMG / name, tmp_path / "shot.png", height), colours)


def test_the_rendering_check_catches_a_broken_picture(tmp_path: Path, browser: Browser) -> None:
    """Planted: the bug the check found first, an attribute written twice, which makes the
    SVG invalid XML (Chromium then shows its error page over a part of the picture)."""
    broken = tmp_path / "broken.svg"
    text = (IMG / "paused-writer.svg").read_text()
    broken.write_text(text.replace("<text ", "<text fill='black' ", 1))
    rows = _screenshot(browser, broken, tmp_path / "shot.png", 330)
    with pytest.raises(AssertionError):
        _check_rendered(rows, EXPECTED["paused-writer.svg"][1])
