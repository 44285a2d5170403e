// Tensor: a non-owning view (pointer, dtype, device, shape, strides). Buffers own memory.
// Shapes are written in comments with fixed letters and sharding, e.g. x: [s, b, h].
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/device.h"
#include "core/dtype.h"

namespace mt {

class Tensor {
 public:
  static constexpr int kMaxDims = 6;

  Tensor() = default;
  /// Contiguous (row-major) view of `data` with the given shape.
  Tensor(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape);
  Tensor(void* data, DType dtype, Device device, const std::vector<int64_t>& shape);

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int ndim() const { return ndim_; }
  int64_t size(int d) const;                 ///< size along dim d (negative d counts from the end)
  int64_t stride(int d) const;               ///< stride in elements
  std::vector<int64_t> shape() const { return {shape_.begin(), shape_.begin() + ndim_}; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;
  bool defined() const { return data_ != nullptr || numel() == 0; }
  bool empty() const { return data_ == nullptr; }
  /// Same storage, new contiguous shape (numel must match; requires contiguous).
  Tensor view(std::initializer_list<int64_t> shape) const;
  Tensor view(const std::vector<int64_t>& shape) const;
  /// Rows [begin, end) along dim 0 (requires contiguous).
  Tensor slice0(int64_t begin, int64_t end) const;
  /// Elements [begin, end) along dimension `dim` (negative counts from the end): a view with the
  /// same strides, non-contiguous in general (e.g. the query heads of a fused QKV output).
  Tensor slice(int dim, int64_t begin, int64_t end) const;
  /// Flat elements [begin, begin+n) as a 1-D view (requires contiguous).
  Tensor flat_range(int64_t begin, int64_t n) const;
  std::string shape_str() const;
  std::string str() const;  ///< "fp32[2, 3]@cpu"

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Device device_{};
  int ndim_ = 1;  // a default Tensor is 1-D with 0 elements (empty)
  std::array<int64_t, kMaxDims> shape_{};
  std::array<int64_t, kMaxDims> strides_{};
};

/// Throws unless `t` is contiguous with exactly the given dtype and shape (-1 = any size).
void check_tensor(const Tensor& t, DType dtype, std::initializer_list<int64_t> shape, const char* name);
/// Throws unless all tensors live on the same device.
void check_same_device(std::initializer_list<const Tensor*> ts);

}  // namespace mt
