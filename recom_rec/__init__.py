"""recom_rec: fused, table-batched embedding layers for torchrec models."""
from .decisions import (
    aoti_compile_and_package,
    aoti_load_package,
    kernel_decisions,
    load_exported,
    save_exported,
    use_kernel_decisions,
)
from .modules import EmbeddingBagCollection, EmbeddingCollection, swap_modules
from .quant import quantize
from .tuning import tune

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "aoti_compile_and_package", "aoti_load_package",
           "kernel_decisions", "load_exported", "quantize", "save_exported", "swap_modules", "tune",
           "use_kernel_decisions"]
__version__ = "0.1.0"
