"""Bug: the mask takes local row i's positive at column i·n, forgetting the rank offset
rank·local_batch_size: every rank but 0 masks against another query's positive."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def mask_gathered_passages_same_doc_as_positive(scores, passage_doc_ids, train_n_passages, rank, local_batch_size):
    rows = torch.arange(local_batch_size, device=scores.device)
    positives = rows * train_n_passages  # should be (rank * local_batch_size + rows) * train_n_passages
    same_doc = passage_doc_ids[positives][:, None] == passage_doc_ids[None, :]
    same_doc[rows, positives] = False
    scores.masked_fill_(same_doc, torch.finfo(scores.dtype).min)


export_real_module(globals(), "inbatch_neg_utils",
                   mask_gathered_passages_same_doc_as_positive=mask_gathered_passages_same_doc_as_positive)
