// The backward's updates with SGD (OPT 0; see backward_launch.cuh).
#include "backward_launch.cuh"

const BackwardKernels kBackwardSgd{&piece_update_for<0>, &singleton_update_for<0>};
