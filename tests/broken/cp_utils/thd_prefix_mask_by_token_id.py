"""A copy taken just before a real fix, written as an independent implementation would be: the THD padding mask is
`input_ids == padding_token_id` (real tokens that share the pad id are masked: the bug the fix removed), and it reads
`batch["position_ids"]`, which the seed makes optional (KeyError: 'position_ids'; the fixed version,
thd_fixed_requires_position_ids.py, keeps that one).  Two findings lines; the fixed version prints only the second."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _to_thd(batch, padding_token_id, seq_lens_padding_value):
    input_ids, labels, position_ids = batch["input_ids"], batch["labels"], batch["position_ids"]  # bug: optional
    ids, labs, pos, real, padded = [], [], [], [], []
    for row in range(input_ids.shape[0]):
        start = 0
        for n, p in zip(batch["seq_lens"][row].tolist(), batch["seq_lens_padded"][row].tolist()):
            if seq_lens_padding_value in (n, p):
                continue
            ids.append(input_ids[row, start:start + p])
            labs.append(labels[row, start:start + p])
            pos.append(position_ids[row, start:start + p])
            real.append(n)
            padded.append(p)
            start += p
    ids = torch.cat(ids)
    return {"input_ids": ids, "labels": torch.cat(labs), "position_ids": torch.cat(pos),
            "cu_seqlens": torch.tensor([0] + real).cumsum(0).to(torch.int32),
            "cu_seqlens_padded": torch.tensor([0] + padded).cumsum(0).to(torch.int32),
            "max_seqlen": torch.tensor(max(padded, default=0), dtype=torch.int32), "qkv_format": "thd",
            "padding_mask": ids == padding_token_id}  # bug: by token id, not by position


export_real_module(globals(), "cp_utils", _to_thd=_to_thd)
