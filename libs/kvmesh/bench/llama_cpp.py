"""`kvmesh bench engine --with-llama-cpp`: llama.cpp's server on the same GGUF, beside our engine.

The server is llama-cpp-python's (`pip install 'llama-cpp-python[server]'`, built from source), started here as a
subprocess on a free loopback port with the engine's thread count. Each workload's requests are sent at once as
text completions (the prompt ids decoded by our tokenizer; the server's own `usage` counts the tokens), with the
same sampling settings and EOS banned through `logit_bias`, so every output has its requested length. Useful
tokens per second are each request's completion tokens over the wall time of the whole batch, the same count
our engine is measured on.

llama-cpp-python's server holds one context and answers one request at a time (it has no parallel slots, unlike
llama.cpp's own `llama-server --parallel N`): requests sent together queue, and the report says so.
"""

from __future__ import annotations

import importlib.util
import json
import os
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
SERVER = "llama-cpp-python's server (llama_cpp.server): one request at a time, no parallel slots"


def why_unavailable(model_path: Path) -> str | None:
    """None when the side-by-side can run; else the message the report carries instead of figures."""
    if model_path.suffix != ".gguf":
        return f"llama.cpp needs a GGUF file; {model_path.name} is not one"
    for module in ("llama_cpp", "uvicorn", "sse_starlette"):
        if importlib.util.find_spec(module) is None:
            return f"skipped: {module} is not installed (pip install 'llama-cpp-python[server]')"
    return None


class LlamaCppServer:
    """One llama_cpp.server process on the GGUF; stop() ends it."""

    def __init__(self, model_path: Path, threads: int, context_tokens: int) -> None:
        self.port = _free_port()
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(context_tokens)]
        command += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # where llama_cpp was found
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(f"llama_cpp.server exited with {self.process.returncode}: {stderr[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"llama_cpp.server did not answer within {STARTUP_TIMEOUT_S:.0f} s")

    def complete(self, prompt: str, max_tokens: int, sampling: SamplingParams, eos_ids: list[int]) -> int:
        """One completion; returns the server's count of generated tokens."""
        body = {"prompt": prompt, "max_tokens": max_tokens, **_sampling_fields(sampling)}
        body["logit_bias"] = {str(t): -100.0 for t in eos_ids}  # EOS never wins: the output has its full length
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
