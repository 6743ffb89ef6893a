"""Headless Chromium for the tests: Debian's ``chromium`` and ``chromium-driver``, via Selenium.

Without a browser the tests that need one skip with one line saying what to install;
with ``ASNACKQ_REQUIRE_BROWSER=1`` (as in CI) they fail instead.  ``ASNACKQ_SCREENSHOTS=DIR``
keeps a copy of every screenshot there (the README's come from these tests).
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

INSTALL = "apt-get install chromium chromium-driver"
CSS, ID = "css selector", "id"  # Selenium's locator strategies (``By``)
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--disable-gpu",
    "--window-size=1280,900",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
)


def found() -> tuple[str, str] | str:
    """The browser's and its driver's paths, or why there are none."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "no selenium: pip install '.[test]'"
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        return f"no browser found: {INSTALL}"
    return browser, driver


def chrome() -> Any:
    """A headless Chromium session (the caller quits it), or a skip (a failure in CI)."""
    paths = found()
    if isinstance(paths, str):
        if os.environ.get("ASNACKQ_REQUIRE_BROWSER") == "1":
            pytest.fail(f"ASNACKQ_REQUIRE_BROWSER=1, but {paths}")
        pytest.skip(paths)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in FLAGS:
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(paths[1]))


def screenshot(driver: Any, directory: Path, name: str) -> Path:
    """The whole page as ``directory/name`` (and in ``$ASNACKQ_SCREENSHOTS``); its path."""
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    path = directory / name
    path.write_bytes(base64.b64decode(shot["data"]))
    keep = os.environ.get("ASNACKQ_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(keep) / name)
    return path


def wait_for(probe: Any, timeout: float = 15.0, what: str = "the page") -> Any:
    """Poll ``probe()`` (``(done, detail)``) until done; fail after ``timeout`` s with the
    last detail.  Returns the detail."""
    deadline = time.monotonic() + timeout
    while True:
        done, detail = probe()
        if done:
            return detail
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not get there within {timeout} s: {detail!r}")
        time.sleep(0.1)
