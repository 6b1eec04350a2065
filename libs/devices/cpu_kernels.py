"""Kernels of our own for the cpu module, built from C++ (`csrc/`) at first use by torch's extension builder.

    kernel = paged_decode_kernel()   # None where it cannot be built here (no compiler, no ninja): say why, once
    out = kernel(q, k_cache, v_cache, block_tables, context_lens, scale)             # (B, H, Dv)
    out = kernel(q, latent, latent, block_tables, context_lens, scale, value_dim=R)   # MLA: latent (N, S, 1, R+P)
    chunk = paged_chunk_kernel()     # the same build
    out = chunk(q, k_cache, v_cache, block_table, num_cached, scale)                  # (Lq, H, Dv)
    linear = int8_linear_kernel()    # the same build
    y = linear(x, input_scale, packed, output_scale, zero_points, bias)              # (R, O)

Built with `-O3 -march=native -fopenmp` (vectorized for this CPU, torch's threads), so the build is named after
this CPU's flags and the sources: a cache directory shared by hosts with other instruction sets never loads a
binary this one cannot run. The first build takes ~30-60 s (three files, compiled in parallel); later processes
load it from torch's extension cache (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) in well under a
second.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)  # the engine's libraries log through the standard library

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
# (q, k_cache, v_cache, block_tables, context_lens, scale[, value_dim]) -> out: csrc/paged_decode.cpp
PagedDecode = Callable[..., torch.Tensor]
# (q, k_cache, v_cache, block_table, num_cached, scale[, value_dim]) -> out: the same file
PagedChunk = Callable[..., torch.Tensor]
# (x, input_scale, packed, output_scale, zero_points[, bias]) -> y: csrc/int8_linear.cpp
Int8LinearKernel = Callable[..., torch.Tensor]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


SOURCES = ("paged_decode.cpp", "int8_linear.cpp", "module.cpp")  # and kernels.h, which they include


def build_name() -> str:
    """The extension's name: after its sources and this CPU's flags (see the module's docstring)."""
    text = b"".join((SOURCE_DIR / name).read_bytes() for name in (*SOURCES, "kernels.h"))
    return f"kvmesh_cpu_kernels_{hashlib.sha256(text + _cpu_flags().encode()).hexdigest()[:16]}"


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` package's binary is beside this Python, which a process
    started as .venv/bin/python (not from an activated environment) does not have on its PATH."""
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    directory = str(ninja.BIN_DIR)
    if directory not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [directory, os.environ.get("PATH", "")]))


@contextlib.contextmanager
def _only_builder(build_directory: Path) -> Iterator[None]:
    """Hold an flock on the build directory while torch builds or loads the kernel there. torch's own lock is a
    file that its waiters poll until it is gone: a process killed mid-build (a mesh stopped during its first
    start) leaves it behind, and every later process would wait forever. The kernel drops an flock with its
    holder, so whoever holds ours knows no build is running, and a torch lock file it finds is such a leftover."""
    with open(build_directory / "kvmesh.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        leftover = build_directory / "lock"
        if leftover.exists():
            log.warning("cpu kernels: removing a build lock left by a process that died building it")
            leftover.unlink(missing_ok=True)
        yield


@functools.cache
def _extension() -> Any:
    """The built extension module (csrc/), or None where it cannot be built (a warning says why, once; the cpu
    module then gathers blocks for SDPA or its GEMMs, and the int8 layers call oneDNN from Python, as without it)."""
    _put_ninja_on_path()
    try:
        from torch.utils import cpp_extension  # builds our C++ source and imports it; nothing is deserialized

        name = build_name()
        build_directory = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _only_builder(build_directory):
            return cpp_extension.load(
                name=name,
                sources=[str(SOURCE_DIR / source) for source in SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as error:  # a missing compiler or ninja, a failed build: the plain path serves instead
        log.warning("cpu kernels unavailable; the plain torch paths serve instead: %s", str(error)[-500:])
        return None


def paged_decode_kernel() -> PagedDecode | None:
    """Decode attention over the paged cache, one query per sequence, or None where the kernels cannot be built."""
    extension = _extension()
    return None if extension is None else extension.paged_decode  # type: ignore[no-any-return]


def paged_chunk_kernel() -> PagedChunk | None:
    """A chunk of one sequence's new queries attending over its paged context, or None where they cannot be built."""
    extension = _extension()
    return None if extension is None else extension.paged_chunk  # type: ignore[no-any-return]


def int8_linear_kernel() -> Int8LinearKernel | None:
    """An int8 linear layer's forward through oneDNN's kernel in one call, or None where it cannot be built."""
    extension = _extension()
    return None if extension is None else extension.int8_linear  # type: ignore[no-any-return]


def chunk_kernel_pays() -> bool:
    """Whether the chunk kernel is the faster path on this CPU: where torch's vector capability is AVX-512. Its rows
    are the lanes of 16-float vectors, 4 positions' sums held in registers at once: AVX-512's 32 registers hold them;
    AVX2's 16 do not, and the spills made it slower than the gather path (`bench/chunk_kernel.py --contexts 4000
    --queries 2 8 --threads 2`, AMD EPYC Zen 3, 2026-12-07: 208 against 172 ms at 2 tokens, 764 against 130 at 8,
    30 layers; on a Zen 4 with AVX-512, 1.5-6x faster than the gather)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def main() -> None:
    """Build the kernels now: `make install` does (`python -c 'from devices.cpu_kernels import main; main()'`), so
    that neither the first mesh started nor a test run pays the build, nor a test's timing meets it. Returns
    where they cannot be built here: the engines then warn and take the plain path, no reason to fail an install."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kernel = paged_decode_kernel()
    log.info("cpu kernels: %s", "built" if kernel is not None else "unavailable (the plain torch paths serve)")
