"""The one way sinklm draws a figure into a file, so every plot gets the same backend,
resolution and cleanup.

matplotlib is imported when a figure is drawn, never when this module is: importing it costs
about a second, which every ``sinklm ... --help`` would otherwise pay.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 120


@contextmanager
def figure(
    path: Path | str, *, tight: bool = True, **subplots: Any
) -> Iterator[tuple[Figure, Any]]:
    """``plt.subplots(**subplots)`` as (figure, axes), saved to ``path`` when the block ends
    and closed even if drawing fails, so long evaluations never pile up open figures.

    ``tight``: lay out with ``tight_layout()`` before saving; pass False when the block lays
    the figure out itself (a ``tight_layout(rect=...)`` leaving room for a shared legend).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        if tight:
            fig.tight_layout()
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
