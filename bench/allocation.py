"""Allocation benchmark: Coral, Homo-ILP, Homo and Cauchy on the same inputs, and Helix on its cluster.

`coral bench allocation` writing bench/results/allocation.json (and .png) by default; every option of that command
applies (`--help`), e.g. python bench/allocation.py --scenarios core --no-helix. The settings are described in
coral_dagster/app/allocation_bench.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from coral_dagster.cli.plan import bench

OUT = Path(__file__).resolve().parent / "results" / "allocation.json"

if __name__ == "__main__":
    bench.main(["allocation", "--out", str(OUT), *sys.argv[1:]], prog_name="bench/allocation.py")
