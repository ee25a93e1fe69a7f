"""Data layer: offline loaders, splits, vertical partitioning and missing-block masks."""

from secvfl.data.dataset import Dataset, RawData
from secvfl.data.loaders import DATASETS, dataset_names, load_dataset, load_raw, resolve_data_dir
from secvfl.data.masks import block_miss_probabilities, draw_masks, drop_unobserved
from secvfl.data.partition import IMAGE_SPLITS, Partition, make_partition, partition_columns, partition_image
from secvfl.data.preprocess import NAN_POLICIES, prepare, stratified_split

__all__ = [
    "Dataset", "RawData", "DATASETS", "dataset_names", "load_dataset", "load_raw", "resolve_data_dir",
    "block_miss_probabilities", "draw_masks", "drop_unobserved", "IMAGE_SPLITS", "Partition", "make_partition",
    "partition_columns", "partition_image", "NAN_POLICIES", "prepare", "stratified_split",
]
