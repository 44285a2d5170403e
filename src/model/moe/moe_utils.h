// Small helpers shared by the MoE layer's parts (model/moe/).
#pragma once
#include <cstdint>
#include <memory>

#include "comm/communicator.h"
#include "model/module.h"

namespace mt {

/// The rows [begin, begin + n) of a [R, c] buffer (any leading shape: viewed as rows first).
inline Tensor row_range(const Tensor& t, int64_t begin, int64_t n) { return rows(t).slice0(begin, begin + n); }

/// The size of a group, 1 for nullptr (a group of one rank, or a layout-only model).
inline int group_size(const std::shared_ptr<Communicator>& c) { return c ? c->size() : 1; }

}  // namespace mt
