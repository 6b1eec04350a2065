// Decode attention that reads the paged KV cache in place (the cpu module's `paged_decode_attention` and
// `mla_decode_attention`, float32).
//
// One query token per sequence attends over its own context, block by block through its block table: no copy of
// the blocks into a gathered buffer, no padding to a longer row's length. Work is split by sequence; each
// position's K and V rows (all KV heads) are read once, front to back, for every query head. Softmax in float32
// with the row's maximum subtracted, as SDPA does; sums run in position order, so a row's result does not depend
// on the other rows of the batch.
//
//   q            (B, H, D)       float32, contiguous
//   k_cache      (N, S, K, D)    float32, contiguous: N blocks of S positions, K KV heads
//   v_cache      (N, S, K, W)    float32, contiguous; each head's value is the first Dv of its W floats
//   block_tables (B, M)          int32: block ids per sequence
//   context_lens (B,)            int32: positions each sequence attends (its new token included)
//   value_dim    Dv              0: W. MLA passes its latent cache as both caches (K = 1, D = W = R + P) and
//                                Dv = R: a position's value is its latent vector, without the rope part
//   -> (B, H, Dv) float32

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, int64_t value_dim) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && context_lens.device().is_cpu(),
              "paged_decode: cpu tensors only");
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
                  v_cache.dtype() == torch::kFloat32,
              "paged_decode: float32 only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && context_lens.dtype() == torch::kInt32,
              "paged_decode: int32 block tables and context lengths");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode: shapes");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t S = k_cache.size(1), K = k_cache.size(2), W = v_cache.size(3), M = block_tables.size(1);
  const int64_t Dv = value_dim > 0 ? value_dim : W;
  TORCH_CHECK(k_cache.size(3) == D && K > 0 && H % K == 0 && Dv <= W, "paged_decode: head shapes");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == S && v_cache.size(2) == K,
              "paged_decode: K and V caches of different block shapes");
  const int64_t G = H / K;
  auto out = torch::empty({B, H, Dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  // Query heads [h0, h1) of sequence b. Each head's arithmetic is the same whichever heads share the call, so
  // a row's result is the same bits however the work is split.
  auto attend = [&](int64_t b, int64_t h0, int64_t h1, std::vector<float>& scores, std::vector<float>& acc) {
    const int64_t L = lens[b], n = h1 - h0;
    TORCH_CHECK(L > 0 && L <= M * S, "paged_decode: a context length outside its block table");
    scores.resize(n * L);
    acc.assign(n * Dv, 0.f);
    const float* queries = qp + b * H * D;
    const int32_t* table = tables + b * M;
    for (int64_t l = 0; l < L; ++l) {
      const float* keys = kc + (static_cast<int64_t>(table[l / S]) * S + l % S) * K * D;  // (K, D)
      for (int64_t h = h0; h < h1; ++h) {
        const float* query = queries + h * D;
        const float* key = keys + (h / G) * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += query[d] * key[d];
        scores[(h - h0) * L + l] = dot * sc;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      float* row = scores.data() + i * L;
      const float most = *std::max_element(row, row + L);
      float total = 0.f;
      for (int64_t l = 0; l < L; ++l) {
        row[l] = std::exp(row[l] - most);
        total += row[l];
      }
      const float inverse = 1.f / total;
      for (int64_t l = 0; l < L; ++l) row[l] *= inverse;
    }
    for (int64_t l = 0; l < L; ++l) {
      const float* values = vc + (static_cast<int64_t>(table[l / S]) * S + l % S) * K * W;  // (K, W)
      for (int64_t h = h0; h < h1; ++h) {
        const float weight = scores[(h - h0) * L + l];
        const float* value = values + (h / G) * W;
        float* sum = acc.data() + (h - h0) * Dv;
#pragma omp simd
        for (int64_t d = 0; d < Dv; ++d) sum[d] += weight * value[d];
      }
    }
    std::copy(acc.begin(), acc.end(), op + (b * H + h0) * Dv);
  };

  // One work item per sequence where there are enough of them: each position's keys (or values) for all KV
  // heads are one contiguous row of the block, K * D floats, read front to back; a block's rows follow each
  // other, so the reads stream through memory as the hardware prefetcher expects. (An item per KV head read a
  // D-float slice every K * D floats: on a cold cache, as between two layers of a real step, that ran 3x slower
  // on one AMD host than the same call warm.) Fewer sequences than threads (a batch of one): an item per
  // (sequence, query head), so that every thread works; a few sequences' rows are small enough to stay cached.
  if (B >= at::get_num_threads()) {
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc;
      for (int64_t b = begin; b < end; ++b) attend(b, 0, H, scores, acc);
    });
  } else {
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc;
      for (int64_t item = begin; item < end; ++item) attend(item / H, item % H, item % H + 1, scores, acc);
    });
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over the paged cache", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("value_dim") = 0);
}
