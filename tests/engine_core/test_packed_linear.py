"""Linear layers on oneDNN's reordered weight (engine_core.packed_linear): which kernel runs at which batch, how
close it stays to F.linear, and where the engine applies the pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_core import LLM, EngineConfig
from engine_core.config import ConfigError
from engine_core.packed_linear import (
    MIN_PACKED_ROWS,
    PackedLinear,
    can_pack,
    min_packed_rows,
    pack_linear_layers,
)
from mesh.compute.settings import WorkerSettings
from mesh.config import load_settings

# The two kernels sum in another order: measured at most 1.0e-5 on SmolLM2-135M's layer shapes
# (bench/linear_kernels.py, outputs of magnitude ~1); these small layers stay well inside.
ATOL = 2e-5


def onednn(x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


@pytest.fixture
def layer() -> PackedLinear:
    torch.manual_seed(0)
    return PackedLinear.from_linear(nn.Linear(576, 960).requires_grad_(False))


def test_one_row_takes_f_linear_and_two_rows_the_reordered_weight(layer: PackedLinear) -> None:
    assert MIN_PACKED_ROWS == 2 and layer.min_rows == MIN_PACKED_ROWS
    x = torch.randn(8, 576)
    plain, packed = F.linear(x, layer.weight, layer.bias), onednn(x, layer)
    assert not torch.equal(plain, packed)  # the kernels differ in the last bits, so equality below tells them apart
    with torch.inference_mode():
        one = layer(x[:1])
        many = layer(x)
        two = layer(x[:2])
    assert not layer.uses_packed(x[:1]) and layer.uses_packed(x[:2])
    assert torch.equal(one, F.linear(x[:1], layer.weight, layer.bias))
    assert torch.equal(many, packed)
    assert torch.equal(two, onednn(x[:2], layer))
    torch.testing.assert_close(many, plain, atol=ATOL, rtol=0)


def test_a_layer_packed_from_one_row_takes_the_reordered_weight_for_one_row() -> None:
    torch.manual_seed(0)
    layer = PackedLinear.from_linear(nn.Linear(576, 960).requires_grad_(False), min_rows=1)
    x = torch.randn(1, 576)
    with torch.inference_mode():
        one = layer(x)
    assert layer.uses_packed(x) and torch.equal(one, onednn(x, layer))
    assert "min_packed_rows=1" in repr(layer)


def test_the_pass_gives_every_layer_the_probed_row_count() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).requires_grad_(False)
    assert pack_linear_layers(model, min_rows=1) == 2
    assert [m.min_rows for m in model.modules() if isinstance(m, PackedLinear)] == [1, 1]
    probed = nn.Sequential(nn.Linear(8, 16)).requires_grad_(False)
    pack_linear_layers(probed)
    assert [m.min_rows for m in probed.modules() if isinstance(m, PackedLinear)] == [min_packed_rows()]


def test_rows_count_across_leading_dimensions(layer: PackedLinear) -> None:
    x = torch.randn(2, 3, 576)  # (B, T, I): six rows
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (2, 3, 960)
    assert torch.equal(y, onednn(x, layer))
    assert not layer.uses_packed(torch.randn(1, 1, 576))


def test_a_weight_changed_in_place_is_reordered_again(layer: PackedLinear) -> None:
    x = torch.randn(4, 576)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    with torch.inference_mode():
        after = layer(x)
    torch.testing.assert_close(after - layer.bias, 2 * (before - layer.bias), atol=2 * ATOL, rtol=0)


def test_the_engine_packs_every_float32_cpu_linear_layer(llama_reference) -> None:
    path = str(llama_reference[0])
    packed = LLM(path, device="cpu", num_kv_blocks=16, cpu_packed_linear=True).engine.runner.model
    plain = LLM(path, device="cpu", num_kv_blocks=16, cpu_packed_linear=False).engine.runner.model
    num_linear = sum(type(m) is nn.Linear for m in plain.modules())
    assert num_linear == 3 * 4 + 1  # 3 layers of (qkv, o, gate_up, down), the head
    assert sum(type(m) is PackedLinear for m in packed.modules()) == num_linear
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert not any(type(m) is PackedLinear for m in plain.modules())
    names = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in packed.named_parameters()] == names
    assert all(torch.equal(a, b) for a, b in zip(packed.parameters(), plain.parameters(), strict=True))


def test_a_tied_head_keeps_the_embedding_tensor(smollm2_gguf_path) -> None:
    llm = LLM(str(smollm2_gguf_path), device="cpu", num_kv_blocks=16, cpu_packed_linear=True)
    model = llm.engine.runner.model  # SmolLM2 ties its head to the embeddings
    assert type(model.lm_head) is PackedLinear
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_the_pass_runs_only_where_its_kernel_does() -> None:
    assert can_pack("cpu", torch.float32, "none")
    assert not can_pack("cpu", torch.float32, "int8")  # int8 layers have their own kernels
    assert not can_pack("cuda", torch.float32, "none")
    assert not can_pack("cpu", torch.bfloat16, "none")
    with pytest.raises(ConfigError, match="cpu_packed_linear must be true or false, got 'yes'"):
        EngineConfig(model="smollm2-135m", cpu_packed_linear="yes")  # type: ignore[arg-type]


def test_workers_take_the_setting_from_their_environment() -> None:
    assert load_settings(WorkerSettings, env={}).engine_config("m").cpu_packed_linear is True
    off = load_settings(WorkerSettings, env={"KVMESH_CPU_PACKED_LINEAR": "false"})
    assert off.engine_config("m").cpu_packed_linear is False
