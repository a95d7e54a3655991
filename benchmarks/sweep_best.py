"""Merge the best configs of several config sweeps into one `autoopt registry tune --configs`.

    python benchmarks/sweep_best.py OUT/sweep/results.json OUT/sweep2/results.json ...

Each file is a `benchmarks/config_sweep_gpu.py` results.json of one variant; its "best" maps a
token bucket ("T=32") to the fastest config there, {} where the defaults were fastest. Prints
one JSON object with the buckets in token order, a bucket that no sweep improved on as null (the
variant's defaults), so `registry tune` verifies and times exactly what the sweeps found. A bucket
swept twice takes the later file's best; sweeps of different variants are refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def merge(results: list[dict]) -> dict[str, dict | None]:
    variants = {(r.get("op"), r.get("variant")) for r in results if r.get("variant")}
    if len(variants) > 1:
        raise ValueError(f"the sweeps are of different variants: {sorted(variants)}")
    best: dict[str, dict | None] = {}
    for r in results:
        for bucket, cfg in (r.get("best") or {}).items():
            best[bucket] = dict(cfg) if cfg else None
    return dict(sorted(best.items(), key=lambda kv: int(kv[0].split("=", 1)[1])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="config sweeps' results.json files")
    a = p.parse_args(argv)
    loaded = []
    for path in a.results:
        if not path.is_file():
            print(f"sweep_best: {path} is missing (that sweep did not finish); skipped",
                  file=sys.stderr)
            continue
        loaded.append(json.loads(path.read_text()))
    best = merge(loaded)
    if not any(best.values()):
        print("sweep_best: no sweep found a config faster than the defaults", file=sys.stderr)
        return 1
    print(json.dumps(best, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
