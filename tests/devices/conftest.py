"""Device-module tests. Without a CUDA device the cuda module's Triton kernels run in Triton's interpreter on CPU
tensors (the root conftest sets TRITON_INTERPRET=1 before anything imports them)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def torch_device() -> torch.device:
    """Where kernel tests put their tensors: the GPU when there is one, else the CPU under the interpreter."""
    return torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
