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
    holds "topology": [dp, cp, tp] and "dtype": a dtype name, beside the case's own parameters (sizes, chunking,
    masking ratios, which special values, ...).  `case(params)` builds the ordinary Case those parameters
    describe; every rank rebuilds it from the same dict, so it must be a pure function of it.  The harness gives
    the case its id, its one dtype and its one topology (harness/rank/fuzz_cases.py)."""

    op: str
    params: Callable[[list[Topology]], Any]  # -> hypothesis SearchStrategy[dict]
    case: Callable[[dict], Case]
