"""schemathesis (v4, every check) against the gateway's /openapi.json: the document and the server agree. Valid
bodies by the document are accepted (or refused only for what a schema cannot say: an unknown model is a 404),
invalid ones are refused, every status and header is documented, no 5xx. A bounded, seeded run: 25 examples per
operation. The workers are test doubles (tests/services/gateway_harness.py): this is about the REST surface."""

from __future__ import annotations

import os
import subprocess
import sys

from .test_gateway_openapi_fuzz import KEY, Gateway
from .test_gateway_openapi_fuzz import gateway as gateway  # the fixture: this module's own gateway

MAX_EXAMPLES = 15
SEED = 13


def test_schemathesis_finds_the_document_and_the_server_in_agreement(gateway: Gateway) -> None:
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"http://127.0.0.1:{gateway.port}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        str(SEED),
        "--generation-deterministic",
        "--workers",
        "1",
        "--header",
        f"Authorization: Bearer {KEY}",
        "--request-timeout",
        "20",
        # the fake balancer (tests/services/gateway_harness.py) does not serve ListWorkers: a 503 here
        "--exclude-path",
        "/v1/mesh/workers",
    ]
    hooks = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.services.schemathesis_hooks"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, env=hooks)
    assert result.returncode == 0, result.stdout[-12000:] + result.stderr[-3000:]
