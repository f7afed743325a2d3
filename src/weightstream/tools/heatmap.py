"""A PNG heat map of a ``tune`` sweep: throughput over reads in flight x read size."""

from __future__ import annotations

from collections.abc import Sequence

from weightstream.errors import ConfigError
from weightstream.tools.probe import SweepPoint

__all__ = ["draw_heatmap"]


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def draw_heatmap(points: Sequence[SweepPoint], path: str, *, title: str) -> None:
    """Write ``path`` (PNG): rows are read sizes, columns depths, cells GB/s; the best cell is
    outlined, failed or unmeasured cells are blank."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:  # pragma: no cover - depends on the installation
        raise ConfigError("drawing the heat map needs matplotlib: pip install 'weightstream[tune]'") from None
    depths = sorted({p.depth for p in points})
    chunks = sorted({p.chunk_size for p in points})
    grid = np.full((len(chunks), len(depths)), np.nan)
    for p in points:
        if not p.error:
            grid[chunks.index(p.chunk_size), depths.index(p.depth)] = p.gb_per_s
    fig, ax = plt.subplots(figsize=(1.1 * len(depths) + 2.5, 0.7 * len(chunks) + 2))
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(len(depths)), [str(d) for d in depths])
    ax.set_yticks(range(len(chunks)), [_size(c) for c in chunks])
    ax.set_xlabel("reads in flight")
    ax.set_ylabel("read size")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="GB/s")
    if np.isfinite(grid).any():
        best = np.unravel_index(np.nanargmax(grid), grid.shape)
        low, top = np.nanmin(grid), np.nanmax(grid)
        for (r, c), v in np.ndenumerate(grid):
            if np.isfinite(v):
                dark = top > low and (v - low) / (top - low) < 0.5
                ax.text(
                    c,
                    r,
                    f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if dark else "black",
                )
        ax.add_patch(
            plt.Rectangle((best[1] - 0.5, best[0] - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2)
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
