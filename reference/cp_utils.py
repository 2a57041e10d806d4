"""Single-device references for cp_utils: the tiny causal attention step the CP context must
reproduce, the padded batch make_cp_batch_and_ctx shards, and the BSHD -> THD conversion.

Plain torch, any float dtype; no sharding anywhere.  `attention_block_loss` is also the model the
suite runs inside the CP context: its SDPA call goes through the module attribute
`torch.nn.functional.scaled_dot_product_attention`, so the context's replacement is what runs there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PARAM_NAMES = ("embed", "pos_embed", "wqkv", "wo", "lm_head")


def attention_block_loss(
    params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], num_valid: torch.Tensor, n_heads: int
) -> torch.Tensor:
    """Token cross-entropy of a one-layer causal attention block, summed over the valid tokens
    (labels != -100 and loss_mask != 0) and divided by `num_valid` (the global count).

    embedding (or inputs_embeds) + position embedding (mRoPE ids [3, B, S]: the sum of the three)
    -> q, k, v -> causal SDPA -> output projection + residual -> logits -> cross-entropy.
    An `attention_mask` [B, S] in the batch is honoured like a key-padding mask on top of causal."""
    h = batch["inputs_embeds"] if batch.get("inputs_embeds") is not None else params["embed"][batch["input_ids"]]
    pos = batch.get("position_ids")
    if pos is None:  # as a HF model does: positions 0..S-1
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    if pos.dim() == 3:
        h = h + sum(params["pos_embed"][pos[c]] for c in range(pos.shape[0]))
    else:
        h = h + params["pos_embed"][pos]
    b, s, hidden = h.shape
    head_dim = hidden // n_heads
    qkv = torch.matmul(h, params["wqkv"].t()).view(b, s, 3, n_heads, head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    mask = batch.get("attention_mask")
    if mask is not None:
        causal = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & mask.bool()[:, None, None, :])
    else:
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = torch.matmul(attn.transpose(1, 2).reshape(b, s, hidden), params["wo"].t()) + h
    logits = torch.matmul(out, params["lm_head"].t())
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100, reduction="none"
    )
    loss_mask = batch.get("loss_mask")
    if loss_mask is not None:
        ce = ce * loss_mask.reshape(-1).to(ce.dtype)
    return ce.sum() / num_valid


def count_valid(labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    valid = labels != -100
    if loss_mask is not None:
        valid = valid & (loss_mask != 0)
    return valid.sum()


def padded_batch(batch: dict[str, torch.Tensor], cp_size: int) -> dict[str, torch.Tensor]:
    """What make_cp_batch_and_ctx holds before sharding: attention_mask dropped, position_ids
    arange(S) when missing, every buffer right-padded to a multiple of 2·CP (labels -100,
    padding_mask True, floats 0, ids 0)."""
    out = {k: v for k, v in batch.items() if k != "attention_mask"}
    primary = out["input_ids"] if out.get("input_ids") is not None else out["inputs_embeds"]
    bsz, s = primary.shape[:2]
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(s).unsqueeze(0).expand(bsz, s)
    pad = -s % (2 * cp_size)
    for name, t in list(out.items()):
        if name not in ("input_ids", "inputs_embeds", "labels", "position_ids", "loss_mask", "padding_mask"):
            continue
        dim = 2 if name == "position_ids" and t.dim() == 3 else 1
        fill = -100 if name == "labels" else (True if name == "padding_mask" else 0)
        shape = list(t.shape)
        shape[dim] = pad
        out[name] = torch.cat([t, torch.full(shape, fill, dtype=t.dtype)], dim)
    return out


def thd_batch(
    batch: dict[str, torch.Tensor], padding_token_id: int = 0, num_chunks: int = 1, seq_lens_padding_value: int = -1000
) -> dict[str, torch.Tensor]:
    """BSHD -> THD on one device (no CP partition).  A pack is absent when its seq_lens_padded
    entry is the sentinel.  padding_mask: True past each sequence's real length (by position)."""
    bsz = batch["input_ids"].shape[0]
    per = bsz // num_chunks
    chunks = []
    for c in range(num_chunks):
        rows = range(c * per, (c + 1) * per)
        keep_ids, keep_labels, keep_pos, keep_pad, lens, lens_padded = [], [], [], [], [], []
        for row in rows:
            start = 0
            for real, padded in zip(batch["seq_lens"][row].tolist(), batch["seq_lens_padded"][row].tolist()):
                if padded == seq_lens_padding_value:
                    continue
                idx = torch.arange(start, start + padded)
                keep_ids.append(batch["input_ids"][row][idx])
                keep_labels.append(batch["labels"][row][idx])
                keep_pos.append(batch["position_ids"][row][idx] if "position_ids" in batch else idx - start)
                keep_pad.append(idx - start >= real)
                lens.append(real)
                lens_padded.append(padded)
                start += padded
        chunks.append(
            {
                "input_ids": torch.cat(keep_ids),
                "labels": torch.cat(keep_labels),
                "position_ids": torch.cat(keep_pos),
                "padding_mask": torch.cat(keep_pad),
                "cu_seqlens": torch.cumsum(torch.tensor([0] + lens), 0).to(torch.int32),
                "cu_seqlens_padded": torch.cumsum(torch.tensor([0] + lens_padded), 0).to(torch.int32),
                "max_seqlen": torch.tensor(max(lens_padded), dtype=torch.int32),
            }
        )
    if num_chunks == 1:
        return chunks[0]
    fills = {
        "input_ids": padding_token_id,
        "labels": -100,
        "position_ids": 0,
        "padding_mask": True,
        "cu_seqlens": seq_lens_padding_value,
        "cu_seqlens_padded": seq_lens_padding_value,
    }
    out = {}
    for key, fill in fills.items():
        longest = max(ch[key].shape[0] for ch in chunks)
        rows = []
        for ch in chunks:
            t = ch[key]
            extra = torch.full((longest - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype)
            rows.append(torch.cat([t, extra]))
        out[key] = torch.stack(rows)
    out["max_seqlen"] = max(ch["max_seqlen"] for ch in chunks)
    return out
