"""matplotlib for the project's figures (training curves, timeline), without a display.

Design: matplotlib is an optional import for a library module; the figure modules get pyplot from
here, and a missing matplotlib becomes an error that says which figure needs it and how to get it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot(what: str) -> Any:
    """matplotlib's pyplot on the Agg backend (no display), or an ImportError saying that ``what``
    needs matplotlib and how to get it."""
    try:
        import matplotlib
    except ImportError as e:
        if e.name != "matplotlib":
            raise
        raise ImportError(
            f"{what} needs matplotlib: bin/setup installs it (or pip install matplotlib)",
            name="matplotlib",
        ) from None
    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, out: Path) -> Path:
    """Lay ``fig`` out and write it to ``out`` (its folder made), at the project's 100 dpi."""
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
