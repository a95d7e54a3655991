"""Screenshots of the review pages (`autoopt review serve`) for docs/review/, on a demo registry.

The demo is a temporary copy of the committed kernels/ plus one candidate awaiting review: the
logit_softcap variant that the from-scratch optimize run on an H200 registered
(docs/gpu-runs/2026-11-30-h200-x2/optimize-4-from-scratch), re-registered as a candidate
with that run's own record (GPU verification on sm_90, H200 timings, provenance) and NOTES
entry, through `model.registry.writers`; that run directory is the runs directory. Nothing in
the repository is written except the PNGs under --out.

    python benchmarks/review_screenshots.py --out docs/review     # ~20 s on a CPU

Chromium comes from the system (`apt-get install -y chromium`), driven by Playwright's Python
package (no browser download); the server is uvicorn in a thread on a free loopback port.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model.registry import Registry, writers  # noqa: E402
from model.registry.migrate import migrate  # noqa: E402

RUN_SRC = REPO / "docs" / "gpu-runs" / "2026-11-30-h200-x2" / "optimize-4-from-scratch"
OP, NAME = "logit_softcap", "template_tiles_v1"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# (file, path, element at the top of the shot or None, height in CSS pixels)
PAGES = (("registry.png", "/", None, 2400),
         ("candidate.png", f"/variant/{OP}/{NAME}", None, 1500),
         ("candidate-evidence.png", f"/variant/{OP}/{NAME}", "#timings", 1500),
         ("run.png", "/runs/{run}", None, 2000))


def build_demo(tmp: Path) -> tuple[Registry, Path, str]:
    """(registry, runs dir, run name): kernels/ copied, the GPU run's variant as a candidate."""
    reg = Registry(tmp / "registry")
    shutil.copytree(REPO / "kernels", reg.root,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    source = Registry(tmp / "from-run")
    shutil.copytree(RUN_SRC / "registry", source.root)
    migrate(source.root)  # that run wrote schema 1
    rec = source.read_record(OP, NAME)
    run = rec.provenance.run
    runs = tmp / "runs"
    shutil.copytree(RUN_SRC, runs / run, ignore=shutil.ignore_patterns("registry"))
    data = source.read_variant(OP, NAME)[1]
    checks = [v for vs in rec.verification.values() for v in vs]
    writers.register(reg, OP, NAME, data, rec.provenance, checks,
                     [dict(b.row) for b in rec.benchmarks], source.read_configs(OP, NAME),
                     dict(rec.optimize or {}), "verified and faster; awaiting review")
    for entry in source.notes_entries(OP, NAME):
        writers.note(reg, OP, "\n" + entry)
    return reg, runs, run


def shoot(out: Path, width: int = 1400) -> list[Path]:
    from playwright.sync_api import sync_playwright

    from autoopt.review_web import Runs, prepare
    from autoopt.review_web.server import in_thread

    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    written, cwd = [], Path.cwd()
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)  # the pages name the registry and runs by these relative paths
        try:
            reg, runs, run = build_demo(Path("."))
            served = prepare(reg, Runs(runs), "127.0.0.1", 0)
            with in_thread(served), sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(served.url)
                for file, path, anchor, height in PAGES:
                    page.goto(served.base + path.format(run=run))
                    top = page.locator(anchor).bounding_box()["y"] - 8 if anchor else 0
                    full = page.evaluate("document.documentElement.scrollHeight")
                    clip = {"x": 0, "y": top, "width": width,
                            "height": min(height, full - top)}
                    page.screenshot(path=str(out / file), full_page=True, clip=clip)
                    written.append(out / file)
                browser.close()
        finally:
            os.chdir(cwd)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "review")
    ap.add_argument("--width", type=int, default=1400)
    args = ap.parse_args()
    for path in shoot(args.out, args.width):
        print(f"{path}  {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
