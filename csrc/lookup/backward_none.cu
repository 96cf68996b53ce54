// The backward's updates with no optimizer: the rows' gradients written (OPT -1; see backward_launch.cuh).
#include "backward_launch.cuh"

const BackwardKernels kBackwardNone{&piece_update_for<-1>, &singleton_update_for<-1>};
