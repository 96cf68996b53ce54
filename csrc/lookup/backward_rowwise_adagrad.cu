// The backward's updates with row-wise Adagrad (OPT 2; see backward_launch.cuh).
#include "backward_launch.cuh"

const BackwardKernels kBackwardRowwiseAdagrad{&piece_update_for<2>, &singleton_update_for<2>};
