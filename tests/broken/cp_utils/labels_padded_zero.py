"""Bug: the batch is padded to a multiple of 2·CP with label 0 instead of -100 (padded tokens enter the loss)."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import cp_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402

export_real_module(globals(), "cp_utils", PAD_FILLS={**good.PAD_FILLS, "labels": 0})
