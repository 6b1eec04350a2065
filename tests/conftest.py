"""Models shared across the suite: built or fetched once per session.

Reference models come from `transformers` (a test-only dependency): random weights saved with
`save_pretrained`, then loaded by our engine from that directory, exactly as a real checkpoint would be.
initializer_range=0.1 makes random models pick varied tokens, so greedy-parity tests compare real choices.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile`, longest file first, files sharing a mesh together (tests/scheduling.py)."""
    if config.getoption("dist") != "loadfile":
        return None
    from tests.scheduling import LongestFirstFileScheduling

    return LongestFirstFileScheduling(config, log)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A mesh shared by a unit of files stops after the unit's last test (tests/scheduling.py)."""
    from tests.scheduling import note_ended_unit

    note_ended_unit(item, nextitem)


@pytest.hookimpl(tryfirst=True)  # before pytest sets the next test up
def pytest_runtest_setup(item: pytest.Item) -> None:
    from tests.scheduling import finish_ended_units

    finish_ended_units()


@pytest.fixture(scope="module", autouse=True)
def released_memory() -> Iterator[None]:
    """What a module's in-process models held goes back to the system when the module ends."""
    yield
    from tests.scheduling import release_memory

    release_memory()


def pytest_configure(config: pytest.Config) -> None:
    if path := os.environ.get("KVMESH_TEST_DURATIONS_OUT"):
        from tests.scheduling import DurationRecorder

        config.pluginmanager.register(DurationRecorder(path), "kvmesh-durations")


# Triton picks interpreter or compiler when a kernel is decorated (at import): decide before anything imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def gateway_state_dir() -> Iterator[str]:
    """KVMESH_STATE_DIR for every gateway the suite starts from the environment (`kvmesh up`, the benchmarks'
    own meshes): the tenancy database and server secret in a directory of this run, never in the home directory
    where runs would share them. Fixtures that build GatewaySettings directly pass a state_dir of their own."""
    path = tempfile.mkdtemp(prefix="kvmesh-test-state-")
    previous = os.environ.get("KVMESH_STATE_DIR")
    os.environ["KVMESH_STATE_DIR"] = path
    yield path
    if previous is None:
        os.environ.pop("KVMESH_STATE_DIR", None)
    else:
        os.environ["KVMESH_STATE_DIR"] = previous
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def mesh_certificates() -> Iterator[Path]:
    """KVMESH_TLS_DIR for the whole suite: a CA and one certificate per role (`kvmesh certs init`), so every role
    the tests start, in-process or as a child process, speaks mutual TLS and checks callers' roles, as it does by
    default. In-process test clients take a role's credentials with `mesh.tls.load_credentials(role)`."""
    from kvmesh.certs import init_directory

    path = Path(tempfile.mkdtemp(prefix="kvmesh-test-certs-"))
    init_directory(path)
    previous = {name: os.environ.pop(name, None) for name in TLS_VARIABLES}
    os.environ["KVMESH_TLS_DIR"] = str(path)
    yield path
    for name, value in previous.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    shutil.rmtree(path, ignore_errors=True)


TLS_VARIABLES = ("KVMESH_TLS_DIR", "KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA", "KVMESH_INSECURE")


DEEPSEEK_TEST_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.1,
    routed_scaling_factor=2.5,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)

LLAMA_TEST_CONFIG = dict(
    vocab_size=500,
    hidden_size=96,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=100000.0,
    initializer_range=0.1,
)


@pytest.fixture(scope="session")
def deepseek_reference(tmp_path_factory: pytest.TempPathFactory):
    """(directory, transformers model): a random DeepSeek-V3 with YaRN rope and a non-zero correction bias."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK_TEST_CONFIG)).eval()
    with torch.no_grad():  # transformers initialises the bias at zero; a real checkpoint's is not
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.uniform_(0.0, 0.2)
    path = tmp_path_factory.mktemp("deepseek-v3-random")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="session")
def llama_reference(tmp_path_factory: pytest.TempPathFactory):
    """(directory, transformers model): a random Llama with grouped-query attention (6 heads, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_TEST_CONFIG)).eval()
    path = tmp_path_factory.mktemp("llama-random")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), fetched once by the project's own `kvmesh models pull` code."""
    from engine_core import model_store

    return model_store.ensure("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf_path: Path):
    from engine_core import LLM

    return LLM(str(smollm2_gguf_path), device="cpu", num_kv_blocks=512, served_name="smollm2-135m")
