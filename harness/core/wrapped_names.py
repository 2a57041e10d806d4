"""A wrapped model's names mapped back to the names `build()` gave: the wrappers that hold the model one attribute
down (DDP's `module.`, FSDP1's `_fsdp_wrapped_module.`, `torch.compile`'s `_orig_mod.`, the activation-checkpoint
wrapper's `_checkpoint_wrapped_module.`) add that attribute to every name below them; the names here drop it.

FSDP1 also keeps each rank's parameters as flat 1-D pieces of a flat parameter; `gathered` is its
`summon_full_params`, inside which they are the whole parameters under their original shapes (and, with
`use_orig_params=True`, their gradients too)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from torch import nn

# (module, class, attribute): each wrapper, where torch defines it, and the attribute it holds the wrapped module
# under.  Looked up only in modules already imported (a wrapper whose module nobody imported wraps nothing), so
# that loading a model case does not import FSDP1 or dynamo (FSDP1's import alone takes about half a second).
_WRAPPERS = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "_fsdp_wrapped_module"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper", "_checkpoint_wrapped_module"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
)


def _loaded_class(module: str, name: str) -> type | None:
    found = sys.modules.get(module)
    return getattr(found, name, None) if found is not None else None


def _wrapped_attribute(module: nn.Module) -> str | None:
    """The attribute under which a wrapper holds the module it wraps; None for any other module."""
    for where, name, attr in _WRAPPERS:
        cls = _loaded_class(where, name)
        if cls is not None and isinstance(module, cls):
            return attr
    return None


class OriginalNames:
    """`name(wrapped)`: a parameter name or module path of the wrapped model as the unwrapped model has it."""

    def __init__(self, model: nn.Module) -> None:
        # the full paths of the wrapped attributes, each a path segment to drop
        self.hidden = {
            _join(path, attr)
            for path, module in model.named_modules()
            if (attr := _wrapped_attribute(module)) is not None
        }
        # torch.compile's: the harness's hooks must stay outside its graphs (torch.compiler.disable)
        self.compiled = any(path.rpartition(".")[2] == "_orig_mod" for path in self.hidden)

    def name(self, wrapped: str) -> str:
        parts = wrapped.split(".") if wrapped else []
        return ".".join(p for i, p in enumerate(parts) if ".".join(parts[: i + 1]) not in self.hidden)

    def modules(self, model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        """(original path, module) of every module but the wrappers: of the modules one path names (a wrapper and
        the module it wraps), the innermost, the one build() made."""
        named = {self.name(path): module for path, module in model.named_modules()}  # pre-order: the last is inner
        yield from named.items()

    def parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(self.name(n), p) for n, p in model.named_parameters()]


def fsdp1_modules(model: nn.Module) -> list[nn.Module]:
    fsdp = _loaded_class(*_WRAPPERS[1][:2])
    return [m for m in model.modules() if isinstance(m, fsdp)] if fsdp is not None else []


def gathered(model: nn.Module, with_grads: bool = False, writeback: bool = False) -> contextlib.AbstractContextManager:
    """Where the model has FSDP1 modules, their `summon_full_params` (every rank enters it: it all-gathers); else
    nothing.  Inside, `named_parameters()` are the whole parameters under their original names."""
    units = fsdp1_modules(model)
    if not units:
        return contextlib.nullcontext()
    return type(units[0]).summon_full_params(model, writeback=writeback, with_grads=with_grads)


def flat_parameters(model: nn.Module) -> str:
    """Why the model's FSDP1 parameters cannot be judged one by one ("" where they can): flat parameters
    (`use_orig_params=False`) have no gradient per original parameter."""
    if any(not m._use_orig_params for m in fsdp1_modules(model)):
        return "FSDP1 with flat parameters (use_orig_params=False): wrap with use_orig_params=True"
    return ""


def _join(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr
