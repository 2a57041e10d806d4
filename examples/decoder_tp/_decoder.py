"""The example's decoder: the built-in model suite's (`shardcheck.reference.decoder`), one copy of its code."""

from shardcheck.reference.decoder import (
    Attention,
    Block,
    Config,
    Decoder,
    FeedForward,
    RMSNorm,
    Rotary,
    build,
)

__all__ = ["Attention", "Block", "Config", "Decoder", "FeedForward", "RMSNorm", "Rotary", "build"]
