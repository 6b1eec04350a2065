"""Nothing that arrives on a wire is unpickled, torch.load'ed or evaluated (issue 15; vLLM's pickle-over-ZMQ
advisory is the anchor). Bytes between processes are protobuf, the lanes' own frames (mesh.lane_io) or raw
tensors read with torch.frombuffer; weights are safetensors or GGUF. So the service code (libs/, services/) must
not reach any deserializer that runs code: no pickle, marshal, shelve, dill, cloudpickle or joblib import, no
torch.load, no numpy.load with allow_pickle=True, no yaml.load/unsafe_load, no eval or exec. The checker is
tried on a tiny tree first, so the check on the real tree cannot pass vacuously."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_code_health import EXCLUDED, ROOTS, Module, collect_modules

CODE_RUNNING_MODULES = ("pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib")
CODE_RUNNING_CALLS = {("torch", "load"), ("serialization", "load"), ("yaml", "load"), ("yaml", "unsafe_load")}
BUILTINS = ("eval", "exec")


def _root(name: str) -> str:
    return name.split(".")[0]


def unsafe_deserializers(modules: dict[str, Module]) -> list[str]:
    found = []
    for module in modules.values():
        tree = ast.parse(module.path.read_text(), str(module.path))
        for node in ast.walk(tree):
            where = f"{module.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                found += [f"{where} imports {a.name}" for a in node.names if _root(a.name) in CODE_RUNNING_MODULES]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if _root(node.module) in CODE_RUNNING_MODULES:
                    found.append(f"{where} imports from {node.module}")
                elif _root(node.module) == "torch" and any(a.name == "load" for a in node.names):
                    found.append(f"{where} imports torch's load")
            elif isinstance(node, ast.Call):
                function = node.func
                if isinstance(function, ast.Name) and function.id in BUILTINS:
                    found.append(f"{where} calls {function.id}")
                elif isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name | ast.Attribute):
                    owner = function.value.id if isinstance(function.value, ast.Name) else function.value.attr
                    if (owner, function.attr) in CODE_RUNNING_CALLS:
                        found.append(f"{where} calls {owner}.{function.attr}")
                    elif owner in ("np", "numpy") and function.attr == "load":
                        pickles = [k for k in node.keywords if k.arg == "allow_pickle"]
                        if any(not (isinstance(k.value, ast.Constant) and k.value.value is False) for k in pickles):
                            found.append(f"{where} calls {owner}.load with allow_pickle")
    return found


def test_the_checker_finds_every_form(tmp_path: Path) -> None:
    code = {
        "a.py": "import pickle\nimport marshal as m\nfrom dill import loads\n",
        "b.py": "import torch\nfrom torch import load\nx = torch.load('f')\ny = torch.serialization.load('f')\n",
        "c.py": "import numpy as np\nnp.load('f', allow_pickle=True)\nnp.load('f')\nnp.load('f', allow_pickle=False)\n",
        "d.py": "eval('1')\nexec('x = 1')\nimport yaml\nyaml.load('a')\nyaml.safe_load('a')\n",
        "e.py": "import json\nimport torch\njson.loads('1')\ntorch.frombuffer(b'1234', dtype=torch.uint8)\n",
    }
    for name, text in code.items():
        (tmp_path / name).write_text(text)
    found = unsafe_deserializers(collect_modules(((tmp_path, "t"),)))
    assert found == [
        "t.a:1 imports pickle",
        "t.a:2 imports marshal",
        "t.a:3 imports from dill",
        "t.b:2 imports torch's load",
        "t.b:3 calls torch.load",
        "t.b:4 calls serialization.load",
        "t.c:2 calls np.load with allow_pickle",
        "t.d:1 calls eval",
        "t.d:2 calls exec",
        "t.d:4 calls yaml.load",
    ]


def test_no_service_code_reaches_a_deserializer_that_runs_code() -> None:
    modules = collect_modules(ROOTS, EXCLUDED)
    assert len(modules) > 100  # the real tree
    assert unsafe_deserializers(modules) == []
