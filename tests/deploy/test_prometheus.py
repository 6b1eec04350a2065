"""deploy/: the Grafana dashboard is current with its generator, every expression in it and in the alert rules
parses and reads only metrics the mesh defines, and the rules pass `promtool check rules` (Prometheus's own
checker: `make test` fetches it from Debian's prometheus package where apt is available)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh import dashboards
from mesh.metrics import METRICS
from tests.deploy.promql import ALERTS, PROMETHEUS_OWN, expressions, family, metric_names


def test_the_dashboard_file_is_what_its_generator_writes() -> None:
    assert dashboards.main(["--check"]) == 0, "run: python -m kvmesh.dashboards"


def test_every_expression_parses_and_reads_only_metrics_the_mesh_defines() -> None:
    defined = {metric.name for metric in METRICS}
    unknown = {
        where: sorted(
            name for name in metric_names(expr) if family(name, defined) is None and name not in PROMETHEUS_OWN
        )
        for where, expr in expressions().items()
    }
    assert {where: names for where, names in unknown.items() if names} == {}
    used = {family(name, defined) for expr in expressions().values() for name in metric_names(expr)}
    assert len(used - {None}) >= 30  # the panels and rules cover most of the mesh's metrics


def test_the_checker_tells_a_broken_expression_and_an_unknown_metric() -> None:
    with pytest.raises(ValueError):
        metric_names("sum(rate(kvmesh_gateway_requests_total[5m])")
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(a_bucket{x="y"}[5m]))) > on() b') == {
        "a_bucket",
        "b",
    }
    assert family("kvmesh_prefill_seconds_bucket", {"kvmesh_prefill_seconds"}) == "kvmesh_prefill_seconds"
    assert family("kvmesh_prefill_seconds_p99", {"kvmesh_prefill_seconds"}) is None


BESIDE_PYTHON = Path(sys.executable).with_name("promtool")  # where `make test` puts it
PROMTOOL = str(BESIDE_PYTHON) if BESIDE_PYTHON.exists() else shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (make test fetches it where apt is available)")
def test_the_alert_rules_pass_promtool(tmp_path) -> None:
    checked = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout and "rules found" in checked.stdout
    broken = tmp_path / "broken.yml"
    broken.write_text(ALERTS.read_text().replace("> 0.05", "> > 0.05", 1))
    refused = subprocess.run([PROMTOOL, "check", "rules", str(broken)], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
