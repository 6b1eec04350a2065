"""The step API the services drive: add requests, step, abort, export and import KV.

    engine = LLMEngine(EngineConfig(model="smollm2-135m"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

One step = schedule, run the model, sample, update (the scheduler owns request state; the model runner
owns the KV cache tensor; the KV cache manager owns block ownership).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from devices import CpuOps, DeviceOps, get_device
from engine_core import model_store
from engine_core.config import ConfigError, EngineConfig, ModelConfig
from engine_core.expert_parallel import ExpertLayout, ExpertLoadReport, ExpertParallel, PreparedPlacement
from engine_core.kv_cache.block_hash import KeySpan, hash_token_blocks, root_hash
from engine_core.kv_cache.events import KVCacheEvent
from engine_core.kv_cache.manager import KVCacheManager, cdiv
from engine_core.kv_load import KVLoadFailed, LayerLoads
from engine_core.kv_transfer import (
    KVExport,
    KVLayout,
    KVLayoutError,
    bytes_to_tensor,
    dtype_name,
    tensor_to_bytes,
)
from engine_core.loader.checkpoint import open_checkpoint
from engine_core.model_runner import ModelRunner
from engine_core.models import build_model
from engine_core.models.deepseek_v4.state import SequenceState
from engine_core.models.deepseek_v4.transfer import block_sections, layer_from_bytes, layer_to_bytes, state_sections
from engine_core.packed_linear import can_pack, min_packed_rows, pack_linear_layers
from engine_core.prefill_budget import PrefillBudget, PrefillShape
from engine_core.quantization import calibration_ids, check_quantization, int8_kernel, quantize_model
from engine_core.request import EmbeddingSpan, Request, RequestStatus
from engine_core.sampler import Sampler
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler import RequestOutput, Scheduler, SchedulerConfig, SchedulerOutput
from engine_core.structured_output import GrammarCompiler

log = logging.getLogger(__name__)


def uses_cpu_decode_kernel(ops: DeviceOps, dtype: torch.dtype) -> bool:
    """Turn on the C++ decode attention where it applies: the cpu family itself at float32 (the cuda and ascend
    modules inherit CpuOps, and their tensors are not the kernel's); True when it was built."""
    return ops.name == "cpu" and dtype == torch.float32 and isinstance(ops, CpuOps) and ops.use_decode_kernel()


class PromptError(ValueError):
    """A prompt the engine cannot take (empty, out of vocabulary, longer than the context)."""


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_usage: float  # share of blocks held by requests
    num_prompt_tokens_computed: int  # prompt tokens this engine computed (not imported, not cache hits)
    num_prefix_hit_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    num_evictions: int
    num_kv_tokens: int  # tokens of KV held by running requests
    num_queued_prompt_tokens: int  # prompt tokens admitted but not yet computed (waiting and running)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ops = get_device(config.device)
        checkpoint = open_checkpoint(model_store.resolve(config.model))
        self.model_config: ModelConfig = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.served_name = config.served_name or config.model
        self.dtype = config.torch_dtype(self.ops.name)
        check_quantization(config.quantization, self.model_config.model_type, self.ops.name, self.dtype)
        model = build_model(self.model_config, self.ops, self.dtype)
        model.load_weights(checkpoint.tensors())  # type: ignore[operator]
        quantize_model(
            model,
            config.quantization,
            calibration_ids(self.tokenizer, self.model_config.vocab_size),
            self.model_config.num_layers,
        )
        if config.cpu_decode_kernel and uses_cpu_decode_kernel(self.ops, self.dtype):
            if getattr(self.ops, "chunk_kernel", None) is not None:
                log.info("decode and chunk attention: the C++ kernels over the paged cache (devices.cpu_kernels)")
            else:  # chunk_kernel_pays: not on AVX2
                log.info("decode attention: the C++ kernel over the paged cache; chunk attention: the gather path")
        if config.cpu_packed_linear and can_pack(self.ops.name, self.dtype, config.quantization):
            pack_linear_layers(model)
            log.info("linear layers: oneDNN's reordered weights from %d row(s) a call", min_packed_rows())
        self.config = config = self._model_block_size(config, model)
        self.max_num_seqs, slot_bytes = self._state_slots(model)
        num_slots = self.max_num_seqs if slot_bytes else 0
        num_blocks = self._num_blocks(model, num_slots * slot_bytes)
        self.runner = ModelRunner(
            model, self.ops, self.dtype, self.model_config.num_layers, num_blocks, config.block_size, num_slots
        )
        self.experts = ExpertParallel.attach(model, self.model_config, config)  # None without MoE layers
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, config.device_cache_policy, num_slots
        )
        self.scheduler = Scheduler(
            SchedulerConfig(self.max_num_seqs, config.max_num_batched_tokens, config.long_prefill_token_threshold),
            self.kv,
            PrefillBudget(config.long_prefill_step_ratio, PrefillShape.of(self.model_config))
            if config.long_prefill_step_ratio
            else None,
        )
        self.loads = LayerLoads(self.kv.pool, self.kv_layout, self.runner.write_stored_layer)
        self.sampler = Sampler(config.seed)
        model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings, self.model_config.max_position_embeddings
        )
        self.max_model_len = min(model_len, num_blocks * config.block_size)  # a request alone must always fit
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self._arrivals = itertools.count()
        self.num_generated_tokens = 0
        log.info(
            "engine ready: %s on %s (quantization %s), %d KV blocks (%d MiB), %d state slots (%d MiB), context %d",
            self.served_name,
            self.ops.name,
            f"int8, {int8_kernel()}'s kernel" if config.quantization == "int8" else config.quantization,
            num_blocks,
            self.runner.kv_cache_bytes >> 20,
            num_slots,
            self.runner.state_pool_bytes >> 20,
            self.max_model_len,
        )

    @staticmethod
    def _model_block_size(config: EngineConfig, model: torch.nn.Module) -> EngineConfig:
        """The config with the block size the model needs (DeepSeek-V4: a multiple of its compress ratios)."""
        model_block_size = getattr(model, "kv_block_size", None)
        block_size = config.block_size if model_block_size is None else model_block_size(config.block_size)
        if block_size == config.block_size:
            return config
        log.info("block_size %d -> %d: the model's blocks hold whole compressed windows", config.block_size, block_size)
        return dataclasses.replace(config, block_size=block_size)

    def _state_slots(self, model: torch.nn.Module) -> tuple[int, int]:
        """(requests that may run at once, bytes of each one's state slot) for models that keep a fixed-size state
        per sequence in pools beside the paged cache (DeepSeek-V4: models.deepseek_v4.pools): one slot per
        request, and at most half of kv_cache_memory_bytes goes to the slots, so max_num_seqs may shrink;
        (max_num_seqs, 0) for the others."""
        slot_bytes = getattr(model, "state_slot_bytes", None)
        if slot_bytes is None:
            return self.config.max_num_seqs, 0
        size = slot_bytes()
        if self.config.num_kv_blocks is not None:  # no byte budget
            return self.config.max_num_seqs, size
        max_num_seqs = min(self.config.max_num_seqs, self.config.kv_cache_memory_bytes // 2 // size)
        if max_num_seqs < 1:
            raise ConfigError(
                f"kv_cache_memory_bytes {self.config.kv_cache_memory_bytes} holds no request: its state slot "
                f"needs {size} bytes, and at most half the budget goes to state slots"
            )
        return max_num_seqs, size

    def _num_blocks(self, model: torch.nn.Module, pool_bytes: int) -> int:
        """Blocks that fit kv_cache_memory_bytes beside the state pools (`pool_bytes`, `_state_slots`). A block
        costs every layer's row of the one cache tensor, or for a model whose paged cache is per-layer-type pools
        (DeepSeek-V4: `kv_block_bytes`) the sum over its pools of their bytes per block."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        block_bytes = getattr(model, "kv_block_bytes", None)
        if block_bytes is not None:
            bytes_per_block = sum(block_bytes(self.config.block_size).values())
        else:
            shape = model.kv_cache_shape(1, self.config.block_size)  # type: ignore[operator]
            bytes_per_block = self.model_config.num_layers * self.dtype.itemsize * int(torch.tensor(shape).prod())
        num_blocks = (self.config.kv_cache_memory_bytes - pool_bytes) // bytes_per_block
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_memory_bytes {self.config.kv_cache_memory_bytes} holds no block: "
                f"one block needs {bytes_per_block}"
            )
        return num_blocks

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    @property
    def kv_layout(self) -> KVLayout:
        """The format of this engine's blocks, as the prefix cache's reads and writes and the KV store carry them
        (mesh.kv_blocks): format 1, the cache's rows; DeepSeek-V4, format 2, each layer's sections by its kind."""
        layout = self._row_layout
        if self.model_config.v4 is None:
            return layout
        sections = block_sections(self.model_config.v4, self.config.block_size)
        return dataclasses.replace(layout, layer_shape=(), block_axis=0, block_format=2, block_sections=sections)

    @property
    def _row_layout(self) -> KVLayout:
        """Format 1's description of the cache: one layer's row for ONE block (the block axis has size 1). A model
        whose paged cache is per-layer-type pools (DeepSeek-V4) has no such row; its handoff layout (which sends
        state sections, not rows) says the widest layer's elements per block, as when its cache was one tensor of
        rows that wide, so the wire's layout is unchanged."""
        model = self.runner.model
        if self.model_config.v4 is not None:
            layouts = model.block_layouts(self.config.block_size)  # type: ignore[operator]
            row_shape: tuple[int, ...] = (max(layout.row_width for layout in layouts),)
        else:
            row_shape = tuple(model.kv_cache_shape(1, self.config.block_size))  # type: ignore[operator]
        return KVLayout(
            self.served_name,
            dtype_name(self.dtype),
            self.config.block_size,
            self.model_config.num_layers,
            row_shape,
            self.runner.block_axis,
        )

    @property
    def transfer_layout(self) -> KVLayout:
        """How a request's KV travels to another engine (export_kv, begin_kv_import): its blocks (`kv_layout`),
        or for a model with per-sequence state (DeepSeek-V4) that state, in per-layer sections (`sections`)."""
        if self.model_config.v4 is None:
            return self.kv_layout
        return dataclasses.replace(self._row_layout, sections=state_sections(self.model_config.v4))

    # -- requests -----------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError("this model has no tokenizer: pass the prompt as token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _new_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None,
        keep_kv: bool,
        embeddings: Sequence[EmbeddingSpan] = (),
    ) -> Request:
        token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise PromptError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise PromptError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise PromptError(
                f"the prompt has {len(token_ids)} tokens; this model's context is {self.max_model_len} tokens "
                "(the prompt must leave room for at least one generated token)"
            )
        if params.structured_output is not None and params.token_mask is None:
            # compiled here only on a cache miss: the services compile ahead, off this thread (prepare_grammar)
            params = dataclasses.replace(params, token_mask=self.grammars.token_mask(params.structured_output))
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_seq=next(self._arrivals),
            eos_token_ids=self.eos_token_ids,
            cache_root=root_hash(self.served_name, cache_salt),
            keep_kv=keep_kv,
            max_total_tokens=self.max_model_len,
            embedding_spans=self._checked_spans(embeddings, len(token_ids)),
        )

    def _checked_spans(self, spans: Sequence[EmbeddingSpan], num_prompt_tokens: int) -> tuple[EmbeddingSpan, ...]:
        """The spans in prompt order, in the model's dtype; PromptError unless each fits the prompt and the model."""
        checked: list[EmbeddingSpan] = []
        end = 0
        hidden = self.model_config.hidden_size
        for span in sorted(spans, key=lambda s: s.offset):
            shape = tuple(span.embeddings.shape)
            if len(shape) != 2 or shape[1] != hidden or shape[0] < 1:
                raise PromptError(f"embeddings of shape {shape} do not fit this model: expected (n, {hidden})")
            if span.offset < end or span.end > num_prompt_tokens:
                raise PromptError(
                    f"embeddings for positions [{span.offset}, {span.end}) overlap another span or "
                    f"run past the prompt's {num_prompt_tokens} tokens"
                )
            if not span.key:
                raise PromptError("embeddings need a key (their content hash): it enters the block keys")
            checked.append(EmbeddingSpan(span.offset, span.embeddings.to(self.dtype), span.key))
            end = span.end
        return tuple(checked)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        keep_kv: bool = False,
        embeddings: Sequence[EmbeddingSpan] = (),
        output_token_ids: Sequence[int] = (),
    ) -> Request:
        """Queue a request. keep_kv=True holds its blocks after it finishes, for `export_kv`, until `release`.
        `embeddings`: prompt positions whose input embeddings are given (images at their placeholder tokens).
        `output_token_ids`: output it already has (a generation resumed elsewhere): they are computed with the
        prompt, and it goes on as if it had generated them (max_tokens, penalties, seeded draws, grammars)."""
        request = self._new_request(request_id, prompt, params or SamplingParams(), cache_salt, keep_kv, embeddings)
        if output_token_ids:
            self._resume(request, output_token_ids)
        self.scheduler.add_request(request)
        return request

    def _resume(self, request: Request, output_token_ids: Sequence[int]) -> None:
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in output_token_ids):
            raise PromptError(f"output token ids must be integers in [0, {vocab})")
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and len(output_token_ids) >= max_tokens:
            raise PromptError(
                f"the request already has {len(output_token_ids)} output tokens; max_tokens is {max_tokens}"
            )
        if request.num_prompt_tokens + len(output_token_ids) >= self.max_model_len:
            raise PromptError(
                f"the prompt and output have {request.num_prompt_tokens + len(output_token_ids)} "
                f"tokens; this model's context is {self.max_model_len} tokens"
            )
        for token in output_token_ids:
            request.append_output_token(token)

    def abort_request(self, request_id: str) -> bool:
        is_aborted = self.scheduler.abort(request_id)
        if is_aborted:
            self.runner.forget_sequence_state(request_id)
        return is_aborted

    def release(self, request_id: str) -> None:
        """Free a finished request that was kept for KV export."""
        self.scheduler.release(request_id)
        self.runner.forget_sequence_state(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        output = self.scheduler.schedule()
        if not output.scheduled:
            return self.scheduler.update(output, {})
        self.loads.release_done()
        wait_for_layer = self.loads.waiter([s.block_ids for s in output.scheduled])
        started = time.perf_counter()
        try:
            logits = (
                self.runner.execute(output) if wait_for_layer is None else self.runner.execute(output, wait_for_layer)
            )
        except KVLoadFailed:
            return self._recompute_failed_loads(output)
        self.loads.release_done()  # a load this step waited for is complete: its requests hold its blocks now
        if self.experts is not None:
            self.experts.note_step()
        sampling = [s.request for s in output.scheduled if s.needs_sample]
        sampled = self.sampler(logits, sampling)
        if wait_for_layer is None:  # a step that waited for KV loads timed the network, not the model
            self.scheduler.observe_step(output, time.perf_counter() - started)
        self.num_generated_tokens += len(sampling)
        tokens = {r.request_id: t for r, t in zip(sampling, sampled.token_ids, strict=True)}
        logprobs = {r.request_id: lp for r, lp in zip(sampling, sampled.logprobs, strict=True) if lp is not None}
        return self.scheduler.update(output, tokens, logprobs)

    def _recompute_failed_loads(self, output: SchedulerOutput) -> list[RequestOutput]:
        """A layer-by-layer load failed mid-step (engine_core.kv_load): the requests that read its blocks go back
        to waiting and recompute; the step changed no other request's state, so the next step simply redoes it."""
        failed = self.loads.failed_block_ids()
        for item in output.scheduled:
            if failed.intersection(item.block_ids):
                self.scheduler.requeue(item.request)
        self.loads.release_done()
        log.warning(
            "a KV load failed mid-step; %d block(s) dropped from the prefix cache, their requests recompute",
            len(failed),
        )
        return []

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.kv.pool.take_events()

    # -- MoE experts: load counts and placements (engine_core.expert_parallel) --------------------------------
    @property
    def expert_layout(self) -> ExpertLayout | None:
        return None if self.experts is None else self.experts.layout

    def take_expert_report(self, min_steps: int = 1) -> ExpertLoadReport | None:
        """Tokens per expert (and per rank) since the last report, once at least `min_steps` steps ran; None
        before that, and for models without MoE layers."""
        if self.experts is None or self.experts.num_steps < min_steps:
            return None
        return self.experts.take_report()

    def prepare_expert_placement(self, phy2log: Sequence[Sequence[int]], version: int) -> PreparedPlacement:
        """The weights of a new placement (layers, slots). Safe on any thread: it reads only the logical expert
        weights, which nothing writes after loading. ValueError for a placement that does not fit."""
        if self.experts is None:
            raise ValueError(f"{self.served_name} has no MoE layers to place")
        return self.experts.prepare(phy2log, version)

    def apply_expert_placement(self, prepared: PreparedPlacement) -> bool:
        """Switch every MoE layer to a prepared placement (between steps). False for a version not newer than
        the current one."""
        assert self.experts is not None
        return self.experts.apply(prepared)

    def set_expert_placement(self, phy2log: Sequence[Sequence[int]], version: int) -> bool:
        return self.apply_expert_placement(self.prepare_expert_placement(phy2log, version))

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=self.kv.num_blocks,
            num_free_kv_blocks=self.kv.pool.num_free_blocks,
            kv_usage=self.kv.usage,
            num_prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            num_prefix_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_evictions=self.kv.pool.num_evictions,
            num_kv_tokens=sum(r.num_computed_tokens for r in self.scheduler.running),
            num_queued_prompt_tokens=sum(
                max(r.num_prompt_tokens - r.num_computed_tokens, 0)
                for r in (*self.scheduler.waiting, *self.scheduler.running)
            ),
        )

    # -- prefix cache blocks, for a KV store ----------------------------------------------------------
    def prompt_block_hashes(
        self, prompt_token_ids: list[int], cache_salt: str | None = None, key_spans: Sequence[KeySpan] = ()
    ) -> list[bytes]:
        """The keys of the prompt's full blocks, as this engine computes them (`key_spans`: its images')."""
        root = root_hash(self.served_name, cache_salt)
        return hash_token_blocks(root, prompt_token_ids, self.config.block_size, key_spans=key_spans)

    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        """How many of the keys, from the first, this engine's prefix cache holds."""
        count = 0
        for block_hash in block_hashes:
            if self.kv.pool.get_cached_block(block_hash) is None:
                break
            count += 1
        return count

    def read_cached_blocks(self, block_hashes: list[bytes]) -> list[bytes | None]:
        """Each cached block's KV, every layer (layer-major), or None for a key not cached."""
        out: list[bytes | None] = []
        for block_hash in block_hashes:
            block = self.kv.pool.get_cached_block(block_hash)
            out.append(None if block is None else self.runner.read_stored_block(block.block_id))
        return out

    def inject_cached_blocks(
        self, parent_hash: bytes, block_hashes: list[bytes], token_ids: list[int], blocks_data: list[bytes]
    ) -> int:
        """Enter blocks fetched from elsewhere (a KV store) into the prefix cache, as a chain after `parent_hash`.

        Returns how many were entered (fewer when blocks run short). They sit in the free queue as cached
        blocks, most recently used, so the next request with this prefix hits them.
        """
        count = min(len(block_hashes), len(blocks_data), self.kv.pool.num_free_blocks)
        blocks = self.kv.pool.allocate(count)
        layout = self.kv_layout
        for block, data in zip(blocks, blocks_data[:count], strict=True):
            self.runner.write_stored_block(block.block_id, data, layout)
        size = self.config.block_size
        # a key already cached here stays with its block; the duplicate becomes a plain free block
        self.kv.pool.cache_blocks(blocks, block_hashes[:count], parent_hash, token_ids[: count * size], size)
        self.kv.pool.free(reversed(blocks))
        return count

    # -- KV export / import -------------------------------------------------------------------------
    def export_kv(self, request_id: str) -> KVExport:
        """The KV of a request kept with keep_kv (typically finished after prefill's first token)."""
        request = self.scheduler.requests.get(request_id)
        if request is None or not request.keep_kv:
            raise KeyError(f"no request {request_id!r} kept for KV export")
        num_tokens = request.num_computed_tokens
        block_ids = self.kv.block_ids(request_id)[: cdiv(num_tokens, self.config.block_size)]
        layout = self.transfer_layout
        # the request's whole state (views of its slot, which it holds until released), one section per layer
        state: SequenceState | None = self.runner.sequence_state(request_id) if layout.sections else None  # type: ignore[assignment]

        def read(layer: int, first: int, count: int) -> bytes:
            if layout.sections is not None:
                assert state is not None
                return layer_to_bytes(state.layers[layer], layout.sections, layer, num_tokens, layout.dtype)
            return tensor_to_bytes(self.runner.read_blocks(layer, block_ids[first : first + count]))

        return KVExport(
            layout,
            request_id,
            list(request.prompt_token_ids),
            list(request.output_token_ids),
            num_tokens,
            len(block_ids),
            read,
        )

    def begin_kv_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        layout: KVLayout,
        num_tokens: int,
        *,
        cache_salt: str | None = None,
        embeddings: Sequence[EmbeddingSpan] = (),
    ) -> bool:
        """Reserve blocks for a request whose KV (for its first `num_tokens` tokens) will arrive by layer.
        `embeddings`: as for add_request (they key its blocks, and a recompute after preemption needs them).

        Returns False, changing nothing, when too few blocks are free right now.
        """
        self.transfer_layout.check_compatible(layout)
        if request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        request = self._new_request(
            request_id, prompt_token_ids, params, cache_salt, keep_kv=False, embeddings=embeddings
        )
        for token in output_token_ids:
            request.append_output_token(token)
        if not 0 < num_tokens < request.num_tokens:
            raise PromptError(f"imported KV covers {num_tokens} tokens; the request has {request.num_tokens}")
        request.status = RequestStatus.IMPORTING
        if self.kv.allocate_slots(request, num_tokens) is None:
            return False
        request.num_computed_tokens = num_tokens
        if layout.sections is not None:  # filled layer by layer by import_kv_chunk, into its slot and blocks
            block_ids = tuple(self.kv.block_ids(request_id))
            self.runner.begin_import(request, self.kv.state_slot(request_id), block_ids, num_tokens)
            self.kv.skip_caching(request, num_tokens)  # its blocks' rows stay unwritten: never a prefix hit
        self.scheduler.add_request(request)
        return True

    def import_kv_chunk(
        self, request_id: str, layer: int, data: bytes | bytearray | memoryview, first_block: int = 0
    ) -> None:
        """Write one chunk of the request's KV: blocks [first_block, ...) of `layer`, as many as `data` holds."""
        request = self._importing(request_id)
        if not 0 <= layer < self.model_config.num_layers:
            raise KVLayoutError(f"layer {layer} out of range [0, {self.model_config.num_layers})")
        layout = self.transfer_layout
        if layout.sections is not None:  # state sections: the layer's whole section, whatever first_block says
            num_tokens, device = request.num_computed_tokens, self.ops.torch_device
            state = layer_from_bytes(data, layout.sections, layer, num_tokens, layout.dtype, device)
            self.runner.import_layer(request_id, layer, state)
            return
        block_ids = self.kv.block_ids(request_id)[: cdiv(request.num_computed_tokens, self.config.block_size)]
        num_blocks = len(data) // max(self.kv_layout.chunk_bytes(1), 1)
        if first_block < 0 or num_blocks < 1 or first_block + num_blocks > len(block_ids):
            raise KVLayoutError(
                f"KV chunk of {len(data)} bytes at block {first_block} does not fit the request's "
                f"{len(block_ids)} blocks ({self.kv_layout.chunk_bytes(1)} bytes each), "
                f"expected {self.kv_layout.chunk_bytes(len(block_ids))}"
            )
        values = bytes_to_tensor(data, self.kv_layout, num_blocks)
        self.runner.write_blocks(layer, block_ids[first_block : first_block + num_blocks], values)

    def finish_kv_import(self, request_id: str) -> None:
        """All layers arrived: the request joins the running batch (its blocks may now be shared)."""
        request = self._importing(request_id)
        if self.transfer_layout.sections is None:
            self.kv.cache_computed_blocks(request)
        else:  # the state arrived, not the blocks' contents: they are never offered as a prefix
            self._check_imported_state(request)
        self.scheduler.start_running(request)

    def _check_imported_state(self, request: Request) -> None:
        """KVLayoutError unless every layer's section arrived."""
        missing = self.runner.missing_layers(request.request_id)
        if missing:
            raise KVLayoutError(f"imported state lacks layers {missing}")

    def _importing(self, request_id: str) -> Request:
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status != RequestStatus.IMPORTING:
            raise KeyError(f"no KV import in progress for {request_id!r}")
        return request
