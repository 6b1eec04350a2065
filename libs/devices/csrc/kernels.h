// The cpu module's C++ kernels, one extension (module.cpp binds them for Python). Each file says what its kernels
// take and return.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

// paged_decode.cpp
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor context_lens, double scale, int64_t value_dim);
at::Tensor paged_chunk(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                       int64_t num_cached, double scale, int64_t value_dim);

// int8_linear.cpp
at::Tensor int8_linear(at::Tensor x, at::Tensor input_scale, at::Tensor packed, at::Tensor output_scale,
                       at::Tensor zero_points, std::optional<at::Tensor> bias);
