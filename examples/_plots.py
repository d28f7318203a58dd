"""Small matplotlib helpers shared by the examples: one image panel, and saving."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: the examples run headless, in tests too
import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import AxesImage

SIGNED = "RdBu_r"  # diverging: red raises the target, blue lowers it, white is zero
POSITIVE = "magma"


def show_digit(ax: Axes, image: torch.Tensor, title: str) -> None:
    ax.imshow(image.squeeze().numpy(), cmap="gray_r", vmin=0, vmax=1)
    _finish(ax, title)


def show_signed(fig: Figure, ax: Axes, values: torch.Tensor, title: str, *, limit: float | None = None,
                bar: bool = True) -> AxesImage:
    """A signed map on a symmetric scale (``±limit``, default its own max), so white always means zero."""
    limit = limit or float(values.abs().max()) or 1.0
    image = ax.imshow(values.squeeze().detach().numpy(), cmap=SIGNED, vmin=-limit, vmax=limit)
    if bar:
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    _finish(ax, title)
    return image


def show_positive(fig: Figure, ax: Axes, values: torch.Tensor, title: str, *, limit: float | None = None,
                  bar: bool = True) -> AxesImage:
    """A non-negative map (|gradient|, ReLU'd Grad-CAM, spread) from zero up (to ``limit``, default its max)."""
    image = ax.imshow(values.squeeze().detach().numpy(), cmap=POSITIVE, vmin=0, vmax=limit)
    if bar:
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    _finish(ax, title)
    return image


def _finish(ax: Axes, title: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def save(fig: Figure, out_dir: Path, name: str) -> Path:
    path = out_dir / name
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
