// The backward's updates with Adagrad (OPT 1; see backward_launch.cuh).
#include "backward_launch.cuh"

const BackwardKernels kBackwardAdagrad{&piece_update_for<1>, &singleton_update_for<1>};
