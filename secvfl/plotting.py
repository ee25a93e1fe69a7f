"""The one matplotlib setup of every PNG secvfl writes (run curves, attack plots, sweeps, reproductions).

Figures are :class:`matplotlib.figure.Figure` objects on the Agg canvas, never pyplot's: pyplot keeps every open
figure in process-wide state until it is closed and picks a backend (a GUI one where a display exists), so a plot
drawn in a worker thread, or one that raises before its ``close``, leaks or interferes with others. A figure made
here belongs to its caller alone and is freed with it; nothing needs closing. matplotlib is imported on the first
figure, so commands that draw nothing do not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from secvfl.io import save_figure_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["new_figure", "save_figure_atomic"]


def new_figure(figsize: tuple[float, float], *, dpi: float | None = None) -> Figure:
    """A new figure of ``figsize`` inches on its own Agg canvas (``dpi``: matplotlib's default unless given; the
    saved PNG's resolution is :func:`save_figure_atomic`'s ``dpi``). Add axes with ``fig.subplots(...)``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)  # binds itself to fig: fig.canvas draws and measures text without pyplot
    return fig
