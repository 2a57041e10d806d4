"""Run a function on a module right after it is first imported, importing nothing before (the titan shims' hook)."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable


class _Patched(importlib.abc.Loader):
    def __init__(self, loader, after: Callable):
        self.loader, self.after = loader, after

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.after(module)


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds `module` with the other finders and wraps its loader so that `after(module)` runs once it executed."""

    def __init__(self, module: str, after: Callable):
        self.module, self.after = module, after

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, AfterImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _Patched(spec.loader, self.after)
                return spec
        return None


def after_import(module: str, after: Callable) -> None:
    """Install the hook once per module name (a module already imported is patched now)."""
    if module in sys.modules:
        after(sys.modules[module])
        return
    if not any(isinstance(f, AfterImport) and f.module == module for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(module, after))
