"""The cuda device module: Triton kernels for NVIDIA GPUs (tuned for Hopper SM90 and Blackwell SM100)."""

from devices.cuda.ops import CudaOps

__all__ = ["CudaOps"]
