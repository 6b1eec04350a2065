// Decode attention that reads the paged KV cache in place (the cpu module's `paged_decode_attention` and
// `mla_decode_attention`, float32).
//
// One query token per sequence attends over its own context, block by block through its block table: no copy of
// the blocks into a gathered buffer, no padding to a longer row's length. Work is split by sequence; each
// position's K and V rows (all KV heads) are read front to back, a register's width of positions at a time (16
// floats with AVX-512, 8 with AVX2) for every query head. Where heads are multiples of that width, a query head's
// dot products for those positions are summed across lanes at once, the softmax's exp is vectorized, a head's
// value sums stay in registers, and the next positions' rows are prefetched (blocks lie anywhere, so the hardware
// prefetcher meets each cold); other head sizes take scalar loops. Softmax in float32 with the row's maximum
// subtracted, as SDPA does; each head's sums run in a fixed order, so a row's result does not depend on the other
// rows of the batch.
//
//   q            (B, H, D)       float32, contiguous
//   k_cache      (N, S, K, D)    float32, contiguous: N blocks of S positions, K KV heads
//   v_cache      (N, S, K, W)    float32, contiguous; each head's value is the first Dv of its W floats
//   block_tables (B, M)          int32: block ids per sequence
//   context_lens (B,)            int32: positions each sequence attends (its new token included)
//   value_dim    Dv              0: W. MLA passes its latent cache as both caches (K = 1, D = W = R + P) and
//                                Dv = R: a position's value is its latent vector, without the rope part
//   -> (B, H, Dv) float32

// `paged_chunk` (the cpu module's `cached_prefill_attention`): a chunk of Lq new queries of one sequence (a long
// prompt's next chunk) over its whole context, read in place through its block table the same way. Its cost is
// in its arithmetic (Lq x H x L dot products) more than its reads, so each block's keys are transposed into a
// (D, S) tile and a query row's scores for the block's S positions are one vector per d; the softmax's exp is a
// polynomial the compiler vectorizes. The context is split into contiguous partitions, one per thread, each
// reading its positions' K and V rows front to back for every query head; their partial softmaxes are merged as
// flash-decoding does.
//
//   q           (Lq, H, D)   float32, contiguous: positions num_cached .. num_cached + Lq - 1
//   block_table (M,)         int32: the sequence's blocks, covering num_cached + Lq positions
//   -> (Lq, H, Dv) float32; query i sees positions 0 .. num_cached + i
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Explicit vectors of 16 floats (GCC's vector extensions: one AVX-512 register, two AVX2 ones elsewhere), and
// of 8 (one AVX2 register), which the decode kernel takes where a register holds no more (`vd`, kWide).
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 16;
#if defined(__AVX512F__)
typedef vf vd;
#else
typedef v8 vd;
#endif
constexpr int64_t kWide = sizeof(vd) / sizeof(float);

template <typename V = vf>
inline V load(const float* p) {
  V x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
template <typename V>
inline void store(float* p, V x) {
  std::memcpy(p, &x, sizeof x);
}

// e^x for x <= 0 (a score minus its row's maximum), as Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by a
// degree-6 polynomial, 2^n by the exponent's bits; relative error under 2e-7; exactly 0 below -87 (a masked
// score, -inf, included). std::exp would stay scalar without -ffast-math (which would also assume no NaN).
template <typename V>
inline V exp_nonpositive(V x) {
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  const VI keep = x >= -87.0f;
  x = x < -87.0f ? V{} - 87.0f : x;
  const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 x 2^23
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  return (V)((VI)(y * (V)bits) & keep);
}

#if defined(__clang__)
#define KVMESH_SHUFFLE(a, b, mask, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define KVMESH_SHUFFLE(a, b, mask, ...) __builtin_shuffle(a, b, mask{__VA_ARGS__})
#endif

// A vector's worth of dot products' partial vectors summed across their lanes at once, as a tree of pairwise
// halvings (15 shuffle-and-add steps for 16 lanes, 7 for 8, instead of a horizontal sum each): lane t of the result
// is the sum of the lanes of parts[kBitReversed[t]] (its index with the bits reversed), always in the same order.
constexpr int kBitReversed[kWide] =
#if defined(__AVX512F__)
    {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#else
    {0, 4, 2, 6, 1, 5, 3, 7};
#endif
inline vf lane_sums(const vf* parts) {
  vf half[8], quarter[4], eighth[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: parts[2i]'s 8 partial sums; 8-15: parts[2i + 1]'s
    const vf a = parts[2 * i], b = parts[2 * i + 1];
    half[i] = KVMESH_SHUFFLE(a, b, vi, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
              KVMESH_SHUFFLE(a, b, vi, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // four lanes a part
    const vf a = half[2 * i], b = half[2 * i + 1];
    quarter[i] = KVMESH_SHUFFLE(a, b, vi, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
                 KVMESH_SHUFFLE(a, b, vi, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // two lanes a part
    const vf a = quarter[2 * i], b = quarter[2 * i + 1];
    eighth[i] = KVMESH_SHUFFLE(a, b, vi, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                KVMESH_SHUFFLE(a, b, vi, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  const vf a = eighth[0], b = eighth[1];
  return KVMESH_SHUFFLE(a, b, vi, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         KVMESH_SHUFFLE(a, b, vi, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

inline v8 lane_sums(const v8* parts) {
  v8 half[4], quarter[2];
  for (int i = 0; i < 4; ++i) {  // lanes 0-3: parts[2i]'s 4 partial sums; 4-7: parts[2i + 1]'s
    const v8 a = parts[2 * i], b = parts[2 * i + 1];
    half[i] = KVMESH_SHUFFLE(a, b, vi8, 0, 1, 2, 3, 8, 9, 10, 11) +
              KVMESH_SHUFFLE(a, b, vi8, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {  // two lanes a part
    const v8 a = half[2 * i], b = half[2 * i + 1];
    quarter[i] =
        KVMESH_SHUFFLE(a, b, vi8, 0, 1, 8, 9, 4, 5, 12, 13) + KVMESH_SHUFFLE(a, b, vi8, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  const v8 a = quarter[0], b = quarter[1];
  return KVMESH_SHUFFLE(a, b, vi8, 0, 8, 2, 10, 4, 12, 6, 14) + KVMESH_SHUFFLE(a, b, vi8, 1, 9, 3, 11, 5, 13, 7, 15);
}

inline float sum_lanes(vd x) {  // in lane order
  float total = 0.f;
  for (int i = 0; i < kWide; ++i) total += x[i];
  return total;
}

// The batch's shapes and pointers, as every sequence's attention reads them.
struct Decode {
  int64_t H, D, S, K, W, Dv, G, M;
  const float* qp;
  const float* kc;
  const float* vc;
  const int32_t* tables;
  const int32_t* lens;
  float* op;
  float scale;
};

// Query heads [h0, h1) of sequence b, any head size: scalar loops, sums in position order.
void attend_any(const Decode& c, int64_t b, int64_t h0, int64_t h1, std::vector<float>& scores,
                std::vector<float>& acc) {
  const int64_t L = c.lens[b], n = h1 - h0, D = c.D, Dv = c.Dv;
  scores.resize(n * L);
  acc.assign(n * Dv, 0.f);
  const float* queries = c.qp + b * c.H * D;
  const int32_t* table = c.tables + b * c.M;
  for (int64_t l = 0; l < L; ++l) {
    const float* keys = c.kc + (static_cast<int64_t>(table[l / c.S]) * c.S + l % c.S) * c.K * D;  // (K, D)
    for (int64_t h = h0; h < h1; ++h) {
      const float* query = queries + h * D;
      const float* key = keys + (h / c.G) * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += query[d] * key[d];
      scores[(h - h0) * L + l] = dot * c.scale;
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
    const float* values = c.vc + (static_cast<int64_t>(table[l / c.S]) * c.S + l % c.S) * c.K * c.W;  // (K, W)
    for (int64_t h = h0; h < h1; ++h) {
      const float weight = scores[(h - h0) * L + l];
      const float* value = values + (h / c.G) * c.W;
      float* sum = acc.data() + (h - h0) * Dv;
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) sum[d] += weight * value[d];
    }
  }
  std::copy(acc.begin(), acc.end(), c.op + (b * c.H + h0) * Dv);
}

// Heads whose value sums are held in registers at once: 4 x 4 vectors and the value row's 4 fit AVX-512's 32
// registers, 2 x 4 and 4 AVX2's 16.
constexpr int kHeads = kWide == 16 ? 4 : 2;

// Heads [h, h + NH): their weighted sum of values over the context, VC vectors of each value from float u0 on,
// sums in position order in registers, divided by each head's softmax total at the end.
template <int NH, int VC>
void weigh_values(const Decode& c, int64_t b, int64_t h, int64_t u0, int64_t L, const int64_t* entries,
                  const float* weights, int64_t stride, const float* inverse) {
  vd sums[NH][VC] = {};
  const float* rows[NH];
  for (int g = 0; g < NH; ++g) rows[g] = c.vc + ((h + g) / c.G) * c.W + u0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t at = entries[l] * c.K * c.W;
    for (int g = 0; g < NH; ++g) {
      const float w = weights[g * stride + l];
      for (int i = 0; i < VC; ++i) sums[g][i] += w * load<vd>(rows[g] + at + i * kWide);
    }
  }
  for (int g = 0; g < NH; ++g)
    for (int i = 0; i < VC; ++i) store(c.op + (b * c.H + h + g) * c.Dv + u0 + i * kWide, sums[g][i] * inverse[g]);
}

template <int VC>
void weigh_values_of(const Decode& c, int64_t b, int64_t h, int64_t nh, int64_t u0, int64_t L, const int64_t* entries,
                     const float* weights, int64_t stride, const float* inverse) {
  switch (nh) {
    case 1: return weigh_values<1, VC>(c, b, h, u0, L, entries, weights, stride, inverse);
    case 2: return weigh_values<2, VC>(c, b, h, u0, L, entries, weights, stride, inverse);
    case 3: return weigh_values<3, VC>(c, b, h, u0, L, entries, weights, stride, inverse);
    default: return weigh_values<4, VC>(c, b, h, u0, L, entries, weights, stride, inverse);
  }
}

// Query heads [h0, h1) of sequence b, head sizes that are multiples of kWide floats (VC vectors of a value at a
// time): scores kWide positions a vector, the softmax's exp vectorized, values summed in registers. The scratch
// holds the entries (L), the scaled queries (n x D), the scores (n x L rounded up to kWide) and n inverse totals.
template <int VC>
void attend(const Decode& c, int64_t b, int64_t h0, int64_t h1, std::vector<float>& scratch,
            std::vector<int64_t>& entries) {
  const int64_t L = c.lens[b], n = h1 - h0, D = c.D, stride = (L + kWide - 1) / kWide * kWide;
  const int32_t* table = c.tables + b * c.M;
  entries.resize(stride);
  for (int64_t l = 0; l < L; ++l) entries[l] = static_cast<int64_t>(table[l / c.S]) * c.S + l % c.S;
  scratch.resize(n * D + n * stride + n);
  float* queries = scratch.data();
  float* scores = queries + n * D;
  float* inverse = scores + n * stride;  // each head's 1 / its softmax total
  for (int64_t i = 0; i < n * D; ++i) queries[i] = c.qp[(b * c.H + h0) * D + i] * c.scale;
  // Scores: kWide positions at a time, every head (each position's keys are one row, read front to
  // back; the block's rows stay in L1 while the heads read them).
  const int64_t key_bytes = c.K * D * 4, value_bytes = c.K * c.W * 4;
  for (int64_t l0 = 0; l0 < L; l0 += kWide) {
    const int64_t m = std::min<int64_t>(kWide, L - l0);
    // Blocks lie anywhere in the cache, so the hardware prefetcher meets each one cold: ask for the next
    // positions' keys, and these positions' values (the value pass reads them next), while these are scored.
    for (int64_t t = 0; t < m; ++t) {
      const char* value = reinterpret_cast<const char*>(c.vc + entries[l0 + t] * c.K * c.W);
      for (int64_t at = 0; at < value_bytes; at += 64) __builtin_prefetch(value + at, 0, 3);
      if (l0 + kWide + t < L) {
        const char* key = reinterpret_cast<const char*>(c.kc + entries[l0 + kWide + t] * c.K * D);
        for (int64_t at = 0; at < key_bytes; at += 64) __builtin_prefetch(key + at, 0, 3);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* query = queries + i * D;
      const int64_t kh = (h0 + i) / c.G;
      vd parts[kWide];
      for (int s = 0; s < kWide; ++s) {
        const int t = kBitReversed[s];
        vd dot = {};
        if (t < m) {
          const float* key = c.kc + entries[l0 + t] * c.K * D + kh * D;
          for (int64_t d = 0; d < D; d += kWide) dot += load<vd>(query + d) * load<vd>(key + d);
        }
        parts[s] = dot;
      }
      store(scores + i * stride + l0, lane_sums(parts));
    }
  }
  // Softmax: each head's maximum subtracted, exp kWide positions a vector; the total in a fixed order.
  for (int64_t i = 0; i < n; ++i) {
    float* row = scores + i * stride;
    for (int64_t l = L; l < stride; ++l) row[l] = -INFINITY;  // past the context: weight 0
    vd top = vd{} - INFINITY;
    for (int64_t l = 0; l < stride; l += kWide) {
      const vd x = load<vd>(row + l);
      top = x > top ? x : top;
    }
    float most = top[0];
    for (int k = 1; k < kWide; ++k) most = std::max(most, top[k]);
    vd total = {};
    for (int64_t l = 0; l < stride; l += kWide) {
      const vd p = exp_nonpositive(load<vd>(row + l) - most);
      store(row + l, p);
      total += p;
    }
    inverse[i] = 1.f / sum_lanes(total);
  }
  for (int64_t u0 = 0; u0 < c.Dv; u0 += VC * kWide)
    for (int64_t i = 0; i < n; i += kHeads)
      weigh_values_of<VC>(c, b, h0 + i, std::min<int64_t>(kHeads, n - i), u0, L, entries.data(),
                          scores + i * stride, stride, inverse + i);
}

}  // namespace

// Decode attention: one query token per sequence over its own context, block by block through its block table (no
// copy of the blocks into a gathered buffer, no padding to a longer row's length). Work is split by sequence;
// a head's arithmetic is the same whichever heads share its call, so a row's result is the same bits however the
// batch is made up and split.
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor context_lens, double scale, int64_t value_dim) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && context_lens.device().is_cpu(),
              "paged_decode: cpu tensors only");
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kFloat &&
                  v_cache.dtype() == at::kFloat,
              "paged_decode: float32 only");
  TORCH_CHECK(block_tables.dtype() == at::kInt && context_lens.dtype() == at::kInt,
              "paged_decode: int32 block tables and context lengths");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode: shapes");
  Decode c;
  const int64_t B = q.size(0);
  c.H = q.size(1), c.D = q.size(2);
  c.S = k_cache.size(1), c.K = k_cache.size(2), c.W = v_cache.size(3), c.M = block_tables.size(1);
  c.Dv = value_dim > 0 ? value_dim : c.W;
  TORCH_CHECK(k_cache.size(3) == c.D && c.K > 0 && c.H % c.K == 0 && c.Dv <= c.W, "paged_decode: head shapes");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == c.S && v_cache.size(2) == c.K,
              "paged_decode: K and V caches of different block shapes");
  c.G = c.H / c.K;
  c.lens = context_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(c.lens[b] > 0 && c.lens[b] <= c.M * c.S, "paged_decode: a context length outside its block table");
  auto out = at::empty({B, c.H, c.Dv}, q.options());
  c.qp = q.data_ptr<float>();
  c.kc = k_cache.data_ptr<float>();
  c.vc = v_cache.data_ptr<float>();
  c.tables = block_tables.data_ptr<int32_t>();
  c.op = out.data_ptr<float>();
  c.scale = static_cast<float>(scale);
  const bool vectors = c.D % kWide == 0 && c.Dv % kWide == 0;
  auto heads = [&](int64_t b, int64_t h0, int64_t h1, std::vector<float>& scratch, std::vector<float>& more,
                   std::vector<int64_t>& entries) {
    if (!vectors) return attend_any(c, b, h0, h1, scratch, more);
    if (c.Dv % (4 * kWide) == 0) return attend<4>(c, b, h0, h1, scratch, entries);
    if (c.Dv % (2 * kWide) == 0) return attend<2>(c, b, h0, h1, scratch, entries);
    return attend<1>(c, b, h0, h1, scratch, entries);
  };
  // One work item per sequence where there are enough of them; fewer sequences than threads (a batch of one):
  // an item per (sequence, query head), so that every thread works.
  const int64_t H = c.H;
  const bool by_sequence = B >= at::get_num_threads();
  at::parallel_for(0, by_sequence ? B : B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch, more;
    std::vector<int64_t> entries;
    for (int64_t item = begin; item < end; ++item) {
      if (by_sequence) heads(item, 0, H, scratch, more, entries);
      else heads(item / H, item % H, item % H + 1, scratch, more, entries);
    }
  });
  return out;
}

namespace {

constexpr int64_t kRows = 4;  // positions scored, or rows summed, at once: independent sums in registers
// Positions a span holds: its keys and values stay in the core's cache while every KV head reads them, and its
// scores (positions x KV heads x lanes) stay under 256 KB.
constexpr int64_t kSpan = 256, kSpanFloats = 1 << 16;
constexpr int64_t kPrefetch = 16;  // positions ahead whose keys are prefetched

// One sequence's chunk: the shapes and pointers every partition reads.
struct Chunk {
  int64_t Lq, H, D, S, K, W, Dv, G, num_cached;
  const int32_t* table;
  const float* kc;
  const float* vc;
  const float* qt;  // (K, D, NV * kLanes): per KV head, its group's query rows (row i * G + g) transposed, scaled
  int64_t entry(int64_t l) const { return (int64_t)table[l / S] * S + l % S; }  // position l's slot in the cache
};

// Positions [s0, s1) of one partition, every KV head: scores (rows as lanes), the online softmax's update of each
// row's maximum, sum and weighted values (most, total: (K, NV * kLanes); acc: (K, NV * kLanes, Dv)). With
// `causal` the positions are the chunk's own (num_cached ..): query i sees those up to num_cached + i.
template <int NV, int DV>
void attend_span(const Chunk& c, int64_t s0, int64_t s1, bool causal, float* scores, float* most, float* total,
                 float* acc) {
  const int64_t n = s1 - s0, width = NV * kLanes, rows = c.Lq * c.G;
  int64_t entries[kSpan];  // each position's slot, looked up once (a division by the block size each)
  for (int64_t j = 0; j < n; ++j) entries[j] = c.entry(s0 + j);
  auto key = [&](int64_t j, int64_t kh) { return c.kc + entries[j] * c.K * c.D + kh * c.D; };
  auto value = [&](int64_t j, int64_t kh) { return c.vc + entries[j] * c.K * c.W + kh * c.W; };
  // Scores, position by position (each position's keys of every KV head are one row, read front to back):
  // kRows positions a pass, so that each query column is loaded once for all of them.
  int64_t j = 0;
  const int64_t key_bytes = c.K * c.D * 4, value_bytes = c.K * c.W * 4;
  for (; j < n; j += kRows) {
    const int64_t m = std::min(kRows, n - j);
    // Ask for what comes next while the FMAs run (the hardware prefetcher alone kept a core at ~6 GB/s here): the
    // keys kPrefetch positions ahead, and these positions' values, which the value pass reads head by head.
    for (int64_t t = 0; t < m; ++t) {
      const char* v = reinterpret_cast<const char*>(value(j + t, 0));
      for (int64_t b = 0; b < value_bytes; b += 64) __builtin_prefetch(v + b, 0, 3);
      if (j + t + kPrefetch < n) {
        const char* k = reinterpret_cast<const char*>(key(j + t + kPrefetch, 0));
        for (int64_t b = 0; b < key_bytes; b += 64) __builtin_prefetch(k + b, 0, 3);
      }
    }
    for (int64_t kh = 0; kh < c.K; ++kh) {
      const float* qt = c.qt + kh * c.D * width;
      const float* keys[kRows];
      for (int64_t t = 0; t < kRows; ++t) keys[t] = key(j + std::min(t, m - 1), kh);  // repeats: unused
      vf dots[kRows][NV] = {};
      for (int64_t d = 0; d < c.D; ++d) {
        for (int v = 0; v < NV; ++v) {
          const vf column = load(qt + d * width + v * kLanes);
          for (int64_t t = 0; t < kRows; ++t) dots[t][v] += keys[t][d] * column;
        }
      }
      float* sc = scores + kh * n * width;  // (n, width)
      for (int64_t t = 0; t < m; ++t)
        for (int v = 0; v < NV; ++v) store(sc + (j + t) * width + v * kLanes, dots[t][v]);
    }
  }
  for (int64_t kh = 0; kh < c.K; ++kh) {
    float* sc = scores + kh * n * width;
    if (causal) {  // position s0 + j is the chunk's token j - (num_cached - s0); earlier queries do not see it
      for (j = 0; j < n; ++j) {
        const int64_t token = s0 + j - c.num_cached;
        for (int64_t r = 0; r < std::min(token * c.G, rows); ++r) sc[j * width + r] = -INFINITY;
      }
    }
    // The online softmax, lanes as rows: a new maximum rescales what each row has summed so far.
    float* m = most + kh * width;
    float* sum = total + kh * width;
    float* out = acc + kh * width * c.Dv;
    for (int v = 0; v < NV; ++v) {
      vf top = load(m + v * kLanes);
      const vf before = top;
      for (j = 0; j < n; ++j) {
        const vf x = load(sc + j * width + v * kLanes);
        top = x > top ? x : top;
      }
      const vf factor = exp_nonpositive(before - top);  // 0 where nothing was summed yet (before = -inf)
      store(m + v * kLanes, top);
      vf s = load(sum + v * kLanes) * factor;
      for (j = 0; j < n; ++j) {
        const vf p = exp_nonpositive(load(sc + j * width + v * kLanes) - top);
        store(sc + j * width + v * kLanes, p);
        s += p;
      }
      store(sum + v * kLanes, s);
      for (int64_t lane = 0; lane < kLanes && v * kLanes + lane < rows; ++lane) {
        float* row = out + (v * kLanes + lane) * c.Dv;
        const float f = factor[lane];
        for (int64_t d = 0; d < c.Dv; ++d) row[d] *= f;
      }
    }
    // Values: kRows rows a pass, their weighted sums in registers over the span's positions.
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      vf sums[kRows][DV] = {};
      for (j = 0; j < n; ++j) {
        const float* value_row = value(j, kh);
        vf parts[DV];
        for (int u = 0; u < DV; ++u) parts[u] = load(value_row + u * kLanes);
        const float* p = sc + j * width + r0;
        for (int64_t t = 0; t < kRows; ++t)
          for (int u = 0; u < DV; ++u) sums[t][u] += p[t] * parts[u];
      }
      for (int64_t t = 0; t < kRows && r0 + t < rows; ++t) {
        float* row = out + (r0 + t) * c.Dv;
        for (int u = 0; u < DV; ++u) store(row + u * kLanes, load(row + u * kLanes) + sums[t][u]);
      }
    }
  }
}

template <int NV, int DV>
at::Tensor chunk_attention(const Chunk& c, at::Tensor q) {
  const int64_t width = NV * kLanes, rows = c.Lq * c.G, L = c.num_cached + c.Lq;
  const int64_t span = std::max<int64_t>(kRows, std::min(kSpan, kSpanFloats / (c.K * width) / kRows * kRows));
  // Partitions of the cached positions on block boundaries, one a thread; the chunk's own positions, which
  // need the causal mask, are one more, attended after them (a few positions).
  const int64_t cached_blocks = (c.num_cached + c.S - 1) / c.S;
  const int64_t P =
      c.num_cached > 0 ? std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), cached_blocks)) : 0;
  const int64_t blocks_per_part = P > 0 ? (cached_blocks + P - 1) / P : 0;
  const int64_t state = c.K * width;
  std::vector<float> most((P + 1) * state, -INFINITY), total((P + 1) * state, 0.f);
  std::vector<float> acc((P + 1) * state * c.Dv, 0.f);
  auto attend = [&](int64_t part, std::vector<float>& scores) {
    const bool own = part == P;
    const int64_t p0 = own ? c.num_cached : std::min(c.num_cached, part * blocks_per_part * c.S);
    const int64_t p1 = own ? L : std::min(c.num_cached, (part + 1) * blocks_per_part * c.S);
    for (int64_t s0 = p0; s0 < p1; s0 += span)
      attend_span<NV, DV>(c, s0, std::min(p1, s0 + span), own, scores.data(), most.data() + part * state,
                          total.data() + part * state, acc.data() + part * state * c.Dv);
  };
  const int64_t scores_floats = c.K * span * width;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(scores_floats);
    for (int64_t part = begin; part < end; ++part) attend(part, scores);
  });
  std::vector<float> scores(scores_floats);
  attend(P, scores);
  // Merge the partitions in their order: each row's sums rescaled to its largest maximum.
  auto out = at::empty({c.Lq, c.H, c.Dv}, q.options());
  float* op = out.data_ptr<float>();
  for (int64_t kh = 0; kh < c.K; ++kh) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r / c.G, h = kh * c.G + r % c.G, at = kh * width + r;
      float top = -INFINITY, sum = 0.f;
      for (int64_t part = 0; part <= P; ++part)
        if (total[part * state + at] > 0.f) top = std::max(top, most[part * state + at]);
      float* row = op + (i * c.H + h) * c.Dv;
      std::fill(row, row + c.Dv, 0.f);
      for (int64_t part = 0; part <= P; ++part) {
        if (total[part * state + at] == 0.f) continue;  // an empty partition
        const float factor = std::exp(most[part * state + at] - top);
        sum += factor * total[part * state + at];
        const float* a = acc.data() + (part * state + at) * c.Dv;
        for (int64_t d = 0; d < c.Dv; ++d) row[d] += factor * a[d];
      }
      for (int64_t d = 0; d < c.Dv; ++d) row[d] /= sum;
    }
  }
  return out;
}

template <int DV>
at::Tensor chunk_attention_rows(const Chunk& c, at::Tensor q, int64_t nv) {
  switch (nv) {
    case 1: return chunk_attention<1, DV>(c, q);
    case 2: return chunk_attention<2, DV>(c, q);
    case 3: return chunk_attention<3, DV>(c, q);
    case 4: return chunk_attention<4, DV>(c, q);
    case 5: return chunk_attention<5, DV>(c, q);
    case 6: return chunk_attention<6, DV>(c, q);
    case 7: return chunk_attention<7, DV>(c, q);
    default: return chunk_attention<8, DV>(c, q);
  }
}

}  // namespace

at::Tensor paged_chunk(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                       int64_t num_cached, double scale, int64_t value_dim) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_table.device().is_cpu(),
              "paged_chunk: cpu tensors only");
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kFloat &&
                  v_cache.dtype() == at::kFloat,
              "paged_chunk: float32 only");
  TORCH_CHECK(block_table.dtype() == at::kInt, "paged_chunk: an int32 block table");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && block_table.is_contiguous(),
              "paged_chunk: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4 && block_table.dim() == 1,
              "paged_chunk: shapes");
  Chunk c;
  c.Lq = q.size(0), c.H = q.size(1), c.D = q.size(2);
  c.S = k_cache.size(1), c.K = k_cache.size(2), c.W = v_cache.size(3);
  c.Dv = value_dim > 0 ? value_dim : c.W;
  c.num_cached = num_cached;
  TORCH_CHECK(k_cache.size(3) == c.D && c.K > 0 && c.H % c.K == 0 && c.Dv <= c.W, "paged_chunk: head shapes");
  TORCH_CHECK(c.Dv == 16 || c.Dv == 32 || c.Dv == 64 || c.Dv == 128, "paged_chunk: values of 16, 32, 64 or 128 floats");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == c.S && v_cache.size(2) == c.K,
              "paged_chunk: K and V caches of different block shapes");
  c.G = c.H / c.K;
  const int64_t rows = c.Lq * c.G, nv = (rows + kLanes - 1) / kLanes;
  TORCH_CHECK(nv <= 8, "paged_chunk: at most 128 query rows a KV head (chunk tokens x query heads per KV head)");
  TORCH_CHECK(c.Lq > 0 && num_cached >= 0 && num_cached + c.Lq <= block_table.size(0) * c.S,
              "paged_chunk: a context length outside its block table");
  c.table = block_table.data_ptr<int32_t>();
  c.kc = k_cache.data_ptr<float>();
  c.vc = v_cache.data_ptr<float>();
  // Each KV head's query rows (query i, head kh * G + g as row i * G + g) transposed to (D, lanes), scaled.
  const int64_t width = nv * kLanes;
  std::vector<float> qt(c.K * c.D * width, 0.f);
  const float* qp = q.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  for (int64_t i = 0; i < c.Lq; ++i)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t d = 0; d < c.D; ++d)
        qt[((h / c.G) * c.D + d) * width + i * c.G + h % c.G] = qp[(i * c.H + h) * c.D + d] * sc;
  c.qt = qt.data();
  switch (c.Dv) {
    case 16: return chunk_attention_rows<1>(c, q, nv);
    case 32: return chunk_attention_rows<2>(c, q, nv);
    case 64: return chunk_attention_rows<4>(c, q, nv);
    default: return chunk_attention_rows<8>(c, q, nv);
  }
}
