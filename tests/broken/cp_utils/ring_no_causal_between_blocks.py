"""Bug: the ring attention applies the causal mask only inside a chunk; every other chunk pair,
future ones included, is treated as fully visible."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _chunk_visibility(q_chunk: int, k_chunk: int) -> str:
    return "causal" if q_chunk == k_chunk else "full"


export_real_module(globals(), "cp_utils", _chunk_visibility=_chunk_visibility)
