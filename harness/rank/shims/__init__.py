"""CPU shims: stand-ins for what code under test calls but cannot run here.

An implementation put under test with `--impl` may build on libraries that have no CPU path: torch
2.13's context parallelism has attention handlers for the CUDA SDPA ops only, and Transformer
Engine's THD partition is a CUDA extension.  Without help such code stops before it computes
anything on a CPU machine, and its real bugs stay unseen.  Each shim lives in its own module:

- `torch_cp_attention`: ring-attention handlers for the CPU SDPA op (and its backward) in torch's
  context-parallel dispatch; installed when the device is CPU.
- `te_thd_partition`: `transformer_engine_torch.thd_get_partitioned_indices` in plain torch;
  installed when Transformer Engine is not installed (a real install is never shadowed).
- `triton_import`: `import triton` answered by a stub for torchtitan's modules alone; installed when torchtitan is
  and Triton is not.
- `titan_device`: torchtitan's `device_type` "cpu" instead of its "cuda" fallback; installed on CPU where torchtitan
  is installed.
- `titan_grouped_experts`: torchtitan's grouped-experts forward as one matmul per expert in the input's dtype
  (`torch._grouped_mm` is a bfloat16 CUDA kernel); installed on CPU where torchtitan is installed.
- `titan_fsdp_sum`: torchtitan's FSDP modules on FSDP2's SUM path (its divide factor 1.0 is otherwise a
  PREMUL_SUM, which gloo refuses); installed on CPU where torchtitan is installed.
- `cuda_calls`: `Tensor.cuda()`, `Tensor.pin_memory()` and `pin_memory=True` leave the tensor on the CPU; installed
  on CPU where torch has no CUDA.

The worker installs them on every rank before any case runs, and `shardcheck run` in its own process
before it imports the module under test (`--no-shims`: none); the run records them in run.json
(`shims`, `shim_notes`) and the report's header.  Each counts the calls it handles; the ranks report them with each
item, and the run's notes say whether a shim was *used* (its calls on the ranks) or only *installed*.
"""

from __future__ import annotations

from shardcheck.harness.rank.shims import (
    cuda_calls,
    te_thd_partition,
    titan_device,
    titan_fsdp_sum,
    titan_grouped_experts,
    torch_cp_attention,
    triton_import,
)


def select(device: str) -> tuple[list, list[str]]:
    """(the shim modules this process needs and can take on `device`, why a needed one cannot)."""
    chosen, unavailable = [], []
    if device == "cpu":
        reason = torch_cp_attention.unavailable_reason()
        if reason:
            unavailable.append(reason)
        else:
            chosen.append(torch_cp_attention)
    if not te_thd_partition.te_installed():
        chosen.append(te_thd_partition)
    if triton_import.wanted():
        chosen.append(triton_import)
    if device == "cpu" and titan_device.wanted():
        chosen += [titan_device, titan_grouped_experts, titan_fsdp_sum]
    if device == "cpu" and cuda_calls.wanted():
        chosen.append(cuda_calls)
    return chosen, unavailable


def install(device: str) -> list[str]:
    """Install on this process every shim `select` picks; their names."""
    chosen, _ = select(device)
    for shim in chosen:
        shim.install()
    return [shim.NAME for shim in chosen]


def describe(device: str, enabled: bool) -> dict:
    """What run.json records: `shims` (names of those installed), `shim_notes` (sentences for the
    report's header)."""
    chosen, unavailable = select(device)
    names = [shim.NAME for shim in chosen]
    if not enabled:
        notes = (
            [f"ran without shardcheck's CPU shims (--no-shims): not installed for {', '.join(names)}"] if names else []
        )
        return {"shims": [], "shims_off": names, "shim_notes": notes}
    notes = [f"installed shardcheck's CPU shim for {name}" for name in names]
    return {"shims": names, "shim_notes": notes + [f"not installed: {reason}" for reason in unavailable]}


ALL = (
    torch_cp_attention,
    te_thd_partition,
    triton_import,
    titan_device,
    titan_grouped_experts,
    titan_fsdp_sum,
    cuda_calls,
)


def calls() -> dict[str, int]:
    """{shim name: calls it handled in this process so far} of every shim (0 for one not installed)."""
    return {shim.NAME: shim.CALLS for shim in ALL}


def usage_notes(meta: dict, counted: dict[str, int] | None) -> list[str]:
    """run.json's shim notes once the run ended: each installed shim *used* (the calls it handled on the ranks) or
    only *installed* (never reached by the code under test); `counted` None: the ranks did not report (a
    hand-launched worker), the notes stay as they were."""
    if counted is None:
        return list(meta.get("shim_notes", []))
    installed = set(meta.get("shims", []))
    notes = []
    for note in meta.get("shim_notes", []):
        name = next((n for n in installed if note == f"installed shardcheck's CPU shim for {n}"), None)
        if name is None:
            notes.append(note)
        elif counted.get(name, 0):
            notes.append(f"used shardcheck's CPU shim for {name}: {counted[name]} call(s) on the ranks")
        else:
            notes.append(f"installed shardcheck's CPU shim for {name}, never called by the code under test")
    return notes
