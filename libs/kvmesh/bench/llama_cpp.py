"""`kvmesh bench engine --with-llama-cpp`: llama.cpp's server on the same GGUF, beside our engine.

Two servers can stand in for llama.cpp:

- **llama.cpp's own `llama-server`** (the C++ server, built from llama.cpp's source: `cmake -B build
  -DLLAMA_BUILD_SERVER=ON && cmake --build build --target llama-server`; llama-cpp-python's sdist carries that
  source under `vendor/llama.cpp`), given by `--llama-server PATH` or found as `llama-server` on PATH. It is
  started once per concurrency with that many parallel slots (`--parallel N`, each slot the workload's context),
  so requests sent together are decoded together by its continuous batching: the comparison the issue asks for.
- **llama-cpp-python's server** (`pip install 'llama-cpp-python[server]'`, built from source) when no
  `llama-server` is found. It holds one context and answers one request at a time (no parallel slots): requests
  sent together queue, and the report says so.

Either way the server runs on a free loopback port with the engine's thread count, each workload's requests are
sent at once as text completions (the prompt ids decoded by our tokenizer; the server's own `usage` counts the
tokens), with the same sampling settings and EOS banned (`logit_bias`, and `ignore_eos` for llama-server), so every
output has its requested length. Useful tokens per second are each request's completion tokens over the wall time
of the whole batch, the same count our engine is measured on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine_core import SamplingParams

STARTUP_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 1800.0
PYTHON_SERVER = "llama-cpp-python's server (llama_cpp.server): one request at a time, no parallel slots"
CPP_SERVER = "llama.cpp's llama-server: parallel slots = concurrency, continuous batching"


def find_llama_server(given: str | None) -> Path | None:
    """The llama-server binary to run: `given` (which must exist), else `llama-server` on PATH, else None."""
    if given is not None:
        path = Path(given)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ValueError(f"--llama-server: {given} is not an executable file")
        return path
    found = shutil.which("llama-server")
    return Path(found) if found else None


def why_unavailable(model_path: Path, llama_server: Path | None) -> str | None:
    """None when the side-by-side can run; else the message the report carries instead of figures."""
    if model_path.suffix != ".gguf":
        return f"llama.cpp needs a GGUF file; {model_path.name} is not one"
    if llama_server is not None:
        return None
    for module in ("llama_cpp", "uvicorn", "sse_starlette"):
        if importlib.util.find_spec(module) is None:
            return (
                f"skipped: no llama-server binary (--llama-server PATH) and {module} is not installed "
                "(pip install 'llama-cpp-python[server]')"
            )
    return None


def llama_server_command(
    binary: Path, model_path: Path, port: int, threads: int, slots: int, slot_context: int
) -> list[str]:
    """llama-server's command line: `slots` parallel slots of `slot_context` tokens each (its -c is the total)."""
    return [
        str(binary),
        "--model", str(model_path),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--ctx-size", str(slots * slot_context),
        "--parallel", str(slots),
        "--threads", str(threads),
        "--threads-batch", str(threads),
    ]  # fmt: skip


def python_server_command(model_path: Path, port: int, threads: int, context: int) -> list[str]:
    """llama-cpp-python's server: one context, one request at a time."""
    return [
        sys.executable, "-m", "llama_cpp.server",
        "--model", str(model_path),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--n_ctx", str(context),
        "--n_threads", str(threads),
        "--n_threads_batch", str(threads),
    ]  # fmt: skip


class LlamaCppServer:
    """One llama.cpp server process (either kind) on a free loopback port; stop() ends it."""

    def __init__(
        self, model_path: Path, threads: int, context_tokens: int, *, llama_server: Path | None = None, slots: int = 1
    ) -> None:
        self.port = _free_port()
        self.is_cpp = llama_server is not None
        if llama_server is not None:
            command = llama_server_command(llama_server, model_path, self.port, threads, slots, context_tokens)
            env = None
        else:
            command = python_server_command(model_path, self.port, threads, context_tokens)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # where llama_cpp was found
        self.name = command[0] if self.is_cpp else "llama_cpp.server"
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()

    def _wait_ready(self) -> None:
        # llama-server answers /health with 503 while it loads the model (an HTTPError, so an OSError), 200 once ready
        probe = "/health" if self.is_cpp else "/v1/models"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {stderr[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{probe}", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer within {STARTUP_TIMEOUT_S:.0f} s")

    def complete(self, prompt: str, max_tokens: int, sampling: SamplingParams, eos_ids: list[int]) -> int:
        """One completion; returns the server's count of generated tokens."""
        body = {"prompt": prompt, "max_tokens": max_tokens, **_sampling_fields(sampling)}
        body["logit_bias"] = {str(t): -100.0 for t in eos_ids}  # EOS never wins: the output has its full length
        if self.is_cpp:
            body["ignore_eos"] = True
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return int(json.load(response)["usage"]["completion_tokens"])

    def run(self, prompts: list[str], output_lens: list[int], sampling: SamplingParams, eos: list[int]) -> tuple:
        """Every request sent at once: (wall seconds, completion tokens in all)."""
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            counts = list(pool.map(lambda p, n: self.complete(p, n, sampling, eos), prompts, output_lens))
        return time.perf_counter() - start, sum(counts)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _sampling_fields(params: SamplingParams) -> dict[str, Any]:
    if params.is_greedy:
        return {"temperature": 0.0, "top_k": 1}
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "repeat_penalty": params.repetition_penalty,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
