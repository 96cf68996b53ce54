"""The sharded-dlrm benchmark's parts that need no process group: the kernels' categories of a
step's split and the table (speed-up, scaling, weak-scaling efficiency, the split)."""
import re
from pathlib import Path

from recom_rec.bench.sharded_dlrm import format_sharded, kernel_category, plan_of
from recom_rec.bench.random_layouts import dcnv2
from recom_rec.native_build import LOOKUP_HEADERS, LOOKUP_SOURCES, csrc_dir

KERNEL_SOURCES = Path(__file__).resolve().parents[1] / "recom_rec" / "kernels"


def test_kernels_fall_into_lookup_all_to_all_and_the_rest():
    assert kernel_category("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "all-to-all"
    assert kernel_category("ncclKernel_AllToAll_RING_LL_Sum_int8_t") == "all-to-all"
    assert kernel_category("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "rest"  # DDP's dense gradients
    assert kernel_category("split_embedding_codegen_forward_unweighted_kernel<float>") == "lookup"
    assert kernel_category("_pooled_forward_kernel") == "lookup"
    assert kernel_category("void cub::DeviceRadixSortOnesweepKernel<...>") == "lookup"
    assert kernel_category("ampere_sgemm_128x64_tn") == "rest"
    assert kernel_category("void at::native::vectorized_elementwise_kernel<4>") == "rest"


def test_every_kernel_of_ours_counts_as_lookup():
    """The split is only as true as its names: a backward kernel counted as 'rest' once hid 1.1 ms
    of a DLRM step's embedding time. Every CUDA kernel of csrc/lookup (every source) and every Triton kernel of the
    package's lookups must fall under 'lookup'."""
    source = "\n".join((csrc_dir() / "lookup" / name).read_text() for name in LOOKUP_SOURCES + LOOKUP_HEADERS)
    cuda = re.findall(r"__global__[^;{]*?(\w+_kernel)\(", source)
    assert len(cuda) == source.count("__global__")
    triton = []  # the jitted functions launched with a grid (the others are inlined helpers)
    for path in KERNEL_SOURCES.glob("*_triton.py"):
        text = path.read_text()
        triton += [name for name in re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\ndef (\w+)\(", text) if f"{name}[" in text]
    assert len(cuda) >= 10 and len(triton) >= 8
    assert {name: kernel_category(name) for name in cuda + triton} == {name: "lookup" for name in cuda + triton}


def test_the_plan_puts_every_table_on_a_rank():
    plan = plan_of(dcnv2(small=True), 3)
    assert len(plan) == 26 and set(plan.values()) == {0, 1, 2}


def _row(world, peer, ms, split=None):
    return {"workload": "sharded-dlrm", "world": world, "peer": peer, "ms": ms, "batch_per_rank": 100,
            "samples_per_s": world * 100 / (ms * 1e-3), "device": "GPU", "split_ms": split, "tables": "26 tables"}


def test_the_table_shows_speed_up_scaling_efficiency_and_split():
    rows = [_row(1, "recom_rec", 2.0, {"lookup": 1.0, "all-to-all": 0.0, "rest": 0.5}), _row(1, "torchrec", 3.0),
            _row(2, "recom_rec", 2.5, {"lookup": 1.0, "all-to-all": 0.75, "rest": 0.5}), _row(2, "torchrec", 4.0)]
    lines = format_sharded(rows).splitlines()
    assert "26 tables" in lines[0] and "weak eff." in lines[1]
    two = next(line for line in lines if line.split()[:2] == ["2", "recom_rec"])
    # 2 ranks: 1.60x torchrec, 1.60x the samples/s of 1 rank, so 80% of its per-GPU throughput
    assert "1.60" in two and "80%" in two and "1.00 / 0.75 / 0.50" in two
    assert next(line for line in lines if line.split()[:2] == ["1", "torchrec"]).endswith("-")
