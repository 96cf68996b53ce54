"""Dataset readers that yield `torchrec.datasets.utils.Batch` objects.

* `criteo`: Criteo click logs (real tab-separated form, gzip, or CSV with a header), DLRM
  preprocessing, and a synthetic Criteo-shaped generator with a learnable signal.
"""
from .criteo import (
    CRITEO_KAGGLE_CARDINALITIES,
    DENSE_NAMES,
    SPARSE_NAMES,
    CriteoChunk,
    CriteoIterDataset,
    criteo_batches,
    criteo_hash_sizes,
    hash_categorical,
    iter_criteo_chunks,
    preprocess_dense,
    synthetic_criteo_batches,
    truncated_zipf,
    write_criteo_tsv,
)

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "DENSE_NAMES",
    "SPARSE_NAMES",
    "CriteoChunk",
    "CriteoIterDataset",
    "criteo_batches",
    "criteo_hash_sizes",
    "hash_categorical",
    "iter_criteo_chunks",
    "preprocess_dense",
    "synthetic_criteo_batches",
    "truncated_zipf",
    "write_criteo_tsv",
]
