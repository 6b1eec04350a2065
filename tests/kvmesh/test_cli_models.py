"""`kvmesh models pull` without names pulls what the roles are configured to serve (the compose stack's models
service relies on it)."""

from __future__ import annotations

from kvmesh.cli import _default_pulls


def test_without_kvmesh_models_every_known_model_is_pulled(monkeypatch):
    monkeypatch.delenv("KVMESH_MODELS", raising=False)
    assert _default_pulls() == ["smollm2-135m", "deepseek-tiny", "deepseek-v4-tiny"]


def test_the_known_models_in_kvmesh_models_are_pulled_and_paths_skipped(monkeypatch):
    monkeypatch.setenv("KVMESH_MODELS", " deepseek-tiny , /models/my-llama.gguf")
    assert _default_pulls() == ["deepseek-tiny"]
