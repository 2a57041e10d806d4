"""The example's decoder: the built-in model suite's (`shardcheck.reference.decoder`), one copy of its code."""

from shardcheck.reference.decoder import (
    Rotary,  # noqa: F401
)
