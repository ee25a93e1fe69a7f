"""Bottom models (feature parties) and heads (label party)."""

from secvfl.models.bottoms import MLP, SmallCNN, make_bottom
from secvfl.models.heads import ConcatHead, MeanHead, SumHead, output_dim

__all__ = ["MLP", "SmallCNN", "make_bottom", "ConcatHead", "MeanHead", "SumHead", "output_dim"]
