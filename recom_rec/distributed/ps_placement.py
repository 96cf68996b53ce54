"""The parameter-server tier as a compute kernel of sharded tables.

torchrec offers key-value compute kernels (fbgemm's SSD tables) for tables that do not fit in
HBM. Ours is the PS tier (``recom_rec.ps``): a shard planned with ``PS_KERNEL`` becomes a
PS-backed table of the rank's local module - a cache of ``cache_load_factor x rows`` slots inside
the fused buffer, the rows in the store at ``ps_url``. It appears in plans as torchrec's
``customized_kernel``, the kernel whose state_dict a sharded module handles itself (torchrec's
``key_value`` kernel expects fbgemm's SSD tensors in its state_dict hooks).

The settings travel in the sharder's ``fused_params`` (so the planner's estimators and every
rank's lookup see them): ``ps_url``, ``ps_cache_load_factor``, ``ps_eviction``.
"""
import math
from typing import Any, Dict, Optional

from torchrec.distributed.embedding_types import EmbeddingComputeKernel

from ..ps.config import PSConfig

PS_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
PS_KEYS = ("ps_url", "ps_cache_load_factor", "ps_eviction")
DEFAULT_CACHE_LOAD_FACTOR = 0.2


def ps_fused_params(url: str, cache_load_factor: float = DEFAULT_CACHE_LOAD_FACTOR,
                    eviction: str = "lru") -> Dict[str, Any]:
    if not 0 < cache_load_factor <= 1:
        raise ValueError(f"ps_cache_load_factor must be in (0, 1], got {cache_load_factor}")
    PSConfig(url=url, cache_rows=1, eviction=eviction)  # validates the URL form and the policy
    return {"ps_url": url, "ps_cache_load_factor": float(cache_load_factor), "ps_eviction": eviction}


def ps_enabled(fused_params: Optional[Dict[str, Any]]) -> bool:
    return bool(fused_params and fused_params.get("ps_url"))


def cache_rows(fused_params: Dict[str, Any], rows: int) -> int:
    """Cache slots of a shard of ``rows`` rows."""
    factor = float(fused_params.get("ps_cache_load_factor", DEFAULT_CACHE_LOAD_FACTOR))
    return max(1, min(rows, math.ceil(rows * factor)))


def ps_config(fused_params: Dict[str, Any], rows: int) -> PSConfig:
    return PSConfig(url=fused_params["ps_url"], cache_rows=cache_rows(fused_params, rows),
                    eviction=fused_params.get("ps_eviction", "lru"))


def store_in_host_memory(fused_params: Dict[str, Any]) -> bool:
    """Whether the store's rows count against the host's memory (the embedded memory:// store)."""
    return str(fused_params.get("ps_url", "")).startswith("memory://")


def shard_table_name(table: str, row_offset: int, col_offset: int) -> str:
    """The local (and store) name of a shard: unique per table and shard, so shards of one table
    on different ranks, or of two sharding types on one rank, never share store keys."""
    return f"{table}__r{row_offset}_c{col_offset}"
