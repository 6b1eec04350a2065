"""How `make test` deals the suite's files to its two xdist workers (`--dist loadfile`, with two changes).

1. Longest first. xdist deals files in order of their number of tests, so the files that start a whole mesh (few
   tests, a minute or more each) came last, and one worker ran the last of them alone while the other sat idle.
   Here the next file a worker gets is the costliest left (LPT scheduling), by the seconds each file took in a
   recorded run (tests/durations.json; a file not in it counts DEFAULT_S_PER_TEST a test).
2. Files that share a session-scoped mesh are one unit (SHARED_SCOPES): dealt to two workers they would start it
   twice.

A shared mesh stops when the last test of its unit has run (`finish_ended_units`), not at the end of the session:
a session-scoped fixture otherwise holds its processes (gigabytes) while the worker runs every later file, and two
such leftovers beside the meshes running then took a CI machine to its last few MiB of memory and thrashed it.

Refresh the record after adding or moving slow tests:
    KVMESH_TEST_DURATIONS_OUT=tests/durations.json make test
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
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


# the session-scoped fixture each unit shares
SHARED_FIXTURES = {_MESH: "mesh", _API_MESH: "api_mesh_session"}


def scope_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_SCOPES.get(path, path)


def unit_ended(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    """Whether `item` is the last test of its unit this process runs. On an xdist worker a unit comes whole (the
    scheduler deals it as one), so it ends where the next test is another unit's; in a plain run, where no test
    left in the session's order belongs to it."""
    unit = scope_of(item.nodeid)
    if nextitem is None:
        return True
    if scope_of(nextitem.nodeid) == unit:
        return False
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return True
    items = item.session.items
    return all(scope_of(later.nodeid) != unit for later in items[items.index(nextitem) :])


# the shared fixtures of units that have ended, with the request of their last test: stopped at the next setup
_ended: list[tuple[Any, Any]] = []


def note_ended_unit(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """At `item`'s teardown: if it ended a unit whose mesh is shared, the mesh stops before the next test's setup
    (`finish_ended_units`): by then pytest has dropped the test's own references to it, and the memory can go."""
    name = SHARED_FIXTURES.get(scope_of(item.nodeid))
    if name is not None and nextitem is not None and unit_ended(item, nextitem):
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):  # type: ignore[attr-defined]
            _ended.append((fixturedef, item._request))  # type: ignore[attr-defined]


def finish_ended_units() -> None:
    """Stop the shared mesh of each unit whose last test has run (its fixture's finalizers run now; were a later
    test to ask for it after all, pytest would start it again), then hand the freed memory back to the system."""
    if not _ended:
        return
    while _ended:
        fixturedef, request = _ended.pop()
        fixturedef.finish(request)
    release_memory()


def release_memory() -> None:
    """Collect garbage and return the allocator's free pages to the system: torch's CPU tensors come from glibc's
    heap, which keeps what a freed model held (measured: a SmolLM2 engine loaded, run and freed left 678-1,262 MiB
    in the process; malloc_trim took it back to 420-427 MiB)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


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
