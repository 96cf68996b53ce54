"""``backend="auto"`` on a GPU: which kernels run a group's forward, chosen per shape by measuring
them (issue 18), rather than by a rule on dims.

The candidates compute the same pooled output: the Triton kernel, and the CUDA kernel's launches
(feature-major or bag-major, 8 or 4 rows in flight a lane: pooled_cuda.FORWARD_LAUNCHES). The
first launches of a shape run each once untimed (Triton's, which compiles, paced by the tuner's
budget), then in A B B A order timed with CUDA events
(the kernels' device time; against Triton, whose launch costs the host more, the longer of device
and host time); the shape keeps the default (CUDA feature-major) unless another is clearly faster, by
launch_tuner.MARGIN beyond the samples' spread (launch_tuner.LaunchOrderTuner, whose key includes
the weights' address, so two models of one shape tune apart). Where the CUDA extension is
unavailable or does not cover the group (a weight buffer that is not 16-byte aligned), Triton
runs.

The backward always takes the CUDA kernels where they build and cover the group (they won on
every workload measured, docs/perf-notes.md v6-v12); pooled_cuda measures its path per shape.
"""
from typing import Optional

from . import cuda_ext, pooled_cuda, pooled_triton
from .launch_tuner import ForwardLaunchShape, LaunchOrderTuner

TRITON, CUDA = "triton", "cuda:"
CUDA_FEATURES = CUDA + "features"  # the default
CHOICES = tuple(CUDA + name for name in pooled_cuda.FORWARD_LAUNCHES) + (TRITON,)


def _candidates(shape: ForwardLaunchShape):
    if not shape.cuda_ok:
        return (TRITON,)
    return tuple(CUDA + name for name in pooled_cuda.forward_launches(shape.launch)) + (TRITON,)


# The tuner's key: the forward's launch shape and whether the CUDA kernels cover it.
class ForwardChoiceShape(tuple):
    __slots__ = ()

    def __new__(cls, launch: ForwardLaunchShape, cuda_ok: bool):
        return tuple.__new__(cls, (launch, cuda_ok))

    launch = property(lambda self: self[0])
    cuda_ok = property(lambda self: self[1])
    num_features = property(lambda self: self[0].num_features)


# The CUDA launches are one call to the extension with other flags: device time decides among them.
# Triton's launch costs the host more, so it is compared on the longer of its device and host times.
# A Triton candidate's first launch in a process compiles (or loads) its kernel: ~450-540 ms on the
# H200 (v55), paid on the user's call; the tuner paces that launch as a trial of this cost.
TRITON_FIRST_LAUNCH_MS = 450.0
FORWARD = LaunchOrderTuner(names={c: c for c in CHOICES}, candidates=_candidates, default=CUDA_FEATURES,
                           host_path=lambda choice: choice == TRITON, cache_name="forward",
                           first_launch_ms=lambda choice: TRITON_FIRST_LAUNCH_MS if choice == TRITON else 0.0)


def force_forward(choice: Optional[str]) -> None:
    """Tests and tools: run every shape's forward with ``choice`` (one of CHOICES; None: measure).
    A choice a shape cannot take (CUDA where it is unavailable) falls back to the default."""
    if choice is not None and choice not in CHOICES:
        raise ValueError(f"forward choice must be one of {CHOICES} (got {choice!r})")
    FORWARD.force(choice)


def forward(flat, values, offsets, per_sample_weights, feature_meta, key_index, batch_size, total_dim, max_dim,
            check=None):
    cuda_ok = cuda_ext.build_error() is None and pooled_cuda.supports_forward(flat)
    shape = ForwardChoiceShape(ForwardLaunchShape.of(flat, values, per_sample_weights, feature_meta, batch_size,
                                                     total_dim, max_dim), cuda_ok)
    if cuda_ok:  # a first use's build and the arguments' conversions before any timed trial
        args = pooled_cuda.forward_args(values, offsets, per_sample_weights, feature_meta, key_index)

    def run(choice):
        if choice == TRITON or not cuda_ok:
            return pooled_triton.forward(flat, values, offsets, per_sample_weights, feature_meta, key_index,
                                         batch_size, total_dim, max_dim, check=check)
        return pooled_cuda.forward_launch(flat, *args, batch_size, total_dim, max_dim, choice[len(CUDA):], check)

    return FORWARD.launch(shape, run, flat.device)


def _tuners():
    return (FORWARD, pooled_cuda.FORWARD_ORDER_TUNER, pooled_cuda.BACKWARD_PATH_TUNER)


def trial_launches() -> int:
    """How many launches so far ran while their shape was undecided, over every tuner (forward
    kernels, the CUDA forward's order, the backward's path): a step that leaves this count unchanged
    ran only decided choices (the benchmark warms up until then)."""
    return sum(t.trial_launches for t in _tuners())


def forget_all() -> None:
    """Drop every measured choice (forward kernels, the CUDA forward's order, the backward's path)
    and the decisions imported (recom_rec.use_kernel_decisions): a model built where a freed one's
    weights were would inherit its choices. The decision file (RECOM_REC_CACHE) stays."""
    from .decision_cache import IMPORTED

    for tuner in _tuners():
        tuner.forget()
    IMPORTED.clear()
