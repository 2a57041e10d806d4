"""The room a figure's labels take, worked out before drawing: the reports lay their figures out from it instead of
matplotlib's constrained layout, whose passes measure every label again (a quarter of a model chart's CPU)."""

from __future__ import annotations

from collections.abc import Iterable

from matplotlib.font_manager import FontProperties
from matplotlib.textpath import text_to_path


def text_width(labels: Iterable, font: FontProperties) -> float:
    """The widest of `labels` in `font`, in inches."""
    widths = [text_to_path.get_text_width_height_descent(str(t), font, ismath=False)[0] / 72 for t in labels]
    return max(widths, default=0.0)
