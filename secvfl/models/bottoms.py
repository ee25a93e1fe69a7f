"""Bottom (representation) models a feature party runs on its own block."""

from __future__ import annotations

import torch
from torch import nn

from secvfl.errors import ConfigError

__all__ = ["MLP", "SmallCNN", "make_bottom"]


class MLP(nn.Module):
    """Linear -> ReLU stacks; ``hidden=[]`` is a linear map."""

    def __init__(self, in_dim: int, hidden: list[int], out_dim: int, *, last_activation: bool = False) -> None:
        super().__init__()
        dims = [in_dim, *hidden, out_dim]
        layers: list[nn.Module] = []
        for i in range(len(dims) - 1):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < len(dims) - 2 or last_activation:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)
        self.in_dim, self.out_dim = in_dim, out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv blocks and a linear map, for an image region of shape (h, w) given as flattened pixels."""

    def __init__(self, shape: tuple[int, int], out_dim: int, channels: int = 16) -> None:
        super().__init__()
        h, w = shape
        self.shape = shape
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
        )
        with torch.no_grad():
            n = self.features(torch.zeros(1, 1, h, w)).numel()
        self.fc = nn.Linear(n, out_dim)
        self.in_dim, self.out_dim = h * w, out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], 1, *self.shape)
        return self.fc(self.features(x).flatten(1))


def make_bottom(kind: str, in_dim: int, out_dim: int, hidden: list[int], shape: tuple[int, int] | None) -> nn.Module:
    if kind == "mlp":
        return MLP(in_dim, hidden, out_dim)
    if kind == "cnn":
        if shape is None:
            raise ConfigError("--bottom cnn needs image data split into regions (e.g. --dataset mnist); use --bottom mlp")
        return SmallCNN(shape, out_dim)
    raise ConfigError(f"unknown bottom model {kind!r}; choose mlp or cnn")
