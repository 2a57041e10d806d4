"""Where the data-parallel splits (ep, dp_replicate) must show: how failure messages name a rank ((dp, cp, tp) with
dp's parts where the topology splits dp, alike from the rank's rows and the driver), the common factor's items and
names, and the hang budget's topology."""

from __future__ import annotations

from shardcheck.harness.core.compare import describe
from shardcheck.harness.core.topology import Topology, named_coords
from shardcheck.harness.driver.collect import _coords_of


def test_a_rank_is_named_with_dps_parts_only_where_the_topology_splits_dp():
    # dp 4, tp 2: rank 7 is dp 3, tp 1
    assert _coords_of(7, Topology(4, 1, 2)) == {"dp": 3, "cp": 0, "tp": 1}
    # ep 2 (ep innermost): dp 3 is ep 1, edp 1
    assert list(_coords_of(7, Topology(4, 1, 2, ep=2)).items()) == [
        ("dp", 3),
        ("ep", 1),
        ("edp", 1),
        ("cp", 0),
        ("tp", 1),
    ]
    # HSDP 2 x 2 (shard innermost): dp 1 is replicate 0, shard 1
    assert named_coords({"dp": 1, "cp": 0, "tp": 0}, Topology(4, dp_replicate=2)) == {
        "dp": 1,
        "dp_replicate": 0,
        "dp_shard": 1,
        "cp": 0,
        "tp": 0,
    }
    row = {"rank": 2, "coords": _coords_of(2, Topology(4, dp_replicate=2)), "status": "error", "message": "boom"}
    assert describe(row) == "rank 2 (dp=2, dp_replicate=1, dp_shard=0, cp=0, tp=0): boom"


def _wrong(check: str, factor: float, **split) -> dict:
    """A model step's row whose tensor is `factor` times its golden, at dp 8 (and `split`)."""
    mismatch = {"expected": 1.5, "got": 1.5 * factor}
    common = dict(symptom="values", case_id="c", dp=8, cp=1, tp=1, dtype="float64")
    return dict(check=check, mismatch=mismatch, max_rel_err=factor - 1, **common, **split)


def test_the_common_factor_keeps_items_differing_only_in_ep_apart_and_names_ep():
    from shardcheck.harness.findings.common_factor import factor_text

    expert = [_wrong("forward:dparam:w1", 2.0, ep=2), _wrong("forward:dparam:w2", 2.0, ep=2)]
    assert factor_text(expert) == "every wrong tensor ×2 = ep"  # edp is 4 here, dp 8
    plain = [_wrong("forward:dparam:w1", 4.0, ep=1), _wrong("forward:dparam:w2", 4.0, ep=1)]
    assert factor_text(plain + expert) == (
        "every wrong tensor of a step off by one factor: ×4 at dp8-cp1-tp1, ×2 at dp8-ep2-cp1-tp1"
    )


def test_a_hang_budget_skips_its_ops_items_at_its_whole_topology_only():
    from types import SimpleNamespace

    from shardcheck.harness.core.plan_data import Item
    from shardcheck.harness.driver.launch import _skip_after

    def item(i: int, **split) -> Item:
        return Item(i, "moe", "moe.dispatch", "c", "float64", (4, 1, 1), 4, 0, ["forward"], **split)

    skipped = {}
    collector = SimpleNamespace(finished=set())

    def skip(it, reason):
        skipped[it.id] = reason
        collector.finished.add(it.id)

    collector.skip = skip
    world = SimpleNamespace(progress=SimpleNamespace(done=lambda items: None))
    hung, same, plain, hsdp = item(0, ep=2), item(1, ep=2), item(2), item(3, dp_replicate=2)
    left = _skip_after(world, collector, hung, "hung", [same, plain, hsdp], mesh_failed=False)
    assert left == [plain, hsdp] and list(skipped) == [1]
    assert "at dp4-ep2-cp1-tp1;" in skipped[1]


def test_the_reports_topology_of_each_row_names_ep_and_dp_replicate_only_where_set():
    import pandas as pd

    from shardcheck.reports.report import _topology

    rows = pd.DataFrame(
        {
            "dp": [4, 4, 4, 1, 4],
            "cp": [1, 1, 1, 2, 1],
            "tp": [2, 2, 1, 1, 2],
            "ep": [2, float("nan"), 1, 1, 2],
            "dp_replicate": [1, 1, 2, 1, 1],
        },
        index=[10, 11, 12, 13, 14],
    )
    assert _topology(rows).to_dict() == {
        10: "dp4-ep2-cp1-tp2",
        11: "dp4-cp1-tp2",  # NaN: a row made before expert parallelism
        12: "dp4r2-cp1-tp1",
        13: "dp1-cp2-tp1",
        14: "dp4-ep2-cp1-tp2",
    }
    assert _topology(rows[["dp", "cp", "tp"]]).tolist() == [
        "dp4-cp1-tp2",
        "dp4-cp1-tp2",
        "dp4-cp1-tp1",
        "dp1-cp2-tp1",
        "dp4-cp1-tp2",
    ]
