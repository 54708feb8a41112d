"""The plot helper writes a PNG and leaves no figure open, also when drawing fails."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from sinklm.eval.plots import figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_figure_writes_a_png_and_closes_it(tmp_path: Path) -> None:
    path = tmp_path / "plot.png"
    with figure(path, ncols=2, figsize=(4, 2)) as (_, axes):
        assert len(axes) == 2
        axes[0].plot([0, 1], [1, 0])
    png = path.read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    # Width and height from the IHDR chunk: 4 x 2 inches at the 120 dpi of every sinklm plot.
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (480, 240)
    assert plt.get_fignums() == []


def test_a_failing_plot_is_closed_and_not_written(tmp_path: Path) -> None:
    path = tmp_path / "plot.png"
    with pytest.raises(RuntimeError), figure(path) as (_, ax):
        ax.plot([0, 1], [1, 0])
        raise RuntimeError("drawing failed")
    assert not path.exists()
    assert plt.get_fignums() == []
