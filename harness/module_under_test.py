"""The module under test of a family: our `distributed_impl.<family>` or what `--impl FAMILY=SPEC` names."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import zlib
from pathlib import Path
from types import ModuleType

from harness.topology import UsageError


def resolve_impl(family: str, spec: str) -> ModuleType:
    """Import the module under test: a dotted module name or a path to a .py file."""
    try:
        if spec.endswith(".py") or "/" in spec:
            path = Path(spec).resolve()
            if not path.is_file():
                raise UsageError(f"--impl {family}={spec}: no such file")
            # As for `python file.py`, the file's own folder is importable: a module under test may import its
            # siblings (an adapter the older module it adapts).  Appended, so it shadows nothing installed.
            if str(path.parent) not in sys.path:
                sys.path.append(str(path.parent))
            mod_name = f"shardcheck_impl_{family}_{zlib.crc32(str(path).encode()):08x}"
            if mod_name in sys.modules:
                return sys.modules[mod_name]
            module_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[mod_name] = module
            module_spec.loader.exec_module(module)
            return module
        return importlib.import_module(spec)
    except UsageError:
        raise
    except BaseException as exc:  # an import can raise anything, SystemExit included
        raise UsageError(f"--impl {family}={spec}: cannot import: {type(exc).__name__}: {exc}".splitlines()[0]) from None
