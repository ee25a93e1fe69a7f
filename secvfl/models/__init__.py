"""Bottom models (feature parties) and heads (label party)."""

from secvfl.models.bottoms import IMAGE_BOTTOMS, MLP, ResNetBottom, SmallCNN, make_bottom
from secvfl.models.heads import ConcatHead, MeanHead, SumHead, output_dim

__all__ = ["MLP", "SmallCNN", "ResNetBottom", "make_bottom", "IMAGE_BOTTOMS", "ConcatHead", "MeanHead", "SumHead", "output_dim"]
