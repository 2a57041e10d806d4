"""`shardcheck fuzz` and the data-parallel splits: a space whose cases run expert parallelism (or HSDP) draws ep (or
dp_replicate) topologies, the others never do, and the drawn case runs and is named at its whole topology."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies

from shardcheck.harness.core.fuzz_space import FuzzSpace, topology_params
from shardcheck.harness.core.options import RunSettings
from shardcheck.harness.core.plan_data import Plan
from shardcheck.harness.core.topology import Topology, default_topologies, expert_topologies
from shardcheck.harness.driver.fuzz import params_text
from shardcheck.harness.driver.planner import plan_fuzz_example
from shardcheck.harness.rank.fuzz_cases import fuzz_case
from shardcheck.suites import _fuzz_draws, moe

TOPOLOGIES = [*default_topologies([1, 2, 4]), *expert_topologies([1, 2, 4]), Topology(4, dp_replicate=2)]


def _choices(strategy) -> list[list[int]]:
    """Every value a `sampled_from` strategy draws, in its order."""
    return list(strategy.wrapped_strategy.elements if hasattr(strategy, "wrapped_strategy") else strategy.elements)


def test_only_spaces_that_opt_in_draw_ep_or_dp_replicate():
    plain = _choices(_fuzz_draws.topology(TOPOLOGIES))
    assert plain == [[1, 1, 1], [2, 1, 1], [1, 1, 2], [4, 1, 1], [2, 1, 2], [1, 1, 4]]
    experts = _choices(_fuzz_draws.topology(TOPOLOGIES, expert_parallel=True))
    assert [4, 1, 1, 2, 1] in experts and [4, 1, 1, 4, 1] in experts and [2, 1, 2, 2, 1] in experts
    assert all(t[4:] in ([], [1]) for t in experts)  # no HSDP without hsdp=True
    hsdp = _choices(_fuzz_draws.topology(TOPOLOGIES, hsdp=True))
    assert [4, 1, 1, 1, 2] in hsdp and all(len(t) == 3 or t[3] == 1 for t in hsdp)
    assert [Topology(*topology_params(t)) for t in TOPOLOGIES] == TOPOLOGIES  # read back whole


def test_a_drawn_expert_parallel_case_runs_and_is_named_at_its_whole_topology():
    dispatch = next(c for c in moe.op_cases() if c.op == "moe.dispatch")
    space = FuzzSpace(
        op="moe.dispatch",
        params=lambda topologies: strategies.fixed_dictionaries(
            {"topology": _fuzz_draws.topology(topologies, expert_parallel=True), "dtype": strategies.just("float64")}
        ),
        case=lambda params: dataclasses.replace(dispatch),
    )
    params = {"topology": [4, 1, 1, 2, 1], "dtype": "float64"}
    case = fuzz_case(space, params)
    assert case.case_id.startswith("fuzz-dp4-ep2-cp1-tp1-float64-")
    assert case.runs_on(Topology(4, ep=2)) and not case.runs_on(Topology(4))
    assert params_text(params) == "dp4-ep2-cp1-tp1 float64: "
    base = Plan(run_id="r", quick=False, settings=RunSettings(device="cpu", backend="gloo"), impl={})
    (item,) = plan_fuzz_example(base, "moe", space, params).items
    assert item.full_topology == Topology(4, ep=2) and item.skip == ""
