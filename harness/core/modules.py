"""The module under test of a family: its default (our `shardcheck.distributed_impl.<family>`, or the IMPLEMENTATION its
suite names) or what `--impl FAMILY=SPEC` names.  A spec is a dotted module name or a path to a .py file."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import zlib
from pathlib import Path
from types import ModuleType

from shardcheck.harness.core.options import UsageError

OUR_PACKAGE = "shardcheck.distributed_impl"  # our sharded implementations: one seed module per family


def is_ours(spec: str | None, family: str | None = None) -> bool:
    """Whether a spec (`--impl FAMILY=SPEC`, Plan.impl) is shardcheck's own implementation: None (the family's default,
    ours), else our seed module of `family`, or, with no family named, any module of ours."""
    if spec is None:
        return True
    if family is not None:
        return spec == f"{OUR_PACKAGE}.{family}"
    return str(spec).startswith(OUR_PACKAGE)


def is_path(spec: str) -> bool:
    """Whether a spec names a .py file (else it is a dotted module name)."""
    return spec.endswith(".py") or "/" in spec


def same_module(a: str | None, b: str | None) -> bool:
    """Whether two specs name the same module (paths compared resolved, from the working directory)."""
    if a is None or b is None:
        return a is b
    if is_path(a) and is_path(b):
        return Path(a).resolve() == Path(b).resolve()
    return a == b


def import_file(path: Path, prefix: str) -> ModuleType:
    """The module of a .py file, imported once per process under a name unique to its path.  As for `python
    file.py`, its folder comes *first* on sys.path, so that its own siblings (an adapter's older module, a suite's
    `reference.py`) win over anything installed; shardcheck itself is only importable as `shardcheck.*`, so it is
    never shadowed.  A failed import leaves nothing behind: a later attempt runs the file again."""
    mod_name = f"{prefix}_{zlib.crc32(str(path).encode()):08x}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    folder = str(path.parent)
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[mod_name]
        raise
    return module


def resolve_impl(family: str, spec: str, origin: str | None = None) -> ModuleType:
    """Import the module under test: a dotted module name or a path to a .py file.  `origin` names where the
    spec comes from in an error (default: `--impl FAMILY=SPEC`)."""
    origin = origin or f"--impl {family}={spec}"
    try:
        if is_path(spec):
            path = Path(spec).resolve()
            if not path.is_file():
                raise UsageError(f"{origin}: no such file")
            return import_file(path, f"shardcheck_impl_{family}")
        return importlib.import_module(spec)
    except UsageError:
        raise
    except BaseException as exc:  # an import can raise anything, SystemExit included
        raise UsageError(f"{origin}: cannot import: {type(exc).__name__}: {exc}".splitlines()[0]) from None
