// Argument validation and backend dispatch for ops/fp8_epilogue.h.
#include "ops/fp8_epilogue.h"

#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {

void fp8_bias_gelu(const Tensor& y, const Tensor& bias, const Tensor& act, const Stream& stream) {
  const char* fn = "fp8_bias_gelu";
  op_checks::check_act(y, fn, "y");
  const auto [rows, n] = op_checks::rows_of(y, fn);
  (void)rows;
  MT_CHECK(!bias.empty() || !act.empty(), "{}: neither bias nor act given: nothing to do", fn);
  if (!bias.empty()) {
    op_checks::check_act(bias, fn, "bias");
    MT_CHECK(bias.numel() == n && bias.dtype() == y.dtype(), "{}: bias {} must be [{}] of y's dtype ({})", fn,
             bias.str(), n, y.str());
  }
  if (!act.empty()) {
    op_checks::check_act(act, fn, "act");
    op_checks::check_like(act, y, fn, "act", "y");
    MT_CHECK(act.data() != y.data(), "{}: act must not alias y", fn);
  }
  check_same_device({&y, &bias, &act});
  op_checks::check_stream(stream, y, fn);
  MT_DISPATCH(y.device(), fp8_bias_gelu, y, bias, act, stream);
}

}  // namespace mt
