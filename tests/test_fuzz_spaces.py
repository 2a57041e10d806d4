"""Fuzz spaces of every suite (model_utils, kd_loss, cp_utils, inbatch_neg_utils, distributed_utils, model_utils_cp,
model_utils_megatron).

Each space draws only legal, valid, cheap cases (a Case builds, runs on its own topology, its inputs are small), and
the broken implementations in tests/broken/ whose bug the fixed matrix misses fail on the smallest drawn example that
exposes them but not on the examples one step smaller or simpler, run on the ranks through an external suite made of
drawn examples (`example_suite`: the route `shardcheck fuzz` takes, without the search).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from helpers import BROKEN, assert_one_cause, shardcheck
from hypothesis import HealthCheck, Phase, given, seed, settings

from shardcheck.harness.core.topology import Topology, default_topologies

SUITES = (
    "model_utils",
    "kd_loss",
    "cp_utils",
    "inbatch_neg_utils",
    "distributed_utils",
    "model_utils_cp",
    "model_utils_megatron",
)
TOPOLOGIES = default_topologies([1, 2, 4])


def spaces(suite: str) -> dict:
    return {s.op: s for s in importlib.import_module(f"shardcheck.suites.{suite}").fuzz_spaces()}


def draw_examples(strategy, n: int, at: int = 0) -> list[dict]:
    """n params drawn by hypothesis (reproducibly: seed `at`), as `shardcheck fuzz` draws them."""
    drawn = []

    @seed(at)
    @settings(
        max_examples=n, database=None, phases=[Phase.generate], deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(strategy)
    def collect(params):
        drawn.append(params)

    collect()
    return drawn


# An external suite whose cases are the drawn examples of one suite's spaces, each at its one dtype and topology.
EXAMPLE_SUITE = """\
import dataclasses
import importlib
import json

from shardcheck import Topology

_suite = importlib.import_module("shardcheck.suites.{suite}")
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
"""


def example_suite(folder: Path, suite: str, examples: list[tuple[str, dict]]) -> Path:
    """A suite file `fuzz_<suite>.py` in `folder` running `examples` ((op, params) pairs); its default module under
    test is the suite's own (ours), another one comes with `--impl`."""
    family = importlib.import_module(f"shardcheck.suites.{suite}").FAMILY
    path = folder / f"fuzz_{suite}.py"
    path.write_text(
        EXAMPLE_SUITE.format(suite=suite, impl=f"shardcheck.distributed_impl.{family}", examples=json.dumps(examples))
    )
    return path


def world_sizes(examples: list[tuple[str, dict]]) -> str:
    return ",".join(str(s) for s in sorted({Topology(*p["topology"]).size for _, p in examples}))


# ---- every space draws only legal, valid, cheap cases -----------------------------------------------

ALL_SPACES = [
    (suite, op)
    for suite in SUITES
    if hasattr(importlib.import_module(f"shardcheck.suites.{suite}"), "fuzz_spaces")
    for op in spaces(suite)
]


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


# ---- broken implementations the fixed matrix misses, each failing on its smallest drawn example -------------
#
# The minimal failing params were found by shrinking by hand along the space's own order (smallest topology, first
# choices, smallest integers): each one is the example `shardcheck fuzz` must shrink to.

MISSED = {
    "reduce_loss_equal_counts": dict(
        suite="distributed_utils",
        broken="distributed_utils/loss_count_assumes_equal_ranks.py",
        op="distributed_utils.reduce_loss",
        check="forward:denominator",
        minimal={
            "topology": [2, 1, 1],
            "dtype": "float64",
            "per_token_loss": False,
            "dp_group": True,
            "n_losses": 3,
            "n_token_slices": 1,
            "tokens_over_int32": False,
        },
        # one loss fewer is even over 2 ranks: right there
        passing=[{"n_losses": 2}, {"per_token_loss": True}, {"dp_group": False}],
    ),
    "thd_max_seqlen_first_chunk": dict(
        suite="cp_utils",
        broken="cp_utils/max_seqlen_of_first_chunk.py",
        op="cp_utils.make_cp_batch_for_te",
        check="property:max_seqlen",
        minimal={
            "topology": [1, 1, 1],
            "dtype": "float64",
            "lens": [[[1, 2]], [[1, 4]]],
            "S": 4,
            "padding_token_id": 0,
            "num_chunks": 2,
            "position_ids": False,
            "embeds": 0,
        },
        # the longest sequence in the first chunk, or one chunk: right there
        passing=[{"lens": [[[1, 4]], [[1, 2]]]}, {"num_chunks": 1}],
    ),
}


@pytest.fixture(scope="module")
def missed_runs(tmp_path_factory):
    """Per broken implementation: the run of its minimal failing example beside the variants one step smaller or
    simpler, which it gets right (that the fixed matrix passes it, and that `shardcheck fuzz` shrinks to exactly this
    example: tests/test_fuzz.py)."""
    runs = {}
    for name, m in MISSED.items():
        folder = tmp_path_factory.mktemp(name)
        impl = str(BROKEN / m["broken"])
        family = importlib.import_module(f"shardcheck.suites.{m['suite']}").FAMILY
        examples = [(m["op"], m["minimal"])] + [(m["op"], {**m["minimal"], **change}) for change in m["passing"]]
        suite = example_suite(folder, m["suite"], examples)
        drawn = shardcheck(
            "run",
            "--suite-path",
            str(suite),
            "--suite",
            suite.stem,
            "--impl",
            f"{family}={impl}",
            "--world-sizes",
            world_sizes(examples),
            out=folder / "drawn",
        )
        runs[name] = drawn
    return runs


@pytest.mark.parametrize("name", list(MISSED))
def test_minimal_drawn_example_fails_on_the_right_check(missed_runs, name):
    m = MISSED[name]
    drawn = missed_runs[name]
    assert drawn.returncode == 1, drawn.stdout[-3000:] + drawn.stderr[-2000:]
    failed = drawn.failed()
    assert set(failed["case_id"]) == {"ex0"}, failed[["case_id", "check", "message"]].to_string()
    assert set(failed["check"]) == {m["check"]} and set(failed["status"]) == {"fail"}
    assert failed.iloc[0]["params"]["topology"] == m["minimal"]["topology"]
    assert_one_cause(drawn)
