"""How the harness's own cost grows with the world size: one `shardcheck run --world-sizes W` per W, each in a
process of its own, its ranks sampled from /proc while it runs.

    python docs/performance/scale_cost.py --world-sizes 1,2,4,8,16 --matrix quick --dtype float64 --out /tmp/scale-cost
    python docs/performance/scale_cost.py --world-sizes 1,2,4,8,16 --matrix default --out /tmp/scale-cost-default

Per world size: the run's wall time, the planning time (build_plan alone, in this process: its wall time on the
first call, suites' imports included, and its CPU time on a second call, one torch thread), the launch time (the
command's start to the first item a rank started), items and checks, wall seconds per item (the median of the
items' slowest rank), CPU seconds per item summed over the ranks (user + system of every rank, divided by the
items), the driver's own CPU per item (its process: planning, polling the ranks' events, writing rows), and the
peak resident memory of a rank (VmHWM, the largest over the ranks).  `--matrix default` is the matrix of a plain
`shardcheck run`, `quick` that of `--quick`.  Writes table.md and time_per_item.png into --out.  Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _rank_pids(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in run_dir.glob("workers/*/rank*.pid") if p.read_text().strip()]


def _sample(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, peak resident kB) of a live process, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
    hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return cpu, hwm


def measure(world: int, extra: list[str], out: Path) -> dict:
    run_dir = out / f"w{world}"
    cmd = [
        sys.executable,
        "-m",
        "shardcheck.harness.cli",
        "run",
        "--world-sizes",
        str(world),
        "--no-progress",
        "--timeout",
        "300",
        "--out",
        str(run_dir),
        *extra,
    ]
    seen: dict[int, tuple[float, int]] = {}
    driver: list[float] = [0.0]  # the driver process's CPU seconds, last sampled
    done = threading.Event()
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def sampler():
        while not done.is_set():
            for pid in _rank_pids(run_dir) if run_dir.exists() else []:
                s = _sample(pid)
                if s is not None:
                    seen[pid] = s
            s = _sample(proc.pid)
            if s is not None:
                driver[0] = s[0]
            time.sleep(0.2)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    output = proc.communicate()[0]
    wall = time.time() - start
    done.set()
    thread.join()
    if proc.returncode not in (0, 1):  # a usage error or a crash: its rows, if any, are not this run's
        raise SystemExit(f"shardcheck run --world-sizes {world} exited {proc.returncode}:\n{output[-2000:]}")
    from shardcheck.harness.core.records import load, with_mesh_splits

    rows = with_mesh_splits(load(run_dir))
    ran = rows[rows["status"] != "skip"]
    items = ran.drop_duplicates(["op", "case_id", "dtype", "dp", "cp", "tp", "ep", "dp_replicate"])
    first_start = min(
        json.loads(line)["time"]
        for f in run_dir.glob("workers/*/plan*/rank*.jsonl")
        for line in f.read_text().splitlines()[:1]
    )
    cpu = sum(c for c, _ in seen.values())
    return {
        "world": world,
        "exit": proc.returncode,
        "wall_s": wall,
        "launch_s": first_start - start,
        "items": len(items),
        "checks": len(rows),
        "errors": int((rows["status"] == "error").sum()),
        "skipped": int((rows["status"] == "skip").sum()),
        "item_wall_s": float(items["item_seconds"].median()),
        "item_cpu_s": cpu / max(len(items), 1),
        "driver_cpu_s": driver[0],
        "driver_cpu_per_item_ms": 1e3 * driver[0] / max(len(items), 1),
        "rank_rss_mb": max((h for _, h in seen.values()), default=0) / 1024,
        "ranks_seen": len(seen),
    }


def plan_seconds(world: int, quick: bool, dtypes: list[str]) -> tuple[float, float]:
    """(wall s of a first build_plan, suites' imports included; CPU s of a second one)."""
    import torch

    from shardcheck.harness.core.options import RunSettings
    from shardcheck.harness.driver.planner import Selection, build_plan

    torch.set_num_threads(1)  # as the driver's planning runs beside its ranks; CPU time then is one thread's
    selection = Selection(
        run_id="cost",
        settings=RunSettings(device="cpu", backend="gloo", timeout=60, seed=0),
        world_sizes=[world],
        quick=quick,
        dtypes=dtypes,
    )
    start = time.time()
    build_plan(selection)
    wall = time.time() - start
    start = time.process_time()
    build_plan(selection)
    return wall, time.process_time() - start


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--world-sizes", default="1,2,4,8,16")
    p.add_argument(
        "--matrix",
        choices=("default", "quick"),
        default="default",
        help="the matrix of a plain `shardcheck run`, or of `--quick`",
    )
    p.add_argument("--quick", action="store_true", help="the same as --matrix quick")
    p.add_argument("--dtype", default="float64,float32,bfloat16")
    p.add_argument("--suite", action="append", default=[])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    quick = args.quick or args.matrix == "quick"
    extra = (["--quick"] if quick else []) + ["--dtype", args.dtype] + [a for s in args.suite for a in ("--suite", s)]
    results = []
    for w in map(int, args.world_sizes.split(",")):
        r = measure(w, extra, args.out)
        r["plan_s"], r["plan_cpu_s"] = plan_seconds(w, quick, args.dtype.split(","))
        results.append(r)
        print(json.dumps(r), flush=True)
    lines = [
        "| world size | items | checks (skipped) | errors | run wall s | planning s (CPU s) | launch s | wall s per "
        "item (median) | CPU s per item, all ranks | driver CPU ms per item | peak RSS per rank MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['world']} | {r['items']} | {r['checks']} ({r['skipped']}) | {r['errors']} | {r['wall_s']:.0f} "
            f"| {r['plan_s']:.1f} ({r['plan_cpu_s']:.2f}) | {r['launch_s']:.1f} | {r['item_wall_s']:.3f} "
            f"| {r['item_cpu_s']:.2f} | {r['driver_cpu_per_item_ms']:.1f} | {r['rank_rss_mb']:.0f} |"
        )
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ws = [r["world"] for r in results]
    ax.plot(ws, [r["item_wall_s"] for r in results], "o-", label="wall s per item (median)")
    ax.plot(ws, [r["item_cpu_s"] for r in results], "s-", label="CPU s per item, all ranks")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ws, [str(w) for w in ws])
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("seconds")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / "time_per_item.png", dpi=120)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
