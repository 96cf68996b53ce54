"""What a grid's blocks that find no work cost: a kernel whose blocks read one word (as the forward's
blocks read their feature's record) and leave, timed at several grid sizes. GPU only."""
import torch
import triton
import triton.language as tl


@triton.jit
def _leave(meta_ptr, out_ptr, n_meta):
    pid = tl.program_id(0)
    x = tl.load(meta_ptr + pid % n_meta)
    if x < 0:  # never: the block leaves after one load
        tl.store(out_ptr + pid, x)


def main():
    meta = torch.arange(300, device="cuda", dtype=torch.int64)
    out = torch.empty(1 << 20, device="cuda", dtype=torch.int64)
    for warps in (8,):
        for blocks in (1, 10_000, 25_000, 52_144, 76_800, 200_000):
            ms = triton.testing.do_bench(lambda: _leave[(blocks,)](meta, out, 300, num_warps=warps),
                                         warmup=50, rep=200, return_mode="median")
            print(f"{warps} warps, {blocks:7d} blocks: {ms * 1e3:7.1f} us ({ms * 1e6 / blocks:.2f} ns a block)")


if __name__ == "__main__":
    main()
