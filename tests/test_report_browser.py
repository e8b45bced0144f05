"""The post-mortem in a real browser: headless Chromium (Debian's chromium + chromium-driver,
driven by Selenium) opens the file with no network, logs no error, draws every plot, runs none
of the run's hostile strings, and takes a screenshot."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from browser import chromium, missing
from spikeguard.supervisor.observe.report import write_report
from test_report import DEMO, hostile_run

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))


def severe(driver) -> list[dict]:
    """The browser's console and rendering errors since the last call."""
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def test_the_demo_s_report_renders_in_chromium_without_errors(tmp_path):
    page = write_report(DEMO, tmp_path / "report.html")
    html = page.read_text()
    with chromium() as driver:
        driver.get(page.as_uri())
        assert driver.title == "spikeguard · demo"
        assert severe(driver) == []
        count = driver.execute_script
        assert count("return document.scripts.length") == 0
        assert count("return document.querySelectorAll('svg.panel').length") == 4
        assert count("return document.querySelectorAll('svg.heatmap').length") == 2
        # every element the page was written with is in the DOM (an SVG parse error drops them)
        for selector, pattern in (
            ("path.series", r'<path class="series"'),
            ("line.marker", r'<line class="marker'),
            ("rect.cell", r'<rect class="cell"'),
            ("rect.fell-first", r'class="fell-first"'),
        ):
            n = len(re.findall(pattern, html))
            assert n > 0 and count(f"return document.querySelectorAll('{selector}').length") == n
        # ... and drawn: each line has a real extent inside its panel
        boxes = count(
            "return [...document.querySelectorAll('path.series')].map(p => {"
            "const b = p.getBBox(); return [b.width, b.height];})"
        )
        assert all(w > 50 for w, _ in boxes), boxes
        width = count("return document.querySelector('svg.panel').getBoundingClientRect().width")
        assert width > 1000
        shot = tmp_path / "report.png"
        height = count("return document.body.scrollHeight")
        driver.set_window_size(1180, min(height + 40, 6000))
        assert driver.save_screenshot(str(shot))
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 50_000


def test_a_hostile_run_s_strings_never_run_in_the_browser(tmp_path):
    page = write_report(hostile_run(tmp_path), tmp_path / "report.html")
    with chromium() as driver:
        driver.get(page.as_uri())
        assert driver.execute_script("return window.__pwned === undefined")
        assert driver.execute_script("return document.scripts.length") == 0
        assert driver.execute_script("return document.images.length") == 0
        assert severe(driver) == []
        # the hostile layer is a row label, shown as the text it is
        labels = driver.execute_script(
            "return [...document.querySelectorAll('svg.heatmap text.row')].map(t => t.textContent)"
        )
        assert any(label.startswith("g1 <script>") for label in labels), labels


def test_the_browser_reports_a_broken_page(tmp_path):
    """The check above can fail: a page with an error in it is seen as one."""
    bad = Path(tmp_path / "bad.html")
    bad.write_text('<html><body><svg><rect width="1/"/></svg></body></html>')
    with chromium() as driver:
        driver.get(bad.as_uri())
        # the console entry reaches the driver asynchronously: on a loaded machine (the suite on
        # two workers) it was not there yet right after the load
        deadline = time.monotonic() + 15
        errors = severe(driver)
        while not errors and time.monotonic() < deadline:
            time.sleep(0.1)
            errors = severe(driver)
        assert errors
