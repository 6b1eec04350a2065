"""The compute roles' exceptions and their status codes. Each server maps errors through `status_on_error`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NoReturn

import grpc
import grpc.aio

from engine_core.async_engine import EngineFailure
from mesh import rpc
from mesh.compute.faults import InjectedFault
from mesh.rpc import UnknownModelError


class UnknownRequestError(LookupError):
    """A request id this worker does not hold (never pushed here, finished, aborted, or timed out)."""


class NoFreeBlocksError(RuntimeError):
    """Too few free KV blocks for the request right now: the caller should try another worker."""


@contextlib.contextmanager
def status_on_error() -> Iterator[None]:
    """mesh.rpc.status_on_error plus the compute roles' own exceptions."""
    try:
        with rpc.status_on_error():
            yield
    except (UnknownModelError, UnknownRequestError) as exc:
        raise rpc.ServiceError(grpc.StatusCode.NOT_FOUND, str(exc)) from exc
    except NoFreeBlocksError as exc:
        raise rpc.ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
    except InjectedFault as exc:
        raise rpc.ServiceError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
    except EngineFailure as exc:
        raise rpc.ServiceError(grpc.StatusCode.INTERNAL, str(exc)) from exc


async def abort(context: grpc.aio.ServicerContext, error: rpc.ServiceError) -> NoReturn:
    """End the call with the error's status (and trailing metadata)."""
    await rpc.abort_with(context, error)
    raise AssertionError("unreachable: context.abort raises") from error
