"""External suites (`--suite-path`, `[tool.shardcheck] suite-paths`): a team's own op checked from a folder
outside the repository, with the reference, the sharded implementation and the cases in one file that imports
only the case-writing API.  It runs, shows in `list`, passes; a broken variant fails on the right check with a
rerun line that reproduces it; the config, --bench, JUnit, compare and a hand-written torchrun work on it; bad
suites are one line and exit 2.

The CLI runs share a few small launches (world sizes 1 and 2, two or three cases each).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from helpers import ROOT, Run, assert_one_cause, shardcheck

from shardcheck.harness.cli import main
from shardcheck.harness.core.options import RunSettings
from shardcheck.harness.core.records import load
from shardcheck.harness.driver.planner import Selection, build_plan
from shardcheck.harness.rank.signatures import signature_rows, under_test

# What a suite imports of shardcheck: the case-writing API, nothing else.
API_IMPORT = "from shardcheck import Case, GradSum, Layout"

# A vocab-parallel log-softmax (two collectives, one of them differentiable) and a row-parallel linear (an
# all-reduce whose backward is the identity), as a team would write them: plain torch.distributed.
SUITE = '''\
"""My team's TP ops: reference, sharded implementation and shardcheck cases in one file."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

@API_IMPORT@

FAMILY = "my_tp"
IMPLEMENTATION = __file__  # the implementation below is the family's default module under test


# ---- sharded implementation ----------------------------------------------------------------------

class _SumOverRanks(torch.autograd.Function):
    """Every rank gets the sum of the ranks' x; each x feeds every rank's result, so its gradient is the sum."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceOutput(torch.autograd.Function):
    """All-reduce of partial products into a replicated output: every rank's gradient is already whole."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_log_softmax(logits, group):
    """log_softmax over the last dim, each rank holding a slice of it."""
    shift = logits.detach().amax(-1, keepdim=True)
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)  # for stability only: no gradient
    shifted = logits - shift
    return shifted - _SumOverRanks.apply(shifted.exp().sum(-1, keepdim=True), group).log()


def row_parallel_linear(x, weight, group):
    """x [B, K] @ weight [N, K].T with K split over the ranks (x's last dim, weight's dim 1)."""
    return _ReduceOutput.apply(x @ weight.T, group)


# ---- reference and cases -------------------------------------------------------------------------

def reference_log_softmax(logits):
    return torch.log_softmax(logits, dim=-1)


def reference_linear(x, weight):
    return x @ weight.T


def log_softmax_case(b, s, v, neg_inf=0.0):
    def make_inputs(gen):
        logits = torch.randn(b, s, v, generator=gen, dtype=torch.float64) * 3
        if neg_inf:  # masked vocab entries; no row all masked
            mask = torch.rand(b, s, v, generator=gen) < neg_inf
            mask[..., 0] = False
            logits = logits.masked_fill(mask, float("-inf"))
        return {"logits": logits}

    vocab = Layout(dp=Shard(0), tp=Shard(-1))  # [B, S, V]: batch over DP, vocab over TP (37: 19 + 18)
    return Case(op="my_tp.vocab_parallel_log_softmax", case_id=f"b{b}s{s}v{v}" + ("-masked" if neg_inf else ""),
                make_inputs=make_inputs, reference=lambda x: reference_log_softmax(x["logits"]),
                run=lambda impl, ctx, x: impl.vocab_parallel_log_softmax(x["logits"], ctx.group("tp")),
                input_layouts={"logits": vocab}, output_layouts=(vocab,), grad_inputs=("logits",),
                params={"b": b, "s": s, "v": v, "neg_inf": neg_inf}, supports=lambda t: b % t.dp == 0)


def linear_case(b, k, n):
    def run(impl, ctx, x):
        weight = GradSum.apply(x["weight"], (ctx.group("dp"),))  # DDP's gradient sum over the batch shards
        return impl.row_parallel_linear(x["x"], weight, ctx.group("tp"))

    return Case(op="my_tp.row_parallel_linear", case_id=f"b{b}k{k}n{n}",
                make_inputs=lambda gen: {"x": torch.randn(b, k, generator=gen, dtype=torch.float64),
                                         "weight": torch.randn(n, k, generator=gen, dtype=torch.float64)},
                reference=lambda x: reference_linear(x["x"], x["weight"]), run=run,
                input_layouts={"x": Layout(dp=Shard(0), tp=Shard(-1)), "weight": Layout(tp=Shard(1))},
                output_layouts=(Layout(dp=Shard(0)),), grad_inputs=("x", "weight"),
                params={"b": b, "k": k, "n": n}, supports=lambda t: b % t.dp == 0)


def cases(quick):
    return [log_softmax_case(2, 3, 37), log_softmax_case(2, 3, 8, neg_inf=0.3), linear_case(4, 13, 5)]


def bench_cases(quick):  # the log-softmax is measured on its first cases
    return [linear_case(8, 64, 32)]
'''.replace("@API_IMPORT@", API_IMPORT)

# The sum of exponentials all-reduced in place, outside autograd: the values are right, the gradient
# through the other ranks' sums is lost.
BROKEN = """\
import torch.distributed as dist


def vocab_parallel_log_softmax(logits, group):
    shift = logits.detach().amax(-1, keepdim=True)
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - shift
    total = shifted.exp().sum(-1, keepdim=True)
    dist.all_reduce(total, group=group)
    return shifted - total.log()


def row_parallel_linear(x, weight, group):
    raise NotImplementedError
"""

OPS = ("my_tp.vocab_parallel_log_softmax", "my_tp.row_parallel_linear")
SMALL = ("--world-sizes", "1,2")  # dp1-cp1-tp1, dp2-cp1-tp1, dp1-cp1-tp2
TP2 = ("--topology", "dp=1,cp=1,tp=2")


@pytest.fixture(scope="module")
def team(tmp_path_factory) -> Path:
    """A folder outside the repository: team/my_tp_ops.py, the broken variant beside it in variants/."""
    root = tmp_path_factory.mktemp("team-repo")
    assert not root.resolve().is_relative_to(ROOT)
    (root / "ops").mkdir()
    (root / "ops" / "my_tp_ops.py").write_text(SUITE)
    (root / "variants").mkdir()
    (root / "variants" / "broken_log_softmax.py").write_text(BROKEN)
    return root


@pytest.fixture(scope="module")
def suite_file(team) -> Path:
    return team / "ops" / "my_tp_ops.py"


@pytest.fixture(scope="module")
def passing(suite_file, tmp_path_factory) -> Run:
    out = tmp_path_factory.mktemp("runs") / "pass"
    return shardcheck(
        "run",
        "--suite-path",
        str(suite_file),
        *SMALL,
        "--dtype",
        "float64,float32",
        "--junit-xml",
        str(out.parent / "pass.xml"),
        out=out,
    )


@pytest.fixture(scope="module")
def broken(suite_file, team, tmp_path_factory) -> Run:
    out = tmp_path_factory.mktemp("runs") / "broken"
    return shardcheck(
        "run",
        "--suite-path",
        str(suite_file),
        "--impl",
        f"my_tp={team / 'variants/broken_log_softmax.py'}",
        "--op",
        OPS[0],
        *SMALL,
        "--dtype",
        "float64,float32",
        out=out,
    )


def _from(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`shardcheck ARGS` run from `cwd` (this checkout's harness, whatever is installed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "shardcheck.harness.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_suite_file_imports_only_the_case_writing_api():
    imports = [line for line in SUITE.splitlines() if line.startswith(("import ", "from "))]
    assert [line for line in imports if not line.startswith(("import torch", "from torch"))] == [API_IMPORT]


def test_list_shows_the_external_suite_with_its_path(suite_file, capsys):
    assert main(["list", "--suite-path", str(suite_file)]) == 0
    out = capsys.readouterr().out
    assert f"suite my_tp_ops (external: {suite_file}):\n" in out
    assert f"  {OPS[0]}  (2 cases)\n  {OPS[1]}  (1 case)\n" in out
    assert "suite kd_loss:\n" in out  # the built-in ones too


def test_external_suite_runs_and_passes(passing, suite_file):
    assert passing.returncode == 0, passing.stdout + passing.stderr
    # 3 cases x 2 dtypes x (tp1, dp2, tp2): the log-softmax has 2 checks, the linear 3
    assert "shardcheck: 42 passed, 0 warnings, 0 failed, 0 errors, 0 skipped" in passing.stdout
    rows = passing.rows
    assert set(rows["suite"]) == {"my_tp_ops"} and set(rows["family"]) == {"my_tp"}
    assert rows.groupby("op").size().to_dict() == {OPS[1]: 18, OPS[0]: 24}
    assert set(zip(rows["dp"], rows["tp"])) == {(1, 1), (2, 1), (1, 2)}
    assert set(rows["impl"]) == {str(suite_file)}  # its IMPLEMENTATION, the suite file itself
    assert "my_tp.vocab_parallel_log_softmax" in (passing.out / "report.md").read_text()


def test_junit_of_the_external_suite(passing):
    root = ET.parse(passing.out.parent / "pass.xml").getroot()
    assert {s.get("name"): s.get("tests") for s in root.findall("testsuite")} == {OPS[0]: "12", OPS[1]: "6"}
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("18", "0", "0")


def test_broken_variant_fails_on_the_gradient_and_its_rerun_line_reproduces(broken, suite_file, tmp_path):
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert_one_cause(broken)
    bad = broken.failed()
    # values right, gradient wrong, only where the vocab is split: TP 2, both cases, both dtypes
    assert set(bad["check"]) == {"grad:logits"} and set(bad["tp"]) == {2} and len(bad) == 4
    assert set(bad["status"]) == {"fail"} and set(bad["culprit_ranks"].map(tuple)) == {(0, 1)}
    assert "FAIL my_tp.vocab_parallel_log_softmax: wrong values — exactly in grad:logits, at tp ≥ 2" in broken.stdout
    assert "grad:logits: rank " in broken.stdout and "failing rank(s): 0, 1" in broken.stdout
    lines = [line[len("rerun: ") :] for line in broken.stdout.splitlines() if line.startswith("rerun: ")]
    assert len(lines) == 4
    args = shlex.split(lines[0])
    assert args[:6] == ["shardcheck", "run", "--suite-path", str(suite_file), "--suite", "my_tp_ops"]
    assert f"my_tp={suite_file.parent.parent / 'variants/broken_log_softmax.py'}" in args
    # run from another directory: the line needs nothing of the first run's
    again = _from(tmp_path, *args[1:], "--out", str(tmp_path / "rerun"), "--no-progress")
    assert again.returncode == 1, again.stdout + again.stderr
    rows = load(tmp_path / "rerun")
    case = bad[bad["case_id"] == rows["case_id"].iloc[0]]
    assert len(rows.groupby(["case_id", "dp", "cp", "tp", "dtype"])) == 1
    assert rows.set_index("check")["status"].to_dict() == {"forward": "pass", "grad:logits": "fail"}
    failed = rows[rows["status"] == "fail"].iloc[0]
    first = case[(case["dtype"] == failed["dtype"])].iloc[0]
    assert failed["max_abs_err"] == first["max_abs_err"]  # the same inputs, the same worst error


def test_compare_of_two_runs_of_the_external_suite(passing, broken):
    proc = _from(ROOT, "compare", str(passing.out), str(broken.out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    regressions = [line for line in proc.stdout.splitlines() if "REGRESSION: pass -> fail" in line]
    assert len(regressions) == 4 and all(OPS[0] in line and "grad:logits" in line for line in regressions)
    assert "**4 regression(s)**" in proc.stdout


def test_suite_paths_from_pyproject(team, tmp_path):
    """`[tool.shardcheck] suite-paths` of the working directory's pyproject.toml, relative to it: a folder."""
    (team / "pyproject.toml").write_text('[project]\nname = "team"\n\n[tool.shardcheck]\nsuite-paths = ["ops"]\n')
    try:
        listed = _from(team, "list")
        assert listed.returncode == 0, listed.stderr
        assert f"suite my_tp_ops (external: {team / 'ops' / 'my_tp_ops.py'}):" in listed.stdout
        run = _from(
            team,
            "run",
            "--suite",
            "my_tp",
            *TP2,
            "--dtype",
            "float64",
            "--strict",
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "shardcheck: 7 passed, 0 warnings, 0 failed, 0 errors, 0 skipped" in run.stdout
        assert json.loads((tmp_path / "run" / "run.json").read_text())["impl"] == {
            "my_tp": str(team / "ops" / "my_tp_ops.py")
        }
    finally:
        (team / "pyproject.toml").unlink()


def test_bench_on_the_external_suite(suite_file, tmp_path):
    run = shardcheck("run", "--suite-path", str(suite_file), "--bench", "--bench-iters", "2", *TP2, out=tmp_path / "b")
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    # the linear's own benchmark case; the log-softmax measured on its first correctness cases
    assert sorted(zip(rows["op"], rows["case_id"])) == [
        (OPS[1], "b8k64n32"),
        (OPS[0], "b2s3v37"),
        (OPS[0], "b2s3v8-masked"),
    ]
    assert (rows["check"] == "bench").all() and (rows["status"] == "pass").all() and (rows["time_ms"] > 0).all()


def test_hand_launched_worker_runs_the_external_suite(suite_file, tmp_path):
    out = tmp_path / "by-hand"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "shardcheck.harness.standalone",
            "--suite-path",
            str(suite_file),
            "--suite",
            "my_tp_ops",
            "--dtype",
            "float64",
            "--strict",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = load(out)
    assert set(zip(rows["dp"], rows["tp"])) == {(1, 1), (2, 1), (1, 2)}
    assert len(rows) == 21 and (rows["status"] == "pass").all() and set(rows["suite"]) == {"my_tp_ops"}


# ---- bad suites and bad configuration: one line, exit 2 --------------------------------------------

GOOD_CASES = "def cases(quick):\n    return []\n"


def _usage_error(capsys, *args: str) -> str:
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardcheck: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    "files, words",
    [
        ({}, "no such file or directory"),
        ({"s.py": GOOD_CASES}, "FAMILY must be a name"),
        ({"s.py": "FAMILY = 'x'\n"}, "defines no function cases(quick)"),
        (
            {"s.py": "FAMILY = 'x'\nraise RuntimeError('boom at import')\n" + GOOD_CASES},
            "cannot import: RuntimeError: boom at import",
        ),
        ({"s.py": "FAMILY = 'x'\ndef cases(quick):\n    return [1 / 0]\n"}, "cases() raised ZeroDivisionError"),
        ({"s.py": "FAMILY = 'x'\ndef cases(quick):\n    return ['a case']\n"}, "cases() returned a str"),
        ({"kd_loss.py": "FAMILY = 'x'\n" + GOOD_CASES}, "its name 'kd_loss' is a built-in suite's"),
        ({"s.txt": ""}, "not a .py file"),
    ],
)
def test_bad_suite_is_one_line(tmp_path, capsys, files, words):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    path = tmp_path / (next(iter(files)) if files else "missing.py")
    assert words in _usage_error(capsys, "list", "--suite-path", str(path))


def test_two_suites_of_one_name_are_named_both(tmp_path, capsys):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "ops.py").write_text("FAMILY = 'x'\n" + GOOD_CASES)
        (tmp_path / folder / "_helper.py").write_text("raise RuntimeError('a helper is not a suite')\n")
    line = _usage_error(capsys, "list", "--suite-path", f"{tmp_path / 'a'},{tmp_path / 'b'}")
    assert f"two suites named 'ops': {tmp_path / 'a' / 'ops.py'} and {tmp_path / 'b' / 'ops.py'}" in line


def test_new_family_needs_an_implementation(suite_file, tmp_path, capsys):
    lone = tmp_path / "lone.py"
    lone.write_text(
        SUITE.replace('FAMILY = "my_tp"', 'FAMILY = "lone"')
        .replace("my_tp.", "lone.")
        .replace("IMPLEMENTATION = __file__", "UNUSED = 0")
    )
    assert (
        f"family 'lone' has no implementation: set IMPLEMENTATION in suite {lone} or pass --impl lone=MODULE"
        in _usage_error(capsys, "run", "--suite-path", str(lone), "--out", str(tmp_path / "run"))
    )
    missing = tmp_path / "missing_impl.py"
    missing.write_text(SUITE.replace("IMPLEMENTATION = __file__", "IMPLEMENTATION = 'impl/nowhere.py'"))
    assert f"IMPLEMENTATION 'impl/nowhere.py': no such file ({tmp_path / 'impl' / 'nowhere.py'})" in _usage_error(
        capsys, "run", "--suite-path", str(missing), "--out", str(tmp_path / "run")
    )


def test_implementation_by_module_name_from_the_suite_folder(tmp_path):
    """IMPLEMENTATION as a module name: a sibling of the suite file (its folder is on sys.path)."""
    (tmp_path / "sibling_tp_impl.py").write_text(SUITE)
    (tmp_path / "sibling_tp.py").write_text(
        SUITE.replace("IMPLEMENTATION = __file__", "IMPLEMENTATION = 'sibling_tp_impl'")
    )
    plan = build_plan(
        Selection(
            run_id="r",
            suites_wanted=[],
            ops=[],
            case_patterns=[],
            world_sizes=[2],
            topologies=[],
            dtypes=["float64"],
            impl={},
            quick=True,
            settings=RunSettings(device="cpu", backend="gloo", timeout=60, seed=0),
            suite_paths=[str(tmp_path / "sibling_tp.py")],
        )
    )
    assert plan.impl == plan.default_impl == {"my_tp": "sibling_tp_impl"}
    assert plan.suite_paths == [str(tmp_path / "sibling_tp.py")] and {i.suite for i in plan.items} == {"sibling_tp"}


def test_impl_of_a_new_family_is_held_to_the_signatures_of_its_implementation(suite_file, tmp_path):
    """--impl of a new family: its signatures against IMPLEMENTATION's, its ops called by those names."""
    swapped = tmp_path / "swapped_tp.py"
    swapped.write_text(
        "def vocab_parallel_log_softmax(logits, group):\n    return logits\n\n"
        "def row_parallel_linear(weight, x, group):\n    return x @ weight.T\n"
    )
    plan = build_plan(
        Selection(
            run_id="r",
            suites_wanted=["my_tp"],
            ops=[],
            case_patterns=[],
            world_sizes=[1],
            topologies=[],
            dtypes=["float64"],
            impl={"my_tp": str(swapped)},
            quick=True,
            settings=RunSettings(device="cpu", backend="gloo", timeout=60, seed=0),
            suite_paths=[str(suite_file)],
        )
    )
    assert plan.default_impl == {"my_tp": str(suite_file)} and plan.impl == {"my_tp": str(swapped)}
    rows = signature_rows(plan, {})
    assert [(r["op"], r["status"]) for r in rows] == [("my_tp.row_parallel_linear", "fail")]
    assert "parameters in another order: (weight, x, group), the seed has (x, weight, group)" in rows[0]["message"]
    module = under_test("my_tp", str(swapped), plan.default_impl["my_tp"])
    x, w = torch.randn(2, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    assert torch.equal(module.row_parallel_linear(x, w, None), x @ w.T)  # called by the default's names


@pytest.mark.parametrize(
    "config, words",
    [
        ("[tool.shardcheck\n", "pyproject.toml: cannot read: "),
        ("[tool.shardcheck]\nsuite-paths = ['nowhere']\n", "suite-paths: nowhere: no such file or directory"),
        ("[tool.shardcheck]\nsuite-paths = 'ops'\n", "suite-paths must be a list of paths"),
        ("[tool.shardcheck]\nsuite_paths = ['ops']\n", "unknown key(s) suite_paths; known: suite-paths"),
    ],
)
def test_bad_pyproject_config_is_one_line(tmp_path, capsys, monkeypatch, config, words):
    (tmp_path / "pyproject.toml").write_text(config)
    monkeypatch.chdir(tmp_path)
    assert words in _usage_error(capsys, "list")
    assert words in _usage_error(capsys, "run", "--out", str(tmp_path / "run"))


def test_a_suite_imports_its_own_sibling_before_anything_of_the_same_name(tmp_path):
    """A suite's folder comes first on sys.path: its `reference.py` wins over the checkout's `reference/` folder
    (first on sys.path here: pytest runs from the repository root), in the driver and in the ranks."""
    folder = tmp_path / "sib"
    folder.mkdir()
    (folder / "reference.py").write_text("OWN_REFERENCE = True\n")
    (folder / "sib_tp.py").write_text(
        SUITE.replace(API_IMPORT, API_IMPORT + "\nfrom reference import OWN_REFERENCE  # noqa")
    )
    run = shardcheck(
        "run",
        "--suite-path",
        str(folder / "sib_tp.py"),
        "--op",
        OPS[0],
        "--world-sizes",
        "1",
        "--dtype",
        "float64",
        out=tmp_path / "run",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert set(run.rows["status"]) == {"pass"} and len(run.rows) >= 2
