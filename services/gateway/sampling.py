"""Request fields -> the wire's SamplingParams, checked by the engine's own rules (so a bad value fails at
the gateway, before routing, with the parameter named)."""

from __future__ import annotations

from collections.abc import Mapping

from engine_core.sampling_params import SamplingParams, SamplingParamsError
from engine_core.structured_output import StructuredOutput
from mesh.pb import common_pb2
from services.gateway.errors import invalid

# The wire's integer widths (common.proto): a value past them cannot travel, whatever the engine would accept.
WIRE_LIMITS = {"max_tokens": 2**31 - 1, "min_tokens": 2**31 - 1, "top_k": 2**31 - 1, "seed": 2**63 - 1}


def _validated(params: dict[str, object], param_names: Mapping[str, str]) -> None:
    try:
        SamplingParams(**params)  # type: ignore[arg-type]
    except SamplingParamsError as exc:
        name = param_names.get(exc.param, exc.param)
        raise invalid(name, str(exc).replace(exc.param, name, 1)) from None
    for field, limit in WIRE_LIMITS.items():
        value = params.get(field)
        if isinstance(value, int) and not -limit - 1 <= value <= limit:
            name = param_names.get(field, field)
            raise invalid(name, f"'{name}' must be at most {limit}, got {value}")


def openai_to_wire(
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_tokens: int | None = None,
    seed: int | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    param_names: Mapping[str, str] = {},
) -> common_pb2.SamplingParams:
    """OpenAI's sampling fields (and vLLM's extensions: top_k, min_p, repetition_penalty, min_tokens,
    ignore_eos) as the mesh's SamplingParams. Unset max_tokens: until the context is full.
    `param_names` renames engine parameters in errors (max_tokens -> max_completion_tokens)."""
    fields: dict[str, object] = dict(
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
    )
    _validated(fields, param_names)
    # temperature and top_p always go on the wire: an unset proto float reads as 0 (greedy), not OpenAI's 1
    return common_pb2.SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        top_k=max(top_k, 0),
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
    )


def check_wire(sampling: common_pb2.SamplingParams) -> None:
    """A gRPC caller's SamplingParams, read as the engine reads them (0 top_p and repetition_penalty are 1)."""
    _validated(
        dict(
            temperature=sampling.temperature,
            top_p=sampling.top_p or 1.0,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            seed=sampling.seed if sampling.HasField("seed") else None,
            max_tokens=sampling.max_tokens if sampling.HasField("max_tokens") else None,
            min_tokens=sampling.min_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty or 1.0,
        ),
        {},
    )


def structured_to_wire(structured: StructuredOutput) -> common_pb2.StructuredOutput:
    if structured.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    return common_pb2.StructuredOutput(**{structured.kind: structured.spec})  # type: ignore[arg-type]
