"""DeepSeek-V4 as a causal LM for the engine: embed -> N residual streams -> layers -> collapse -> norm -> head.

A running sequence's cache (window + compressors) is a `SequenceState` that the runner loads from the request's
slot of the state pools and its blocks (`load_sequence_state`, `pools`), hands in through `ForwardBatch.sequences`
and stores back after the step (`store_sequence_state`). The paged cache, per-layer-type pools indexed by block id
(`new_kv_cache`, `paged_pools`), holds per block what resumes a sequence exactly at the block's end
(`block_layout`): the forward writes it as tokens are computed, and `sequence_state_from_blocks` rebuilds a state
from a prefix-cache hit. Blocks hold a multiple of every compress ratio (`kv_block_size`); a block costs
`kv_block_bytes`.

Parameter names are those of DeepSeek's checkpoints, which is how transformers writes V4 directories too
(`layers.3.attn.wq_a.weight`, `layers.3.ffn.experts.5.w1.weight`...); `_target` maps the few that differ.
Multi-token-prediction layers (`mtp.*`) are skipped: serving does not use them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from devices.base import DeviceOps
from engine_core.config import ModelConfig, V4Config
from engine_core.models.batch import ForwardBatch
from engine_core.models.deepseek_v4.attention import V4Attention
from engine_core.models.deepseek_v4.block_layout import (
    BlockLayout,
    LayerBlocks,
    block_size_for,
    read_entries,
    write_entries,
)
from engine_core.models.deepseek_v4.blocks import HyperConnection, HyperHead, V4MoE, mix_streams
from engine_core.models.deepseek_v4.functional import Fp32RMSNorm
from engine_core.models.deepseek_v4.paged_pools import PagedPools, block_bytes
from engine_core.models.deepseek_v4.pools import StatePools, bytes_per_slot
from engine_core.models.deepseek_v4.state import LayerState, SequenceState
from engine_core.models.loading import Target, load_weights
from engine_core.models.rope import RotaryEmbedding


class V4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, v4: V4Config, layer: int) -> None:
        super().__init__()
        self.attn = V4Attention(config, v4, layer)
        self.mlp = V4MoE(config, v4, layer)  # the checkpoint's `ffn`
        self.attn_norm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_attn = HyperConnection(config, v4)
        self.hc_ffn = HyperConnection(config, v4)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        sequences: list[tuple[int, int, LayerState]],
        blocks: LayerBlocks | None,
    ) -> torch.Tensor:
        """streams (T, N, Hd) -> (T, N, Hd)."""
        post, comb, collapsed = self.hc_attn(streams)
        out = self.attn(self.attn_norm(collapsed), positions, rope, cos_sin, sequences, blocks)
        streams = mix_streams(streams, out, post, comb)
        post, comb, collapsed = self.hc_ffn(streams)
        return mix_streams(streams, self.mlp(self.ffn_norm(collapsed), input_ids), post, comb)


class V4Model(nn.Module):
    def __init__(self, config: ModelConfig, v4: V4Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(config, v4, i) for i in range(config.num_layers))
        self.hc_head = HyperHead(config, v4)
        self.norm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    kv_block_axis = 0  # blocks sit on axis 0 of each layer's rows of the paged pools
    keeps_sequence_state = True  # the runner creates a SequenceState per request, or rebuilds it from blocks

    def __init__(self, config: ModelConfig, ops: DeviceOps) -> None:
        super().__init__()
        v4 = config.v4
        assert v4 is not None
        self.config, self.v4 = config, v4
        self.model = V4Model(config, v4)
        self._layouts: dict[int, list[BlockLayout]] = {}  # block size -> per layer, filled by block_layouts
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        max_pos = config.max_position_embeddings
        self.main_rope = RotaryEmbedding(v4.rope_head_dim, v4.rope_theta, None, max_pos, interleaved=True)
        self.compress_rope = RotaryEmbedding(
            v4.rope_head_dim, v4.compress_rope_theta, v4.compress_rope_scaling, max_pos, interleaved=True
        )

    def kv_block_size(self, requested: int) -> int:
        """Tokens per block: `requested` rounded up to a multiple of every compress ratio in use."""
        return block_size_for(self.v4, requested)

    def kv_block_bytes(self, block_size: int) -> dict[str, int]:
        """Each paged pool's bytes per block of `block_size` tokens (paged_pools.block_bytes): their sum is what
        the engine counts per block against kv_cache_memory_bytes."""
        return block_bytes(self.block_layouts(block_size), self.model.embed.weight.element_size())

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedPools:
        """The paged cache: `num_blocks` blocks of every per-layer-type pool (paged_pools), zeroed."""
        weight = self.model.embed.weight
        return PagedPools(self.block_layouts(block_size), num_blocks, weight.dtype, weight.device)

    def block_layouts(self, block_size: int) -> list[BlockLayout]:
        """Each layer's sections of a block (block_layout), for blocks of `block_size` tokens; ValueError unless
        that is a multiple of every compress ratio in use."""
        if block_size != block_size_for(self.v4, block_size):
            raise ValueError(f"block_size {block_size} is not a multiple of every compress ratio in use")
        if block_size not in self._layouts:
            layers = range(self.config.num_layers)
            self._layouts[block_size] = [BlockLayout.of_layer(self.v4, layer, block_size) for layer in layers]
        return self._layouts[block_size]

    def state_slot_bytes(self) -> int:
        """Bytes of one sequence's slot in the state pools (pools.bytes_per_slot): what the engine counts per
        running request against the memory budget beside the paged cache."""
        return sum(bytes_per_slot(self.v4, self.model.embed.weight.element_size()).values())

    def new_state_pools(self, num_slots: int) -> StatePools:
        weight = self.model.embed.weight
        return StatePools(self.v4, num_slots, weight.dtype, weight.device)

    def load_sequence_state(
        self,
        pools: StatePools,
        slot: int,
        kv_caches: PagedPools,
        block_ids: Sequence[int],
        block_size: int,
        num_tokens: int,
    ) -> SequenceState:
        """The state of the sequence in `slot` after `num_tokens` tokens: its window, tails and overlaps as views of
        the slot, its entries read from its blocks `block_ids` (pools)."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches.device)
        layouts = self.block_layouts(block_size)
        layers = [
            pools.load(slot, i, num_tokens, read_entries(kv_caches.layer(i), layouts[i], index, num_tokens))
            for i in range(self.config.num_layers)
        ]
        return SequenceState(layers, num_tokens)

    def store_sequence_state(self, pools: StatePools, slot: int, state: SequenceState) -> None:
        """Write a state's fixed part back into `slot` (its entries are in the blocks already)."""
        for i, layer in enumerate(state.layers):
            pools.store(slot, i, layer)

    def store_imported_layer(
        self,
        pools: StatePools,
        slot: int,
        layer: int,
        state: LayerState,
        kv_caches: PagedPools,
        block_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """A layer's state that arrived whole (a KV import): its fixed part into `slot`, its entries into the
        sequence's blocks, where the forward reads them."""
        pools.store(slot, layer, state)
        layout = self.block_layouts(block_size)[layer]
        index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches.device)
        for prefix, compressor in (("", state.compressor), ("index_", state.indexer)):
            if compressor is not None:
                write_entries(kv_caches.layer(layer), layout, index, prefix + "entries", compressor.entries)

    def sequence_state_from_blocks(self, kv_caches: PagedPools, block_ids: list[int], block_size: int) -> SequenceState:
        """The state of a sequence after the tokens of its first blocks `block_ids`, from the paged pools: a
        prefix-cache hit resumes exactly where a cold run would be."""
        index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches.device)
        layouts = self.block_layouts(block_size)
        layers = [
            layer.attn.state_from_blocks(kv_caches.layer(i), layouts[i], index)  # type: ignore[union-attr, operator]
            for i, layer in enumerate(self.model.layers)
        ]
        return SequenceState(layers, num_tokens=len(block_ids) * block_size)

    def new_sequence_state(self) -> SequenceState:
        dtype, device = self.model.embed.weight.dtype, self.model.embed.weight.device
        return SequenceState([layer.attn.empty_state(dtype, device) for layer in self.model.layers])  # type: ignore[union-attr, operator]

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches: PagedPools) -> torch.Tensor:
        """input_ids (T,) -> final hidden states (T, Hd). Every row belongs to one of `batch.sequences`."""
        states = self._advance(batch)
        streams = self.model.embed(input_ids)[:, None, :].expand(-1, self.v4.hc_mult, -1).contiguous()  # (T, N, Hd)
        ropes = {
            "main": (self.main_rope, self.main_rope.cos_sin(batch.positions)),
            "compress": (self.compress_rope, self.compress_rope.cos_sin(batch.positions)),
        }
        layouts = self.block_layouts(batch.block_size) if batch.block_size else None
        for index, layer in enumerate(self.model.layers):
            rope, cos_sin = ropes["main" if self.v4.attention_types[index] == "window" else "compress"]
            sequences = [(start, end, state.layers[index]) for start, end, state in states]
            blocks = LayerBlocks(kv_caches.layer(index), layouts[index], batch.slot_mapping) if layouts else None
            streams = layer(streams, input_ids, batch.positions, rope, cos_sin, sequences, blocks)
        return self.model.norm(self.model.hc_head(streams))

    def _advance(self, batch: ForwardBatch) -> list[tuple[int, int, SequenceState]]:
        """Each sequence's rows and state, checking the state is where the step starts, then moving it on."""
        out = []
        for seq in batch.sequences:
            state: SequenceState = seq.state
            first = int(batch.positions[seq.start])
            if first != state.num_tokens:
                raise RuntimeError(f"sequence state holds {state.num_tokens} tokens, the step starts at {first}")
            state.num_tokens += seq.end - seq.start
            out.append((seq.start, seq.end, state))
        if sum(end - start for start, end, _ in out) != batch.positions.shape[0]:
            raise RuntimeError("deepseek_v4 needs every row in batch.sequences (a runner without sequence state?)")
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, weights, self._target)

    def _target(self, name: str) -> Target:
        name = name.removeprefix("model.")
        layer = re.match(r"layers\.(\d+)\.", name)
        if name.startswith("mtp.") or (layer and int(layer.group(1)) >= self.config.num_layers):
            return None  # multi-token-prediction layers, which serving does not use
        if name in ("head.weight", "lm_head.weight"):
            return "head.weight", None
        renamed = {"embed_tokens.weight": "embed.weight"}.get(name, name)
        renamed = "model." + re.sub(r"^hc_head[._](?:hc_)?(fn|base|scale)$", r"hc_head.\1", renamed)
        renamed = renamed.replace(".ffn.", ".mlp.")
        renamed = re.sub(r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2", renamed)
        width = self.v4.moe_intermediate_size
        expert = re.fullmatch(r"(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.w([123])\.weight", renamed)
        if expert:
            prefix, index, part = expert.group(1), int(expert.group(2)), expert.group(3)
            if part == "2":
                return f"{prefix}.w_down", index
            return f"{prefix}.w_gate_up", (index, slice(0, width) if part == "1" else slice(width, 2 * width))
        shared = re.fullmatch(r"(model\.layers\.\d+\.mlp\.shared_experts)\.w([13])\.weight", renamed)
        if shared:
            return f"{shared.group(1)}.w13.weight", slice(0, width) if shared.group(2) == "1" else slice(width, None)
        return renamed, None
