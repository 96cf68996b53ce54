#pragma once
// The input check's device side (recom_rec/ops/input_check.py), shared by the lookup kernels
// (kernels.cuh) and the variable-batch expansion (expand.cu).
#include <cstdint>

namespace {  // internal linkage, as kernels.cuh's kernels

// Every kernel that reads ids keeps its reads in bounds whatever the batch holds: an id outside
// [0, rows) of its table reads row 0 (fbgemm's default clamps so too), a bag whose range leaves the
// values is empty. The forward also reports the first bad lookup it meets when `report` is set:
// the lookup that wins `claim` (a device word, 0 until then) writes kind, feature, bag and values
// to `report` (pinned host memory, mapped: no copy, no sync) for the host to raise on its next
// call. A batch without bad input pays a compare a lookup, and at rows wider than one 16-byte
// chunk a lane a second read of its ids: 0-4% of the forward kernel (perf-notes v24).
// REPORT_INVERSE: an output row of a variable batch sent to a bag its feature lacks (expand.cu).
// REPORT_LENGTH: a bag of negative length in an unpooled lookup's batch (unpooled.cu), whose ids are
// found from the keys' summed lengths, so that such a batch is read all the same.
enum : int64_t { REPORT_NONE = 0, REPORT_ID = 1, REPORT_BAG = 2, REPORT_TOTAL = 3, REPORT_INVERSE = 4,
                 REPORT_LENGTH = 5 };
struct InputCheck {
  int64_t num_values;   // the KJT's values
  int64_t last_offset;  // index of the KJT's last offset (keys x batch size)
  int32_t* claim;       // null: clamp without reporting
  int64_t* report;      // REPORT_WORDS words: kind, feature, bag, a, b, num_values
};

__device__ __forceinline__ int64_t clamp_id(int64_t id, int64_t rows) {
  return (uint64_t)id < (uint64_t)rows ? id : 0;
}

__device__ __forceinline__ bool bag_in_values(int64_t start, int64_t end, int64_t num_values) {
  return 0 <= start && start <= end && end <= num_values;
}

__device__ __forceinline__ void report_bad(const InputCheck& c, int64_t kind, int64_t feature, int64_t bag, int64_t a,
                                        int64_t b) {
  if (c.claim == nullptr || atomicCAS(c.claim, 0, 1) != 0) return;
  volatile int64_t* r = c.report;
  r[1] = feature; r[2] = bag; r[3] = a; r[4] = b; r[5] = c.num_values;
  __threadfence_system();
  r[0] = kind;  // last: a host that sees it sees the rest
}

}  // namespace
