"""Weight quantization, applied once after the weights load: `EngineConfig.quantization` (KVMESH_QUANTIZATION).

`int8` runs every linear layer (attention projections, the MLP, the LM head) with int8 weights, one scale per
output channel, and int8 activations quantized on the fly at each call (one scale per token, from its own
range; see `Int8Linear`): PyTorch's own int8 kernels, oneDNN's (`torch.ops.onednn.qlinear_pointwise`, AMX or
AVX-512 VNNI, what inductor's x86 int8 path calls) where the CPU has VNNI and a probe finds it the faster
(`int8_kernel`), fbgemm's dynamic linear (`torch.ops.quantized.linear_dynamic`) elsewhere. The weights take a
quarter of the bytes and the multiplies run on int8 dot products, which is where a CPU decode step spends most of
its time. Norms, embeddings, rope, attention and the KV cache stay float32.

One scale per token is still coarse when a few channels carry outliers (they do in LLMs: the inputs of
`down_proj` most): their range sets the step for every other channel. So each linear layer is first smoothed,
as SmoothQuant does: input channel j is divided by s_j and the weight's column j multiplied by it (the product is
unchanged), s_j = sqrt(max|x_j| / max|W_j|), which moves outlier range from the activations into the per-channel
weights. max|x_j| comes from one float32 forward pass over a fixed calibration text at load, so every worker
computes the same weights. docs/engine.md gives the quality this buys (greedy agreement, perplexity).

The pass walks the model's `nn.Linear` modules, whatever their names or fusing, so model code needs no change.
Models that read a linear layer's weight directly (DeepSeek's absorbed MLA uses `kv_b_proj.weight` as a matrix)
are not supported and say so at start; so are devices and dtypes the kernels do not serve.
"""

from __future__ import annotations

import functools
import random
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from devices.cpu_kernels import int8_linear_kernel
from engine_core.config import QUANTIZATION_MODES, ConfigError
from engine_core.models.batch import ForwardBatch, PrefillSegment

INT8_MODEL_TYPES = ("llama",)  # architectures that only call their linear layers (no direct weight reads)
# Prose, code and numbers, so that most channels see typical values. Not the text docs/engine.md measures on.
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. Revenue from the port rose by "
    "twelve percent, while the cost of repairs to the northern bridge came in under the estimate.\n\n"
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n"
    "Q: What is 17 times 23?\nA: 17 times 23 is 391.\n\n"
    "She opened the window and listened. Somewhere below, a radio was playing an old song about the sea, "
    "and a dog barked twice at a passing bicycle. Tomorrow, she thought, the letters would finally arrive."
)
MAX_CALIBRATION_TOKENS = 256
# torch.ops.onednn.qlinear_pointwise's arguments after the weight's: no bias (added in float32 after the rescale),
# output scale 1 and zero point 0 with float32 output (no requantization), no fused post-op
ONEDNN_FLOAT32_OUTPUT: tuple[object, ...] = (None, 1.0, 0, torch.float32, "none", [], "")


def check_quantization(mode: str, model_type: str, device_name: str, dtype: torch.dtype) -> None:
    """Raise ConfigError, naming the setting, unless `mode` can run this model here. Called before loading."""
    if mode == "none":
        return
    if mode not in QUANTIZATION_MODES:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")
    if model_type not in INT8_MODEL_TYPES:
        raise ConfigError(
            f"quantization {mode!r} does not support model_type {model_type!r}: supported are "
            f"{', '.join(INT8_MODEL_TYPES)} (use quantization 'none')"
        )
    if device_name != "cpu":
        raise ConfigError(f"quantization {mode!r} runs on the cpu device only, got device {device_name!r}")
    if dtype != torch.float32:
        raise ConfigError(f"quantization {mode!r} needs dtype float32 (its activations), got {dtype}")


def quantize_model(model: nn.Module, mode: str, calibration_ids: list[int], num_layers: int) -> int:
    """Replace the model's linear layers in place for `mode` (checked by check_quantization); return how many.
    `calibration_ids`: the tokens whose float32 forward pass measures each layer's input range."""
    if mode == "none":
        return 0
    input_ranges = measure_input_ranges(model, lambda: prefill_logits(model, calibration_ids, num_layers))
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear.from_linear(linear, input_ranges[name]))
    return len(targets)


def calibration_ids(tokenizer: object | None, vocab_size: int) -> list[int]:
    """The calibration tokens: CALIBRATION_TEXT through the tokenizer, or seeded random ids without one."""
    limit = MAX_CALIBRATION_TOKENS
    if tokenizer is not None:
        ids: list[int] = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)  # type: ignore[attr-defined]
        return ids[:limit]
    rng = random.Random(0)
    return [rng.randrange(vocab_size) for _ in range(limit)]


def measure_input_ranges(model: nn.Module, forward: Callable[[], object]) -> dict[str, torch.Tensor]:
    """max |x_j| over the tokens `forward` runs, for each input channel j of each nn.Linear, by module name."""
    ranges: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0)  # (I,)
            ranges[name] = torch.maximum(ranges[name], seen) if name in ranges else seen

        return hook

    hooks = [
        module.register_forward_pre_hook(record(name))
        for name, module in model.named_modules()
        if type(module) is nn.Linear
    ]
    try:
        forward()
    finally:
        for handle in hooks:
            handle.remove()
    return ranges


@torch.inference_mode()
def prefill_logits(model: nn.Module, token_ids: list[int], num_layers: int) -> torch.Tensor:
    """Logits (T, V) at every position of one prefill of `token_ids`, run into a scratch KV cache (the engine's
    cache is untouched): calibration, and teacher-forced quality measures (`kvmesh bench quant`)."""
    block_size = 16
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    layer_shape = model.kv_cache_shape(num_blocks, block_size)  # type: ignore[operator]
    kv_caches = torch.zeros((num_layers, *layer_shape))
    batch = ForwardBatch(
        positions=torch.arange(num_tokens),
        slot_mapping=torch.arange(num_tokens),
        num_decode_tokens=0,
        decode=None,
        prefills=(PrefillSegment(0, num_tokens, 0, torch.arange(num_blocks)),),
    )
    hidden = model(torch.tensor(token_ids), batch, kv_caches)  # (T, Hd)
    return model.compute_logits(hidden)  # type: ignore[operator]


def can_use_onednn() -> bool:
    """Whether oneDNN's int8 linear (`torch.ops.onednn.qlinear_pointwise`, what inductor's x86 int8 path calls)
    serves here: a torch built with oneDNN, on a CPU with AVX-512 VNNI int8 dot products (AMX implies them).
    Elsewhere (AVX2 only) fbgemm's dynamic kernel, which has AVX2 code, runs instead."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.onednn, "qlinear_pointwise")
        and torch.cpu._is_vnni_supported()
    )


# rows, in, out: a batch of 32 through a SmolLM2-sized layer. Not 8: on a Xeon with AMX the two kernels take the
# same time at 8 rows (15.8 and 16.2 ms for a decode step's layers, bench/linear_kernels.py, 2026-12-07), so a
# probe there chose either from one process to the next; at 32 rows oneDNN is 1.7-1.9x fbgemm there, and on a CPU
# where oneDNN falls back to its reference matmul a thousand times slower, far from a tie either way.
PROBE_SHAPE = (32, 576, 1536)
PROBE_CALLS = 5


@functools.cache
def int8_kernel() -> str:
    """The int8 kernel this process uses: "onednn" where `can_use_onednn` and a probe finds it faster than fbgemm
    on one layer at 32 rows (the best of PROBE_CALLS calls each, after one warm-up), else "fbgemm".

    VNNI alone does not say: on an AMD EPYC with AVX-512 VNNI and no AMX (2026-12-07) oneDNN 3.12 ran this call
    shape in its reference matmul (`ref_int8:any` in ONEDNN_VERBOSE), 93 ms a call at 8 rows and 385 at 32 against
    fbgemm's 0.1-0.3 ms, where on an Intel host with AMX it ran its brgemm kernel and was the faster. The probe
    takes milliseconds where both kernels are fast; where oneDNN falls back, two of its calls (under a second)."""
    if not can_use_onednn():
        return "fbgemm"
    rows, in_features, out_features = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator) * 0.05)
    x = torch.randn(rows, in_features, generator=generator)
    input_range = x.abs().amax(dim=0)

    def best_s(kernel: str, give_up_after_s: float) -> float:
        layer = Int8Linear.from_linear(linear, input_range, kernel)
        layer(x)  # warm-up: first-call setup is not the kernel's pace
        best = float("inf")
        for _ in range(PROBE_CALLS):
            started = time.perf_counter()
            layer(x)
            best = min(best, time.perf_counter() - started)
            if best > give_up_after_s:
                break  # clearly the slower: the rest would not change that
        return best

    fbgemm = best_s("fbgemm", float("inf"))
    return "onednn" if best_s("onednn", 20 * fbgemm) < fbgemm else "fbgemm"


class Int8Linear(nn.Module):
    """y = r * ((x / s / r) @ (W * s).T) + b: the weight int8 per output channel, each row of activations
    quantized with its own range r (per token) at each call, so a row's result depends only on the row: int8
    outputs are as independent of the batch as float32's, and one outlier token does not coarsen the others.

    `kernel` "onednn" (where `can_use_onednn`): each row divided by its own max |x| lies in [-1, 1], so it is
    quantized with the fixed scale 1/127 (int8, zero point 0) and one oneDNN int8 GEMM (AMX or VNNI) returns
    float32 with the weight's per-channel scales folded in; no per-call range search.

    `kernel` "fbgemm" (the fallback): PyTorch's dynamic kernel takes one range for the whole input, from its min
    and max; two extra input channels of zero weight holding 1 and -1 pin that range to [-1, 1] at every call.
    `reduce_range` (7-bit activations) is on only where the CPU lacks VNNI: there fbgemm's AVX2 kernels sum pairs of
    u8 x s8 products in 16 bits, which saturate with 8-bit activations (measured on an AVX2 AMD EPYC: a layer's
    error 0.17 of its output's range instead of under 0.02); with VNNI 8 bits measured better (docs/engine.md)."""

    input_scale: torch.Tensor
    output_scale: torch.Tensor
    weight_zero_points: torch.Tensor
    range_channels: torch.Tensor

    def __init__(self, weight: torch.Tensor, input_scale: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> None:
        """`weight`: the smoothed float32 weight (O, I), quantized here per output channel, symmetric."""
        super().__init__()
        assert kernel in ("onednn", "fbgemm")
        self.kernel = kernel
        self.register_buffer("input_scale", input_scale)  # (I,): 1 / s, applied to x before quantizing
        self.bias = bias  # (O,) or None, added in float32
        self.in_features = input_scale.shape[0]
        self.out_features = weight.shape[0]
        self.reduce_range = kernel == "fbgemm" and not torch.cpu._is_vnni_supported()  # docstring
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (O,): symmetric, so zero points are 0
        # oneDNN's layer in one C++ call (devices/csrc/int8_linear.cpp) where the cpu kernels are built: at a
        # decode step's 32 rows the eight ops around the kernel, each a call from Python, cost more than the small
        # layers' int8 GEMMs (bench/linear_kernels.py); None: those ops (`forward`)
        self.one_call = int8_linear_kernel() if kernel == "onednn" else None
        if kernel == "onednn":
            qweight = _quantize_per_channel(weight, scales).int_repr()  # (O, I) int8
            self.packed = torch.ops.onednn.qlinear_prepack(qweight, None)  # opaque oneDNN int8 (I, O), blocked
            self.register_buffer("output_scale", scales / 127.0)  # (O,): weight step times the activations' 1/127
            self.register_buffer("weight_zero_points", torch.zeros(self.out_features, dtype=torch.long))
        else:
            padded = torch.cat([weight, weight.new_zeros(weight.shape[0], 2)], dim=1)  # (O, I + 2)
            self.packed = torch.ops.quantized.linear_prepack(_quantize_per_channel(padded, scales), None)  # opaque
            self.register_buffer("range_channels", torch.tensor([1.0, -1.0]))  # (2,): pin the input's range

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_range: torch.Tensor, kernel: str | None = None) -> Int8Linear:
        """`input_range`: max |x_j| per input channel (I,), measured on calibration tokens. `kernel`: "onednn" or
        "fbgemm"; None takes `int8_kernel()`'s."""
        weight = linear.weight.detach().float()  # (O, I)
        weight_range = weight.abs().amax(dim=0).clamp(min=1e-5)  # (I,)
        smooth = (input_range.float().clamp(min=1e-5) / weight_range).sqrt()  # (I,): s_j
        bias = None if linear.bias is None else linear.bias.detach().float()
        if kernel is None:
            kernel = int8_kernel()
        return cls(weight * smooth, 1.0 / smooth, bias, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_call is not None:  # the C++ kernel: the ops below and the kernel's call in one, the same bits
            rows = x.reshape(-1, self.in_features).contiguous()
            scales = (self.input_scale, self.packed, self.output_scale, self.weight_zero_points)
            return self.one_call(rows, *scales, self.bias).view(*x.shape[:-1], self.out_features)
        x = x * self.input_scale  # (..., I)
        row_range = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)  # (..., 1)
        y = self._onednn(x, row_range) if self.kernel == "onednn" else self._fbgemm(x, row_range)  # (..., O)
        y = y.mul_(row_range)
        return y if self.bias is None else y + self.bias

    def _onednn(self, x: torch.Tensor, row_range: torch.Tensor) -> torch.Tensor:
        """The int32 sums of x quantized with step row_range / 127, times `output_scale`: float32 (..., O)."""
        qx = (x * (127.0 / row_range)).round_().to(torch.int8)  # (..., I): in [-127, 127]
        # activation scale 1 and zero point 0, then ONEDNN_FLOAT32_OUTPUT (positional: keywords cost ~4 us a call)
        return torch.ops.onednn.qlinear_pointwise(
            qx, 1.0, 0, self.packed, self.output_scale, self.weight_zero_points, *ONEDNN_FLOAT32_OUTPUT
        )

    def _fbgemm(self, x: torch.Tensor, row_range: torch.Tensor) -> torch.Tensor:
        pinned = torch.cat([x / row_range, self.range_channels.expand(*x.shape[:-1], 2)], dim=-1)  # (..., I + 2)
        return torch.ops.quantized.linear_dynamic(pinned, self.packed, self.reduce_range)  # (..., O)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def _quantize_per_channel(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`weight` (O, I) as a qint8 tensor, one scale per output channel, zero points 0."""
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # PyTorch 2.10+ deprecates creating quantized tensors; prepacking still needs one, once, at load.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        return torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
