"""Single-device references.  Their softmax-family math runs in `math_dtype(dtype)`: float32 at
least (docs/ops/README.md), float64 stays float64.  `low_precision_math()` turns the upcast off, so the same
reference does its math in the input dtype: the harness uses it to tell "bfloat16 math" (a design
difference, `warn`) from a sharding bug in a bfloat16 result that misses its budget."""

from __future__ import annotations

from contextlib import contextmanager

import torch

_upcast = [True]


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reference computes in for inputs of `dtype`."""
    return torch.promote_types(dtype, torch.float32) if _upcast[0] else dtype


@contextmanager
def low_precision_math():
    """References compute in their inputs' dtype (no float32 upcast) inside this block."""
    _upcast[0] = False
    try:
        yield
    finally:
        _upcast[0] = True
