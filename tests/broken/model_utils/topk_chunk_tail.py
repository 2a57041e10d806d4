"""BUG: distributed_vocab_topk's chunk loop runs to S - 1 (a next-token habit), so a last chunk of one position is
never computed: the result loses its last position when S % chunk_size == 1, chunk_size is 1, or S is 1.  The
fixed matrix's top-k cases (S 4..8, chunks None, 3, 2) never leave a chunk of one position; `shardcheck fuzz`
draws them."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def distributed_vocab_topk(vocab_parallel_logits, k, tp_group, *, vocab_start_index, vocab_end_index,
                           chunk_size=None):
    S = vocab_parallel_logits.shape[1]
    step = S if chunk_size is None else chunk_size
    vals, ids = [], []
    for s0 in range(0, S - 1, step):
        v, i = good.distributed_vocab_topk(vocab_parallel_logits[:, s0:s0 + step], k, tp_group,
                                           vocab_start_index=vocab_start_index, vocab_end_index=vocab_end_index)
        vals.append(v)
        ids.append(i)
    return torch.cat(vals, dim=1), torch.cat(ids, dim=1)


export_real_module(globals(), "model_utils", distributed_vocab_topk=distributed_vocab_topk)
