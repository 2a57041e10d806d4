"""`MemoryModel`: what one rank's forward and backward should allocate, from the shapes (`Case.memory`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryModel:
    """What one rank's forward and backward should allocate, from the shapes (`Case.memory`).

    `peak_bytes`: the expected peak above what existed before the step (the inputs do not count; the gradients
    the step produces do), as the CPU tracker and CUDA's allocator measure it.  `saved_bytes`: what the forward
    saves for the backward beyond its inputs.  `terms`: how the peak is made up, in words (for the report)."""

    peak_bytes: int
    saved_bytes: int = 0
    terms: str = ""
