"""The kernel benches' source variants (tools/forward_kernel_variants.py,
tools/backward_kernel_variants.py) are textual rewrites of csrc/lookup/kernels.cuh: each must
still find what it rewrites in the current kernels, or a GPU session's variant run stops at its
first build (v59: a product change had moved two of them)."""
import pathlib
import sys

import pytest

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

import backward_kernel_variants  # noqa: E402
import forward_kernel_variants  # noqa: E402
from kernel_variants import SOURCE  # noqa: E402


@pytest.mark.parametrize("tool", [forward_kernel_variants, backward_kernel_variants], ids=["forward", "backward"])
def test_every_variant_rewrites_the_current_kernels(tool):
    text = SOURCE.read_text()
    for name, variant in tool.VARIANTS.items():
        if variant is None:  # "old": a git revision's source, not a rewrite
            continue
        change, _ = variant
        rewritten = change(text)  # (raises SystemExit naming what it did not find)
        assert isinstance(rewritten, str) and rewritten, name
