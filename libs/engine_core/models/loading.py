"""Copies checkpoint tensors (under their Hugging Face names) into a model's parameters.

Models fuse some projections (q/k/v, gate/up) and stack experts into one tensor; each model gives a
`target(name)` function mapping a checkpoint name to (parameter name, index into that parameter).
Every parameter must be covered exactly once, element for element, or loading fails naming what is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

Target = tuple[str, Any] | None  # (parameter name, index such as a row slice or an expert number); None: skip


class WeightError(ValueError):
    """A checkpoint that does not fit the model: missing, unexpected or mis-shaped tensors."""


def load_weights(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], target: Callable[[str], Target]
) -> None:
    params = dict(module.named_parameters())
    filled = {name: 0 for name in params}
    for name, tensor in weights:
        mapped = target(name)
        if mapped is None:
            continue
        param_name, index = mapped
        if param_name not in params:
            raise WeightError(f"checkpoint tensor {name!r} has no place in the model (looked for {param_name!r})")
        dest = params[param_name].data if index is None else params[param_name].data[index]
        if dest.shape != tensor.shape:
            raise WeightError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        filled[param_name] += dest.numel()
    missing = [name for name, count in filled.items() if count != params[name].numel()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WeightError(f"checkpoint is missing weights for {shown}")


def rows(start: int, end: int) -> slice:
    return slice(start, end)
