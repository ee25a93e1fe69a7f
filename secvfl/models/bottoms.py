"""Bottom (representation) models a feature party runs on its own block.

- :class:`MLP` (``--bottom mlp``): any columns.
- :class:`SmallCNN` (``--bottom cnn``): two conv blocks, for an image region (MNIST-sized parts, one or more
  channels).
- :class:`ResNetBottom` (``--bottom resnet``): a small residual network (a 3x3 stem and three stages of basic
  blocks, He et al. 2016, in the CIFAR layout) for colour image regions, where a convolutional bottom is what a GPU
  is for. Its normalisation is GroupNorm, not BatchNorm: a row's embedding then depends on that row alone (in
  training as in prediction, at any batch size), which per-sample clipping (feature DP) and the attacks' replays
  of single rows need.

An image region arrives as its flattened pixels in channel-major order (all of channel 0, then channel 1, ...), the
order :func:`secvfl.data.partition.partition_image` cuts them in.
"""

from __future__ import annotations

import torch
from torch import nn

from secvfl.errors import ConfigError

__all__ = ["MLP", "SmallCNN", "ResNetBottom", "make_bottom", "IMAGE_BOTTOMS"]

IMAGE_BOTTOMS = ("cnn", "resnet")


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
    """Two conv blocks and a linear map, for an image region of shape (h, w) with ``in_channels`` channels, given as
    flattened pixels."""

    def __init__(self, shape: tuple[int, int], out_dim: int, channels: int = 16, *, in_channels: int = 1) -> None:
        super().__init__()
        h, w = shape
        self.shape = (in_channels, h, w)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
        )
        with torch.no_grad():
            n = self.features(torch.zeros(1, *self.shape)).numel()
        self.fc = nn.Linear(n, out_dim)
        self.in_dim, self.out_dim = in_channels * h * w, out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], *self.shape)
        return self.fc(self.features(x).flatten(1))


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with a skip connection (a 1x1 projection where the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = _norm(c_out)
        self.skip = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(out)) + self.skip(x))


class ResNetBottom(nn.Module):
    """A small ResNet for an image region of shape (h, w) with ``in_channels`` channels: a 3x3 stem of ``width``
    channels, three stages of ``blocks`` basic blocks with ``width``, ``2 width`` and ``4 width`` channels (the later
    two halve the resolution, never below one pixel), global average pooling and a linear map to ``out_dim``.
    ``width=16, blocks=1`` is a ResNet-8 in the layout of He et al.'s CIFAR networks."""

    def __init__(self, shape: tuple[int, int], out_dim: int, *, in_channels: int = 3, width: int = 16,
                 blocks: int = 1) -> None:
        super().__init__()
        h, w = shape
        self.shape = (in_channels, h, w)
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False), _norm(width), nn.ReLU())
        layers: list[nn.Module] = []
        c, size = width, min(h, w)
        for stage, c_out in enumerate((width, 2 * width, 4 * width)):
            stride = 2 if stage > 0 and size > 1 else 1
            size = -(-size // stride)
            for i in range(blocks):
                layers.append(_BasicBlock(c, c_out, stride if i == 0 else 1))
                c = c_out
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(c, out_dim)
        self.in_dim, self.out_dim = in_channels * h * w, out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], *self.shape)
        return self.fc(self.stages(self.stem(x)).mean(dim=(2, 3)))


def make_bottom(kind: str, in_dim: int, out_dim: int, hidden: list[int], shape: tuple[int, int] | None, *,
                channels: int = 1) -> nn.Module:
    """The bottom model ``kind`` for a block of ``in_dim`` columns: an image region of ``shape`` (h, w) with
    ``channels`` channels for the image bottoms. ``hidden``: the MLP's widths; for ``resnet`` its first value is the
    stem's width (the stages have 1x, 2x and 4x it); ``cnn`` keeps its 16 and 32 channels."""
    if kind == "mlp":
        return MLP(in_dim, hidden, out_dim)
    if kind in IMAGE_BOTTOMS:
        if shape is None:
            raise ConfigError(f"--bottom {kind} needs image data split into regions (e.g. --dataset mnist or "
                              "cifar:DIR, not --image-split columns); use --bottom mlp")
        if channels * shape[0] * shape[1] != in_dim:
            raise ConfigError(f"--bottom {kind}: a {channels}x{shape[0]}x{shape[1]} image region has "
                              f"{channels * shape[0] * shape[1]} values, the block has {in_dim} columns")
        if kind == "cnn":
            return SmallCNN(shape, out_dim, in_channels=channels)
        return ResNetBottom(shape, out_dim, in_channels=channels, width=hidden[0] if hidden else 16)
    raise ConfigError(f"unknown bottom model {kind!r}; choose mlp, cnn or resnet")
