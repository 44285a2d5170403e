#include "model/layers/parallel_params.h"

#include "core/check.h"

namespace mt {

ParamSpec column_parallel_weight(std::string name, int64_t out, int64_t in, float init_std, int tp, int rank,
                                 int64_t parts) {
  MT_REQUIRE(out % tp == 0, "{}: {} output rows are not divisible by tensor parallel size {}", name, out, tp);
  ParamSpec p;
  p.name = std::move(name);
  p.shape = {parts * (out / tp), in};
  p.init = InitKind::kNormal;
  p.init_std = init_std;
  p.weight_decay = true;
  if (parts == 1) {
    p.global_shape = {out, in};
    p.shard_offset = {rank * (out / tp), 0};
  } else {
    p.global_shape = {parts, out, in};
    p.shard_offset = {0, rank * (out / tp), 0};
    p.shard_shape = {parts, out / tp, in};
  }
  p.tp_split_dim = parts == 1 ? 0 : 1;
  p.tensor_parallel = tp > 1;
  return p;
}

ParamSpec column_parallel_bias(std::string name, int64_t out, int tp, int rank, int64_t parts) {
  MT_REQUIRE(out % tp == 0, "{}: {} outputs are not divisible by tensor parallel size {}", name, out, tp);
  ParamSpec p;
  p.name = std::move(name);
  p.shape = {parts * (out / tp)};
  p.init = InitKind::kZeros;
  p.init_std = 0.f;
  p.weight_decay = false;
  if (parts == 1) {
    p.global_shape = {out};
    p.shard_offset = {rank * (out / tp)};
  } else {
    p.global_shape = {parts, out};
    p.shard_offset = {0, rank * (out / tp)};
    p.shard_shape = {parts, out / tp};
  }
  p.tp_split_dim = parts == 1 ? 0 : 1;
  p.tensor_parallel = tp > 1;
  return p;
}

ParamSpec row_parallel_weight(std::string name, int64_t out, int64_t in, float init_std, int tp, int rank) {
  MT_REQUIRE(in % tp == 0, "{}: {} input columns are not divisible by tensor parallel size {}", name, in, tp);
  ParamSpec p;
  p.name = std::move(name);
  p.shape = {out, in / tp};
  p.init = InitKind::kNormal;
  p.init_std = init_std;
  p.weight_decay = true;
  p.global_shape = {out, in};
  p.shard_offset = {0, rank * (in / tp)};
  p.tp_split_dim = 1;
  p.tensor_parallel = tp > 1;
  return p;
}

ParamSpec replicated_param(std::string name, std::vector<int64_t> shape, InitKind init, float init_std,
                           TpGradSum grad_sum) {
  ParamSpec p;
  p.name = std::move(name);
  p.weight_decay = shape.size() >= 2;
  p.shape = std::move(shape);
  p.init = init;
  p.init_std = init_std;
  p.tp_grad_sum = grad_sum;
  return p;
}

}  // namespace mt
