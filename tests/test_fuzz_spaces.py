"""Fuzz spaces of cp_utils, inbatch_neg_utils, distributed_utils, model_utils_cp and model_utils_megatron.

Each space draws only legal, valid, cheap cases (a Case builds, runs on its own topology, its inputs are small), and
the broken implementations in tests/broken/ whose bug the fixed matrix misses pass `shardcheck run` but fail on the
smallest drawn example that exposes them, run on the ranks through an external suite made of drawn examples
(`example_suite`: the route `shardcheck fuzz` takes, without the search).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings

from harness.topology import Topology, default_topologies
from helpers import BROKEN, ROOT, assert_one_cause, shardcheck

SUITES = ("cp_utils", "inbatch_neg_utils", "distributed_utils", "model_utils_cp", "model_utils_megatron")
TOPOLOGIES = default_topologies([1, 2, 4])


def spaces(suite: str) -> dict:
    return {s.op: s for s in importlib.import_module(f"suites.{suite}").fuzz_spaces()}


def draw_examples(strategy, n: int, at: int = 0) -> list[dict]:
    """n params drawn by hypothesis (reproducibly: seed `at`), as `shardcheck fuzz` draws them."""
    drawn = []

    @seed(at)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(params):
        drawn.append(params)

    collect()
    return drawn


# An external suite whose cases are the drawn examples of one suite's spaces, each at its one dtype and topology.
EXAMPLE_SUITE = '''\
import dataclasses
import importlib
import json

from shardcheck import Topology

_suite = importlib.import_module("suites.{suite}")
FAMILY = _suite.FAMILY
IMPLEMENTATION = {impl!r}
EXAMPLES = json.loads({examples!r})


def cases(quick=False):
    spaces = {{s.op: s for s in _suite.fuzz_spaces()}}
    out = []
    for i, (op, p) in enumerate(EXAMPLES):
        case = spaces[op].case(p)
        out.append(dataclasses.replace(case, case_id=f"ex{{i}}", dtypes=(p["dtype"],), params={{**case.params, **p}},
                                       supports=lambda t, p=p: t == Topology(*p["topology"])))
    return out
'''


def example_suite(folder: Path, suite: str, examples: list[tuple[str, dict]], impl: str | None = None) -> Path:
    """A suite file `fuzz_<suite>.py` in `folder` running `examples` ((op, params) pairs) on `impl` (default: ours)."""
    family = importlib.import_module(f"suites.{suite}").FAMILY
    path = folder / f"fuzz_{suite}.py"
    path.write_text(EXAMPLE_SUITE.format(suite=suite, impl=impl or f"distributed_impl.{family}",
                                         examples=json.dumps(examples)))
    return path


def world_sizes(examples: list[tuple[str, dict]]) -> str:
    return ",".join(str(s) for s in sorted({Topology(*p["topology"]).size for _, p in examples}))


# ---- every space draws only legal, valid, cheap cases -----------------------------------------------

ALL_SPACES = [(suite, op) for suite in SUITES if hasattr(importlib.import_module(f"suites.{suite}"), "fuzz_spaces") for op in spaces(suite)]


@pytest.mark.parametrize("suite, op", ALL_SPACES, ids=[op for _, op in ALL_SPACES])
def test_space_draws_legal_valid_cases(suite, op):
    space = spaces(suite)[op]
    examples = draw_examples(space.params(TOPOLOGIES), 60, at=1)
    assert examples, f"{op}: nothing drawn"
    for p in examples:
        assert json.loads(json.dumps(p)) == p, f"{op}: params are not JSON-able: {p}"
        topology = Topology(*p["topology"])
        assert topology in TOPOLOGIES and p["dtype"] in ("float64", "float32", "bfloat16"), p
        case = space.case(p)
        assert case.op == op and p["dtype"] in case.dtypes, (p, case.dtypes)
        assert case.runs_on(topology), f"{op}: drawn topology {topology} is one the case does not run on: {p}"
        if case.skip_reason is None:
            inputs = case.make_inputs(torch.Generator().manual_seed(0))
            elements = sum(t.numel() for t in inputs.values() if isinstance(t, torch.Tensor))
            assert elements <= 200_000, f"{op}: {elements} input elements is not cheap: {p}"
    # A run that allows only one rank draws only one-rank topologies.
    one = draw_examples(space.params([Topology()]), 10, at=2)
    assert all(p["topology"] == [1, 1, 1] for p in one)
