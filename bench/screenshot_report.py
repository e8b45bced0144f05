"""Render docs/report.png: the post-mortem of a run as a real browser shows it.

Writes ``spikeguard report`` of RUN_DIR (default: the recorded demo in ``tests/data/demo_run``; a
fresh ``spikeguard demo --run-dir DIR`` adds its checkpoints and batch forensics) and screenshots
it in headless Chromium (Debian's chromium + chromium-driver, through Selenium), the top
``--height`` pixels of the page.

    python3 bench/screenshot_report.py [RUN_DIR] [--out docs/report.png] [--height 2600]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from browser import chromium, missing  # noqa: E402
from spikeguard.supervisor.observe.report import write_report  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", nargs="?", default=str(ROOT / "tests" / "data" / "demo_run"))
    p.add_argument("--out", default=str(ROOT / "docs" / "report.png"))
    p.add_argument("--height", type=int, default=2600, help="pixels of the page to keep")
    args = p.parse_args()
    why = missing()
    if why:
        print(f"cannot screenshot: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        page = write_report(args.run_dir, Path(tmp) / "report.html")
        with chromium(width=1180, height=args.height) as driver:
            driver.get(page.as_uri())
            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            if errors:
                print(f"the page logged errors: {errors}", file=sys.stderr)
                return 1
            driver.save_screenshot(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
