"""Dataset readers that yield `torchrec.datasets.utils.Batch` objects.

* `criteo`: Criteo click logs (real tab-separated form, gzip, or CSV with a header), DLRM
  preprocessing, and a synthetic Criteo-shaped generator with a learnable signal.
* `movielens`: MovieLens-1M (`.dat` directory or joined CSV) as DeepFM features.
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
from .movielens import (
    MOVIELENS_HASH_SIZES,
    MOVIELENS_SPARSE_NAMES,
    MovieLensIterDataset,
    MovieLensRating,
    encode_ratings,
    iter_movielens_ratings,
    movielens_batches,
    movielens_table_configs,
    stable_hash,
    write_movielens_1m,
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
    "MOVIELENS_HASH_SIZES",
    "MOVIELENS_SPARSE_NAMES",
    "MovieLensIterDataset",
    "MovieLensRating",
    "encode_ratings",
    "iter_movielens_ratings",
    "movielens_batches",
    "movielens_table_configs",
    "stable_hash",
    "write_movielens_1m",
]
