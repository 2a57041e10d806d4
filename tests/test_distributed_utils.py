"""distributed_utils: the references against direct formulas, the implementation where no process
group is needed, the suite on the real implementation, and the harness failing (with the right
check, rank and, for hangs, within its deadline) on each module in tests/broken/distributed_utils/.

CLI runs are few and small (each launch costs seconds on a 2-core machine): value bugs run at
dp = 2 in float64, process bugs on the size-1 topology that starts the fresh ranks.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from helpers import BROKEN, IMPLS

from shardcheck.distributed_impl import distributed_utils as impl
from shardcheck.reference import distributed_utils as ref

TIMEOUT = ("--timeout", "120")  # above the suite's 20 s process deadline, with room for a loaded machine
DP2 = ("--topology", "dp=2,cp=1,tp=1", "--dtype", "float64", *TIMEOUT)
PROCESS_TOPOLOGY = ("--topology", "dp=1,cp=1,tp=1", *TIMEOUT)


# ---- references -------------------------------------------------------------------------------


def test_reference_reduce_loss():
    losses = torch.tensor([0.5, 1.25, 2.0], dtype=torch.bfloat16)
    tokens = torch.tensor([2**31 + 5, 2**31 + 7])
    loss, denominator = ref.reduce_loss(losses, tokens)
    assert loss.dtype == torch.float32 and loss.shape == (1,) and loss.item() == 3.75
    assert denominator.dtype == torch.int64 and denominator.item() == 2**32 + 12  # no int32 wrap
    assert ref.reduce_loss(losses.double(), tokens, per_token_loss=False)[1].item() == 3
    assert ref.reduce_loss(losses.double(), tokens)[0].dtype == torch.float64


def test_reference_accumulated_gradients_match_nn_linear():
    gen = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(3, 4, 6, generator=gen, dtype=torch.float64),
        torch.randn(3, 4, 2, generator=gen, dtype=torch.float64),
    )
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    for m in range(3):  # gradient accumulation on one device
        ((model(x[m]) - y[m]) ** 2).mean().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    w1, b1, w2, b2 = (p.detach() for p in model.parameters())
    torch.testing.assert_close(ref.accumulated_gradients(x, y, w1, b1, w2, b2), expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ref.mlp(x[0], w1, b1, w2, b2), model(x[0]).detach(), rtol=1e-12, atol=1e-14)


# ---- the implementation without a process group ------------------------------------------------


def test_reduce_loss_local():
    gen = torch.Generator().manual_seed(1)
    parts = [t.requires_grad_() for t in (torch.rand(4, generator=gen, dtype=torch.bfloat16) + 1).unbind(0)]
    loss, denominator = impl.reduce_loss(parts, torch.tensor(3 * 2**31))
    assert loss.dtype == torch.float32 and loss.shape == (1,) and not loss.requires_grad
    assert loss.item() == pytest.approx(sum(float(p.detach()) for p in parts), rel=1e-6)
    assert denominator.dtype == torch.int64 and denominator.tolist() == [3 * 2**31]
    assert impl.reduce_loss(parts, torch.tensor(7), per_token_loss=False)[1].tolist() == [4]
    with pytest.raises(ValueError):
        impl.reduce_loss([], torch.tensor(3))
    with pytest.raises(ValueError):
        impl.reduce_loss(parts, torch.tensor(12.5))


def test_dp_eval_sample_shard_values():
    assert impl.dp_eval_sample_shard(impl.DDPConfig(), 1, 4) == (1, 4)
    assert impl.dp_eval_sample_shard(impl.DDPConfig(), 0, 1) is None
    for config in (impl.FSDP2Config(), impl.MegatronFSDPConfig(), None, {"strategy": "ddp"}):
        assert impl.dp_eval_sample_shard(config, 1, 4) is None
    for rank, size in ((4, 4), (-1, 2), (0, 0)):
        with pytest.raises(ValueError):
            impl.dp_eval_sample_shard(impl.DDPConfig(), rank, size)
    # the configs the suite hands any module under test: stand-ins of upstream's, told apart by class name
    from shardcheck.suites import distributed_utils as suite

    assert impl.dp_eval_sample_shard(suite.DDPConfig(), 1, 4) == (1, 4)
    assert impl.dp_eval_sample_shard(suite.FSDP2Config(), 1, 4) is None
    assert impl.dp_eval_sample_shard(suite.MegatronFSDPConfig(), 1, 4) is None


def test_single_process_behaviour(caplog, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with impl.FirstRankPerNode() as first:
        assert first is True
    assert impl._barrier_with_timeout(0.1) is True and impl._create_gloo_group() is None
    model = torch.nn.Linear(2, 2)
    with impl.get_sync_ctx(model, False, True):  # a plain module: a null context
        model(torch.ones(1, 2)).sum().backward()
    with caplog.at_level(logging.INFO):
        impl.barrier_and_log("single process message")
    assert [r.getMessage() for r in caplog.records] == ["single process message"]


# ---- the suite ----------------------------------------------------------------------------------


def test_quick_cases_cover_every_op():
    from shardcheck.suites import distributed_utils as suite

    quick = suite.cases(quick=True)
    assert {c.op.split(".")[1] for c in quick} == {
        "reduce_loss",
        "dp_eval_sample_shard",
        "get_sync_ctx",
        "FirstRankPerNode",
        "_barrier_with_timeout",
        "_create_gloo_group",
        "barrier_and_log",
    }
    ids = [(c.op, c.case_id) for c in suite.cases(quick=False)]
    assert len(ids) == len(set(ids))
    # fresh-rank cases run once, on the size-1 topology, and within the worker's default timeout
    from shardcheck.harness.core.topology import Topology

    process = [c for c in quick if not c.output_names]
    assert process and all(c.runs_on(Topology()) and not c.runs_on(Topology(dp=2)) for c in process)
    assert suite.PROCESS_DEADLINE_S + 10 < 60


def test_quick_suite_passes(run_shardcheck):
    run = run_shardcheck("run", "--suite", "distributed_utils", "--quick", "--world-sizes", "1,2,4", *TIMEOUT)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert (rows["status"] == "pass").all(), run.failed()[["case_id", "check", "message"]]

    def checks(op):
        return set(rows[rows["op"] == f"distributed_utils.{op}"]["check"])

    big = rows[(rows["case_id"] == "per-token-dp-group-tokens-over-int32") & (rows["check"] == "forward:denominator")]
    assert set(big["dp"]) == {1, 2, 4}
    sync = rows[rows["op"] == "distributed_utils.get_sync_ctx"]
    for case in ("ddp-3-micro-batches", "fsdp2-deferred-3-micro-batches"):
        got = sync[(sync["case_id"] == case) & (sync["check"] == "property:grad_sync_on_optim_step")]
        assert set(got["dp"]) == {2, 4}, case
    assert {"forward", "property:no_grad_sync_before_optim_step"} <= checks("get_sync_ctx")
    assert {"property:returns", "property:coverage", "forward"} <= checks("dp_eval_sample_shard")
    assert {
        "property:first_rank_per_node_true",
        "property:others_enter_after_first_left",
        "property:exception_ends_every_rank",
        "property:error_names_rank",
        "property:single_process_true",
    } <= checks("FirstRankPerNode")
    assert {
        "property:waiting_ranks_false_within_timeout",
        "property:late_rank_false",
        "property:groups_work_after",
    } <= checks("_barrier_with_timeout")
    assert {"property:one_record_from_rank_0", "property:logged_after_every_rank_arrived"} <= checks("barrier_and_log")
    assert "property:gloo_group_over_all_ranks" in checks("_create_gloo_group")


def test_own_config_classes_are_the_ones_its_cases_receive(run_shardcheck):
    """An implementation that checks `isinstance(config, DDPConfig)` against its own class gets its own classes."""
    from shardcheck.suites import distributed_utils as suite

    own = _load(IMPLS / "own_config_classes_distributed_utils.py")
    assert suite.config_class(own, "ddp") is own.DDPConfig and suite.config_class(impl, "fsdp2") is impl.FSDP2Config
    assert suite.config_class(ref, "ddp") is suite.DDPConfig  # no class of that name: the stand-in
    run = run_shardcheck(
        "run",
        "--suite",
        "distributed_utils",
        "--op",
        "distributed_utils.dp_eval_sample_shard",
        *DP2,
        "--impl",
        f"distributed_utils={IMPLS / 'own_config_classes_distributed_utils.py'}",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert (rows["status"] == "pass").all(), run.failed()[["case_id", "check", "message"]]
    assert rows["case_id"].str.startswith("ddp-").any() and (rows["case_id"] == "rank-equals-size").any()


def _load(path):
    from shardcheck.harness.core.modules import import_file

    return import_file(path, "own_config_test")


# ---- broken implementations ----------------------------------------------------------------------


def _broken(run_shardcheck, name, op, topology):
    started = time.monotonic()
    run = run_shardcheck(
        "run",
        "--suite",
        "distributed_utils",
        "--op",
        f"distributed_utils.{op}",
        *topology,
        "--impl",
        f"distributed_utils={BROKEN / 'distributed_utils' / name}.py",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    return run.rows, time.monotonic() - started


def _failed(rows, check):
    return rows[(rows["check"] == check) & (rows["status"] == "fail")]


def test_broken_tokens_not_reduced(run_shardcheck):
    rows, _ = _broken(run_shardcheck, "tokens_not_reduced", "reduce_loss", DP2)
    bad = rows[rows["status"] != "pass"]
    assert set(bad["check"]) == {"forward:denominator"}
    assert set(bad["case_id"]) == {c for c in rows["case_id"] if "dp-group" in c}  # without dp_group nothing changes
    row = bad[bad["case_id"] == "per-token-dp-group-tokens-over-int32"].iloc[0]
    assert "failing rank(s): 0, 1" in row["message"] and "expected 1" in row["message"]


def test_broken_eval_shard_under_fsdp2(run_shardcheck):
    rows, _ = _broken(run_shardcheck, "eval_shard_under_fsdp2", "dp_eval_sample_shard", DP2)
    bad = rows[rows["status"] != "pass"]
    sharded = {c for c in rows["case_id"] if c.startswith(("fsdp2-", "megatron-fsdp-"))}
    assert set(bad["case_id"]) == sharded  # DDP cases still pass
    for check in ("forward", "property:returns", "property:coverage"):
        assert set(_failed(rows, check)["case_id"]) == sharded, check
    returns = _failed(rows, "property:returns")
    assert returns["message"].str.contains(r"got \(0, 2\), expected None").all()


def test_broken_no_sync_ignored(run_shardcheck):
    rows, _ = _broken(run_shardcheck, "no_sync_ignored", "get_sync_ctx", DP2)
    bad = rows[rows["status"] != "pass"]
    # the gradients are right: only the communication contract shows the bug
    assert set(bad["check"]) == {"property:no_grad_sync_before_optim_step"}
    assert set(bad["case_id"]) == {
        "ddp-3-micro-batches",
        "fsdp2-deferred-3-micro-batches",
        "no-sync-wrapper-3-micro-batches",
    }
    # a wrapper the seed does not name: the same bug, judged under our rule (a warning)
    assert set(bad[bad["case_id"] == "no-sync-wrapper-3-micro-batches"]["status"]) == {"warn"}
    ddp = bad[bad["case_id"] == "ddp-3-micro-batches"].iloc[0]
    assert "micro-batch 1: {'all_reduce@dp'" in ddp["message"]


def test_broken_first_rank_global(run_shardcheck):
    rows, _ = _broken(run_shardcheck, "first_rank_global", "FirstRankPerNode", PROCESS_TOPOLOGY)
    first = _failed(rows, "property:first_rank_per_node_true")
    assert len(first) == 1 and "rank 2 (node 1, local rank 0): got False, expected True" in first.iloc[0]["message"]
    order = _failed(rows, "property:others_enter_after_first_left")
    assert len(order) == 1 and "node 1: rank 3 entered" in order.iloc[0]["message"]
    assert "node 0:" not in order.iloc[0]["message"]  # node 0's first rank is rank 0: right there
    single = rows[rows["case_id"] == "no-distributed"]
    assert (single["status"] == "pass").all()


def test_broken_barrier_raises_on_late_rank(run_shardcheck):
    rows, _ = _broken(run_shardcheck, "barrier_raises_on_late_rank", "_barrier_with_timeout", PROCESS_TOPOLOGY)
    waited = _failed(rows, "property:waiting_ranks_false_within_timeout")
    assert len(waited) == 1 and "failed to pass monitoredBarrier" in waited.iloc[0]["message"]
    assert len(_failed(rows, "property:ranks_end")) == 1
    assert rows[rows["check"] == "property:on_time_true"]["status"].eq("pass").all()


def test_broken_barrier_hangs_on_late_rank_ends_at_the_deadline(run_shardcheck):
    from shardcheck.suites.distributed_utils import PROCESS_DEADLINE_S

    rows, took = _broken(run_shardcheck, "barrier_hangs_on_late_rank", "_barrier_with_timeout", PROCESS_TOPOLOGY)
    ends = _failed(rows, "property:ranks_end")
    assert len(ends) == 1
    message = ends.iloc[0]["message"]
    # the waiting ranks block in the barrier, the late rank waits for them: all killed at the deadline
    assert "still running at the deadline, killed (last event: call:late)" in message
    assert (
        "rank 2 (node 0, local rank 2): still running at the deadline, killed (last event: return:on-time)" in message
    )
    assert len(_failed(rows, "property:waiting_ranks_false_within_timeout")) == 1
    # the fresh ranks ran for the deadline, not longer (the property's value is their wall time)
    assert PROCESS_DEADLINE_S <= ends.iloc[0]["max_abs_err"] < PROCESS_DEADLINE_S + 5
    assert took < 300  # and the whole run ended: one launch plus the deadline, even on a loaded machine


def test_broken_barrier_breaks_group(run_shardcheck):
    rows, _ = _broken(run_shardcheck, "barrier_breaks_group", "_barrier_with_timeout", PROCESS_TOPOLOGY)
    # it does return False on time...
    assert rows[rows["check"] == "property:waiting_ranks_false_within_timeout"]["status"].eq("pass").all()
    # ...but the group it timed out on is dead afterwards
    after = _failed(rows, "property:groups_work_after")
    assert len(after) == 1
    assert "Application timeout caused pair closure" in after.iloc[0]["message"] or "closed" in after.iloc[0]["message"]


def test_broken_quit_when_rank0_raises(run_shardcheck):
    """A `quit(1)` taken only when rank 0 raises loses its exception: the case raising on rank 2 cannot see it, its
    twin raising on rank 0 does, with one finding naming it (issue 42, item 7); ours passes both."""
    raising = (
        "--suite",
        "distributed_utils",
        "--op",
        "distributed_utils.FirstRankPerNode",
        "--case",
        "raises-on-rank-*",
    )
    impl = f"distributed_utils={BROKEN / 'distributed_utils' / 'quit_when_rank0_raises.py'}"
    broken = run_shardcheck("run", *raising, *PROCESS_TOPOLOGY, "--impl", impl)
    assert broken.returncode == 1, broken.stdout  # a warn under a rule of ours: --strict
    bad = broken.rows[broken.rows["status"] != "pass"]
    assert set(bad["case_id"]) == {"raises-on-rank-0"} and set(bad["check"]) == {"property:error_names_rank"}
    assert "SystemExit" in bad.iloc[0]["message"] and "expected rank 0's RuntimeError" in bad.iloc[0]["message"]
    assert len(broken.causes) == 1 and "raises-on-rank-0" in broken.stdout
    ours = run_shardcheck("run", *raising, *PROCESS_TOPOLOGY)
    assert ours.returncode == 0, ours.stdout
    assert set(ours.rows["case_id"]) == {"raises-on-rank-0", "raises-on-rank-2"}
