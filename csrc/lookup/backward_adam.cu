// The backward's updates with Adam (OPT 3; see backward_launch.cuh).
#include "backward_launch.cuh"

const BackwardKernels kBackwardAdam{&piece_update_for<3>, &singleton_update_for<3>};
