"""A fuzz case: the ordinary Case a suite's FuzzSpace builds from one drawn parameter dict, with the id, dtype and
topology of that dict.  The driver (harness/driver/fuzz.py, harness/driver/planner.py) and every rank
(harness/rank/loaded_plan.py) build it the same way from the same dict, so an item needs to carry only the dict
(Item.fuzz)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from shardcheck.harness.core.case import Case
from shardcheck.harness.core.fuzz_space import FuzzSpace
from shardcheck.harness.core.topology import Topology

FUZZ_PREFIX = "fuzz-"


def canonical(params: dict) -> str:
    """The one JSON text of a parameter dict (keys sorted): what its id hashes and the corpus stores."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"), allow_nan=False)


def fuzz_case_id(params: dict) -> str:
    """'fuzz-dp1-cp1-tp2-float64-<hash>': where and how it runs, readable, and a different id for every dict (the
    ranks cache a golden per case id)."""
    digest = hashlib.sha256(canonical(params).encode()).hexdigest()[:10]
    return f"{FUZZ_PREFIX}{Topology(*params['topology'])}-{params['dtype']}-{digest}"


def fuzz_case(space: FuzzSpace, params: dict) -> Case:
    """The case `params` describes, run at exactly its topology and dtype, its parameters recorded in its rows."""
    case = space.case(params)
    if case.op != space.op:
        raise ValueError(f"FuzzSpace of {space.op}: case(params) built a case of {case.op}")
    topology = Topology(*params["topology"])
    return replace(
        case,
        case_id=fuzz_case_id(params),
        dtypes=(params["dtype"],),
        supports=lambda t: t == topology,
        params={**case.params, **params},
    )
