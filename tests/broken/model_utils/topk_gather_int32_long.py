"""The fixed version of topk_gather_int32_kept.py: the local ids taken `.long()` before the int64-only op."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/broken/model_utils/
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402
from topk_gather_int32_kept import make  # noqa: E402

export_real_module(globals(), "model_utils", ChunkedDistributedGatherLogprob=make(long_ids=True))
