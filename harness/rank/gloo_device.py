"""One gloo transport device for every gloo process group of a rank.

torch 2.13 gives each gloo process group a device of its own (`ProcessGroupGloo(store, rank, size, timeout)`), and
each device an event-loop thread that wakes every 10 ms (gloo's `tcp::Loop`).  A rank holds a group per mesh
dimension of every topology it has run (about 35 at world size 4), and a launch kept idle in the pool keeps them
all: on a 2-core machine those wake-ups were a sixth of the CPU the tests spend (docs/performance.md, "The gloo
event loops").  gloo's devices serve any number of groups (each group's pairs register with the device's loop),
and torch builds a group from options naming its devices (`ProcessGroupGloo(store, rank, size, options)`), so a
rank builds its gloo groups on one device (one per `GLOO_SOCKET_IFNAME` interface, as torch does), made once.

What a group does is unchanged: its collectives, its timeout, its worker threads (two per device, as torch's), its
errors (a wrong size still aborts the rank from the loop thread).  `SHARDCHECK_GLOO_SHARED_DEVICE=0` in the run's
environment (the ranks inherit it) keeps torch's device per group: to measure the difference, or rule it out.
"""

from __future__ import annotations

import os
from datetime import timedelta

from torch.distributed import distributed_c10d

SWITCH = "SHARDCHECK_GLOO_SHARED_DEVICE"
_IFNAME = "GLOO_SOCKET_IFNAME"  # torch's own variable: the interfaces its gloo devices use


def install() -> None:
    """From now on, every gloo process group this process makes uses the process's one device (per interface).
    Call before `init_process_group`; idempotent."""
    if os.environ.get(SWITCH) == "0" or not distributed_c10d.is_gloo_available():
        return
    base = distributed_c10d.ProcessGroupGloo
    if getattr(base, "shares_one_device", False):
        return
    devices = []

    class SharedDeviceGloo(base):
        """torch's ProcessGroupGloo, built on the process's device(s) instead of new ones."""

        shares_one_device = True

        def __init__(self, store, rank: int, size: int, timeout: timedelta = timedelta(minutes=30)):
            if not devices:
                devices.extend(_new_devices())
            options = base._Options()
            options._devices = devices
            options._timeout = timeout
            options._threads = 2 * len(devices)  # as torch sets them for its own devices
            super().__init__(store, rank, size, options)

    SharedDeviceGloo.__name__ = SharedDeviceGloo.__qualname__ = base.__name__  # as torch names it in messages
    distributed_c10d.ProcessGroupGloo = SharedDeviceGloo


def _new_devices() -> list:
    """The devices torch would make for one group: one per interface named in GLOO_SOCKET_IFNAME, else the host's."""
    gloo = distributed_c10d.ProcessGroupGloo
    interfaces = [name for name in os.environ.get(_IFNAME, "").split(",") if name]
    if interfaces:
        return [gloo.create_device(interface=name) for name in interfaces]
    return [gloo.create_default_device()]
