"""Bug: the positive column is masked along with its duplicates (no exception for column p)."""

import torch

from distributed_impl.inbatch_neg_utils import (  # noqa: F401
    _all_gather_tensor, dist_gather_tensor, dist_gather_tensor_with_dim1_padding)


def mask_gathered_passages_same_doc_as_positive(scores, passage_doc_ids, train_n_passages, rank, local_batch_size):
    rows = torch.arange(local_batch_size, device=scores.device)
    positives = (rank * local_batch_size + rows) * train_n_passages
    same_doc = passage_doc_ids[positives][:, None] == passage_doc_ids[None, :]  # includes column p itself
    scores.masked_fill_(same_doc, torch.finfo(scores.dtype).min)
