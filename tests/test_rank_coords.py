"""How failure messages name a rank: (dp, cp, tp), with dp's parts where the topology splits dp (ep and edp where
ep > 1, HSDP's dp_replicate and dp_shard where dp_replicate > 1), alike from the rank's own rows and from the driver
(a rank that reported nothing)."""

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
