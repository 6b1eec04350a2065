"""Canary rollouts in the admin API (/admin/v1/rollouts, services/gateway/rollout_api.py) on a real gateway over a
real NATS (JetStream KV): start, status, abort, from HTTP and from `kvmesh admin rollout`; bad input a 4xx naming
the field; only the admin key."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from .test_tenancy_admin import ADMIN, ENV_KEY, gateway

# this gateway serves no model, so it can render no golden prompt: the rollouts here have no quality probe
START = {
    "model": "m1",
    "stable_version": "1.0",
    "canary_version": "2.0",
    "check_interval_s": 30,
    "gates": {"quality_prompts": []},
}


async def test_start_read_and_abort_a_rollout(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (api, _):
        status, rollout = await api.call("POST", "/admin/v1/rollouts", body=START)
        assert status == 201 and rollout["id"].startswith("ro_")
        assert (rollout["state"], rollout["weight"], rollout["steps"], rollout["step_index"]) == (
            "running",
            5,
            [5, 25, 50, 100],
            0,
        )
        assert rollout["gates"] == {
            "max_ttft_p95_ratio": 1.5,
            "max_itl_p95_ratio": 1.5,
            "max_error_rate_increase": 0.01,
            "max_cost_per_token_ratio": 1.2,
            "min_samples": 50,
            "quality_prompts": [],
            "quality_max_tokens": 16,
        }
        assert [(d["action"], d["weight"]) for d in rollout["decisions"]] == [("start", 5)]
        status, error = await api.call("POST", "/admin/v1/rollouts", body=START)
        assert (status, error["error"]["message"]) == (409, f"model 'm1' has a running rollout: {rollout['id']}")
        assert (await api.call("GET", f"/admin/v1/rollouts/{rollout['id']}"))[1] == rollout
        status, listing = await api.call("GET", "/admin/v1/rollouts")
        assert (status, [r["id"] for r in listing["data"]]) == (200, [rollout["id"]])
        status, aborted = await api.call("POST", f"/admin/v1/rollouts/{rollout['id']}/abort")
        assert (status, aborted["state"], aborted["weight"]) == (200, "aborted", 0)
        assert [d["action"] for d in aborted["decisions"]] == ["start", "abort"]
        status, error = await api.call("POST", f"/admin/v1/rollouts/{rollout['id']}/abort")
        assert (status, error["error"]["message"]) == (409, f"rollout {rollout['id']} is already aborted")
        assert (await api.call("GET", "/admin/v1/rollouts/ro_missing"))[0] == 404
        assert (await api.call("POST", "/admin/v1/rollouts", body=START))[0] == 201  # none running any more


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"steps": [5, 3, 100]}, "steps"),
        ({"steps": [5, 50]}, "steps"),
        ({"steps": [0, 100]}, "steps[0]"),
        ({"canary_version": "1.0"}, "canary_version"),
        ({"check_interval_s": 0}, "check_interval_s"),
        ({"gates": {"min_samples": -1}}, "gates.min_samples"),
        ({"gates": {"quality_prompts": [""]}}, "gates.quality_prompts[0]"),
        ({"gates": {"quality_max_tokens": 0}}, "gates.quality_max_tokens"),
        ({"gates": {}}, "model"),  # the default golden prompts, for a model this gateway cannot render them for
        ({"gates": {"max_ttft_p95_rato": 2}}, "gates.max_ttft_p95_rato"),
        ({"model": ""}, "model"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(tmp_path: Path, change: dict[str, Any], param: str) -> None:
    async with gateway(tmp_path) as (api, _):
        status, error = await api.call("POST", "/admin/v1/rollouts", body=START | change)
        assert (status, error["error"]["param"]) == (400, param)
        assert (await api.call("GET", "/admin/v1/rollouts"))[1]["data"] == []  # nothing started


async def test_only_the_admin_key_may_use_rollouts_and_they_are_in_openapi(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (api, _):
        assert (await api.call("POST", "/admin/v1/rollouts", key=ENV_KEY, body=START))[0] == 403
        assert (await api.call("GET", "/admin/v1/rollouts", key=None))[0] == 401
        status, document = await api.call("GET", "/openapi.json", key=None)
        assert status == 200
        assert {
            "/admin/v1/rollouts",
            "/admin/v1/rollouts/{rollout_id}",
            "/admin/v1/rollouts/{rollout_id}/abort",
        } <= set(document["paths"])
        assert "RolloutCreate" in document["components"]["schemas"]


async def test_the_admin_cli_starts_shows_and_aborts_a_rollout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvmesh.cli import main

    monkeypatch.setenv("KVMESH_ADMIN_KEY", ADMIN)
    async with gateway(tmp_path) as (api, _):

        async def admin(*argv: str) -> tuple[int, Any]:
            code = await asyncio.to_thread(main, ["admin", "--url", api.base, "rollout", *argv])
            out, err = capsys.readouterr()
            return code, json.loads(out) if code == 0 else err

        code, started = await admin(
            "start",
            "--model",
            "m1",
            "--stable",
            "1.0",
            "--canary",
            "2.0",
            "--steps",
            "10",
            "100",
            "--check-interval-s",
            "5",
            "--gates",
            '{"min_samples": 3, "quality_prompts": []}',
        )
        assert (code, started["steps"], started["weight"], started["gates"]["min_samples"]) == (0, [10, 100], 10, 3)
        code, listing = await admin("status")
        assert (code, [r["id"] for r in listing["data"]]) == (0, [started["id"]])
        code, aborted = await admin("abort", started["id"])
        assert (code, aborted["state"]) == (0, "aborted")
        code, shown = await admin("status", started["id"])
        assert (code, shown["weight"], shown["decisions"][-1]["action"]) == (0, 0, "abort")
        code, error = await admin("start", "--model", "m1", "--stable", "1.0", "--canary", "1.0")
        assert code == 1 and json.loads(error)["error"]["param"] == "canary_version"
