"""The size check every module runs on its table configs at construction."""
import numbers


def check_table_size(config, allow_empty: bool = False) -> None:
    """A table has at least one row and one column, else a ``ValueError`` naming it (torchrec's
    modules accept ``embedding_dim=0`` and fail later, or divide by ``num_embeddings=0``).
    ``allow_empty``: zero rows allowed (a row-wise shard of a table with fewer rows than ranks)."""
    least_rows = 0 if allow_empty else 1
    for field, value, least in (("num_embeddings", config.num_embeddings, least_rows),
                                ("embedding_dim", config.embedding_dim, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise ValueError(f"table {config.name!r}: {field} must be an integer >= {least}, got {value!r}")
