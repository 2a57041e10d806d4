"""The "fixed" version of thd_prefix_mask_by_token_id.py, written as an independent implementation would be: its THD
padding mask is by position (the fix), but it still reads `batch["position_ids"]`, which the seed makes optional
("position_ids (optional)"), so a batch without them raises KeyError: 'position_ids'.  One findings line."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _to_thd(batch, padding_token_id, seq_lens_padding_value):
    input_ids, labels, position_ids = batch["input_ids"], batch["labels"], batch["position_ids"]  # bug: optional
    ids, labs, pos, mask, real, padded = [], [], [], [], [], []
    for row in range(input_ids.shape[0]):
        start = 0
        for n, p in zip(batch["seq_lens"][row].tolist(), batch["seq_lens_padded"][row].tolist()):
            if seq_lens_padding_value in (n, p):
                continue
            ids.append(input_ids[row, start:start + p])
            labs.append(labels[row, start:start + p])
            pos.append(position_ids[row, start:start + p])
            mask.append(torch.arange(p, device=input_ids.device) >= n)
            real.append(n)
            padded.append(p)
            start += p
    return {"input_ids": torch.cat(ids), "labels": torch.cat(labs), "position_ids": torch.cat(pos),
            "cu_seqlens": torch.tensor([0] + real).cumsum(0).to(torch.int32),
            "cu_seqlens_padded": torch.tensor([0] + padded).cumsum(0).to(torch.int32),
            "max_seqlen": torch.tensor(max(padded, default=0), dtype=torch.int32), "qkv_format": "thd",
            "padding_mask": torch.cat(mask)}


export_real_module(globals(), "cp_utils", _to_thd=_to_thd)
