"""NOT A SEED BUG (an early upstream make_cp_batch_and_ctx, before it padded): a sequence 2·CP does not divide is
sharded as torch's own context_parallel shards it then, in contiguous chunks with load balancing off (attention stays
exact), and the loss_mask argument is sharded in place, not returned in the batch.  Padding to a multiple of 2·CP and
returning loss_mask in the batch are our rules (docs/ops/cp_utils.md): a warn under them, never a failure cited as the
seed's "accordingly sharded"."""

import contextlib
import sys
from pathlib import Path

from shardcheck.distributed_impl import cp_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


@contextlib.contextmanager
def _contiguous(cp_mesh, buffers, no_restore):
    """Each buffer replaced in place by this rank's contiguous chunk of dim 1, as torch does without load balancing;
    buffers not in `no_restore` put back on exit."""
    full = [b.clone() for b in buffers]
    for b in buffers:
        piece = b.chunk(cp_mesh.size(), dim=1)[cp_mesh.get_local_rank()].clone()
        b.resize_(piece.shape)
        b.copy_(piece)
    yield
    for b, whole in zip(buffers, full):
        if not any(b is n for n in no_restore):
            b.resize_(whole.shape)
            b.copy_(whole)


def make_cp_batch_and_ctx(device_mesh, batch, loss_mask=None, **kwargs):
    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    cp_mesh = device_mesh["cp"] if "cp" in names else None
    if cp_mesh is None or cp_mesh.size() == 1 or kwargs.get("use_te"):
        return good.make_cp_batch_and_ctx(device_mesh, batch, loss_mask=loss_mask, **kwargs)
    batch.pop("attention_mask", None)
    if "position_ids" not in batch:
        batch["position_ids"] = good.torch.arange(batch["input_ids"].shape[1])[None]
    keys = [k for k in ("input_ids", "labels", "position_ids", "padding_mask") if k in batch]
    buffers = [batch[k] for k in keys] + ([loss_mask] if loss_mask is not None else [])
    no_restore = [b for k, b in zip(keys, buffers) if k != "position_ids"] + buffers[len(keys) :]
    return (lambda: _contiguous(cp_mesh, buffers, no_restore)), batch


export_real_module(globals(), "cp_utils", make_cp_batch_and_ctx=make_cp_batch_and_ctx)
