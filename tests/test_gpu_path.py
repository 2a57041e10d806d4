"""What the first run on a GPU machine (one H200, torch 2.11, docs/performance.md "The GPU path") found, each
reproduced here on CPU: a rank's device mesh on torch 2.11, the optimizer of a model case on a GPU, the collectives of
the in-batch gather on torch 2.11 and in the flight recorder on torch 2.13, a dim spanning the world on torch 2.11,
and a process case whose op makes an NCCL group on a machine of fewer GPUs than ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardcheck.harness.core import measure
from shardcheck.harness.core.processes import run_ranks

SEED = 3


def _unflatten_of_torch_2_11(real):
    """DeviceMesh._unflatten as torch 2.11 has it: a dim given by a name that is there raises (pytorch#176443)."""

    def _unflatten(self, dim, mesh_sizes, mesh_dim_names, *args, **kwargs):
        if isinstance(dim, str) and dim in (self.mesh_dim_names or ()):
            raise ValueError(f"dim {dim} specified in `_unflatten` is not in {self.mesh_dim_names}")
        return real(self, dim, mesh_sizes, mesh_dim_names, *args, **kwargs)

    return _unflatten


def _mesh_on_torch_2_11(proc) -> list[int]:
    from torch.distributed.device_mesh import DeviceMesh

    from shardcheck.harness.core.topology import Topology, build_mesh, expert_mesh

    DeviceMesh._unflatten = _unflatten_of_torch_2_11(DeviceMesh._unflatten)
    mesh = build_mesh(Topology(dp=2, ep=2), 2, "cpu")
    return [mesh["dp"].size(), expert_mesh(mesh)["ep"].size(), expert_mesh(mesh)["edp"].size()]


def test_a_rank_builds_its_mesh_with_torch_2_11s_unflatten():
    run = run_ranks(_mesh_on_torch_2_11, 2, init_process_group=True, deadline=60)
    assert [r.error for r in run.ranks] == [None, None]
    assert [r.result for r in run.ranks] == [[2, 2, 1], [2, 2, 1]]


def _mixed_step(proc) -> dict:
    """A Linear sharded column-wise (DTensor parameters) beside a LayerNorm left whole (plain ones), stepped by SGD
    with the foreach kernels a GPU picks by default; by torch's default SGD, then by the model case's."""
    import torch.optim.optimizer as optimizer_module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from shardcheck.harness.core.train_step import make_optimizer

    # what _default_to_fused_or_foreach answers for CUDA parameters: foreach
    optimizer_module._get_foreach_kernels_supported_devices = lambda: ["cpu", "cuda"]
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out = {}
    for name in ("torch_default", "model_case"):
        gen = torch.Generator().manual_seed(SEED)
        model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)).double()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        parallelize_module(model, mesh, {"0": ColwiseParallel(output_layouts=Replicate())})
        before = [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]
        x = torch.randn(5, 3, generator=gen, dtype=torch.float64)
        model(x).square().mul(torch.randn(5, 4, generator=gen, dtype=torch.float64)).sum().backward()
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone() for p in model.parameters()]
        case = SimpleNamespace(optimizer="sgd", lr=0.25)
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=case.lr) if name == "torch_default" else make_optimizer(case, params, None)
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001  what the step raised is the outcome
            out[name] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        after = [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]
        kinds = sorted({type(p).__name__ for p in params})
        err = max(float((a - (b - case.lr * g)).abs().max()) for a, b, g in zip(after, before, grads))
        out[name] = {
            "kinds": kinds,
            "max_err": err,
            "moved": min(float((a - b).abs().max()) for a, b in zip(after, before)),
        }
    return out


def test_the_model_case_optimizer_steps_dtensor_and_plain_parameters_together_on_a_gpu():
    run = run_ranks(_mixed_step, 2, init_process_group=True, deadline=60)
    for rank in run.ranks:
        assert rank.error is None, rank.error
        # the GPU's failure, reproduced: torch's default SGD on such a list
        assert "mixed torch.Tensor and DTensor" in rank.result["torch_default"]
        ours = rank.result["model_case"]
        assert ours["kinds"] == ["DTensor", "Parameter"]
        assert ours["max_err"] < 1e-12 and ours["moved"] > 1e-3


def _gather_without_the_single_names(proc) -> dict:
    """The in-batch gather with grad where torch.distributed has no all_gather_single / reduce_scatter_single (torch
    2.11): values and gradients."""
    from shardcheck.distributed_impl import inbatch_neg_utils

    for name in ("all_gather_single", "reduce_scatter_single"):
        delattr(dist, name)
    gen = torch.Generator().manual_seed(SEED + proc.rank)
    t = torch.randn(3, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(6, 2, generator=torch.Generator().manual_seed(SEED + 10 + proc.rank), dtype=torch.float64)
    gathered = inbatch_neg_utils._GatherWithGrad.apply(t)
    gathered.backward(upstream)
    return {"t": t.detach(), "gathered": gathered.detach(), "upstream": upstream, "grad": t.grad}


def test_the_in_batch_gather_runs_on_torch_without_the_single_collectives():
    run = run_ranks(_gather_without_the_single_names, 2, init_process_group=True, deadline=60)
    assert [r.error for r in run.ranks] == [None, None]
    results = [r.result for r in run.ranks]
    whole = torch.cat([r["t"] for r in results])
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["gathered"], whole, rtol=0, atol=0)
        # rank r's gradient: the sum over the ranks of the upstream gradient's rows of its own slice
        want = sum(other["upstream"][3 * rank : 3 * rank + 3] for other in results)
        torch.testing.assert_close(r["grad"], want, rtol=1e-12, atol=1e-12)


def _recorded_single_collectives(proc, folder: str) -> list[str]:
    from pathlib import Path

    from shardcheck.harness.rank import flight_recorder

    flight_recorder.install(Path(folder), proc.rank)
    dist.all_gather_single(torch.empty(4), torch.full((2,), float(proc.rank + 1)))
    dist.reduce_scatter_single(torch.empty(2), torch.arange(4.0))
    return [r["kind"] for r in flight_recorder.read_records(Path(folder), proc.rank)]


@pytest.mark.skipif(not hasattr(dist, "all_gather_single"), reason="torch before 2.13 has no all_gather_single")
def test_the_flight_recorder_records_torch_2_13s_single_collectives(tmp_path):
    run = run_ranks(_recorded_single_collectives, 2, args=(str(tmp_path),), init_process_group=True, deadline=60)
    assert [r.error for r in run.ranks] == [None, None]
    assert [r.result for r in run.ranks] == [["all_gather", "reduce_scatter"]] * 2


def test_a_dim_spanning_the_world_with_a_group_of_its_own_is_that_dim(monkeypatch):
    """torch 2.11 (on the GPU machine) gave dp = the world a group of its own: a gather on the default group is dp's,
    not "other"."""
    group = lambda name, size: SimpleNamespace(group_name=name, size=lambda: size)  # noqa: E731
    world = group("0", 2)
    dims = SimpleNamespace(groups={"dp": group("5", 2), "cp": group("6", 1), "tp": group("7", 1)})
    monkeypatch.setattr(measure, "mesh_dims", lambda mesh: dims)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: world)
    assert measure.group_dims(object()) == {"5": "dp", "0": "dp", "6": "cp", "7": "tp"}
    # torch 2.13: the dim spanning the world is the default group itself
    dims.groups["dp"] = world
    assert measure.group_dims(object()) == {"0": "dp", "6": "cp", "7": "tp"}


def test_a_process_case_whose_op_makes_an_nccl_group_skips_on_fewer_gpus_than_ranks(monkeypatch):
    from shardcheck.suites import distributed_utils

    assert distributed_utils._gpus_short_of(4) is None  # this machine: no CUDA, the op makes a gloo group
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert distributed_utils._gpus_short_of(4) == (
        "the op's own NCCL group needs a GPU per fresh rank (4); this machine has 1"
    )
    assert distributed_utils._gpus_short_of(1) is None
