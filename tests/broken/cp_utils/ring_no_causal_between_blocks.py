"""Bug: the ring attention applies the causal mask only inside a chunk; every other chunk pair,
future ones included, is treated as fully visible."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _private_copy import private_copy, seed_api  # noqa: E402

_m = private_copy(__file__)  # patched below

_m._chunk_visibility = lambda q_chunk, k_chunk: "causal" if q_chunk == k_chunk else "full"

globals().update(seed_api(_m))  # the six seed names, as patched
