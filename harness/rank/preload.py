"""What the fork server imports once for every CPU rank it forks (`harness/driver/pool.py`): the worker, torch and
DTensor, and torch._dynamo, which DTensor's first op imports (~0.8 s, else paid by each rank inside its first item).

Python's pattern for a process that forks without exec (the `gc` module's documentation): the collector off while
the million objects of these imports are made (it would walk them again and again: ~18 % of the import), then
frozen, so that the ranks' collections skip them and leave their pages shared.
"""

import gc

gc.disable()
import torch._dynamo  # noqa: E402,F401

import shardcheck.harness.rank.worker  # noqa: E402,F401

gc.freeze()
gc.enable()
