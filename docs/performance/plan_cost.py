"""CPU time of `build_plan` (planning alone) for the default matrix, `--quick`, and `--world-sizes 8,16` with and
without `--quick`: the median of 5 builds after a first one (suites' imports), one torch thread.

    OMP_NUM_THREADS=1 python docs/performance/plan_cost.py
"""

from __future__ import annotations

import statistics
import time

from shardcheck.harness.core.options import RunSettings
from shardcheck.harness.driver.planner import Selection, build_plan


def selection(quick: bool, world_sizes: list[int] | None) -> Selection:
    return Selection(
        run_id="plan-cost",
        settings=RunSettings(device="cpu", backend="gloo", timeout=60, seed=0),
        quick=quick,
        world_sizes=world_sizes,
    )


def main() -> None:
    build_plan(selection(True, None))  # imports every suite once
    for name, quick, worlds in [
        ("default", False, None),
        ("--quick", True, None),
        ("--world-sizes 8,16", False, [8, 16]),
        ("--world-sizes 8,16 --quick", True, [8, 16]),
    ]:
        times = []
        for _ in range(5):
            start = time.process_time()
            plan = build_plan(selection(quick, worlds))
            times.append(time.process_time() - start)
        skips = sum(1 for i in plan.items if i.skip)
        print(
            f"{name}: {len(plan.items)} items ({skips} planned skips), build_plan CPU median "
            f"{statistics.median(times):.3f} s"
        )


if __name__ == "__main__":
    main()
