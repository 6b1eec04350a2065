"""API keys (digests only, constant-time comparison, never printed) and the gateway's settings."""

from __future__ import annotations

import pytest

from mesh.config import SettingError, load_settings
from services.gateway.auth import KeyRing, bearer_key
from services.gateway.config import GatewaySettings


def test_key_ring_accepts_only_its_keys() -> None:
    ring = KeyRing(["sk-one", "sk-two"])
    assert ring.is_valid("sk-one") and ring.is_valid("sk-two")
    assert not ring.is_valid("sk-three")
    assert not ring.is_valid("sk-one ")
    assert not ring.is_valid("")
    assert not ring.is_valid(None)


def test_key_ring_holds_no_key() -> None:
    ring = KeyRing(["sk-secret-value"])
    assert repr(ring) == "KeyRing(num_keys=1)"
    assert all("sk-secret-value" not in repr(value) for value in vars(ring).values())


@pytest.mark.parametrize(
    ("header", "key"),
    [
        ("Bearer sk-1", "sk-1"),
        ("bearer sk-1", "sk-1"),
        ("  Bearer   sk-1 ", "sk-1"),
        ("Basic sk-1", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("sk-1", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_key(header: str | None, key: str | None) -> None:
    assert bearer_key(header) == key


def test_settings_from_env() -> None:
    settings = load_settings(
        GatewaySettings,
        env={"KVMESH_API_KEYS": "sk-a, sk-b", "KVMESH_MODELS": "deepseek-tiny", "KVMESH_MAX_RETRIES": "1"},
    )
    assert settings.api_keys == ("sk-a", "sk-b")
    assert settings.models == ("deepseek-tiny",)
    assert (settings.http_port, settings.grpc_port, settings.host) == (8080, 50050, "127.0.0.1")
    assert (settings.block_size, settings.max_retries) == (16, 1)
    assert "sk-a" not in repr(settings)


def test_settings_without_keys_fail_naming_the_variable() -> None:
    with pytest.raises(SettingError, match="KVMESH_API_KEYS"):
        load_settings(GatewaySettings, env={})
    with pytest.raises(SettingError, match="KVMESH_API_KEYS"):
        load_settings(GatewaySettings, env={"KVMESH_API_KEYS": " , "})


@pytest.mark.parametrize(
    ("name", "value"), [("block_size", "0"), ("max_retries", "-1"), ("request_timeout_s", "0"), ("models", "")]
)
def test_bad_settings_fail_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingError, match=f"KVMESH_{name.upper()}"):
        load_settings(GatewaySettings, env={"KVMESH_API_KEYS": "sk-a", f"KVMESH_{name.upper()}": value})
