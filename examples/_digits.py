"""What every example shares: the digits data, a small CNN, its training and the command line.

The data is scikit-learn's bundled ``load_digits`` (1797 real 8x8 images, no download),
so every example runs offline on a laptop CPU in seconds.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

CLASSES = tuple(range(10))
LAST_CONV = "[2]"  # path of the last conv layer in make_cnn, for Grad-CAM
HIDDEN = "[6]"  # path of the ReLU after the 64-unit hidden linear layer
OUT_DIR = Path(__file__).resolve().parent / "out"


@dataclass(frozen=True)
class Digits:
    """Train and test images ``[N, 1, 8, 8]`` in ``[0, 1]`` with their labels ``[N]``."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    def only(self, classes: tuple[int, ...]) -> Digits:
        """The images of ``classes`` only, in both splits."""
        keep_train = torch.isin(self.train_y, torch.tensor(classes))
        keep_test = torch.isin(self.test_y, torch.tensor(classes))
        return Digits(self.train_x[keep_train], self.train_y[keep_train],
                      self.test_x[keep_test], self.test_y[keep_test])


def load(test_fraction: float = 0.25, seed: int = 0) -> Digits:
    """The digits, scaled to ``[0, 1]`` and split at random with a fixed seed."""
    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    y = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return Digits(x[train], y[train], x[test], y[test])


def make_cnn(seed: int = 0) -> nn.Sequential:
    """Two 3x3 convs (padding keeps 8x8, so Grad-CAM maps are full resolution), two linears."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Fraction of correct predictions; a tensor, so it works under ``vmap``."""
    return (logits.argmax(-1) == labels).float().mean()


def train(model: nn.Module, data: Digits, *, epochs: int, lr: float = 3e-3, batch_size: int = 64,
          seed: int = 0, progress: bool = True) -> tuple[nn.Module, float]:
    """Adam on the cross-entropy; returns the model in eval mode and its test accuracy."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    bar = tqdm(range(epochs), desc="training", unit="epoch", disable=not progress)
    for _ in bar:
        for batch in torch.randperm(len(data.train_y), generator=generator).split(batch_size):
            loss = nn.functional.cross_entropy(model(data.train_x[batch]), data.train_y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    with torch.no_grad():
        test_accuracy = float(accuracy(model(data.test_x), data.test_y))
    return model, test_accuracy


def trained_cnn(args: argparse.Namespace, data: Digits, seed: int = 0) -> tuple[nn.Module, float]:
    """The CNN trained for the example's mode: 15 epochs (about 98% test accuracy), 4 with ``--quick``."""
    return train(make_cnn(seed), data, epochs=4 if args.quick else 15, seed=seed, progress=args.progress)


def setup_example(description: str) -> argparse.Namespace:
    """Parse ``--quick``, ``--no-progress`` (or ``TQDM_DISABLE=1``) and ``--out DIR``; one torch thread.

    The models and batches are tiny: one thread is as fast as several on an idle machine,
    and many times faster when other processes share the cores (threads then wait on each other).
    """
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer epochs and samples: a few seconds")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--out", type=Path, default=OUT_DIR, metavar="DIR",
                        help=f"folder for the pictures (default: {OUT_DIR})")
    args = parser.parse_args()
    args.progress = not (args.no_progress or os.environ.get("TQDM_DISABLE", "") not in ("", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    return args
