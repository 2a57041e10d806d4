"""Whether an error is the consequence of a peer's failure (its connection closed, a collective it left, a wait on
it timed out) rather than a cause: the one test the worker and the fresh-rank runner both use."""

from __future__ import annotations

import re

import torch.distributed as dist

# What gloo, the TCP store and the sockets under them say when the other side has gone or never came.
PEER_FAILURE = re.compile(
    r"closed by peer|reset by peer|Broken pipe|Connection refused|pair closure|timed out|Timeout|"
    r"aborted",
    re.I,
)


def is_peer_failure(error: BaseException | str) -> bool:
    """An exception (by its type where torch gives one: a lost store connection), or an error's text."""
    if isinstance(error, dist.DistNetworkError):
        return True
    return bool(PEER_FAILURE.search(str(error)))
