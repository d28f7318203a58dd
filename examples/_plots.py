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


def robust_limit(values: torch.Tensor, quantile: float = 0.99) -> float:
    """The ``quantile`` of the non-zero ``|values|``: a colour scale a few extreme pixels do not flatten.

    Attribution maps are heavy-tailed: one pixel can be ten times the rest, and a scale set by
    the max then shows the rest as zero. Pixels beyond the limit saturate (the colour bar's
    ends). Zeros (a blank background) are left out so that they do not pull the scale down;
    an all-zero map gets 1.
    """
    magnitudes = values.detach().abs().flatten().float()
    magnitudes = magnitudes[magnitudes > 0]
    if magnitudes.numel() == 0:
        return 1.0
    return float(torch.quantile(magnitudes, quantile))


def show_signed(fig: Figure, ax: Axes, values: torch.Tensor, title: str, *, limit: float | None = None,
                bar: bool = True, label: str | None = None) -> AxesImage:
    """A signed map on a symmetric scale (``±limit``, default `robust_limit`), so white always means zero."""
    limit = limit or robust_limit(values)
    image = ax.imshow(values.squeeze().detach().numpy(), cmap=SIGNED, vmin=-limit, vmax=limit)
    if bar:
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label=label)
    _finish(ax, title)
    return image


def show_positive(fig: Figure, ax: Axes, values: torch.Tensor, title: str, *, limit: float | None = None,
                  bar: bool = True, label: str | None = None) -> AxesImage:
    """A non-negative map (|gradient|, ReLU'd Grad-CAM, spread) from zero up (to ``limit``, default `robust_limit`)."""
    image = ax.imshow(values.squeeze().detach().numpy(), cmap=POSITIVE, vmin=0, vmax=limit or robust_limit(values))
    if bar:
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label=label)
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
