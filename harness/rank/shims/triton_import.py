"""An import-only stand-in for `triton`, resolvable by torchtitan's modules alone.

torchtitan 0.3.0 imports Triton at module level in `distributed/minimal_async_ep/kernels.py` (reached by every
model that builds a MoE token dispatcher), to define GPU kernels of a backend a CPU run never selects.  Where Triton
is not installed, `install()` adds a finder that answers `import triton` / `import triton.language` with a stub, only
when the importing module is torchtitan's (any other importer, torch's own probes included, still finds no
Triton).  The stub defines what those modules evaluate at import (`triton.jit`, `triton.language.constexpr`, any
other `tl.` name as a callable placeholder); launching a kernel raises a RuntimeError naming it.  A real install is
never shadowed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

NAME = "Triton imported by torchtitan (import-only stub)"
MODULES = ("triton", "triton.language")
IMPORTER = "torchtitan."
CALLS = 0  # imports the stub answered in this process


def triton_installed() -> bool:
    finder = next((f for f in sys.meta_path if isinstance(f, _Finder)), None)
    try:
        if finder is not None:
            sys.meta_path.remove(finder)
        return importlib.util.find_spec("triton") is not None
    finally:
        if finder is not None:
            sys.meta_path.insert(0, finder)


def wanted() -> bool:
    """Whether this process needs the stub: torchtitan installed, Triton not."""
    return importlib.util.find_spec("torchtitan") is not None and not triton_installed()


class _Kernel:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise RuntimeError(
            f"Triton kernel {getattr(self.fn, '__name__', self.fn)!r} cannot run: Triton is not installed "
            "(shardcheck's import-only stand-in for torchtitan's import of it)"
        )

    def __call__(self, *args, **kwargs):
        return self[None]


def _jit(fn=None, **options):
    return _Kernel(fn) if fn is not None else _Kernel


class _Placeholder:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<triton stub {self.name}>"

    def __call__(self, *args, **kwargs) -> _Placeholder:  # a type made at import: tl.pointer_type(tl.int64)
        return _Placeholder(f"{self.name}(...)")


def _language_getattr(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(f"triton.language.{name}")


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__shardcheck_stub__ = True
    if name == "triton":
        module.__path__ = []
        module.__version__ = "0.0.0+shardcheck-stub"
        module.jit = _jit
        module.cdiv = lambda a, b: (a + b - 1) // b
    else:
        module.constexpr = type("constexpr", (), {})
        module.__getattr__ = _language_getattr
    return module


def _importer() -> str:
    """The module whose `import` statement is being resolved (the first frame outside the import machinery)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(("importlib", "_frozen_importlib", __name__)):
            return name
        frame = frame.f_back
    return ""


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULES:
            return None
        importer = _importer()
        if not (importer.startswith(IMPORTER) or importer in MODULES):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == "triton")

    def create_module(self, spec):
        global CALLS
        CALLS += 1
        return _module(spec.name)

    def exec_module(self, module) -> None:
        if module.__name__ == "triton.language":
            sys.modules["triton"].language = module


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())  # last: a real Triton, where one is installed, is found first
