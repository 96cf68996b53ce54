"""The fused lookup's kernels: Triton (pooled_triton), CUDA C++ (pooled_cuda, through the one
extension loader cuda_ext), and the per-shape measurements that pick between them (launch_tuner,
selection). Imported lazily by the ops: Triton is optional on CPU machines."""
