"""Protobuf <-> engine types that both compute roles use (each server converts its own messages with these)."""

from __future__ import annotations

from collections.abc import Iterable

from engine_core import EngineStats, SamplingParams
from engine_core.request import EmbeddingSpan, TokenLogprobs
from engine_core.structured_output import StructuredOutput
from engine_core.vision import embeddings_from_bytes, embeddings_to_bytes
from mesh.kv_blocks import layout_from_proto as layout_from_proto  # re-exported: the block format's (mesh.kv_blocks)
from mesh.kv_blocks import layout_to_proto as layout_to_proto
from mesh.pb import common_pb2, encoder_pb2

# SamplingParams fields whose proto3 zero means "off" (the engine's value for off), not zero
PROTO_ZERO_MEANS = {"top_p": 1.0, "repetition_penalty": 1.0}
FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """By field name: a field of both common.proto and the engine's SamplingParams travels with no code here.
    Raises SamplingParamsError (a ValueError naming the parameter) for values the engine refuses.

    proto3 zero defaults: top_p and repetition_penalty 0 mean 1 (off); an unset optional field is None (unset
    max_tokens: no limit).
    """
    values: dict[str, object] = {}
    for field in p.DESCRIPTOR.fields:
        value = getattr(p, field.name)
        if field.is_repeated:
            value = list(value)
        elif field.has_presence and not p.HasField(field.name):
            value = None
        elif field.name == "structured_output":
            value = structured_from_proto(value)
        values[field.name] = value
    for name, off in PROTO_ZERO_MEANS.items():
        values[name] = values[name] or off
    return SamplingParams(**values)  # type: ignore[arg-type]


def structured_from_proto(p: common_pb2.StructuredOutput) -> StructuredOutput | None:
    """Raises GrammarError (a ValueError) for an unknown kind or an oversized grammar."""
    kind = p.WhichOneof("kind")
    if kind is None:
        return None
    return StructuredOutput(kind, "" if kind == "json_object" else getattr(p, kind))


def structured_to_proto(structured: StructuredOutput) -> common_pb2.StructuredOutput:
    if structured.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    return common_pb2.StructuredOutput(**{structured.kind: structured.spec})  # type: ignore[arg-type]


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The inverse of sampling_from_proto, by field name (the token mask, a local callable, does not travel)."""
    values: dict[str, object] = {}
    for field in common_pb2.SamplingParams.DESCRIPTOR.fields:
        value = getattr(params, field.name)
        if value is not None:
            values[field.name] = structured_to_proto(value) if field.name == "structured_output" else value
    return common_pb2.SamplingParams(**values)  # type: ignore[arg-type]


def logprob_to_proto(logprob: TokenLogprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=logprob.token_id,
        logprob=logprob.logprob,
        rank=logprob.rank,
        top_token_ids=[t for t, _ in logprob.top],
        top_logprobs=[lp for _, lp in logprob.top],
    )


def finish_reason_to_proto(reason: str | None) -> common_pb2.FinishReason:
    return FINISH_REASONS[reason]


def worker_load(stats: Iterable[EngineStats], num_cached_blocks: int = 0) -> common_pb2.WorkerLoad:
    """One worker's load over all its engines; kv_usage is the share of all their blocks held by requests."""
    stats = list(stats)
    num_blocks = sum(s.num_kv_blocks for s in stats)
    num_free = sum(s.num_free_kv_blocks for s in stats)
    return common_pb2.WorkerLoad(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        num_free_kv_blocks=num_free,
        kv_usage=1.0 - num_free / num_blocks if num_blocks else 0.0,
        num_kv_tokens=sum(s.num_kv_tokens for s in stats),
        num_queued_prompt_tokens=sum(s.num_queued_prompt_tokens for s in stats),
        num_cached_blocks=num_cached_blocks,
    )


def image_from_proto(p: encoder_pb2.PromptImage) -> EmbeddingSpan:
    """A prompt image's embeddings at its placeholder positions; ValueError (INVALID_ARGUMENT) for one whose sizes
    do not add up (the engine checks it against the prompt and the model)."""
    if p.offset < 0 or not p.image_hash:
        raise ValueError(f"an image needs an image_hash and an offset of at least 0 (got {p.offset})")
    return EmbeddingSpan(
        p.offset, embeddings_from_bytes(p.embeddings, p.dtype, p.num_tokens, p.hidden_size), p.image_hash
    )


def image_to_proto(span: EmbeddingSpan) -> encoder_pb2.PromptImage:
    data, dtype = embeddings_to_bytes(span.embeddings)
    return encoder_pb2.PromptImage(
        image_hash=span.key,
        offset=span.offset,
        num_tokens=span.num_tokens,
        hidden_size=int(span.embeddings.shape[1]),
        dtype=dtype,
        embeddings=data,
    )
