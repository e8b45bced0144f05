"""A real headless Chromium for tests and screenshots: Debian's ``chromium`` and
``chromium-driver``, driven by Selenium (no browser download: the driver and the browser are the
system's). :func:`missing` says why one cannot start here, for a clear skip."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
from collections.abc import Iterator
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _binary() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def missing() -> str | None:
    """Why no headless Chromium can be driven here (None: it can)."""
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install -e '.[test]')"
    if _binary() is None:
        return "no chromium binary (Debian's chromium package; .ci/run installs it)"
    if shutil.which("chromedriver") is None:
        return "no chromedriver (Debian's chromium-driver package; .ci/run installs it)"
    return None


@contextlib.contextmanager
def chromium(width: int = 1180, height: int = 900) -> Iterator[Any]:
    """A headless Chromium WebDriver that records the browser's console log."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(_binary())
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()
