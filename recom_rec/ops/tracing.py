"""Whether torch.fx's symbolic tracer is running the caller (a module's forward being traced)."""
from torch.fx import _symbolic_trace

# torch >= 2.12 splits symbolic tracing from torch.export's tracing (and warns on the old name).
_FX_TRACING = getattr(_symbolic_trace, "is_fx_symbolic_tracing", None) or _symbolic_trace.is_fx_tracing


def fx_tracing() -> bool:
    return _FX_TRACING()
