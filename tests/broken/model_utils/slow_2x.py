"""BUG (cost only): DistributedLogprob computes the real op twice and returns the first result: twice the
forward work, twice the forward collectives, and the second pass's working set on top of the first's
saved softmax. Values, gradients and the per-call traffic pattern are right; only a benchmark sees it."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation

from distributed_impl import model_utils as good


class DistributedLogprob:
    @staticmethod
    def apply(*args):
        first = good.DistributedLogprob.apply(*args)
        good.DistributedLogprob.apply(*args)  # the same work again, result dropped
        return first
