"""How `make test` deals the suite's files to its two xdist workers (`--dist loadfile`, with two changes).

1. Longest first. xdist deals files in order of their number of tests, so the files that start a whole mesh (few
   tests, a minute or more each) came last, and one worker ran the last of them alone while the other sat idle.
   Here the next file a worker gets is the costliest left (LPT scheduling), by the seconds each file took in a
   recorded run (tests/durations.json; a file not in it counts DEFAULT_S_PER_TEST a test).
2. Files that share a session-scoped mesh are one unit (SHARED_SCOPES): dealt to two workers they would start it
   twice.

Refresh the record after adding or moving slow tests:
    KVMESH_TEST_DURATIONS_OUT=tests/durations.json make test
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadFileScheduling

DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_S_PER_TEST = 0.5

_API_MESH = "tests/services/api_mesh_session"  # tests/services/conftest.py's api_mesh_session
_MESH = "tests/integration/mesh"  # tests/integration/conftest.py's session-scoped mesh
SHARED_SCOPES = {
    "tests/integration/test_mesh.py": _MESH,
    "tests/integration/test_tracing.py": _MESH,
    "tests/services/test_gateway_chat_api.py": _API_MESH,
    "tests/services/test_gateway_responses_messages_api.py": _API_MESH,
    "tests/services/test_tenancy_isolation.py": _API_MESH,
    "tests/services/test_gateway_v4_api.py": _API_MESH,
}


def scope_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_SCOPES.get(path, path)


class LongestFirstFileScheduling(LoadFileScheduling):
    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.recorded: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)

    def _cost(self, scope: str) -> float:
        return self.recorded.get(scope, DEFAULT_S_PER_TEST * len(self.workqueue[scope]))

    def _assign_work_unit(self, node: Any) -> None:
        self.workqueue.move_to_end(max(self.workqueue, key=self._cost), last=False)  # what super() pops next
        super()._assign_work_unit(node)


class DurationRecorder:
    """Seconds per scope (setup, call and teardown of its tests), written at the end of the run when
    KVMESH_TEST_DURATIONS_OUT names a file. On the controller it sees every worker's reports."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.seconds[scope_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        if os.environ.get("PYTEST_XDIST_WORKER"):
            return  # the controller writes the whole run's
        ordered = {scope: round(s, 1) for scope, s in sorted(self.seconds.items(), key=lambda i: -i[1]) if s >= 1}
        self.path.write_text(json.dumps(ordered, indent=1) + "\n")
