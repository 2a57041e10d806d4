"""Bug: the batch is padded to a multiple of 2·CP with label 0 instead of -100 (padded tokens enter the loss)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _private_copy import private_copy, seed_api  # noqa: E402

_m = private_copy(__file__)  # patched below

_m.PAD_FILLS = {**_m.PAD_FILLS, "labels": 0}

globals().update(seed_api(_m))  # the six seed names, as patched
