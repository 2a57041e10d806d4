"""Calibrate the low-precision budget factor KAPPA on data.

    python -m harness.calibrate --seeds 8 [--suite S]... [shardcheck run options]

Runs the matrix once per seed with the *correct* implementations and reports, over every
low-precision check, the ratio err_sharded / err_naive (how much worse the sharded op is
than the single-device reference in the same dtype).  KAPPA must sit well above the
largest ratio ever seen, so that correct code never flakes; the floor term (one ulp of
the output dtype at the golden's scale) covers checks whose err_naive is 0.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.compare import KAPPA
from harness.records import load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.calibrate")
    p.add_argument("--seeds", type=int, default=8)
    args, run_args = p.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        outs = []
        for seed in range(args.seeds):
            out = Path(tmp) / f"seed{seed}"
            subprocess.run([sys.executable, "-m", "harness.cli", "run", "--seed", str(seed), "--dtype", "float32,bfloat16",
                            "--out", str(out), "--no-progress", *run_args], check=False)
            outs.append(out)
        rows = load(*outs)
    rows = rows[rows["err_naive"].notna() & (rows["err_naive"] > 0)]
    ratio = (rows["max_abs_err"] / rows["err_naive"]).rename("err/err_naive")
    table = rows.assign(ratio=ratio).groupby("dtype")["ratio"].describe(percentiles=[0.5, 0.99])
    print(table.to_markdown())
    worst = rows.assign(ratio=ratio).sort_values("ratio", ascending=False).head(5)
    print(worst[["op", "case_id", "dp", "tp", "dtype", "check", "ratio"]].to_markdown(index=False))
    print(f"\nchecks: {len(rows)}; largest err/err_naive: {ratio.max():.3f}; KAPPA in use: {KAPPA}")
    return 0 if ratio.max() <= KAPPA / 2 else 1


if __name__ == "__main__":
    sys.exit(main())
