"""Peak memory of one rank running and judging a model case's step: the built-in decoder at `--layers`, batch 4, seq
64, hidden 64, float64, one rank (dp = cp = tp = 1), measured with shardcheck's storage-based tracker (LiveBytes,
harness/core/measure.py) around the worker's item (inputs sliced, model built and parallelized, the hooked step,
every check judged), the golden computed before (it is the same either way: one float64 copy of every tensor, kept
per case and dtype).  Three ways, on the same code:

    step alone       the hooks hand each tensor on and nothing keeps or judges it: the floor
    after the run    the hooks keep a copy of every tensor, judged after the step (how model cases were judged)
    as they arrive   each tensor judged as its hook fires (RankContext.judge_output): what the worker does

    python tests/model_case_memory.py --layers 2,8          # prints one JSON line per layer count (bytes)

tests/test_model_case_cost.py runs it (small) and asserts the kept tensors do not grow with the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import shardcheck.suites.decoder as suite
from shardcheck.harness.core.measure import LiveBytes
from shardcheck.harness.core.options import RunSettings
from shardcheck.harness.core.topology import Topology
from shardcheck.harness.driver.planner import Selection, build_plan
from shardcheck.harness.rank.item_run import ItemRun
from shardcheck.harness.rank.worker import Worker
from shardcheck.reference import decoder as ref

WAYS = ("step alone", "after the run", "as they arrive")
JUDGE_ARRIVING = ItemRun.judge_arriving  # the rank's own; the first two ways replace it


def measure(worker: Worker, layers: int, seq: int, dim: int, scale: float = 1.0) -> tuple[dict[str, int], dict]:
    """({way: peak bytes}, {way: the check events the rank wrote, times left out}) of one item of the decoder at
    `layers`.  `scale` != 1: the golden's outputs are multiplied by it, so every check fails (1.5: the tensors a
    finding keeps are then in the figure too) or, within the float32 budget, warns (1 + 1e-9: the precision step)."""
    suite.CONFIG = ref.Config(vocab=64, dim=dim, layers=layers, heads=4, kv_heads=4, hidden=2 * dim)
    suite.SEQ = seq
    plan = build_plan(
        Selection(
            run_id="memory",
            settings=RunSettings(device="cpu", backend="gloo", timeout=60.0, seed=0),
            suites_wanted=["decoder"],
            world_sizes=[1],
            topologies=[Topology(1, 1, 1)],
            dtypes=["float64"],
        )
    )
    plan.failure_artefacts = 8  # as the driver sends it while the run's artefact budget lasts
    (item,) = plan.items
    out, events = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in WAYS:
            worker.load(plan, Path(tmp) / way.replace(" ", "-"))
            loaded = worker.loaded
            case = loaded.cases[(item.op, item.case_id)]
            golden = loaded.goldens.get(case, item, 1)  # computed once, outside the measurement
            if scale != 1.0 and not hasattr(golden, "scaled"):  # (the golden is kept per case: scaled once)
                golden.outputs = golden.naive_outputs = tuple(o * scale for o in golden.outputs)
                precision = golden._precision  # the precision step's reference runs scaled alike
                golden._precision = lambda kind, precision=precision: (tuple(o * scale for o in precision(kind)[0]), {})
                golden.scaled = True
            if way == "step alone":
                ItemRun.judge_arriving = lambda run, call, index, got, lay: True  # dropped unjudged
            elif way == "after the run":
                ItemRun.judge_arriving = lambda run, call, index, got, lay: False  # the run returns a copy of each
            else:
                ItemRun.judge_arriving = JUDGE_ARRIVING
            topo = Topology(*item.topology)
            mesh = worker.mesh(topo)
            with LiveBytes() as tracker:
                ItemRun(loaded, item, topo, mesh).run()
            out[way] = tracker.peak
            loaded.events.file.flush()
            lines = [json.loads(line) for line in Path(loaded.events.file.name).read_text().splitlines()]
            events[way] = [
                {k: v for k, v in e.items() if k not in ("time", "item")} for e in lines if e["t"] == "check"
            ]
    return out, events


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/model_case_memory.py")
    p.add_argument("--layers", default="2,8")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--scale", type=float, default=1.0, help="the golden's outputs times this (1.5: every check fails)")
    p.add_argument("--events", action="store_true", help="print each way's check events too")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    worker = Worker("cpu", "gloo", False, store=dist.HashStore(), rank=0, world=1)  # a world of one rank
    for layers in [int(n) for n in args.layers.split(",")]:
        peaks, events = measure(worker, layers, args.seq, args.dim, args.scale)
        print(
            json.dumps({"layers": layers, "scale": args.scale, **peaks, **({"events": events} if args.events else {})}),
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
