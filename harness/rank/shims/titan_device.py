"""torchtitan's device type on a CPU machine: "cpu", not its fallback "cuda".

torchtitan 0.3.0 sets `torchtitan.tools.utils.device_type` once, at import, to the available accelerator or else
"cuda" (`device_module` to `torch.cuda`), and `torchtitan.distributed.parallel_dims` imports that name to build its
device meshes: on a CPU machine `ParallelDims.build_mesh()` then asks for CUDA meshes.  Where the device is CPU,
`install()` adds an import hook that, right after `torchtitan.tools.utils` runs, sets `device_type = "cpu"` and
`device_module = torch.cpu`; nothing else of torchtitan changes, and nothing is imported before torchtitan is.
"""

from __future__ import annotations

import importlib.util

from shardcheck.harness.rank.shims.import_hook import after_import

NAME = "torchtitan's device type (cpu instead of its cuda fallback)"
MODULE = "torchtitan.tools.utils"
CALLS = 0  # imports of torchtitan.tools.utils the hook patched in this process


def wanted() -> bool:
    return importlib.util.find_spec("torchtitan") is not None


def _to_cpu(module) -> None:
    global CALLS
    import torch

    if module.device_type != "cpu" and not torch.cuda.is_available():
        CALLS += 1
        module.device_type, module.device_module = "cpu", torch.cpu


def install() -> None:
    after_import(MODULE, _to_cpu)
