// The int8 linear layer's forward in one call (engine_core.quantization.Int8Linear with the "onednn" kernel):
//
//   y = r * qlinear(round(x * s * 127 / r)) (+ bias),   r = max |x * s| over the row (at least 1e-30)
//
// x's rows are smoothed (times s, per input channel), each quantized to int8 with its own range, multiplied by the
// int8 weight in oneDNN's kernel (`onednn::qlinear_pointwise`, called through torch's dispatcher, its weight scales
// folded into a float32 output) and scaled back by their range. The same float32 operations in the same order as
// the layer's torch ops (x * s; 127 / r as 127 times 1 / r; times that; round half to even), so the same bits:
// this only saves the eight calls from Python a layer made around the kernel, which at a decode step's 32 rows
// cost more than the int8 GEMM of the smaller layers.
//
//   x             (R, I)  float32, contiguous
//   input_scale   (I,)    float32: 1 / s
//   packed        the weight as qlinear_prepack returned it
//   output_scale  (O,)    float32: each output channel's weight step / 127
//   zero_points   (O,)    int64: zeros
//   bias          (O,)    float32 or None
//   -> (R, O) float32
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// One row: smoothed = x * scale, its range r = max |smoothed| (at least 1e-30), out = round(smoothed * (127 / r))
// with 127 / r as torch computes 127.0 / tensor (the reciprocal times 127) and rounding half to even as
// torch.round does. In AVX-512 where the CPU has it (the hosts where oneDNN's int8 kernel is the fast one): a
// vector multiply then a conversion in the default rounding mode, the same IEEE operations as the scalar tail's
// (no add follows a multiply, so the compiler has nothing to fuse into an FMA, which would round differently).
void quantize_row(const float* __restrict__ x, const float* __restrict__ scale, int64_t I,
                  float* __restrict__ smoothed, int8_t* __restrict__ out, float* range) {
  int64_t i = 0;
  float most = 0.f;
#if defined(__AVX512F__)
  __m512 top = _mm512_setzero_ps();
  for (; i + 16 <= I; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(scale + i));
    _mm512_storeu_ps(smoothed + i, v);
    top = _mm512_max_ps(top, _mm512_abs_ps(v));
  }
  most = _mm512_reduce_max_ps(top);
#endif
  for (; i < I; ++i) {
    smoothed[i] = x[i] * scale[i];
    most = std::max(most, std::fabs(smoothed[i]));
  }
  most = std::max(most, 1e-30f);
  *range = most;
  const float step = (1.f / most) * 127.f;
  i = 0;
#if defined(__AVX512F__)
  const __m512 steps = _mm512_set1_ps(step);
  for (; i + 16 <= I; i += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(smoothed + i), steps));  // nearest, even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtsepi32_epi8(q));         // |q| <= 127
  }
#endif
  for (; i < I; ++i) out[i] = static_cast<int8_t>(std::nearbyint(smoothed[i] * step));
}

const c10::OperatorHandle& qlinear() {
  static const c10::OperatorHandle handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  return handle;
}

}  // namespace

at::Tensor int8_linear(at::Tensor x, at::Tensor input_scale, at::Tensor packed, at::Tensor output_scale,
                       at::Tensor zero_points, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "int8_linear: x must be a contiguous 2-d float32 cpu tensor");
  TORCH_CHECK(input_scale.dtype() == at::kFloat && input_scale.is_contiguous() &&
                  input_scale.numel() == x.size(1),
              "int8_linear: input_scale must be float32 with one scale per input channel");
  const int64_t R = x.size(0), I = x.size(1);
  auto qx = at::empty({R, I}, x.options().dtype(at::kChar));
  auto range = at::empty({R, 1}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = input_scale.data_ptr<float>();
  int8_t* qp = qx.data_ptr<int8_t>();
  float* rp = range.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> smoothed(I);
    for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * I, sp, I, smoothed.data(), qp + r * I, rp + r);
  });
  // qlinear_pointwise(qx, x_scale, x_zero_point, qw, w_scale, w_zero_point, bias, output_scale, output_zero_point,
  // output_dtype, post_op_name, post_op_args, post_op_algorithm): activation scale 1 and zero point 0, no bias,
  // float32 output (no requantization), no fused post-op
  torch::jit::Stack stack{qx,
                          1.0,
                          static_cast<int64_t>(0),
                          packed,
                          output_scale,
                          zero_points,
                          c10::IValue(),
                          1.0,
                          static_cast<int64_t>(0),
                          c10::IValue(at::kFloat),
                          std::string("none"),
                          c10::List<c10::optional<at::Scalar>>(),
                          std::string("")};
  qlinear().callBoxed(&stack);
  auto y = stack.back().toTensor();  // (R, O)
  TORCH_CHECK(y.is_contiguous() && y.dtype() == at::kFloat, "int8_linear: the kernel's output is not float32");
  const int64_t O = y.size(1);
  float* yp = y.data_ptr<float>();
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dtype() == at::kFloat && bias->is_contiguous() && bias->numel() == O,
                "int8_linear: bias must be float32 with one value per output channel");
    bp = bias->data_ptr<float>();
  }
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    const int64_t width = O;  // locals: no reload through the lambda's references in the loops
    for (int64_t r = begin; r < end; ++r) {
      float* __restrict__ out = yp + r * width;
      const float* __restrict__ add = bp;
      const float row_range = rp[r];
      for (int64_t o = 0; o < width; ++o) out[o] *= row_range;
      if (add != nullptr)
        for (int64_t o = 0; o < width; ++o) out[o] += add[o];
    }
  });
  return y;
}
