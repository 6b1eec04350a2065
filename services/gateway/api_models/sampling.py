"""The sampling fields, declared once with their bounds, and their one mapping to the wire's SamplingParams: by
field name, through the engine's own SamplingParams (so its cross-field rules hold at the gateway, before
routing). A field named as in common.proto and engine_core.sampling_params travels with no code here.

Each API takes the fields its clients send: Anthropic's (CoreSampling), the Responses API's (+ seed), and
Chat Completions and Completions all of them, vLLM's extensions included (what clients pass in `extra_body`).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from pydantic import Field

from engine_core.sampling_params import SamplingParams, SamplingParamsError
from mesh.compute.convert import sampling_to_proto
from mesh.pb import common_pb2
from services.gateway.api_models.base import INT32_MAX, INT64_MAX, Bool, Int, Number, RequestModel
from services.gateway.errors import invalid

MaxTokens = Annotated[Int, Field(ge=1, le=INT32_MAX, description="unset: until the context is full")]


class CoreSampling(RequestModel):
    temperature: Annotated[Number, Field(ge=0, le=100, description="0: greedy")] = 1.0
    top_p: Annotated[Number, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[Int, Field(ge=-1, le=INT32_MAX, description="0 or -1: every token")] = 0


class SeededSampling(CoreSampling):
    seed: Annotated[Int, Field(ge=-(2**63), le=INT64_MAX, description="the same seed, the same tokens")] | None = None


class SamplingFields(SeededSampling):
    min_p: Annotated[Number, Field(ge=0, le=1)] = 0.0
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[Number, Field(gt=0, le=10)] = 1.0
    min_tokens: Annotated[
        Int, Field(ge=0, le=INT32_MAX, description="EOS and stop tokens wait this long; at most max_tokens")
    ] = 0
    ignore_eos: Bool = False


SAMPLING_FIELDS = frozenset(SamplingFields.model_fields)
ENGINE_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams))


def to_wire(request: CoreSampling, max_tokens: int | None, max_tokens_param: str) -> common_pb2.SamplingParams:
    """The request's sampling fields (those its API takes) as the wire's SamplingParams, checked by the engine's
    rules; `max_tokens_param` is the client's name for max_tokens, for errors."""
    values: dict[str, object] = {
        name: getattr(request, name)
        for name in type(request).model_fields
        if name in SAMPLING_FIELDS and name in ENGINE_FIELDS
    }
    try:
        params = SamplingParams(**values, max_tokens=max_tokens)  # type: ignore[arg-type]
    except SamplingParamsError as exc:
        name = max_tokens_param if exc.param == "max_tokens" else exc.param
        raise invalid(name, str(exc).replace(exc.param, name, 1)) from None
    return sampling_to_proto(params)
