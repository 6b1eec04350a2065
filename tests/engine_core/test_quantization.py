"""The int8 path (engine_core.quantization): refused where it cannot run, and close to float32 where it runs."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from engine_core import LLM, EngineConfig
from engine_core.config import ConfigError
from engine_core.quantization import (
    Int8Linear,
    can_use_onednn,
    check_quantization,
    int8_kernel,
    measure_input_ranges,
    prefill_logits,
)

KERNELS = [
    "fbgemm",
    pytest.param("onednn", marks=pytest.mark.skipif(not can_use_onednn(), reason="needs AVX-512 VNNI and oneDNN")),
]


def test_an_unknown_quantization_mode_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"quantization must be one of none, int8, got 'fp8'"):
        EngineConfig(model="smollm2-135m", quantization="fp8")


@pytest.mark.parametrize(
    ("model_type", "device", "dtype", "message"),
    [
        ("deepseek_v3", "cpu", torch.float32, "quantization 'int8' does not support model_type 'deepseek_v3'"),
        ("llama", "cuda", torch.float32, "quantization 'int8' runs on the cpu device only, got device 'cuda'"),
        ("llama", "cpu", torch.bfloat16, "quantization 'int8' needs dtype float32"),
    ],
)
def test_int8_is_refused_where_its_kernels_cannot_run(
    model_type: str, device: str, dtype: torch.dtype, message: str
) -> None:
    check_quantization("none", model_type, device, dtype)  # float32 runs anywhere
    with pytest.raises(ConfigError, match=message):
        check_quantization("int8", model_type, device, dtype)


def test_an_unsupported_model_is_refused_at_start(deepseek_reference) -> None:
    with pytest.raises(ConfigError, match="does not support model_type 'deepseek_v3'"):
        LLM(str(deepseek_reference[0]), quantization="int8", num_kv_blocks=16)


@pytest.mark.parametrize("kernel", KERNELS)
def test_an_int8_linear_layer_stays_close_despite_an_outlier_channel(kernel: str) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    x[:, 5] *= 50  # one outlier channel, as LLM activations have: smoothing keeps it from flattening the rest
    ranges = measure_input_ranges(linear, lambda: linear(x))
    assert torch.equal(ranges[""], x.abs().amax(dim=0))
    expected = linear(x)
    error = (Int8Linear.from_linear(linear, ranges[""], kernel)(x) - expected).abs().max() / expected.abs().max()
    assert error < 0.02


@pytest.mark.parametrize("kernel", KERNELS)
def test_an_int8_row_is_the_same_whatever_else_is_in_the_batch(kernel: str) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    x[3] *= 40  # one outlier token: with one scale per call it would coarsen every other row's steps
    layer = Int8Linear.from_linear(linear, x.abs().amax(dim=0), kernel)
    assert layer.kernel == kernel
    with torch.no_grad():
        batch = layer(x)
        for i in range(len(x)):
            assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])
        expected = linear(x)
    error = (batch - expected).abs().amax(dim=-1) / expected.abs().amax(dim=-1)  # (16,) each row's own scale
    assert float(error.max()) < 0.05  # 0.026 here; 0.16 with one scale for the whole call


@pytest.mark.skipif(not can_use_onednn(), reason="needs AVX-512 VNNI and oneDNN")
def test_the_onednn_kernel_computes_the_int8_product_exactly() -> None:
    """Smoothed row / its max |x| quantized with step 1/127, the smoothed weight per output channel with step
    max |W_o| / 127: the int32 sums are exact, so the float32 output is that product to the last bit."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True)
    x = torch.randn(7, 96)
    x[:, 9] *= 30
    input_range = x.abs().amax(dim=0)
    layer = Int8Linear.from_linear(linear, input_range, "onednn")
    with torch.no_grad():
        got = layer(x)
        weight = linear.weight.float()
        smooth = (input_range.clamp(min=1e-5) / weight.abs().amax(dim=0).clamp(min=1e-5)).sqrt()  # (I,)
        weight = weight * smooth
        step = weight.abs().amax(dim=1) / 127.0  # (O,)
        qweight = (weight / step[:, None]).round().clamp(-127, 127)  # (O, I)
        xs = x * (1.0 / smooth)
        row_range = xs.abs().amax(dim=-1, keepdim=True)  # (T, 1)
        qx = (xs * (127.0 / row_range)).round()  # (T, I)
        sums = qx @ qweight.T  # (T, O): integers below 2**24, exact in float32
        expected = sums * (step / 127.0) * row_range + linear.bias
    assert torch.equal(got, expected)


@pytest.mark.skipif(not can_use_onednn(), reason="needs AVX-512 VNNI and oneDNN")
@pytest.mark.parametrize(("rows", "in_features", "out_features", "bias"), [(1, 576, 960, False), (40, 100, 24, True)])
def test_the_one_call_kernel_gives_the_bits_of_the_ops_it_replaces(
    rows: int, in_features: int, out_features: int, bias: bool
) -> None:
    """devices/csrc/int8_linear.cpp does the layer's smoothing, quantization and rescale in C++ around oneDNN's
    kernel: the same bits as the torch ops it saves the calls of (100 input floats: a vector tail; 40 rows: more
    than one thread's share), for 2-d and 3-d inputs."""
    gen = torch.Generator().manual_seed(4)
    linear = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features, generator=gen) * 3
    layer = Int8Linear.from_linear(linear, x.abs().amax(dim=0) * 0.7, "onednn")
    assert layer.one_call is not None, "the kernels did not build (g++ and ninja are part of the test environment)"
    with torch.no_grad():
        one_call, batched = layer(x), layer(x.view(1, rows, in_features))
        layer.one_call = None
        ops = layer(x)
    assert torch.equal(one_call, ops) and torch.equal(batched[0], ops)


def test_int8_replaces_every_linear_layer_and_keeps_the_logits_close(llama_reference) -> None:
    path = str(llama_reference[0])
    fp32 = LLM(path, num_kv_blocks=16)
    int8 = LLM(path, quantization="int8", num_kv_blocks=16)
    modules = list(int8.engine.runner.model.modules())
    assert sum(isinstance(m, Int8Linear) for m in modules) == 3 * 4 + 1  # qkv, o, gate_up, down per layer; LM head
    assert not any(type(m) is nn.Linear for m in modules)
    assert not any(isinstance(m, Int8Linear) for m in fp32.engine.runner.model.modules())
    rng = random.Random(1)
    ids = [rng.randrange(500) for _ in range(64)]
    expected = prefill_logits(fp32.engine.runner.model, ids, 3)  # (T, V)
    got = prefill_logits(int8.engine.runner.model, ids, 3)
    assert (got - expected).abs().mean() / expected.std() < 0.1
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_a_worker_refuses_an_unknown_quantization_naming_the_variable() -> None:
    from mesh.compute.settings import WorkerSettings
    from mesh.config import SettingError, load_settings

    with pytest.raises(SettingError, match=r"^KVMESH_QUANTIZATION='int4': must be one of none, int8$"):
        load_settings(WorkerSettings, env={"KVMESH_QUANTIZATION": "int4"})
    settings = load_settings(WorkerSettings, env={"KVMESH_QUANTIZATION": "int8"})
    config = settings.engine_config("smollm2-135m")
    assert (config.quantization, config.long_prefill_token_threshold) == ("int8", 256)


def test_the_int8_kernel_is_fbgemm_unless_onednn_serves_and_is_measured_faster() -> None:
    kernel = int8_kernel()
    assert kernel in ("fbgemm", "onednn") and int8_kernel() == kernel  # decided once a process
    if not can_use_onednn():
        assert kernel == "fbgemm"
    linear = nn.Linear(16, 8, bias=False)
    assert Int8Linear.from_linear(linear, torch.ones(16)).kernel == kernel  # the default a model's layers take
