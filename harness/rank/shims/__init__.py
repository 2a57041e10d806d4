"""CPU shims: stand-ins for what code under test calls but cannot run here.

An implementation put under test with `--impl` may build on libraries that have no CPU path: torch
2.13's context parallelism has attention handlers for the CUDA SDPA ops only, and Transformer
Engine's THD partition is a CUDA extension.  Without help such code stops before it computes
anything on a CPU machine, and its real bugs stay unseen.  Each shim lives in its own module:

- `torch_cp_attention`: ring-attention handlers for the CPU SDPA op (and its backward) in torch's
  context-parallel dispatch; installed when the device is CPU.
- `te_thd_partition`: `transformer_engine_torch.thd_get_partitioned_indices` in plain torch;
  installed when Transformer Engine is not installed (a real install is never shadowed).

The worker installs them on every rank before any case runs, and `shardcheck run` in its own process
before it imports the module under test (`--no-shims`: none); the run records them in run.json
(`shims`, `shim_notes`) and the report's header.
"""

from __future__ import annotations

from shardcheck.harness.rank.shims import te_thd_partition, torch_cp_attention


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
        notes = [f"ran without shardcheck's CPU shims (--no-shims): not installed for {', '.join(names)}"] if names else []
        return {"shims": [], "shims_off": names, "shim_notes": notes}
    notes = [f"ran with shardcheck's CPU shim for {name}" for name in names]
    return {"shims": names, "shim_notes": notes + [f"not installed: {reason}" for reason in unavailable]}
