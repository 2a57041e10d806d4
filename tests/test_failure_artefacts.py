"""Failure artefacts, error maps and rerun lines: what a failing item leaves for the engineer."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BROKEN, ROOT
from torch.distributed.tensor import Shard

from shardcheck.harness.core.layout import HeadTail, Layout
from shardcheck.harness.core.options import RunSettings
from shardcheck.harness.core.plan_data import Item, Plan
from shardcheck.harness.core.topology import Topology, named_coords
from shardcheck.harness.driver.collect import glob_escape, rerun_command
from shardcheck.harness.rank.artefacts import ArtefactBudget, reassemble
from shardcheck.reports.error_map import artefact_title, draw_artefact, draw_error_map, segments, shown_dims

WRONG_OFFSET = ("--impl", f"model_utils={BROKEN / 'model_utils' / 'wrong_vocab_offset.py'}")
TP2 = ("--topology", "dp=1,cp=1,tp=2", "--dtype", "float64", "--quick")


def _pieces(layout: Layout, shape, sizes: dict, wrong) -> dict[int, dict]:
    """Per-rank pieces of a random tensor laid out by `layout`; wrong(coords, got) perturbs a rank's piece."""
    expected = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pieces, rank = {}, 0
    for dp in range(sizes["dp"]):
        for cp in range(sizes["cp"]):
            for tp in range(sizes["tp"]):
                coords = {"dp": dp, "cp": cp, "tp": tp}
                ix = layout.indices(shape, coords, sizes)
                local = expected[torch.meshgrid(*ix, indexing="ij")] if shape else expected
                got = local.clone()
                wrong(coords, got)
                pieces[rank] = {
                    "got": got,
                    "expected": local,
                    "indices": ix,
                    "budget": 1e-10,
                    "full_shape": shape,
                    "failed": True,
                    "coords": coords,
                }
                rank += 1
    return pieces


def test_reassembly_puts_every_piece_back_and_keeps_the_wrong_replica():
    def wrong(coords, got):
        if coords["tp"] == 1:
            got[:, 0] += 1.0  # the first local position of each rank's head-tail piece

    layout = Layout(dp=Shard(0), cp=HeadTail(1))  # replicated over tp: two copies of every piece
    full = reassemble(_pieces(layout, (4, 8), {"dp": 2, "cp": 2, "tp": 2}, wrong))
    assert not torch.isnan(full["expected"]).any() and not torch.isnan(full["actual"]).any()
    # cp=2 head-tail of 8: rank cp0 holds 0,1,6,7 and cp1 holds 2..5; local position 0 is global 0 and 2
    bad = (full["actual"] - full["expected"]).abs() > 0.5
    assert bad.nonzero()[:, 1].unique().tolist() == [0, 2]
    assert bad.sum() == 8  # every batch row, at both chunk starts: the tp1 replica's error is kept
    assert full["abs_err"].max() == pytest.approx(1.0)


def test_shard_boundaries_are_labelled_by_rank_with_two_segments_per_head_tail_rank():
    layout = Layout(dp=Shard(0), cp=HeadTail(1), tp=Shard(2))
    full = reassemble(_pieces(layout, (4, 16, 37), {"dp": 2, "cp": 2, "tp": 2}, lambda c, g: None))
    shards = full["shards"]
    assert segments(1, shards) == [(0, 4, "cp0"), (4, 12, "cp1"), (12, 16, "cp0")]
    assert segments(2, shards) == [(0, 19, "tp0"), (19, 37, "tp1")]  # torch.chunk sizes: 19 + 18
    assert segments(0, shards) == [(0, 2, "dp0"), (2, 4, "dp1")]
    assert shown_dims(3, shards) == [1, 2]  # all sharded: the later dims (sequence x vocab)
    tp_only = reassemble(_pieces(Layout(tp=Shard(2)), (4, 6, 37), {"dp": 1, "cp": 1, "tp": 2}, lambda c, g: None))
    assert shown_dims(3, tp_only["shards"]) == [1, 2] and segments(0, tp_only["shards"]) == []
    # V below TP: torch.chunk leaves tp rank 3 no vocab at all; it marks no segment (and the map is still drawn)
    empty = reassemble(_pieces(Layout(tp=Shard(2)), (2, 3, 3), {"dp": 1, "cp": 1, "tp": 4}, lambda c, g: None))
    assert segments(2, empty["shards"]) == [(0, 1, "tp0"), (1, 2, "tp1"), (2, 3, "tp2")]


def test_error_map_is_drawn_for_odd_shapes(tmp_path):
    for shape, layout in (((37,), Layout(tp=Shard(0))), ((), Layout()), ((3, 1000, 5), Layout(cp=Shard(1)))):
        sizes = {"dp": 1, "cp": 2 if layout.placements[1] != Layout().placements[1] else 1, "tp": 2}
        full = reassemble(_pieces(layout, shape, sizes, lambda c, g: g.add_(1e-6 * c["tp"])))
        path = draw_error_map(full["abs_err"], full["budget"], full["shards"], f"shape {shape}", tmp_path / "m.png")
        assert path.stat().st_size > 5000


def test_artefact_budget_bounds_the_items_saved(tmp_path):
    layout = Layout(tp=Shard(1))
    pieces_dir = tmp_path / "pieces"
    pieces_dir.mkdir()
    for rank, piece in _pieces(layout, (3, 10), {"dp": 1, "cp": 1, "tp": 2}, lambda c, g: g.add_(c["tp"])).items():
        torch.save({"forward": piece}, pieces_dir / f"rank{rank}.pt")
    budget = ArtefactBudget(max_items=1)
    first = budget.save(_item(0), ["forward"], pieces_dir, tmp_path)
    item_dir = "00000-model_utils.DistributedLogprob-b2_x_-dp2-cp1-tp2-float32"
    assert first == {
        "forward": {
            "artefact": str(Path("failures", item_dir, "forward.pt")),
            "error_map": str(Path("failures", item_dir, "forward.png")),
        }
    }
    saved = torch.load(tmp_path / first["forward"]["artefact"], weights_only=False)
    assert saved["expected"].shape == (3, 10) and saved["check"] == "forward"
    diff = saved["actual"] - saved["expected"]
    assert (
        torch.allclose(diff[:, 5:], torch.ones(3, 5, dtype=torch.float64)) and (diff[:, :5] == 0).all()
    )  # tp1's half is off by 1
    drawn = draw_artefact(
        tmp_path / first["forward"]["artefact"], tmp_path / first["forward"]["error_map"], worst=[0, 7]
    )
    assert drawn.stat().st_size > 5000
    assert budget.save(_item(1), ["forward"], pieces_dir, tmp_path) == {}  # budget spent
    assert len(list((tmp_path / "failures").iterdir())) == 1


def _item(i: int, case_id: str = "b2[x]*?", impl: str = "") -> Item:
    return Item(
        id=i,
        suite="model_utils",
        op="model_utils.DistributedLogprob",
        case_id=case_id,
        dtype="float32",
        topology=(2, 1, 2),
        world_size=4,
        seed=123,
        checks=["forward"],
    )


def test_rerun_command_selects_exactly_its_item():
    plan = Plan(
        run_id="r",
        quick=True,
        settings=RunSettings(device="cpu", backend="gloo", timeout=5, seed=7),
        impl={
            "model_utils": "tests/broken/model_utils/one_rank_off.py",
            "kd_loss": "shardcheck.distributed_impl.kd_loss",
        },
    )
    args = shlex.split(rerun_command(plan, _item(0)))
    assert args[:2] == ["shardcheck", "run"]
    opts = {a: b for a, b in zip(args, args[1:]) if a.startswith("--") and not b.startswith("--")}
    assert opts["--op"] == "model_utils.DistributedLogprob" and opts["--topology"] == "dp=2,cp=1,tp=2"
    assert opts["--dtype"] == "float32" and opts["--seed"] == "7" and opts["--timeout"] == "5"
    assert opts["--impl"] == f"model_utils={ROOT / 'tests/broken/model_utils/one_rank_off.py'}"
    assert "--quick" in args and "kd_loss" not in " ".join(args)
    pattern = opts["--case"]
    assert fnmatch.fnmatchcase("b2[x]*?", pattern)
    assert not any(fnmatch.fnmatchcase(other, pattern) for other in ("b2x12", "b2[x]*?z", "b2[x]ab"))
    assert glob_escape("b4s6v37-masked0.3") == "b4s6v37-masked0.3"


def _rerun_lines(text: str) -> list[str]:
    return [line[len("rerun: ") :] for line in text.splitlines() if line.startswith("rerun: ")]


def test_failing_run_leaves_artefacts_error_maps_and_rerun_lines_that_reproduce(run_shardcheck):
    run = run_shardcheck(
        "run",
        *WRONG_OFFSET,
        "--op",
        "model_utils.DistributedLogprob",
        "--case",
        "b4s6v37-masked0.3",
        "--case",
        "b2s5*",
        *TP2,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    bad = rows[rows["status"] == "fail"]
    items = bad.groupby(["case_id"]).ngroups
    assert items == 2
    # one rerun line per failing item, on stdout and in both reports
    lines = _rerun_lines(run.stdout)
    assert len(lines) == 2 and all(
        line.startswith("shardcheck run --suite model_utils --op model_utils.DistributedLogprob") for line in lines
    )
    md = (run.out / "report.md").read_text()
    assert sorted(_rerun_lines(md)) == sorted(lines)
    page = (run.out / "report.html").read_text()
    items_section = page.split("<h2>Failing items")[1]
    assert items_section.count("<pre class='rerun'>rerun: shardcheck run") == 2
    assert items_section.count("<img class='errmap'") == len(bad)  # an error map beside every failing check

    # the gradient artefact: full [B, S, V] tensors, wrong only in TP rank 1's vocab shard (V = 37: 19 + 18)
    grad = bad[(bad["case_id"] == "b4s6v37-masked0.3") & (bad["check"] == "grad:logits")].iloc[0]
    saved = torch.load(run.out / grad["artefact"], weights_only=False)
    assert saved["expected"].shape == saved["actual"].shape == (4, 6, 37)
    wrong = (saved["actual"] - saved["expected"]).abs() > 1e-6
    assert wrong.any() and not wrong[..., :19].any()
    assert (run.out / grad["error_map"]).stat().st_size > 10_000
    assert saved["shards"][1]["indices"][2].tolist() == list(range(19, 37))

    # a rerun line runs that item alone and fails the same way
    line = next(lr for lr in lines if "b4s6v37" in lr)
    out = run.out.parent / "rerun"
    proc = subprocess.run(
        [sys.executable, "-m", "shardcheck.harness.cli", *shlex.split(line)[1:], "--out", str(out), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    again = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["op"], r["case_id"], r["dp"], r["cp"], r["tp"], r["dtype"]) for r in again} == {
        ("model_utils.DistributedLogprob", "b4s6v37-masked0.3", 1, 1, 2, "float64")
    }
    before = rows[rows["case_id"] == "b4s6v37-masked0.3"].set_index("check")
    for r in again:
        assert r["status"] == before.loc[r["check"], "status"]
        if r["status"] == "fail" and r["check"] != "property:comm":  # the same worst error, bit for bit
            assert r["max_abs_err"] == before.loc[r["check"], "max_abs_err"]
            assert r["mismatch"]["global_index"] == before.loc[r["check"], "mismatch"]["global_index"]
    assert _rerun_lines(proc.stdout) == [line]


def test_artefacts_of_topologies_differing_only_in_ep_or_dp_replicate_never_merge(tmp_path):
    pieces_dir = tmp_path / "pieces"
    pieces_dir.mkdir()
    sizes = {"dp": 4, "cp": 1, "tp": 1}
    for rank, piece in _pieces(Layout(dp=Shard(0)), (4, 3), sizes, lambda c, g: g.add_(c["dp"] == 1)).items():
        torch.save({"forward": piece}, pieces_dir / f"rank{rank}.pt")
    budget = ArtefactBudget(max_items=3)
    plain, expert, hsdp = (
        dataclasses.replace(_item(0), topology=(4, 1, 1), **split) for split in ({}, {"ep": 2}, {"dp_replicate": 2})
    )
    saved = [
        budget.save(item, ["forward"], pieces_dir, tmp_path)["forward"]["artefact"] for item in (plain, expert, hsdp)
    ]
    assert [Path(p).parent.name for p in saved] == [
        "00000-model_utils.DistributedLogprob-b2_x_-dp4-cp1-tp1-float32",
        "00000-model_utils.DistributedLogprob-b2_x_-dp4-ep2-cp1-tp1-float32",
        "00000-model_utils.DistributedLogprob-b2_x_-dp4r2-cp1-tp1-float32",
    ]
    fulls = [torch.load(tmp_path / p, weights_only=False) for p in saved]
    assert fulls[1]["topology"] == {"dp": 4, "cp": 1, "tp": 1, "ep": 2, "dp_replicate": 1}
    assert [artefact_title(f) for f in fulls] == [
        f"model_utils.DistributedLogprob [b2[x]*?] {name} float32 forward"
        for name in ("dp4-cp1-tp1", "dp4-ep2-cp1-tp1", "dp4r2-cp1-tp1")
    ]
    old = {**fulls[0], "topology": {"dp": 2, "cp": 1, "tp": 2}}  # an artefact saved before ep and dp_replicate
    assert "dp2-cp1-tp2 float32" in artefact_title(old)


def test_expert_shards_are_labelled_by_their_ep_coordinate():
    topology = Topology(4, ep=2)
    sizes = {"dp": 4, "cp": 1, "tp": 1, "ep": 2}
    shards = {}
    for rank in range(4):
        coords = named_coords({"dp": rank, "cp": 0, "tp": 0}, topology)
        shards[rank] = {"coords": coords, "indices": Layout(ep=Shard(0)).indices((4, 3), coords, sizes)}
    # experts over ep: dp ranks 0 and 2 hold experts 0-1, ranks 1 and 3 experts 2-3
    assert segments(0, shards) == [(0, 2, "ep0"), (2, 4, "ep1")]
    # tokens over the whole dp group: dp tells the pieces apart (ep alone does not)
    tokens = {r: {**s, "indices": Layout(dp=Shard(0)).indices((8, 3), s["coords"], sizes)} for r, s in shards.items()}
    assert [label for _, _, label in segments(0, tokens)] == ["dp0", "dp1", "dp2", "dp3"]
