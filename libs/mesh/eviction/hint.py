"""BlockHint: what a cache tells its eviction policy about a block as it enters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockHint:
    """The features a predicting policy (`reuse`) classes blocks by. The store fills it from the Put itself
    (`BlockStore.put`), with no state of its own; a worker's device cache gives none."""

    position: int = 0  # the block's place in the chain run of its Put (0: the run's first block)
    run_blocks: int = 1  # how many blocks that run carries: a whole document's prompt, or one turn's new part
    continues: bool = False  # the run's first block extends a chain this store holds (the prompt hit a prefix)
    traffic_class: str = ""  # the block's class ("" is the store's default)


NO_HINT = BlockHint()
