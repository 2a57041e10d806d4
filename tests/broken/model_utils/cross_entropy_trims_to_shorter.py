"""BUG (bad input, silent return): DistributedCrossEntropy given student and target logits of different sequence
lengths trims both to the shorter one and returns its cross entropy, where no answer is documented: a caller's
misaligned batch goes unnoticed."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class DistributedCrossEntropy(good.DistributedCrossEntropy):
    @staticmethod
    def forward(ctx, student_logits, target_logits, group, inference_only=False):
        s = min(student_logits.shape[1], target_logits.shape[1])
        return good.DistributedCrossEntropy.forward(ctx, student_logits[:, :s], target_logits[:, :s], group,
                                                    inference_only)


export_real_module(globals(), "model_utils", DistributedCrossEntropy=DistributedCrossEntropy)
