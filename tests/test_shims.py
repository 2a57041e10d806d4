"""The CPU shims (harness/rank/shims): torch's context-parallel attention on CPU in float64 against the
full-sequence attention and our own ring attention; the Transformer Engine partition stand-in against
a brute-force rule; when each is installed; the torch-CP cp_utils of tests/impls through the suite with
the shims and without them; its broken variant caught."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import BROKEN, ROOT

from shardcheck.harness.core.processes import run_ranks
from shardcheck.harness.rank import shims
from shardcheck.harness.rank.shims import te_thd_partition, torch_cp_attention
from shardcheck.harness.rank.shims.te_thd_partition import thd_get_partitioned_indices

TORCH_CP_IMPL = ROOT / "tests" / "impls" / "torch_cp_cp_utils.py"


# ---- torch context parallelism on CPU ------------------------------------------------------------


def _full_attention(q, k, v, upstream):
    """Causal softmax attention over the whole sequence, in plain float64 math, and its gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    future = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).triu(1)
    out = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    out.backward(upstream)
    return out.detach(), q.grad, k.grad, v.grad


def _cp_attention(proc, seq_len: int) -> dict:
    """On every rank: torch's context_parallel + the shim, both rotate methods, load-balanced or not;
    the errors against the full-sequence attention, and against our ring (load-balanced only)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    from shardcheck.distributed_impl import cp_utils as ours

    torch_cp_attention.install()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(7)
    q, k, v, upstream = (torch.randn((2, 2, seq_len, 4), generator=gen, dtype=torch.float64) for _ in range(4))
    full = _full_attention(q, k, v, upstream)
    result = {}
    for rotate in ("allgather", "alltoall"):
        for balanced in (True, False):
            set_rotate_method(rotate)
            _cp_options.enable_load_balance = balanced
            buffers = [t.clone() for t in (q, k, v, upstream)] + [torch.arange(seq_len).unsqueeze(0)]
            try:
                with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2, 1]):
                    lq, lk, lv = (b.clone().requires_grad_() for b in buffers[:3])
                    out = F.scaled_dot_product_attention(lq, lk, lv, is_causal=True)
                    out.backward(buffers[3])  # inside the context, as a training step does
                    positions = buffers[4][0].clone()
            finally:
                _cp_options.enable_load_balance = True
            got = (out.detach(), lq.grad, lk.grad, lv.grad)
            name = f"{rotate}-{'head-tail' if balanced else 'contiguous'}"
            result[name] = {
                "positions": positions.tolist(),
                "merge_in_float32": _cp_options.convert_to_f32,
                "vs_full": max(float((g - f.index_select(2, positions)).abs().max()) for g, f in zip(got, full)),
            }
            if balanced:  # the same shards through our own ring attention
                sdpa = ours._ring_sdpa(ours._Rotator(mesh.get_group(), rotate), F.scaled_dot_product_attention)
                oq, ok, ov = (t.index_select(2, positions).requires_grad_() for t in (q, k, v))
                ring_out = sdpa(oq, ok, ov, is_causal=True)
                ring_out.backward(upstream.index_select(2, positions))
                result[name]["vs_ours"] = max(
                    float((g - r).abs().max()) for g, r in zip(got, (ring_out.detach(), oq.grad, ok.grad, ov.grad))
                )
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_shim_is_exact_in_float64(world):
    seq_len = 8 * world
    run = run_ranks(_cp_attention, world, args=(seq_len,), init_process_group=True, deadline=120)
    assert all(r.returned for r in run.ranks), run.describe()
    chunk = seq_len // (2 * world)
    for rank, outcome in enumerate(run.ranks):
        for name, res in outcome.result.items():
            # float64 stays float64: torch's float32 merge would be ~1e-7 off
            assert res["vs_full"] < 1e-12, (rank, name, res)
            assert res["merge_in_float32"], "the shim restores torch's option after each call"
            if name.endswith("head-tail"):
                head = list(range(rank * chunk, (rank + 1) * chunk))
                tail = list(range((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk))
                assert res["positions"] == head + tail, (rank, name)
                assert res["vs_ours"] < 1e-12, (rank, name, res)
            else:
                assert res["positions"] == list(range(rank * 2 * chunk, (rank + 1) * 2 * chunk)), (rank, name)


def test_cp_attention_shim_refuses_another_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    assert "written for torch 2.13.x" in torch_cp_attention.unavailable_reason()
    with pytest.raises(RuntimeError, match="this is torch 2.14.0"):
        torch_cp_attention.install()
    chosen, unavailable = shims.select("cpu")
    assert torch_cp_attention not in chosen and "2.14.0" in unavailable[0]
    assert "not installed: shardcheck's CPU shim" in shims.describe("cpu", True)["shim_notes"][-1]


def test_attention_shim_only_on_cpu():
    assert torch_cp_attention in shims.select("cpu")[0]
    assert torch_cp_attention not in shims.select("cuda")[0]


# ---- Transformer Engine's THD partition ------------------------------------------------------------


def _brute_force(cu_seqlens: list[int], world: int, rank: int) -> list[int]:
    """Each sequence cut into 2·world equal chunks; rank r keeps chunks r and 2·world−1−r of each."""
    out = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        chunk = (end - start) // (2 * world)
        for c in (rank, 2 * world - 1 - rank):
            out += list(range(start + c * chunk, start + (c + 1) * chunk))
    return out


@pytest.mark.parametrize("cu_seqlens", [[0, 8], [0, 8, 24, 32], [0, 16, 16, 48], [0, 40, 48, 56, 64, 96]])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_thd_partition_matches_brute_force(cu_seqlens, world):
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    held = []
    for rank in range(world):
        got = thd_get_partitioned_indices(cu, cu_seqlens[-1], world, rank)
        assert got.dtype == torch.int32 and got.shape == (cu_seqlens[-1] // world,)
        assert got.tolist() == _brute_force(cu_seqlens, world, rank)
        held += got.tolist()
    assert sorted(held) == list(range(cu_seqlens[-1]))  # every token on exactly one rank


def test_thd_partition_tokens_past_the_end_go_to_the_last_sequence():
    # as TE's kernel: total_tokens 16 > cu_seqlens[-1] 8; local bounds [0, 4, 6]; the last sequence
    # (local length 2, chunk 1) takes local tokens 4..7 with offsets past its own end
    got = thd_get_partitioned_indices(torch.tensor([0, 8, 12], dtype=torch.int32), 16, 2, 0)
    assert got.tolist() == [0, 1, 6, 7, 8, 11, 12, 13]


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.tensor([0, 8], dtype=torch.int64), 8, 2, 0), "must be int32"),
        ((torch.tensor([[0, 8]], dtype=torch.int32), 8, 2, 0), "must be 1-D"),
        ((torch.tensor([0], dtype=torch.int32), 8, 2, 0), "at least 2 entries"),
        ((torch.tensor([0, 8], dtype=torch.int32), 8, 2, 2), "rank must be in"),
        ((torch.tensor([0, 8], dtype=torch.int32), 6, 2, 0), "multiple of 2·world_size = 4"),
        ((torch.tensor([0, 6, 12], dtype=torch.int32), 12, 2, 0), r"got \[6\]"),
    ],
)
def test_thd_partition_checks_like_te(args, message):
    with pytest.raises(RuntimeError, match=message):
        thd_get_partitioned_indices(*args)


def test_te_stand_in_only_when_te_is_absent(monkeypatch):
    module = te_thd_partition.MODULE
    assert module not in sys.modules or te_thd_partition.installed()
    monkeypatch.setattr(te_thd_partition.importlib.util, "find_spec", lambda name: None)
    try:
        te_thd_partition.install()
        import transformer_engine_torch as tex

        assert tex.thd_get_partitioned_indices is thd_get_partitioned_indices
        with pytest.raises(AttributeError, match="provides only thd_get_partitioned_indices; fused_attn_fwd needs"):
            _ = tex.fused_attn_fwd  # the attribute access itself must raise
        assert te_thd_partition in shims.select("cuda")[0]  # absent: a stand-in on any device
    finally:
        te_thd_partition.uninstall()
    assert module not in sys.modules
    monkeypatch.setattr(te_thd_partition.importlib.util, "find_spec", lambda name: object())  # "installed"
    assert te_thd_partition not in shims.select("cpu")[0]
    with pytest.raises(RuntimeError, match="does not shadow it"):
        te_thd_partition.install()


# ---- someone else's cp_utils on torch's CP, through the suite ---------------------------------------


def test_torch_cp_cp_utils_passes_with_the_shims(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--suite",
        "cp_utils",
        "--quick",
        "--world-sizes",
        "1,2,4",
        "--impl",
        f"cp_utils={TORCH_CP_IMPL}",
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert (rows["status"] == "pass").all(), run.failed()[["case_id", "check", "message"]]
    steps = rows[rows["check"].str.startswith("grad:")]
    for rotate in ("allgather", "alltoall"):
        assert {2, 4} <= set(steps[steps["case_id"].str.contains(rotate)]["cp"]), rotate
    assert "float64" in set(steps["dtype"])
    meta = json.loads((run.out / "run.json").read_text())
    # (and, where torchtitan is installed, its four stand-ins: lazy, never reached by this run)
    assert meta["shims"] == [torch_cp_attention.NAME, te_thd_partition.NAME] + [
        s.NAME for s in shims.select("cpu")[0] if s not in (torch_cp_attention, te_thd_partition)
    ]
    report = (run.out / "report.md").read_text()
    assert meta["shim_calls"][torch_cp_attention.NAME] > 0 and meta["shim_calls"][te_thd_partition.NAME] > 0
    assert f"used shardcheck's CPU shim for {torch_cp_attention.NAME}: " in report
    assert f"used shardcheck's CPU shim for {te_thd_partition.NAME}: " in report


def test_header_says_a_shim_was_used_or_only_installed(run_shardcheck):
    """The attention handlers are reached by torch's CP under test (their calls counted on the ranks); the TE stand-in
    by nothing these cases run: the header says which was used and which only installed."""
    run = run_shardcheck(
        "run",
        "--suite",
        "cp_utils",
        "--topology",
        "dp=1,cp=2,tp=1",
        "--dtype",
        "float64",
        "--case",
        "ctx-alltoall-b2s16*",
        "--impl",
        f"cp_utils={TORCH_CP_IMPL}",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    meta = json.loads((run.out / "run.json").read_text())
    attention = meta["shim_calls"][torch_cp_attention.NAME]
    assert attention > 0 and te_thd_partition.NAME not in meta["shim_calls"], meta["shim_calls"]
    header = (run.out / "report.md").read_text().split("**")[0]
    assert f"- used shardcheck's CPU shim for {torch_cp_attention.NAME}: {attention} call(s) on the ranks" in header
    assert (
        f"- installed shardcheck's CPU shim for {te_thd_partition.NAME}, never called by the code under test" in header
    )
    assert "ran with" not in header


def test_torch_cp_cp_utils_fails_clearly_without_the_shims(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--suite",
        "cp_utils",
        "--topology",
        "dp=1,cp=2,tp=1",
        "--dtype",
        "float64",
        "--case",
        "ctx-alltoall-b2s16*",
        "--case",
        "packs-sentinel",
        "--no-shims",
        "--impl",
        f"cp_utils={TORCH_CP_IMPL}",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    assert (rows["status"] == "error").all()
    attention = rows[rows["op"] == "cp_utils.create_context_parallel_ctx"]["message"]
    assert attention.str.contains("_scaled_dot_product_flash_attention_for_cpu.default does not have a sharding").all()
    thd = rows[rows["op"] == "cp_utils.make_cp_batch_for_te"]
    assert list(thd["check"]) == ["property:properties"]
    assert "No module named 'transformer_engine_torch'" in thd["message"].iloc[0]
    meta = json.loads((run.out / "run.json").read_text())
    assert meta["shims"] == [] and meta["shims_off"] == [s.NAME for s in shims.select("cpu")[0]]
    assert meta["shims_off"][:2] == [torch_cp_attention.NAME, te_thd_partition.NAME]
    assert "ran without shardcheck's CPU shims (--no-shims)" in (run.out / "report.md").read_text()


def test_torch_cp_broken_load_balancing_is_a_silent_wrong_answer(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--suite",
        "cp_utils",
        "--topology",
        "dp=1,cp=2,tp=1",
        "--dtype",
        "float64",
        "--case",
        "layout-b2s10-*",
        "--case",
        "batch-allgather-b2s10h8v11-ids-pos-given",
        "--impl",
        f"cp_utils={BROKEN / 'cp_utils' / 'torch_cp_padded_not_load_balanced.py'}",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    bad = rows[rows["status"] != "pass"]
    assert set(bad["status"]) == {"fail"} and set(bad["case_id"]) == {"layout-b2s10-pad-masks"}
    row = bad[bad["check"] == "property:inside:input_ids"].iloc[0]
    assert "head-tail positions [0, 1, 2, 9, 10, 11] of 12" in row["message"]
    # attention over contiguous chunks is still exact: the step's values and gradients pass
    assert (rows[rows["case_id"].str.startswith("batch-")]["status"] == "pass").all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is for machines without CUDA")
def test_cuda_only_tensor_calls_keep_the_tensor_on_the_cpu_and_are_counted():
    """Issue 42: `torch.tensor(..., pin_memory=True).cuda(non_blocking=True)` (NeMo-RL's CP all-gather backward) raises
    on a CPU machine before the backward computes anything; with the shim it is the tensor itself, counted.  Run in
    a fresh interpreter: the shim patches torch for the whole process."""
    code = (
        "import torch\n"
        "from shardcheck.harness.rank import shims\n"
        "from shardcheck.harness.rank.shims import cuda_calls\n"
        "try:\n"
        "    torch.tensor([1, 2], pin_memory=True).cuda()\n"
        "    raise SystemExit('no error without the shim')\n"
        "except (RuntimeError, AssertionError):\n"
        "    pass\n"
        "assert cuda_calls in shims.select('cpu')[0] and cuda_calls not in shims.select('cuda')[0]\n"
        "cuda_calls.install()\n"
        "t = torch.tensor([1, 2], device='cpu', pin_memory=True).cuda(non_blocking=True)\n"
        "z = torch.zeros(3, pin_memory=True).pin_memory()\n"
        "assert t.device.type == 'cpu' and t.tolist() == [1, 2] and z.tolist() == [0.0, 0.0, 0.0]\n"
        "assert cuda_calls.CALLS == 4, cuda_calls.CALLS\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
