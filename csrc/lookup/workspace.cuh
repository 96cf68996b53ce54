// One device allocation carved into typed arrays: a host-bound step pays the caching allocator and
// a TensorImpl per at::empty (a dozen of them cost plan_backward tens of microseconds, perf-notes
// v62); here one at::empty, and each array a tensor sharing its storage.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

class Workspace {
 public:
  explicit Workspace(at::TensorOptions options) : options_(options.dtype(at::kByte)) {}

  // Reserves `numel` elements of `dtype` at a 256-byte boundary (CUB's temporary storage and the
  // kernels' vector loads want aligned arrays); returns the slot's number.
  int add(int64_t numel, at::ScalarType dtype) {
    slots_.push_back({bytes_, numel, dtype});
    bytes_ += (numel * (int64_t)at::elementSize(dtype) + ALIGN - 1) / ALIGN * ALIGN;
    return (int)slots_.size() - 1;
  }

  // The one allocation, after every add.
  void allocate() { buffer_ = at::empty({std::max<int64_t>(bytes_, 1)}, options_); }

  // Element `first` of a slot.
  void* ptr(int slot, int64_t first = 0) const {
    const Slot& s = slots_[slot];
    return static_cast<char*>(buffer_.data_ptr()) + s.offset + first * (int64_t)at::elementSize(s.dtype);
  }

  // Elements [first, first + numel) of a slot: a contiguous 1-d tensor on the workspace's storage,
  // made without a dispatcher call (it keeps the whole workspace alive).
  at::Tensor view(int slot, int64_t first, int64_t numel) const {
    const Slot& s = slots_[slot];
    auto out = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(buffer_.storage()),
                                                        buffer_.key_set(), c10::scalarTypeToTypeMeta(s.dtype));
    auto* impl = out.unsafeGetTensorImpl();
    impl->set_storage_offset(s.offset / (int64_t)at::elementSize(s.dtype) + first);
    impl->set_sizes_contiguous({numel});
    return out;
  }
  at::Tensor view(int slot) const { return view(slot, 0, slots_[slot].numel); }

 private:
  static constexpr int64_t ALIGN = 256;
  struct Slot {
    int64_t offset, numel;
    at::ScalarType dtype;
  };
  at::TensorOptions options_;
  std::vector<Slot> slots_;
  int64_t bytes_ = 0;
  at::Tensor buffer_;
};
