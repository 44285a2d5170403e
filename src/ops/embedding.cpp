// Argument validation and backend dispatch for ops/embedding.h.
#include "ops/embedding.h"

#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

using op_checks::check_act;

/// ids int32 [s, b]; positions int32 [s, b] or empty; returns {s, b}.
std::pair<int64_t, int64_t> check_ids(const Tensor& ids, const Tensor& positions, const char* fn) {
  MT_CHECK(ids.ndim() == 2, "{}: ids must be [s, b], got {}", fn, ids.str());
  const int64_t s = ids.size(0), b = ids.size(1);
  check_tensor(ids, DType::kI32, {s, b}, "embedding: ids");
  if (!positions.empty()) check_tensor(positions, DType::kI32, {s, b}, "embedding: positions");
  return {s, b};
}

/// Learned positions without a `positions` tensor use pos = i_s, so the table needs s rows.
void check_wpe_rows(int64_t p_rows, int64_t s, const Tensor& positions, const char* fn) {
  MT_CHECK(!positions.empty() || p_rows >= s, "{}: position table has P={} rows but s={} (positions = i_s)", fn,
           p_rows, s);
}

}  // namespace

void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                       const Tensor& positions, int64_t vocab_start, const Stream& stream) {
  const char* fn = "embedding_forward";
  auto [s, b] = check_ids(ids, positions, fn);
  check_act(out, fn, "out");
  MT_CHECK(out.ndim() == 3, "{}: out must be [s, b, h], got {}", fn, out.str());
  const int64_t h = out.size(2);
  check_tensor(out, out.dtype(), {s, b, h}, "embedding_forward: out");
  MT_CHECK(wte.ndim() == 2, "{}: wte must be [V_local, h], got {}", fn, wte.str());
  check_tensor(wte, out.dtype(), {-1, h}, "embedding_forward: wte");
  if (!wpe.empty()) {
    MT_CHECK(wpe.ndim() == 2, "{}: wpe must be [P, h], got {}", fn, wpe.str());
    check_tensor(wpe, out.dtype(), {-1, h}, "embedding_forward: wpe");
    check_wpe_rows(wpe.size(0), s, positions, fn);
  }
  MT_CHECK(vocab_start >= 0, "{}: vocab_start={} must be >= 0", fn, vocab_start);
  check_same_device({&out, &ids, &wte, &wpe, &positions});
  MT_CHECK(stream.device().type == out.device().type, "{}: stream on {} but out {}", fn, stream.device().str(),
           out.str());
  MT_DISPATCH(out.device(), embedding_forward, out, ids, wte, wpe, positions, vocab_start, stream);
}

void embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& ids,
                        const Tensor& positions, int64_t vocab_start, bool deterministic, const Stream& stream) {
  const char* fn = "embedding_backward";
  auto [s, b] = check_ids(ids, positions, fn);
  check_act(dout, fn, "dout");
  MT_CHECK(dout.ndim() == 3, "{}: dout must be [s, b, h], got {}", fn, dout.str());
  const int64_t h = dout.size(2);
  check_tensor(dout, dout.dtype(), {s, b, h}, "embedding_backward: dout");
  MT_CHECK(dwte.ndim() == 2, "{}: dwte must be fp32 [V_local, h], got {}", fn, dwte.str());
  check_tensor(dwte, DType::kF32, {-1, h}, "embedding_backward: dwte");
  if (!dwpe.empty()) {
    MT_CHECK(dwpe.ndim() == 2, "{}: dwpe must be fp32 [P, h], got {}", fn, dwpe.str());
    check_tensor(dwpe, DType::kF32, {-1, h}, "embedding_backward: dwpe");
    check_wpe_rows(dwpe.size(0), s, positions, fn);
  }
  MT_CHECK(vocab_start >= 0, "{}: vocab_start={} must be >= 0", fn, vocab_start);
  check_same_device({&dwte, &dwpe, &dout, &ids, &positions});
  MT_CHECK(stream.device().type == dout.device().type, "{}: stream on {} but dout {}", fn, stream.device().str(),
           dout.str());
  MT_DISPATCH(dout.device(), embedding_backward, dwte, dwpe, dout, ids, positions, vocab_start, deterministic,
              stream);
}

}  // namespace mt
