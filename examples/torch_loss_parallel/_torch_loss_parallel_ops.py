"""The module under test of the torch_loss_parallel example suite: PyTorch's own functions, under the names the
suite calls.  Another module defining these names (a patched loss_parallel, say) is put under test with
`shardcheck run --suite-path examples/torch_loss_parallel --impl torch_loss_parallel=path/to/module.py`.
"""

from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.functional import cross_entropy, log_softmax, nll_loss

__all__ = ["loss_parallel", "cross_entropy", "nll_loss", "log_softmax"]
