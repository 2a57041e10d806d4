"""The collective flight recorder's cost per record (docs/performance.md): a recorded collective against the same
collective unwrapped, on a 1-rank gloo group, in a process of its own per recorder file, alternating.

    python tests/bench_flight_recorder.py OLD.py NEW.py [--rounds 3] [--calls 5000]

Each process loads one recorder file as a module (flight_recorder.py imports nothing of shardcheck), installs it,
and times blocks of `calls` c10d all_reduce and functional all_reduce (DTensor's path) calls, recorded and bare,
interleaved; it prints the median of (recorded - bare) per call in µs.  Not a test (no `test_` prefix)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(recorder_file: str, calls: int, blocks: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("flight_recorder_under_test", recorder_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        import torch.distributed._functional_collectives as funcol

        rec = module.install(Path(tmp), 0)
        world = dist.group.WORLD
        rec.begin_item(0, 0, {world.group_name: "tp"})
        t = torch.randn(16)
        recorded_c10d, bare_c10d = dist.all_reduce, dist.all_reduce.__shardcheck_recorded__
        recorded_funcol, bare_funcol = funcol.all_reduce, funcol.all_reduce.__shardcheck_recorded__

        def block(fn, *args) -> float:
            start = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            return (time.perf_counter() - start) / calls * 1e6

        def noop(tensor, op=None, group=None, async_op=False):  # the recorder's own cost, without gloo's spread
            return None

        recorded_noop = module._recorded(noop, "all_reduce", "tensor", False)
        out = {}
        for name, recorded, bare, args in (
            ("no-op collective", recorded_noop, noop, (t,)),
            ("no-op collective, group given", recorded_noop, noop, (t, None, world)),
            ("c10d all_reduce", recorded_c10d, bare_c10d, (t,)),
            ("funcol all_reduce", recorded_funcol, bare_funcol, (t, "sum", world)),
        ):
            block(recorded, *args), block(bare, *args)  # warm
            diffs = [block(recorded, *args) - block(bare, *args) for _ in range(blocks)]
            out[name] = statistics.median(diffs)
        dist.destroy_process_group()
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("recorders", nargs="+")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure one file
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.recorders[0], args.calls, args.blocks)))
        return
    results: dict[str, list[dict]] = {r: [] for r in args.recorders}
    for _ in range(args.rounds):
        for r in args.recorders:
            child = subprocess.run(
                [sys.executable, __file__, r, "--one", "--calls", str(args.calls), "--blocks", str(args.blocks)],
                capture_output=True,
                text=True,
                check=True,
                env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
            )
            results[r].append(json.loads(child.stdout.strip().splitlines()[-1]))
    for r, runs in results.items():
        for name in runs[0]:
            values = [run[name] for run in runs]
            print(
                f"{r}: {name}: " + " / ".join(f"{v:.1f}" for v in values) + f" µs per record (median "
                f"{statistics.median(values):.1f})"
            )


if __name__ == "__main__":
    main()
