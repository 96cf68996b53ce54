"""The checks every module runs on its table configs at construction: sizes, and for the
EmbeddingCollections torchrec's rules (unique names, one dim), with its messages."""
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


def check_sequence_tables(configs, allow_empty: bool = False) -> int:
    """An EmbeddingCollection's configs: unique names, one ``embedding_dim`` (torchrec's errors),
    sizes; features default to the table's name, as torchrec sets them. Returns the dim (-1: none)."""
    dim, seen = -1, set()
    for config in configs:
        if config.name in seen:
            raise ValueError(f"Duplicate table name {config.name}")
        seen.add(config.name)
        dim = config.embedding_dim if dim < 0 else dim
        if config.embedding_dim != dim:
            raise ValueError("All tables in a EmbeddingCollection are required to have same embedding dimension."
                             f" Violating case: {config.name}'s embedding_dim {config.embedding_dim} != {dim}")
        check_table_size(config, allow_empty=allow_empty)
        if not config.feature_names:
            config.feature_names = [config.name]
    return dim
