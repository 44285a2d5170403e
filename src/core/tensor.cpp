#include "core/tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace mt {

Tensor::Tensor(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape)
    : Tensor(data, dtype, device, std::vector<int64_t>(shape)) {}

Tensor::Tensor(void* data, DType dtype, Device device, const std::vector<int64_t>& shape)
    : data_(data), dtype_(dtype), device_(device) {
  MT_CHECK(static_cast<int>(shape.size()) <= kMaxDims, "tensor rank {} exceeds {}", shape.size(), kMaxDims);
  ndim_ = static_cast<int>(shape.size());
  int64_t s = 1;
  for (int d = ndim_ - 1; d >= 0; --d) {
    MT_CHECK(shape[d] >= 0, "negative size {} in dim {}", shape[d], d);
    shape_[d] = shape[d];
    strides_[d] = s;
    s *= shape[d];
  }
}

int64_t Tensor::size(int d) const {
  if (d < 0) d += ndim_;
  MT_CHECK(d >= 0 && d < ndim_, "dim {} out of range for rank {}", d, ndim_);
  return shape_[d];
}

int64_t Tensor::stride(int d) const {
  if (d < 0) d += ndim_;
  MT_CHECK(d >= 0 && d < ndim_, "dim {} out of range for rank {}", d, ndim_);
  return strides_[d];
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim_; ++d) n *= shape_[d];
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t s = 1;
  for (int d = ndim_ - 1; d >= 0; --d) {
    if (shape_[d] != 1 && strides_[d] != s) return false;
    s *= shape_[d];
  }
  return true;
}

Tensor Tensor::view(std::initializer_list<int64_t> shape) const { return view(std::vector<int64_t>(shape)); }

Tensor Tensor::view(const std::vector<int64_t>& shape) const {
  MT_CHECK(is_contiguous(), "view of a non-contiguous tensor {}", str());
  int64_t n = 1;
  for (auto s : shape) n *= s;
  MT_CHECK(n == numel(), "view {} has {} elements, tensor {} has {}", fmt::join(shape, ","), n, str(), numel());
  return Tensor(data_, dtype_, device_, shape);
}

Tensor Tensor::slice0(int64_t begin, int64_t end) const {
  MT_CHECK(is_contiguous() && ndim_ >= 1, "slice0 needs a contiguous tensor, got {}", str());
  MT_CHECK(0 <= begin && begin <= end && end <= shape_[0], "slice [{}, {}) out of range for {}", begin, end, str());
  std::vector<int64_t> s = shape();
  s[0] = end - begin;
  char* p = static_cast<char*>(data_) + begin * strides_[0] * static_cast<int64_t>(dtype_size(dtype_));
  return Tensor(p, dtype_, device_, s);
}

Tensor Tensor::slice(int dim, int64_t begin, int64_t end) const {
  if (dim < 0) dim += ndim_;
  MT_CHECK(dim >= 0 && dim < ndim_, "slice: dim {} out of range for {}", dim, str());
  MT_CHECK(0 <= begin && begin <= end && end <= shape_[dim], "slice [{}, {}) of dim {} out of range for {}", begin,
           end, dim, str());
  Tensor t = *this;
  t.shape_[dim] = end - begin;
  t.data_ = static_cast<char*>(data_) + begin * strides_[dim] * static_cast<int64_t>(dtype_size(dtype_));
  return t;
}

Tensor Tensor::flat_range(int64_t begin, int64_t n) const {
  MT_CHECK(is_contiguous(), "flat_range of non-contiguous {}", str());
  MT_CHECK(begin >= 0 && n >= 0 && begin + n <= numel(), "flat range [{}, +{}) out of {}", begin, n, numel());
  char* p = static_cast<char*>(data_) + begin * static_cast<int64_t>(dtype_size(dtype_));
  return Tensor(p, dtype_, device_, {n});
}

std::string Tensor::shape_str() const {
  return fmt::format("[{}]", fmt::join(shape_.begin(), shape_.begin() + ndim_, ", "));
}

std::string Tensor::str() const { return fmt::format("{}{}@{}", dtype_name(dtype_), shape_str(), device_.str()); }

void check_tensor(const Tensor& t, DType dtype, std::initializer_list<int64_t> shape, const char* name) {
  MT_CHECK(t.dtype() == dtype, "{}: dtype {} expected {}", name, dtype_name(t.dtype()), dtype_name(dtype));
  MT_CHECK(t.ndim() == static_cast<int>(shape.size()), "{}: shape {} expected rank {}", name, t.shape_str(),
           shape.size());
  int d = 0;
  for (auto s : shape) {
    MT_CHECK(s < 0 || t.size(d) == s, "{}: shape {} expected size {} in dim {}", name, t.shape_str(), s, d);
    ++d;
  }
  MT_CHECK(t.is_contiguous(), "{}: must be contiguous", name);
}

void check_same_device(std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (auto* t : ts) {
    if (t->empty()) continue;
    if (!first) first = t;
    MT_CHECK(t->device() == first->device(), "tensors on different devices: {} vs {}", t->str(), first->str());
  }
}

}  // namespace mt
