"""An older API, not a bug of values: KDLoss without `chunk_size` (as upstream's before chunking, T² and TP were
there since), otherwise right.  Called as its callers call it (the seed's defaults left out), every case without
chunking is judged on its values and passes; a case that sets chunk_size raises on the signature's line."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import kd_loss as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class KDLoss(good.KDLoss):
    def __init__(self, ignore_index: int = -100, temperature: float = 1.0, fp32_upcast: bool = True, tp_group=None):
        super().__init__(ignore_index, temperature, fp32_upcast, tp_group)


export_real_module(globals(), "kd_loss", KDLoss=KDLoss)
