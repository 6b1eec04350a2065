"""structlog for every service: JSON lines when not on a terminal, the request id bound per request and
carried across gRPC metadata (`x-request-id`) and NATS headers, and inside a traced request the trace_id and
span_id of the span the line was logged in (mesh.tracing). Logs go to stderr, always: stdout belongs to the
commands that print results (`kvmesh bench ... --json`), also when they start services in-process."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import structlog

from mesh.tracing import add_trace_ids

REQUEST_ID_KEY = "x-request-id"


class _CurrentStderr:
    """sys.stderr as it is at each write. A logger made (and cached) while something else stood in for stderr
    (pytest's capture, a test's StringIO) would otherwise write to that stand-in after it was closed."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


STDERR = _CurrentStderr()

if not structlog.is_configured():
    # before a service configures logging (or where none does), structlog's default prints to stdout
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(STDERR))  # type: ignore[arg-type]


def configure_logging(level: str = "info", fmt: str = "auto", **context: Any) -> None:
    """Set up structlog (and route the standard library's logging through the same output)."""
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(STDERR),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**context)
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)


def current_request_id() -> str | None:
    return structlog.contextvars.get_contextvars().get("request_id")


@contextlib.contextmanager
def bind_request_id(request_id: str | None) -> Iterator[None]:
    """Every log line inside carries the request id."""
    if not request_id:
        yield
        return
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        yield
