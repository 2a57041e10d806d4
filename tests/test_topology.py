from __future__ import annotations

import pytest

from shardcheck.harness.core.options import UsageError
from shardcheck.harness.core.topology import Topology, default_topologies


def test_parse_and_defaults():
    assert Topology.parse("dp=2,cp=1,tp=2") == Topology(2, 1, 2)
    assert Topology.parse("tp=8") == Topology(1, 1, 8) and Topology(1, 1, 8).size == 8
    assert str(Topology(2, 1, 4)) == "dp2-cp1-tp4"
    assert default_topologies([1, 2, 4]) == [
        Topology(1, 1, 1),
        Topology(2, 1, 1),
        Topology(1, 2, 1),
        Topology(1, 1, 2),
        Topology(4, 1, 1),
        Topology(2, 2, 1),
        Topology(1, 4, 1),
        Topology(2, 1, 2),
        Topology(1, 2, 2),
        Topology(1, 1, 4),
    ]


@pytest.mark.parametrize("text", ["tp=0", "dp=-1", "xp=2", "tp", "tp=1.5"])
def test_bad_topologies(text):
    with pytest.raises(UsageError):
        Topology.parse(text)
