"""When a shared mesh stops (tests/scheduling.py): after the last test of its unit, on an xdist worker (where a
unit comes whole) and in a plain run (where the session's order says), and never while a test of it is left."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.scheduling import unit_ended

MESH_A = "tests/integration/test_mesh.py::test_a"
MESH_B = "tests/integration/test_mesh.py::test_b"
TRACING = "tests/integration/test_tracing.py::test_c"  # the same unit as test_mesh.py
OTHER = "tests/services/test_balancer.py::test_d"


@dataclass
class Session:
    items: list[Any] = field(default_factory=list)


@dataclass
class Item:
    nodeid: str
    session: Session


def ordered(*nodeids: str) -> list[Item]:
    session = Session()
    session.items = [Item(nodeid, session) for nodeid in nodeids]
    return session.items


def test_a_worker_ends_a_unit_where_the_next_test_is_another_units(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    mesh_a, mesh_b, tracing, other = ordered(MESH_A, MESH_B, TRACING, OTHER)
    assert [unit_ended(mesh_a, mesh_b), unit_ended(mesh_b, tracing), unit_ended(tracing, other)] == [
        False,
        False,
        True,
    ]
    assert unit_ended(tracing, None)  # the session's last test


def test_a_plain_run_ends_a_unit_only_when_no_later_test_belongs_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    mesh_a, other, tracing, other_again = ordered(MESH_A, OTHER, TRACING, OTHER + "_again")
    assert not unit_ended(mesh_a, other)  # test_tracing.py, later in the session, still needs the mesh
    assert unit_ended(tracing, other_again)
