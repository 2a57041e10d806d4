"""Shared by the broken cp_utils modules: a private copy of the real module to patch, and the seed names it
exports. Not a module under test itself.

The copy's functions look module-level names up at call time, so what a broken module patches in its copy
changes what they do, without touching distributed_impl.cp_utils itself."""

import importlib.util
from pathlib import Path
from types import ModuleType

SEED_NAMES = ("_build_position_ids", "get_train_context", "create_context_parallel_ctx", "make_cp_batch_and_ctx",
              "make_cp_batch_for_te", "_shard_thd_chunk_for_te")


def private_copy(broken_module_file: str) -> ModuleType:
    """A fresh copy of distributed_impl/cp_utils.py, named after the broken module that patches it."""
    name = "_cp_utils_" + Path(broken_module_file).stem
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parents[3] / "distributed_impl" / "cp_utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seed_api(copy: ModuleType) -> dict:
    """The seed's six names, as the (patched) copy defines them: a broken module's globals()."""
    return {name: getattr(copy, name) for name in SEED_NAMES}
