"""`FuzzSpace`: where `shardcheck fuzz` draws one op's cases from (a suite's `fuzz_spaces()`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardcheck.harness.core.case import Case
from shardcheck.harness.core.topology import Topology


@dataclass(frozen=True)
class FuzzSpace:
    """The space `shardcheck fuzz` draws one op's cases from (a suite's `fuzz_spaces()` lists them).

    `params(topologies)` is a hypothesis strategy of JSON-able dicts; `topologies` are those the run allows
    (`--topology`, the launched world sizes), and the strategy draws the case's own from the legal ones.  Each dict
    holds "topology": [dp, cp, tp] (or [dp, cp, tp, ep, dp_replicate] where either is > 1: `topology_params`; a
    space whose cases run expert parallelism or HSDP draws those) and "dtype": a dtype name, beside the case's own
    parameters (sizes, chunking, masking ratios, which special values, ...).  `case(params)` builds the ordinary
    Case those parameters describe; every rank rebuilds it from the same dict, so it must be a pure function of it.
    The harness gives the case its id, its one dtype and its one topology (harness/rank/fuzz_cases.py)."""

    op: str
    params: Callable[[list[Topology]], Any]  # -> hypothesis SearchStrategy[dict]
    case: Callable[[dict], Case]


def topology_params(topology: Topology) -> list[int]:
    """A topology as a fuzz case's params hold it (JSON, `Topology(*params["topology"])` reads it back): [dp, cp, tp],
    or [dp, cp, tp, ep, dp_replicate] where ep or dp_replicate is > 1 (so that older corpus entries keep their ids)."""
    t = topology
    return [t.dp, t.cp, t.tp] + ([t.ep, t.dp_replicate] if (t.ep, t.dp_replicate) != (1, 1) else [])
