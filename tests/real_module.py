"""How every deliberately wrong (or different) implementation in tests/ is made: the real one, names replaced.

A module in tests/broken/, tests/fixtures/ or tests/impls/ ends with

    export_real_module(globals(), "cp_utils", _compute_dtype=_float32)

which loads a private copy of distributed_impl/<family>.py, puts each replacement in place of the copy's own
name and adds every name of the copy to the module's globals (its own names stay its own).  The copy's
functions look module-level names up when they are called, so a replaced helper changes every op that uses
it: the module under test is the real one with exactly those names changed.  Replacements reach the correct
code through the real module itself (`from distributed_impl import cp_utils as good`), never the copy.

The modules are loaded by file path (`--impl FAMILY=path`), so they find this one through sys.path:

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ (parents[1] from tests/impls/)
    from real_module import export_real_module  # noqa: E402
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

IMPL_DIR = Path(__file__).resolve().parent.parent / "distributed_impl"


def export_real_module(namespace: dict[str, Any], family: str, source: Path | None = None, **replacements: Any) -> None:
    """Add to `namespace` every name of a fresh copy of distributed_impl/<family>.py (or of `source`, another
    implementation of the family, e.g. one in tests/impls/) that it does not define itself, `replacements` in
    place of the copy's own."""
    name = f"_real_{family}_copy{len([m for m in sys.modules if m.startswith(f'_real_{family}_copy')])}"
    spec = importlib.util.spec_from_file_location(name, source or IMPL_DIR / f"{family}.py")
    copy = importlib.util.module_from_spec(spec)
    sys.modules[name] = copy  # dataclasses and pickling look their module up by name
    spec.loader.exec_module(copy)
    unknown = [n for n in replacements if not hasattr(copy, n)]
    if unknown:
        raise AttributeError(
            f"{source or 'shardcheck.distributed_impl.' + family} has no {', '.join(unknown)} to replace"
        )
    for key, value in replacements.items():
        setattr(copy, key, value)
    for key, value in vars(copy).items():
        if not (key.startswith("__") and key.endswith("__")):
            namespace.setdefault(key, value)
