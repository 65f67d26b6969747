"""A real browser for page tests: Debian's headless Chromium driven by its ChromeDriver through Selenium.

``.ci/run`` installs both (``apt-get install chromium chromium-driver``); without them a test skips, which fails
under CI=true (tests/support/ci_strict.py). Waits read what a person sees: the visible text of an element.
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

CHROMIUM = ("chromium", "chromium-browser")
CHROMEDRIVER = ("chromedriver",)
WINDOW = (1400, 1000)


def _which(names: tuple[str, ...]) -> str | None:
    return next((found for name in names if (found := shutil.which(name)) is not None), None)


def chromium_session() -> Iterator[object]:
    """A headless Chromium (Selenium ``WebDriver``), quit afterwards; skips when the browser is not installed."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra (pyproject.toml)")
    from selenium.webdriver.chrome.service import Service

    binary, driver = _which(CHROMIUM), _which(CHROMEDRIVER)
    if binary is None or driver is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them: "
                    "apt-get install -y chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield browser
    finally:
        browser.quit()


def visible_text(browser: object, css: str) -> str:
    """What a person reads in the first element matching ``css`` ("" when there is none yet)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(5):  # the page re-renders twice a second: an element may go stale between find and read
        try:
            found = browser.find_elements(By.CSS_SELECTOR, css)  # type: ignore[attr-defined]
            return str(found[0].text) if found else ""
        except StaleElementReferenceException:
            continue
    return ""


def wait_until(browser: object, css: str, holds: Callable[[str], object], *, timeout: float, what: str) -> str:
    """Until the visible text of ``css`` satisfies ``holds``; that text. Fails naming ``what`` and showing the
    whole page's text as it was last seen."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = visible_text(browser, css)
        if text and holds(text):
            return text
        time.sleep(0.1)
    raise AssertionError(f"{what} did not show within {timeout:g}s; {css!r} read {text!r}; the page read:\n"
                         f"{visible_text(browser, 'body')}")


def screenshot(browser: object, name: str, fallback: Path) -> Path:
    """Save a PNG of the whole page (beyond the window) as ``name``: into ``$SWARMROUTE_SCREENSHOTS`` when set
    (docs/ uses them), else into ``fallback`` (a test's tmp_path)."""
    folder = Path(os.environ.get("SWARMROUTE_SCREENSHOTS") or fallback)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    cdp = browser.execute_cdp_cmd  # type: ignore[attr-defined]
    size = cdp("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = cdp("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                          "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"],
                                                   "scale": 1}})
    path.write_bytes(base64.b64decode(shot["data"]))
    return path
