"""Calibrate the low-precision budget constants KAPPA and FLOOR_ULPS (per output dtype) on data.

    python -m shardcheck.harness.calibrate --seeds 4 [--out DIR] [--suite S]... [shardcheck run options]

Runs the matrix once per seed with the *correct* implementations and reports, over every
low-precision check, the ratio err_sharded / err_naive (how much worse the sharded op is
than the single-device reference in the same dtype) at the worst element, against the
reference's error in that element's row (budgets are per row: harness/core/compare.py).  KAPPA must
sit well above the largest ratio ever seen, so that correct code never flakes; the floor term
(FLOOR_ULPS ulps of the output dtype at the row's scale) covers rows whose err_naive is small
by luck.  A row whose golden and reference are exact zeros has budget 0: any error there is
listed (err/budget inf), never hidden.
Exit 0 when every check passed with err/budget <= 0.5 (a 2x margin).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from shardcheck.harness.core.compare import FLOOR_ULPS, KAPPA
from shardcheck.harness.core.records import Status, load


def _by_name(constants: dict) -> dict:
    return {str(d).removeprefix("torch."): v for d, v in constants.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardcheck.harness.calibrate")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    args, run_args = p.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        outs = []
        for seed in range(args.seeds):
            out = root / f"seed{seed}"
            if not (out / "results.jsonl").exists():
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "shardcheck.harness.cli",
                        "run",
                        "--seed",
                        str(seed),
                        "--dtype",
                        "float32,bfloat16",
                        "--out",
                        str(out),
                        "--no-progress",
                        *run_args,
                    ],
                    check=False,
                )
            outs.append(out)
        rows = load(*outs)
    rows = rows[rows["err_naive"].notna()]
    kappa = rows["dtype"].map(lambda d: KAPPA[getattr(torch, d)])
    floor = rows["budget"] - kappa * rows["err_naive"]  # FLOOR_ULPS ulps at the worst row's scale
    err = rows["err_ratio"] * rows["budget"]  # |err| at the worst element (budget and err_naive: its row's)
    # Where the reference's own error dominates the budget, the ratio says how much worse the
    # sharded op is than the single-device one; elsewhere the ulp floor decides.
    naive_led = rows[kappa * rows["err_naive"] > floor]
    ratio = (err[naive_led.index] / naive_led["err_naive"]).rename("err/err_naive")
    print("err / err_naive where KAPPA*err_naive dominates the budget:")
    print(naive_led.assign(r=ratio).groupby("dtype")["r"].describe(percentiles=[0.5, 0.99]).to_markdown())
    print("\nerr / budget, every low-precision check:")
    print(rows.groupby("dtype")["err_ratio"].describe(percentiles=[0.5, 0.99]).to_markdown())
    zero_rows = rows[(rows["budget"] == 0) & (rows["status"] != Status.PASS)]
    print(f"\nerrors in rows whose golden and reference are exact zeros: {len(zero_rows)}")
    worst = rows.sort_values("err_ratio", ascending=False).head(5)
    print(worst[["op", "case_id", "dp", "tp", "dtype", "check", "err_ratio"]].to_markdown(index=False))
    failed = int((rows["status"] != Status.PASS).sum())
    print(
        f"\nchecks: {len(rows)} ({failed} not passing); largest err/err_naive {ratio.max():.3f} "
        f"(KAPPA {_by_name(KAPPA)}, FLOOR_ULPS {_by_name(FLOOR_ULPS)}); "
        f"largest err/budget {rows['err_ratio'].max():.3f}"
    )
    return 0 if failed == 0 and rows["err_ratio"].max() <= 0.5 else 1


if __name__ == "__main__":
    sys.exit(main())
