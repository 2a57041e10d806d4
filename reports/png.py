"""How the reports write a figure: a PNG drawn by Agg without TrueType hinting, the figure closed after.

matplotlib hints every glyph by default (its autohinter); a report's figures are mostly text (module names, tick
labels, titles), and unhinted they draw 18-25 % faster on a CPU (a model chart 0.72 -> 0.54 CPU-s, a heatmap 0.099
-> 0.080, an error map 0.079 -> 0.065: docs/performance.md, "The tests after the GPU mends"), the glyphs' shapes
all but the same at these sizes."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import matplotlib

matplotlib.use("Agg")  # headless: CI and laptops without a display
import matplotlib.pyplot as plt  # noqa: E402


def save(fig: plt.Figure, target: Path | BinaryIO, dpi: int) -> None:
    """`fig` as a PNG at `target` (a path or a binary file), unhinted; then closed."""
    with matplotlib.rc_context({"text.hinting": "none"}):
        fig.savefig(target, format="png", dpi=dpi)
    plt.close(fig)
