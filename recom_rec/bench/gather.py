"""A bare gather of a point's rows: what a kernel that reads the same rows, with no bags, no id
check and almost no output, reaches at that row width. The copy rate is the ceiling of wide rows;
rows of 16-32 bytes read at random are a different access pattern, and this measures its own
ceiling on the sweep's points (perf-notes v26).

Each program reads a block of lookups' rows through precomputed flat row indices (4 bytes each)
and writes their column sums. The sweep and tools/gather_ceiling.py time it at each of BLOCKS and
keep the fastest."""
from typing import List, Tuple

import torch
import triton
import triton.language as tl

from ..kernels.grid_math import cdiv, next_power_of_2

BLOCKS: Tuple[Tuple[int, int], ...] = ((128, 2), (256, 4), (512, 4), (1024, 8), (2048, 8))  # (lookups a program, warps)


@triton.jit
def _gather_sum(weights, rows, out, n, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    lookups = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = lookups < n
    row = tl.load(rows + lookups, mask=inside, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    tile = tl.load(weights + row[:, None] * D + cols[None, :], mask=inside[:, None] & (cols[None, :] < D), other=0.0)
    tl.store(out + pid * BLOCK_D + cols, tl.sum(tile.to(tl.float32), axis=0))


def flat_rows(values: torch.Tensor, lengths: torch.Tensor, tables: int, rows_per_table: int) -> torch.Tensor:
    """Each lookup's row in the tables stacked into one [tables * rows, dim] buffer (int32), from a
    table-major KJT's values and lengths (one key a table)."""
    per_table = lengths.view(tables, -1).sum(1)
    table = torch.repeat_interleave(torch.arange(tables, device=values.device), per_table)
    return (values + table * rows_per_table).to(torch.int32)


def gather_sum(weights: torch.Tensor, rows: torch.Tensor, block: int, warps: int) -> torch.Tensor:
    """[programs, next_power_of_2(dim)] fp32: program i's sum of the rows of lookups
    [i * block, (i + 1) * block), columns past the dim zero."""
    dim = weights.shape[1]
    programs = max(1, cdiv(rows.numel(), block))
    out = torch.empty(programs, next_power_of_2(dim), device=weights.device, dtype=torch.float32)
    _gather_sum[(programs,)](weights, rows, out, rows.numel(), D=dim, BLOCK_D=next_power_of_2(dim), BLOCK_N=block,
                             num_warps=warps)
    return out


def gather_sum_reference(weights: torch.Tensor, rows: torch.Tensor, block: int) -> torch.Tensor:
    """gather_sum in torch."""
    dim = weights.shape[1]
    programs = max(1, cdiv(rows.numel(), block))
    picked = torch.zeros(programs * block, next_power_of_2(dim), dtype=torch.float32, device=weights.device)
    picked[:rows.numel(), :dim] = weights[rows.long()].float()
    return picked.view(programs, block, -1).sum(1)


class Gather:
    """The gather as a peer of the sweep's (``forward`` of a KJT), at one block size: the same
    rows as the point's tables, which ``weights`` stacks ([tables * rows, dim])."""

    def __init__(self, weights: torch.Tensor, kjt, tables: int, rows_per_table: int, block: int, warps: int):
        self.weights, self.block, self.warps = weights, block, warps
        self.rows = flat_rows(kjt.values(), kjt.lengths(), tables, rows_per_table)

    def forward(self, kjt) -> torch.Tensor:
        return gather_sum(self.weights, self.rows, self.block, self.warps)


def gathers(weights: torch.Tensor, kjt, tables: int, rows_per_table: int) -> List[Tuple[str, Gather]]:
    """The gather at each of BLOCKS, named "gather BLOCK/WARPS"."""
    return [(f"gather {b}/{w}", Gather(weights, kjt, tables, rows_per_table, b, w)) for b, w in BLOCKS]
