"""Linear layers with their weight reordered once for oneDNN, applied after the weights load:
`EngineConfig.cpu_packed_linear`, float32 on the cpu only.

`F.linear` hands MKL's sgemm the weight as stored, and at a decode step's few rows MKL spends much of each call
packing it (bench/linear_kernels.py: the tied head of SmolLM2-135M takes longer at 8 rows than at 32). oneDNN's
weight reordered once ahead (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing uses) serves
any number of rows, so a batch that changes every step keeps it. At one row which is faster depends on the host
(`min_packed_rows`, a probe): on an Intel Xeon the plain call, so `PackedLinear` keeps the stored weight too and
takes `F.linear` below two rows; on an AMD EPYC (Zen 5) MKL's one-row call ran 4.7-5.5x slower than oneDNN's on a
large layer, and the reordered weight serves every row count. The reordered copy costs a second copy of every
linear layer's weight (docs/engine.md gives the figures).

The kernels sum in another order than MKL's, so outputs differ from `F.linear`'s by float32 rounding (about 5e-6
on SmolLM2-135M's layers), as MKL's own differ between batch sizes. The pass swaps the model's `nn.Linear`
modules, whatever their names, and keeps each one's `weight` Parameter, so tied embeddings and models that read
a weight directly (DeepSeek's absorbed MLA) see the same tensor; a change to that weight in place (the fault
injection's noise) reorders it again at the next call. Int8 layers (engine_core.quantization) and other devices
and dtypes are left alone.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Rows from which the reordered weight is faster than F.linear on an Intel Xeon: bench/linear_kernels.py,
# SmolLM2-135M's shapes, one thread (docs/engine.md): 1 row 0.81-0.86x, 2 rows and more faster.
MIN_PACKED_ROWS = 2
# The one-row probe: a layer of 576 -> 16,384 (37 MB, a third of SmolLM2's tied head), the best of PROBE_CALLS
# calls of each kernel after a warm-up. On the AMD EPYC (Zen 5) measured, MKL's one-row call took 4.7-5.0x
# oneDNN's on it (1.9 ms against 0.4; the head itself 6.7 against 1.2 ms, the small layers 1.2-1.4x): one row
# then takes the reordered weight where the probe finds it ONE_ROW_MARGIN times as fast or more. The margin
# keeps hosts near a tie on F.linear, so that two processes on one host do not choose differently.
PROBE_SHAPE = (576, 16384)
PROBE_CALLS = 5
ONE_ROW_MARGIN = 2.0


@functools.cache
def min_packed_rows() -> int:
    """The fewest rows this process runs on the reordered weight: 1 where the probe finds oneDNN's one-row call at
    least ONE_ROW_MARGIN times as fast as F.linear's, else MIN_PACKED_ROWS. About 0.1 s, once a process."""
    in_features, out_features = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    x = torch.randn(1, in_features, generator=generator)

    def best_s(call: Callable[[], object]) -> float:
        call()  # warm-up: first-call setup is not the kernel's pace
        best = float("inf")
        for _ in range(PROBE_CALLS):
            started = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - started)
        return best

    with torch.inference_mode():
        plain = best_s(lambda: torch.mm(x, weight.t()))
        reordered = best_s(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    return 1 if plain >= ONE_ROW_MARGIN * reordered else MIN_PACKED_ROWS


def can_pack(device_name: str, dtype: torch.dtype, quantization: str) -> bool:
    """Whether the pass applies: float32 on the cpu, no quantization, and a torch built with oneDNN."""
    return (
        device_name == "cpu"
        and dtype == torch.float32
        and quantization == "none"
        and torch.backends.mkldnn.is_available()
    )


def pack_linear_layers(model: nn.Module, min_rows: int | None = None) -> int:
    """Replace the model's `nn.Linear` modules in place by `PackedLinear`, each taking the reordered weight from
    `min_rows` rows (default `min_packed_rows()`); return how many. Call after loading."""
    min_rows = min_packed_rows() if min_rows is None else min_rows
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear.from_linear(linear, min_rows))
    return len(targets)


class PackedLinear(nn.Module):
    """y = x @ W.T + b: through oneDNN's reordered weight at `min_rows` rows or more, `F.linear` below."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int = MIN_PACKED_ROWS) -> None:
        super().__init__()
        self.min_rows = min_rows
        self.weight = weight  # (O, I): the loaded Parameter itself (tied embeddings share it)
        self.bias = bias  # (O,) or None
        # opaque oneDNN tensor (O, I), blocked for its kernel; not a buffer: it is derived, never saved
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.packed_version = weight._version  # the weight's version the reordered copy was made from
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, min_rows: int = MIN_PACKED_ROWS) -> PackedLinear:
        assert linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"
        return cls(linear.weight, linear.bias, min_rows)

    def uses_packed(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` runs the reordered weight: x (..., I) has `min_rows` rows or more."""
        return x.numel() >= self.min_rows * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_packed(x):
            if x.dim() == 2:  # what F.linear calls for a matrix, without its dispatch layers (the same kernel)
                weight_t = self.weight.t()
                return torch.mm(x, weight_t) if self.bias is None else torch.addmm(self.bias, x, weight_t)
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self.packed_version:  # changed in place since (a fault injection's noise)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
            self.packed_version = self.weight._version
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")  # (..., O)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, min_packed_rows={self.min_rows}"
