"""docker-compose.yml against the Compose JSON Schema, and the properties the mesh relies on (no Docker needed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jsonschema
import pytest
import yaml

from engine_core import model_store
from kvmesh.config_docs import role_settings

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
SCHEMA_FILE = REPO_ROOT / "tests" / "data" / "compose-spec" / "compose-spec.json"  # tests/data/README.md
ROLES = ("gateway", "encoder", "prefill", "decode", "kvcache", "balancer", "expert_lb")
WORKERS = ("encoder", "prefill", "decode", "kvcache", "balancer", "expert_lb")


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = yaml.safe_load(SCHEMA_FILE.read_text())  # JSON is YAML
    assert "draft-07" in schema["$schema"]  # spelled without the "#" jsonschema looks up, so named here
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())  # merge keys (<<) resolved, as compose does


def test_the_compose_file_validates_against_the_compose_spec(validator, compose):
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []


def test_the_validator_rejects_what_compose_would(validator, compose):
    broken = yaml.safe_load(COMPOSE_FILE.read_text())
    broken["services"]["gateway"]["ports"] = "8080:8080"  # a string, not a list
    broken["services"]["decode"]["depends_on"] = {"nats": {"condition": "service_ready"}}  # no such condition
    broken["services"]["prefill"]["scale_me"] = True  # no such key
    paths = sorted("/".join(map(str, e.absolute_path)) for e in validator.iter_errors(broken))
    assert paths == ["services/decode/depends_on", "services/gateway/ports", "services/prefill"]


OBSERVABILITY = ("prometheus", "grafana", "jaeger")  # the optional profile: docs/operations.md


def mesh_services(compose: dict) -> dict:
    """The services `docker compose up` starts: those of no profile."""
    return {name: service for name, service in compose["services"].items() if not service.get("profiles")}


def test_every_role_is_a_service_of_one_image_that_one_service_builds(compose):
    services = mesh_services(compose)
    assert set(services) == {"nats", "models", "certs", *ROLES}
    images = {services[name]["image"] for name in ("models", "certs", *ROLES)}
    assert images == {"${KVMESH_IMAGE:-kvmesh:latest}"}
    assert [name for name, service in services.items() if "build" in service] == ["models"]
    for role in ROLES:
        assert services[role]["command"] == ["serve", role]
    assert services["models"]["command"] == ["models", "pull"]
    assert services["nats"]["image"] == "nats:2.10-alpine" and "-js" in services["nats"]["command"]


def test_only_the_gateway_publishes_a_port_and_no_service_has_a_fixed_name(compose):
    services = mesh_services(compose)
    assert {name for name, service in services.items() if service.get("ports")} == {"gateway"}
    assert services["gateway"]["ports"] == ["${KVMESH_PUBLISH:-8080}:8080"]
    everything = compose["services"]
    assert not [name for name, service in everything.items() if "container_name" in service or "hostname" in service]


def test_the_observability_profile_publishes_on_this_host_only_and_mounts_the_shipped_files(compose):
    extra = {name: service for name, service in compose["services"].items() if service.get("profiles")}
    assert set(extra) == set(OBSERVABILITY)
    assert all(service["profiles"] == ["observability"] for service in extra.values())
    for service in extra.values():
        assert all(port.startswith("127.0.0.1:") for port in service.get("ports", []))
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (REPO_ROOT / source).exists(), volume
    assert compose["services"]["gateway"]["environment"]["KVMESH_METRICS_PORT"] == "9100"


def test_healthchecks_dial_each_role_on_its_own_status_port(compose):
    services = compose["services"]
    for role in ROLES:
        port = services[role]["environment"]["KVMESH_HTTP_PORT"]
        test = services[role]["healthcheck"]["test"]
        assert test[0] == "CMD" and f"http://127.0.0.1:{port}/readyz" in test[-1], role
    assert services["gateway"]["environment"]["KVMESH_HTTP_PORT"] == "8080"
    assert "8222/healthz" in services["nats"]["healthcheck"]["test"][-1]


def certs_of(role: str) -> str:
    """The mount of one role's own certs volume (its certificate, key, the CA and its NATS credentials),
    read-only: no container holds another role's key."""
    return f"certs-{role.replace('_', '-')}:/certs:ro"


def test_roles_start_after_the_bus_and_the_models_and_read_the_models_volume_read_only(compose):
    services = compose["services"]
    for role in ("gateway", "encoder", "prefill", "decode"):
        depends = services[role]["depends_on"]
        assert depends["nats"] == {"condition": "service_healthy"}
        assert depends["models"] == {"condition": "service_completed_successfully"}
        assert services[role]["volumes"] == ["models:/models:ro", certs_of(role)]
    assert services["gateway"]["depends_on"]["balancer"] == {"condition": "service_healthy"}
    assert services["models"]["volumes"] == ["models:/models"]
    assert services["kvcache"]["volumes"] == ["kv-data:/data", certs_of("kvcache")]  # the SSD tier outlives it
    assert services["kvcache"]["environment"]["KVMESH_DATA_DIR"] == "/data"
    certs_volumes = {f"certs-{r.replace('_', '-')}" for r in (*ROLES, "nats")}
    assert set(compose["volumes"]) == {"models", "nats-data", "kv-data", "certs", *certs_volumes}


def test_the_certs_service_makes_the_certificates_once_and_each_role_mounts_only_its_own(compose):
    services = compose["services"]
    assert services["certs"]["command"] == ["certs", "init", "/certs"]  # leaves a CA already there alone
    assert services["certs"]["volumes"] == [  # each role's directory lands in its own volume
        "certs:/certs",
        *(f"certs-{r.replace('_', '-')}:/certs/{r}" for r in ("nats", "gateway", "prefill", "decode", "kvcache")),
        *(f"certs-{r.replace('_', '-')}:/certs/{r}" for r in ("balancer", "expert_lb", "encoder")),
    ]
    assert services["certs"]["restart"] == "no"
    assert services["nats"]["volumes"] == ["nats-data:/data", "certs-nats:/certs/nats:ro"]
    for role in ROLES:
        assert services[role]["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
        assert certs_of(role) in services[role]["volumes"]
        assert [v for v in services[role]["volumes"] if "certs" in str(v)] == [certs_of(role)]
        assert services[role]["environment"]["KVMESH_TLS_DIR"] == "/certs"
        assert "KVMESH_INSECURE" in services[role]["environment"]  # passed through, unset by default


def test_settings_reach_every_role_and_the_host_api_keys_are_required(compose):
    services = compose["services"]
    for role in ROLES:
        env = services[role]["environment"]
        assert env["KVMESH_NATS_URL"] == "tls://nats:4222" and env["KVMESH_HOST"] == "0.0.0.0"
        assert "KVMESH_MODELS" in env and env["KVMESH_MODELS"] is None  # passed through from the host when set
        assert "KVMESH_WORKER_ID" not in env  # the default names each container apart (its hostname)
    assert services["gateway"]["environment"]["KVMESH_API_KEYS"].startswith("${KVMESH_API_KEYS:?")


def test_the_roles_serve_the_three_default_models_and_the_models_service_pulls_them(compose):
    """KVMESH_MODELS passes through unset, so every role serves its settings' default: deepseek-v4-tiny beside
    smollm2-135m and deepseek-tiny. `models pull` with it unset pulls every known model: those three among them."""
    assert model_store.DEFAULT_MODELS == ("smollm2-135m", "deepseek-tiny", "deepseek-v4-tiny")
    assert set(model_store.DEFAULT_MODELS) <= set(model_store.KNOWN_MODELS)
    fields = {role: {f.name: f for f in dataclasses.fields(cls)} for role, cls in role_settings().items()}
    served = {role: own["models"].default for role, own in fields.items() if "models" in own}
    assert served == dict.fromkeys(("decode", "encoder", "gateway", "prefill"), model_store.DEFAULT_MODELS)
    assert compose["x-kvmesh-settings"]["KVMESH_MODELS"] is None
    assert compose["services"]["models"]["command"] == ["models", "pull"]  # no names: KVMESH_MODELS, else all
    assert compose["services"]["models"]["volumes"] == ["models:/models"]  # the volume every model role reads


def test_every_long_running_service_restarts_and_two_balancers_share_the_routing(compose):
    services = compose["services"]
    assert {name: s.get("restart") for name, s in services.items() if s.get("restart") != "unless-stopped"} == {
        "models": "no",  # one-shot: fetch the models, exit
        "certs": "no",  # one-shot: make the certificates, exit
    }
    assert services["balancer"]["deploy"] == {"replicas": 2}
    assert [name for name, s in services.items() if "deploy" in s] == ["balancer"]
    assert services["gateway"]["stop_grace_period"] == "40s"  # past KVMESH_DRAIN_TIMEOUT_S's 30 s
