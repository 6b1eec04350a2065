"""Tenants on a real mesh (SmolLM2 and deepseek-tiny), through the official SDKs: a stored Response belongs to its
tenant (another tenant's previous_response_id, GET or DELETE is a 404, exactly as for an unknown id), and a key
scoped to some models or APIs gets a 403 naming the field for any other."""

from __future__ import annotations

import secrets

import aiohttp
import anthropic
import grpc.aio
import openai
import pytest

from mesh.pb import gateway_pb2, gateway_pb2_grpc

from .api_harness import ADMIN_KEY, DEEPSEEK, KEY, SMOL, ApiMesh

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def mesh(api_mesh_session: ApiMesh) -> ApiMesh:
    return api_mesh_session


async def _tenant_key(mesh: ApiMesh, **scope: object) -> str:
    """A new tenant (a unique name: the session's mesh is shared) and a key of it, through the admin API."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with aiohttp.ClientSession() as session:
        name = f"tenant-{secrets.token_hex(4)}"
        async with session.post(f"{mesh.base_url}/admin/v1/tenants", json={"name": name}, headers=admin) as response:
            assert response.status == 201
            tenant = await response.json()
        body = {"tenant": tenant["id"], "name": "app", **scope}
        async with session.post(f"{mesh.base_url}/admin/v1/keys", json=body, headers=admin) as response:
            assert response.status == 201
            return str((await response.json())["key"])


async def test_a_stored_response_is_invisible_to_another_tenant(mesh: ApiMesh) -> None:
    alice, bob = mesh.openai(await _tenant_key(mesh)), mesh.openai(await _tenant_key(mesh))
    first = await alice.responses.create(model=SMOL, input="Name a fruit.", max_output_tokens=4, temperature=0)
    assert (await alice.responses.retrieve(first.id)).id == first.id
    for other in (bob, mesh.openai(KEY)):  # another tenant, and the default tenant of KVMESH_API_KEYS
        with pytest.raises(openai.NotFoundError) as caught:
            await other.responses.create(
                model=SMOL, input="And another?", previous_response_id=first.id, max_output_tokens=4
            )
        assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert caught.value.body["message"] == f"no stored response {first.id!r}"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.delete(first.id)
    follow = await alice.responses.create(
        model=SMOL, input="And another?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    assert follow.previous_response_id == first.id
    await alice.responses.delete(first.id)  # still there: the others' deletes did nothing
    with pytest.raises(openai.NotFoundError):
        await alice.responses.retrieve(first.id)


async def test_a_scoped_key_gets_403_for_another_model_or_api(mesh: ApiMesh) -> None:
    key = await _tenant_key(mesh, models=[SMOL], apis=["chat.completions", "messages", "grpc"])
    client = mesh.openai(key)
    assert [model.id async for model in client.models.list()] == [SMOL]  # it sees only its own models
    with pytest.raises(openai.PermissionDeniedError):
        await client.models.retrieve(DEEPSEEK)
    done = await client.chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    assert done.usage is not None and done.usage.completion_tokens == 2
    with pytest.raises(openai.PermissionDeniedError) as caught:
        await client.chat.completions.create(model=DEEPSEEK, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert caught.value.body == {  # type: ignore[comparison-overlap]
        "message": f"model: this key may not use the model {DEEPSEEK!r}",
        "type": "permission_error",
        "param": "model",
        "code": "permission_denied",
    }
    with pytest.raises(openai.PermissionDeniedError) as caught:
        await client.completions.create(model=SMOL, prompt="Hi", max_tokens=2)
    assert caught.value.body["message"] == "this key may not call the completions API"  # type: ignore[index]
    with pytest.raises(anthropic.PermissionDeniedError) as refused:
        await mesh.anthropic(key).messages.create(
            model=DEEPSEEK, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
    assert refused.value.body["error"] == {  # type: ignore[index]
        "type": "permission_error",
        "message": f"model: this key may not use the model {DEEPSEEK!r}",
    }
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        call = stub.Generate(
            gateway_pb2.GenerateRequest(model=DEEPSEEK, prompt="Hi"), metadata=(("authorization", f"Bearer {key}"),)
        )
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in call:
                pass
    assert failed.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert failed.value.details() == f"model: this key may not use the model {DEEPSEEK!r}"
