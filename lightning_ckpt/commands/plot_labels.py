"""Point labels on the commands' plots (``plan.png``, ``compare.png``) placed where they overlap nothing.

Each point's label is an annotation drawn at an offset from its point; :func:`place_labels` moves it to the nearest
offset where it stays inside the axes and overlaps no label placed before it, no marker and not the legend.

Example::

    labels = [ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 5), arrowprops=LEADER)
              for name, x, y in points]
    fig.tight_layout()  # first: the labels are placed on the final layout
    place_labels(ax, labels, [(x, y, 6) for _, x, y in points])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["LABEL_SPOTS", "LEADER", "place_labels"]

#: Where a point's label may go, nearest first: (dx, dy) in points from the point, and the text's alignment.
LABEL_SPOTS = [(dx * r, dy * r, "left" if dx > 0 else "right" if dx < 0 else "center",
                "bottom" if dy > 0 else "top" if dy < 0 else "center")
               for r in (1, 2, 3.5, 5)
               for dx, dy in ((6, 5), (6, -5), (-6, 5), (-6, -5), (0, 9), (0, -9), (9, 0), (-9, 0))]

#: The ``arrowprops`` of a label's line to its point, shown only when the label is placed away from it.
LEADER = {"arrowstyle": "-", "color": "tab:gray", "lw": 0.6, "shrinkA": 1, "shrinkB": 4}


def place_labels(ax: Any, labels: Sequence[Any], markers: Sequence[tuple[float, float, float]]) -> None:
    """Move each label (an annotation of a point, in ``labels``' order: the first placed first) to the nearest spot of
    :data:`LABEL_SPOTS` where it overlaps no label placed before it, none of ``markers`` (``(x, y, diameter)``: data
    coordinates and points) and not the legend, and stays inside ``ax``; where every spot overlaps, the one that
    overlaps least. A label placed away from its point shows its line to it (an annotation made with
    ``arrowprops=LEADER``). Call it after the figure's layout is final (``tight_layout``)."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    taken = [] if ax.get_legend() is None else [ax.get_legend().get_window_extent(renderer)]
    for x, y, diameter in markers:
        (px, py), half = ax.transData.transform((x, y)), diameter / 2 * ax.figure.dpi / 72
        taken.append(Bbox.from_extents(px - half, py - half, px + half, py + half))

    def overlap(a: Any, b: Any) -> float:
        return max(0.0, min(a.x1, b.x1) - max(a.x0, b.x0)) * max(0.0, min(a.y1, b.y1) - max(a.y0, b.y0))

    def move(label: Any, spot: tuple[float, float, str, str]) -> Any:
        label.xyann = spot[:2]
        label.set_horizontalalignment(spot[2])
        label.set_verticalalignment(spot[3])
        label.update_positions(renderer)  # where the text goes for the new offset
        return Text.get_window_extent(label, renderer)  # the text alone: an Annotation's own adds its line

    for label in labels:
        scored = []
        for i, spot in enumerate(LABEL_SPOTS):
            box = move(label, spot)
            score = sum(overlap(box, other) for other in taken) + box.width * box.height - overlap(box, inside)
            scored.append((score, i))
            if score == 0:
                break
        spot = LABEL_SPOTS[min(scored)[1]]
        taken.append(move(label, spot))
        if label.arrow_patch is not None:
            label.arrow_patch.set_visible(spot not in LABEL_SPOTS[:8])
