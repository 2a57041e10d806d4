"""Undo everything a block did to some namespaces: a case that lets the module under test patch a class it does not
own (Megatron-Core's GPTModel) must leave the class, and the module's own "already patched" markers, as they were,
or every later case of the run sees a half-patched world (a restored method, a marker saying it is still patched)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

_MISSING = object()


def _dunder(key: str) -> bool:
    return key.startswith("__") and key.endswith("__")


def _undo(obj: Any, before: dict) -> None:
    """Put `obj`'s attributes (or a globals dict's entries) back to `before`."""
    if isinstance(obj, dict):
        set_, del_, now = obj.__setitem__, obj.__delitem__, dict(obj)
    else:
        set_, del_, now = (lambda k, v: setattr(obj, k, v)), (lambda k: delattr(obj, k)), dict(vars(obj))
    for key in now.keys() - before.keys():
        if not _dunder(key):
            del_(key)
    for key, value in before.items():
        if not _dunder(key) and now.get(key, _MISSING) is not value:
            set_(key, value)


@contextlib.contextmanager
def restored(*objects: Any) -> Iterator[None]:
    """Run the block, then set every attribute of `objects` (classes, modules, functions, or globals dicts) back to
    what it was: attributes added are removed, attributes changed or removed are put back.  Dunder names stay."""
    unique = list({id(o): o for o in objects if o is not None}.values())
    before = [(obj, dict(obj) if isinstance(obj, dict) else dict(vars(obj))) for obj in unique]
    try:
        yield
    finally:
        for obj, saved in before:
            _undo(obj, saved)


def owners_of(function: Any) -> list[Any]:
    """Where a patching function keeps its own markers: the globals it runs in (for a module assembled from another's
    names, those of the module that defined it, not of the one it was imported from) and its own attributes."""
    out: list[Any] = []
    function = inspect.unwrap(function)  # through the harness's keyword-call wrapper to the module's own function
    if isinstance(getattr(function, "__globals__", None), dict):
        out.append(function.__globals__)
    if isinstance(getattr(function, "__dict__", None), dict):
        out.append(function)
    return out
