"""deploy/kubernetes/ rendered (kvmesh.kube, kustomize's subset) and checked offline: every built-in object with
kubernetes-validate --strict against Kubernetes 1.30 and the newest schemas it ships, the CRD kinds (KEDA
ScaledObject, Gateway API HTTPRoute) against their published schemas (tests/data/crds/), and kvmesh's own
invariants: the roles, images and settings of docker-compose.yml, probes, security, disruption budgets, and
NetworkPolicies that follow mesh.access's table."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from engine_core import model_store
from kvmesh.kube import render
from mesh import metrics
from mesh.access import ALLOWED_CALLERS, ROLES
from mesh.config import ServiceSettings
from services.balancer.server import POOL_ROLES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
CRDS = ROOT / "tests" / "data" / "crds"
OVERLAYS = ("cpu", "nvidia", "ascend")
ADDONS = ("autoscaling/keda", "autoscaling/hpa", "examples")
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobject_v1alpha1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproute_v1.json",
}
ACCELERATORS = {"nvidia": ("nvidia.com/gpu", "cuda"), "ascend": ("huawei.com/Ascend910", "ascend")}
ACCELERATED = {"prefill", "decode", "encoder"}
PRE_STOP_S = 5  # the roles' preStop sleep: endpoints drop the pod before SIGTERM starts the drain
GRPC_PORT, LANE_PORT = 50051, 50052
# the gRPC service each role serves (mesh.access names methods by service); every role answers Health
SERVICE_ROLES = {
    "Balancer": "balancer",
    "Prefill": "prefill",
    "Encoder": "encoder",
    "Decode": "decode",
    "KVCache": "kvcache",
    "ExpertBalancer": "expert_lb",
}
LANE_METHODS = {"decode": "/kvmesh.v1.Decode/PushKV", "kvcache": "/kvmesh.v1.KVCache/Put"}  # what a lane carries


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(DEPLOY / "overlays" / name) for name in OVERLAYS} | {
        name: render(DEPLOY / name) for name in ADDONS
    }


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def cpu(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered["cpu"]


def workloads(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for name, workload in workloads(objects).items():
        for container in pod_spec(workload)["containers"]:
            yield name, pod_spec(workload), container


def role_of(container: dict[str, Any]) -> str | None:
    args = container.get("args", [])
    return args[1] if args[:1] == ["serve"] else None


def settings_map(objects: list[dict[str, Any]]) -> dict[str, str]:
    (config,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "kvmesh-settings"]
    return dict(config["data"])


def effective_env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, Any]:
    """The container's environment as the kubelet builds it: envFrom first, its own env over it."""
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == "kvmesh-settings"
        env |= settings_map(objects)
    for variable in container.get("env", []):
        env[variable["name"]] = variable.get("value", variable.get("valueFrom"))
    return env


# -- schemas --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cached_schemas() -> Iterator[None]:
    """kubernetes_validate reads its 2 MB definitions file on every call; read each file once (same contents)."""
    original = kubernetes_validate.utils.schema_contents
    kubernetes_validate.utils.schema_contents = functools.cache(original)
    yield
    kubernetes_validate.utils.schema_contents = original


def unique_objects(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every object of every rendering once (the overlays share most of the base's objects unchanged)."""
    seen: dict[str, dict[str, Any]] = {}
    for objects in rendered.values():
        for obj in objects:
            seen.setdefault(json.dumps(obj, sort_keys=True), obj)
    return list(seen.values())


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_passes_strict_validation(
    rendered: dict[str, list[dict[str, Any]]], cached_schemas: None, version: str
) -> None:
    built_in = [o for o in unique_objects(rendered) if (o["apiVersion"], o["kind"]) not in CRD_SCHEMAS]
    validated = {kubernetes_validate.validate(obj, version, strict=True) for obj in built_in}
    assert validated == {".".join(version.split(".")[:2])}  # the schemas of the version asked for, not an older one
    # the base's 33 objects; the 8 with a kvmesh container again in each GPU/NPU overlay (its image; the 3
    # accelerated Deployments their device too); 3 HPAs; the example Ingress
    assert len(built_in) == 33 + 8 + 8 + 3 + 1


def test_strict_validation_refuses_an_unknown_field(cached_schemas: None) -> None:
    deployment = copy.deepcopy(workloads(render(DEPLOY / "base"))["decode"])
    pod_spec(deployment)["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProbes"):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


def strict_schema(schema: Any) -> Any:
    """A CRD's structural schema as the API server applies it with strict field validation: an object's fields
    are those it lists, unless it preserves unknown fields or says what its other members are."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: strict_schema(value) for key, value in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads((CRDS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    return jsonschema.Draft7Validator(strict_schema(schema))


def test_crd_objects_match_their_published_schemas(rendered: dict[str, list[dict[str, Any]]]) -> None:
    custom = [o for o in unique_objects(rendered) if (o["apiVersion"], o["kind"]) in CRD_SCHEMAS]
    for obj in custom:
        errors = [e.message for e in crd_validator(obj["apiVersion"], obj["kind"]).iter_errors(obj)]
        assert errors == [], obj["metadata"]["name"]
    assert Counter(o["kind"] for o in custom) == {"ScaledObject": 3, "HTTPRoute": 1}
    misspelled = copy.deepcopy(next(o for o in custom if o["kind"] == "ScaledObject"))
    misspelled["spec"]["maxReplicas"] = 4  # HPA's name; KEDA's is maxReplicaCount
    assert not crd_validator("keda.sh/v1alpha1", "ScaledObject").is_valid(misspelled)


# -- what the base holds --------------------------------------------------------------------------------------------
def test_object_counts(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert Counter(o["kind"] for o in rendered["cpu"]) == {
        "Namespace": 1,
        "ConfigMap": 1,
        "PersistentVolumeClaim": 1,
        "Job": 1,
        "StatefulSet": 2,  # nats, kvcache
        "Deployment": 6,
        "Service": 4,  # nats, nats-headless, kvcache (headless), gateway
        "PodDisruptionBudget": 8,
        "NetworkPolicy": 9,  # the default deny and one per pool
    }
    for overlay in OVERLAYS:
        assert len(rendered[overlay]) == 33


def test_every_role_runs_as_compose_runs_it(cpu: list[dict[str, Any]], compose: dict[str, Any]) -> None:
    compose_roles = {s["command"][1] for s in compose["services"].values() if s.get("command", [""])[0] == "serve"}
    by_role = {role_of(c): (name, c) for name, _, c in containers(cpu) if role_of(c)}
    assert set(by_role) == compose_roles == set(ROLES)
    kinds = {role: workloads(cpu)[name]["kind"] for role, (name, _) in by_role.items()}
    assert kinds == {role: "StatefulSet" if role == "kvcache" else "Deployment" for role in ROLES}
    replicas = {name: w["spec"].get("replicas") for name, w in workloads(cpu).items()}
    assert (replicas["balancer"], replicas["nats"], replicas["kvcache"]) == (2, 3, 3)
    assert replicas["balancer"] == compose["services"]["balancer"]["deploy"]["replicas"]
    grace = {pod_spec(workloads(cpu)[name])["terminationGracePeriodSeconds"] for name, _ in by_role.values()}
    assert grace == {int(compose["services"]["gateway"]["stop_grace_period"].removesuffix("s"))}
    (pull,) = [c for name, _, c in containers(cpu) if name == "models-pull"]
    assert pull["args"] == compose["services"]["models"]["command"]
    # KVMESH_MODELS unset in kvmesh-settings, as in compose: the job pulls every known model and the roles serve
    # their default three, deepseek-v4-tiny among them (tests/containers/test_compose_schema.py)
    assert "KVMESH_MODELS" not in settings_map(cpu) and "deepseek-v4-tiny" in model_store.DEFAULT_MODELS


def test_images_match_compose(rendered: dict[str, list[dict[str, Any]]], compose: dict[str, Any]) -> None:
    default = re.fullmatch(r"\$\{KVMESH_IMAGE:-(.+)\}", compose["services"]["gateway"]["image"])
    assert default is not None
    images = {c["image"] for _, _, c in containers(rendered["cpu"])}
    assert images == {default.group(1), compose["services"]["nats"]["image"]}
    for overlay in ACCELERATORS:
        images = {c["image"] for _, _, c in containers(rendered[overlay])}
        assert images == {f"kvmesh:{overlay if overlay != 'nvidia' else 'cuda'}", compose["services"]["nats"]["image"]}


def test_settings_match_compose(cpu: list[dict[str, Any]], compose: dict[str, Any]) -> None:
    shared = compose["x-kvmesh-settings"]
    settings = settings_map(cpu)
    # beyond compose (one NATS server): every stream and bucket copied on each node of the NATS StatefulSet
    (nats,) = [o for o in cpu if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "nats"]
    assert settings.pop("KVMESH_JETSTREAM_REPLICAS") == str(nats["spec"]["replicas"]) == "3"
    assert settings == {k: v for k, v in shared.items() if v is not None}
    for name, _, container in containers(cpu):
        role = role_of(container)
        if role is None:
            continue
        env = effective_env(cpu, container)
        own = compose["services"][role]["environment"]
        # beyond compose: the lane's port, fixed for NetworkPolicies; a store node's stable name
        names = set(shared) | set(own) | {"KVMESH_DATA_PORT", "KVMESH_WORKER_ID", "KVMESH_JETSTREAM_REPLICAS"}
        assert set(env) <= names, name
        stable_name = {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env.get("KVMESH_WORKER_ID") == (stable_name if role == "kvcache" else None), name
        for key, value in own.items():  # the role's own settings in compose (ports, data dir, API keys)
            if key not in shared or value != shared[key]:
                expected = {"secretKeyRef": {"name": "kvmesh-api-keys", "key": "api-keys"}}
                assert env[key] == (expected if key == "KVMESH_API_KEYS" else value), (name, key)


def test_probes_dial_the_status_port(cpu: list[dict[str, Any]]) -> None:
    for name, _, container in containers(cpu):
        if name == "models-pull":
            continue
        port = 8222 if name == "nats" else int(effective_env(cpu, container)["KVMESH_HTTP_PORT"])
        probes = {kind: container[f"{kind}Probe"]["httpGet"] for kind in ("startup", "readiness", "liveness")}
        assert {p["port"] for p in probes.values()} == {port}, name
        paths = {kind: p["path"].split("?")[0] for kind, p in probes.items()}
        assert paths == {
            "startup": "/healthz",
            "readiness": "/readyz" if name != "nats" else "/healthz",
            "liveness": "/healthz",
        }
        assert {"containerPort": port} in [{"containerPort": p["containerPort"]} for p in container["ports"]]


def test_containers_are_unprivileged_bounded_and_drain(cpu: list[dict[str, Any]]) -> None:
    drain_s = float(settings_map(cpu).get("KVMESH_DRAIN_TIMEOUT_S", ServiceSettings().drain_timeout_s))
    for name, spec, container in containers(cpu):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        security = container["securityContext"]
        assert (security["privileged"], security["allowPrivilegeEscalation"]) == (False, False), name
        assert security["capabilities"] == {"drop": ["ALL"]}
        resources = container["resources"]
        assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}, name
        if role_of(container):
            assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRE_STOP_S)]
            assert spec["terminationGracePeriodSeconds"] >= drain_s + PRE_STOP_S, name


def test_every_pool_has_a_disruption_budget(cpu: list[dict[str, Any]]) -> None:
    budgets = [o for o in cpu if o["kind"] == "PodDisruptionBudget"]
    for name, workload in workloads(cpu).items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == (0 if workload["kind"] == "Job" else 1), name
    assert {b["metadata"]["name"]: b["spec"].get("minAvailable") for b in budgets}["nats"] == 2  # JetStream quorum


def expected_callers(role: str) -> dict[int, set[str]]:
    """Port -> the roles mesh.access lets call it: its services' callers and the health checkers on gRPC; the
    callers of what the lane carries on the lane."""
    grpc_callers: set[str] = set()
    for method, allowed in ALLOWED_CALLERS.items():
        service = method.split("/")[1].rsplit(".", 1)[1]
        if SERVICE_ROLES.get(service) == role or service == "Health":
            grpc_callers |= allowed
    expected = {GRPC_PORT: grpc_callers}
    if role in LANE_METHODS:
        expected[LANE_PORT] = set(ALLOWED_CALLERS[LANE_METHODS[role]])
    return expected


def test_network_policies_follow_the_access_table(cpu: list[dict[str, Any]]) -> None:
    policies = {o["metadata"]["name"]: o["spec"] for o in cpu if o["kind"] == "NetworkPolicy"}
    assert policies.pop("default-deny-ingress") == {"podSelector": {}, "policyTypes": ["Ingress"]}
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    for role in ROLES:
        rules = policies.pop(role.replace("_", "-"))["ingress"]
        allowed = {
            rule["ports"][0]["port"]: rule.get("from")
            for rule in rules
            if "from" not in rule or monitoring not in rule["from"]
        }
        if role == "gateway":  # the world's door: REST and the public gRPC API, from anywhere
            assert [r["port"] for r in rules[0]["ports"]] == [8080, 50050] and "from" not in rules[0]
            continue
        callers = {
            port: {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in sources}
            for port, sources in allowed.items()
        }
        expected = {port: {r.replace("_", "-") for r in roles} for port, roles in expected_callers(role).items()}
        assert callers == expected, role
    assert set(policies) == {"nats"}


def test_accelerator_overlays(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, (resource, device) in ACCELERATORS.items():
        for name, spec, container in containers(rendered[overlay]):
            is_accelerated = name in ACCELERATED
            assert (container["resources"]["limits"].get(resource) == "1") is is_accelerated, (overlay, name)
            assert ({"name": "KVMESH_DEVICE", "value": device} in container.get("env", [])) is is_accelerated
            assert ("tolerations" in spec) is is_accelerated
            if is_accelerated:
                assert spec["tolerations"][0]["key"] == resource
    assert not any("nodeSelector" in spec for _, spec, _ in containers(rendered["cpu"]))


def test_autoscalers_follow_the_balancers_recommendation(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (family,) = metrics.BALANCER_RECOMMENDED_WORKERS.describe()
    deployments = {n for n, w in workloads(rendered["cpu"]).items() if w["kind"] == "Deployment"}
    keda = {o["spec"]["scaleTargetRef"]["name"]: o["spec"] for o in rendered["autoscaling/keda"]}
    hpa = {o["spec"]["scaleTargetRef"]["name"]: o["spec"] for o in rendered["autoscaling/hpa"]}
    assert set(keda) == set(hpa) == set(POOL_ROLES) == ACCELERATED and set(keda) <= deployments
    for pool in POOL_ROLES:
        (trigger,) = keda[pool]["triggers"]
        assert trigger["metadata"]["query"] == f'max({family.name}{{namespace="kvmesh", pool="{pool}"}})'
        assert (trigger["metricType"], trigger["metadata"]["threshold"]) == ("AverageValue", "1")
        (external,) = hpa[pool]["metrics"]
        assert external["external"]["metric"] == {"name": family.name, "selector": {"matchLabels": {"pool": pool}}}
        assert external["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        assert keda[pool]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa[pool]["behavior"]


def test_secrets_are_referenced_and_documented(cpu: list[dict[str, Any]]) -> None:
    assert not [o for o in cpu if o["kind"] == "Secret"]  # never in the repository: made per cluster
    names = set()
    for _, spec, container in containers(cpu):
        names |= {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        names |= {
            e["valueFrom"]["secretKeyRef"]["name"]
            for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})
        }
    certs = {f"kvmesh-certs-{role.replace('_', '-')}" for role in (*ROLES, "nats")}
    assert names == certs | {"kvmesh-api-keys"}
    page = (ROOT / "docs" / "kubernetes.md").read_text()
    assert [name for name in sorted(names) if f"`{name}`" not in page] == []


# -- the renderer ---------------------------------------------------------------------------------------------------
def test_render_applies_patches_and_images(tmp_path: Path) -> None:
    (tmp_path / "pod.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a, labels: {x: 'y'}}\n"
        "spec: {template: {spec: {containers: [{name: c, image: 'kvmesh:latest', env: [{name: A, value: '1'}]}]}}}\n"
    )
    (tmp_path / "patch.yaml").write_text(
        "- {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: B, value: '2'}}\n"
        "- {op: replace, path: /metadata/labels/x, value: z}\n"
        "- {op: add, path: /spec/template/spec/containers/0/resources, value: {limits: {nvidia.com/gpu: '1'}}}\n"
    )
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [pod.yaml]\npatches: [{path: patch.yaml, target: {kind: Deployment, labelSelector: x=y}}]\n"
        "images: [{name: kvmesh, newTag: cuda}]\n"
    )
    (deployment,) = render(tmp_path)
    assert deployment["metadata"]["labels"] == {"x": "z"}
    assert deployment["spec"]["template"]["spec"]["containers"][0] == {
        "name": "c",
        "image": "kvmesh:cuda",
        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }
    (tmp_path / "kustomization.yaml").write_text("resources: [pod.yaml]\nnamePrefix: x-\n")
    with pytest.raises(ValueError, match="namePrefix"):
        render(tmp_path)
