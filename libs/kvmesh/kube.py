"""Render deploy/kubernetes's kustomizations without kustomize: the subset of kustomize the manifests use.

    python -m kvmesh.kube render deploy/kubernetes/overlays/nvidia > nvidia.yaml   # what `kubectl apply -k` applies

`kubectl kustomize DIR` gives the same objects (the manifests are written for it; this exists so the tests and
machines without kubectl can render them). Supported in kustomization.yaml: `resources` (files and directories),
`patches` (JSON 6902 operation lists, `target` by kind, name and `key=value` label selector) and `images` (`name`,
`newName`, `newTag`). Any other field raises ValueError naming it, so an overlay cannot silently render to
something else than kustomize would.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION = "kustomization.yaml"
SUPPORTED_FIELDS = frozenset({"apiVersion", "kind", "resources", "patches", "images"})
Manifest = dict[str, Any]


def render(directory: Path) -> list[Manifest]:
    """The objects the kustomization in `directory` produces, in kustomize's resource order."""
    spec = yaml.safe_load((directory / KUSTOMIZATION).read_text())
    unknown = set(spec) - SUPPORTED_FIELDS
    if unknown:
        raise ValueError(f"{directory / KUSTOMIZATION}: unsupported fields {sorted(unknown)}")
    objects: list[Manifest] = []
    for resource in spec.get("resources", []):
        path = directory / resource
        objects += render(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in spec.get("patches", []):
        operations = yaml.safe_load((directory / patch["path"]).read_text())
        matched = [o for o in objects if _matches(o, patch["target"])]
        if not matched:
            raise ValueError(f"{directory / KUSTOMIZATION}: patch {patch['path']} matches no object")
        for obj in matched:
            for operation in operations:
                apply_operation(obj, operation)
    for image in spec.get("images", []):
        for container in _containers(objects):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return objects


def _matches(obj: Manifest, target: dict[str, str]) -> bool:
    unknown = set(target) - {"kind", "name", "labelSelector"}
    if unknown:
        raise ValueError(f"patch target: unsupported fields {sorted(unknown)}")
    metadata = obj.get("metadata", {})
    if "kind" in target and obj.get("kind") != target["kind"]:
        return False
    if "name" in target and metadata.get("name") != target["name"]:
        return False
    if "labelSelector" in target:
        key, _, value = target["labelSelector"].partition("=")
        return bool(metadata.get("labels", {}).get(key) == value)
    return True


def _containers(objects: list[Manifest]) -> Iterator[Manifest]:
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        if obj.get("kind") == "CronJob":
            pod = obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        yield from pod.get("initContainers", [])
        yield from pod.get("containers", [])


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"JSON patch path {path!r} must start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def apply_operation(obj: Manifest, operation: dict[str, Any]) -> None:
    """One RFC 6902 operation (add, replace or remove) on `obj`, in place."""
    op, *parents, last = [operation["op"], *_pointer(operation["path"])]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if op not in ("add", "replace", "remove"):
        raise ValueError(f"JSON patch op {op!r}: only add, replace and remove are supported")
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op == "add":
            node.insert(index, copy.deepcopy(operation["value"]))
        elif op == "replace":
            node[index] = copy.deepcopy(operation["value"])
        else:
            del node[index]
        return
    if op != "add" and last not in node:
        raise ValueError(f"JSON patch {op} {operation['path']}: no such member")
    if op == "remove":
        del node[last]
    else:
        node[last] = copy.deepcopy(operation["value"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.kube", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    render_command = commands.add_parser("render", help="print the objects a kustomization directory produces")
    render_command.add_argument("directory", type=Path, help="e.g. deploy/kubernetes/overlays/cpu")
    args = parser.parse_args(argv)
    yaml.safe_dump_all(render(args.directory), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
