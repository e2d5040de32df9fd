"""The site and server consoles in a real browser: Debian's Chromium driven by Playwright, and ``fedpose console``
started as its own process on 127.0.0.1.

The docs' pictures of the consoles are not a test's: ``tools/console_pictures.py`` takes both from the kits'
pilot, at the kits' own paths and with their default policy, as a hospital and the operator see them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from support.federation import free_port, start, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"]


def playwright():
    """Playwright's sync API (a context manager), or a skip (a failure where CI requires the browser)."""
    if CHROMIUM is None:
        message = ("the console's browser test needs Debian's Chromium: apt-get install chromium (Playwright comes "
                   "with the test extra)")
        if os.environ.get("FEDPOSE_REQUIRE_BROWSER"):  # CI (.ci/run) installs it: there, a missing browser fails
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    return sync_playwright()


def console(args: list[str], log: Path, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    """``fedpose console ARGS`` on a free port of 127.0.0.1, run in ``cwd``, once it answers: (its process, its
    URL)."""
    port = free_port()
    command = [sys.executable, "-m", "fedpose.cli.main", "console", *args, "--port", str(port)]
    if cwd is not None:  # a kit's commands run in its folder, its policy's paths relative to it
        command = ["bash", "-c", 'cd "$0" && exec "$@"', str(cwd), *command]
    proc = start(command, log, dict(os.environ) if env is None else env)
    url = f"http://127.0.0.1:{port}/"
    wait_for(lambda: get(url + "api/status") is not None or proc.poll() is not None, 60, f"the console at {url}")
    assert proc.poll() is None, log.read_text()[-3000:]
    return proc, url


def get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return None
