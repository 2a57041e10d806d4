"""Bug: the mask takes local row i's positive at column i·n, forgetting the rank offset
rank·local_batch_size: every rank but 0 masks against another query's positive."""

import torch

from distributed_impl.inbatch_neg_utils import (  # noqa: F401
    _all_gather_tensor, dist_gather_tensor, dist_gather_tensor_with_dim1_padding)


def mask_gathered_passages_same_doc_as_positive(scores, passage_doc_ids, train_n_passages, rank, local_batch_size):
    rows = torch.arange(local_batch_size, device=scores.device)
    positives = rows * train_n_passages  # should be (rank * local_batch_size + rows) * train_n_passages
    same_doc = passage_doc_ids[positives][:, None] == passage_doc_ids[None, :]
    same_doc[rows, positives] = False
    scores.masked_fill_(same_doc, torch.finfo(scores.dtype).min)
