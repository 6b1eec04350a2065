"""The encoder pool's policy: which encoder worker embeds an image.

An image goes where its embedding already is (the caller names those workers, e.g. from an index of cached
image hashes), else to its rendezvous-hash home among the live workers (highest hash of image and worker id), so
repeats of an image meet their cached embedding with no index at all and a worker leaving moves only its own
images. Affinity is bounded: a worker with more than `max_extra_images` outstanding images beyond the least
loaded one is passed over for the least loaded (fewest outstanding, then id), so a hot image never piles up.

    worker_id = pick_encoder(workers, image_hash)                       # stateless
    balancer = EncoderBalancer(); worker_id = balancer.pick(workers, image_hash)   # + images sent since reports

A worker's outstanding images are its report's `num_running + num_waiting` (WorkerLoad of an encoder).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence

from mesh.routing.state import WorkerState


def rendezvous_rank(image_hash: bytes, worker_id: str) -> bytes:
    return hashlib.blake2b(image_hash + b"\0" + worker_id.encode(), digest_size=8).digest()


def pick_encoder(
    workers: Sequence[WorkerState],
    image_hash: bytes,
    cached_worker_ids: Collection[str] = (),
    max_extra_images: int = 2,
    num_outstanding: Callable[[WorkerState], int] | None = None,
) -> str:
    """The encoder worker for one image (ValueError when `workers` is empty)."""
    if not workers:
        raise ValueError("no encoder worker to pick from")
    load = num_outstanding or (lambda w: w.num_running + w.num_waiting)
    least = min(load(w) for w in workers)
    allowed = [w for w in workers if load(w) <= least + max_extra_images]
    cached = [w for w in allowed if w.worker_id in cached_worker_ids]
    if cached:
        return min(cached, key=lambda w: (load(w), w.worker_id)).worker_id
    home = max(workers, key=lambda w: rendezvous_rank(image_hash, w.worker_id))
    if home in allowed:
        return home.worker_id
    return min(workers, key=lambda w: (load(w), w.worker_id)).worker_id


class EncoderBalancer:
    """pick_encoder plus the images this balancer sent each worker since its last report (so a burst between two
    heartbeats spreads). Only `pick` and `forget` write it."""

    def __init__(self, max_extra_images: int = 2) -> None:
        self.max_extra_images = max_extra_images
        self._sent: dict[str, tuple[float, int]] = {}  # worker -> (report it counts from, images sent since)

    def num_outstanding(self, worker: WorkerState) -> int:
        reported_s, num_sent = self._sent.get(worker.worker_id, (worker.reported_s, 0))
        return worker.num_running + worker.num_waiting + (num_sent if reported_s == worker.reported_s else 0)

    def pick(self, workers: Sequence[WorkerState], image_hash: bytes, cached_worker_ids: Collection[str] = ()) -> str:
        worker_id = pick_encoder(workers, image_hash, cached_worker_ids, self.max_extra_images, self.num_outstanding)
        worker = next(w for w in workers if w.worker_id == worker_id)
        reported_s, num_sent = self._sent.get(worker_id, (worker.reported_s, 0))
        self._sent[worker_id] = (worker.reported_s, (num_sent if reported_s == worker.reported_s else 0) + 1)
        return worker_id

    def forget(self, worker_id: str) -> None:
        self._sent.pop(worker_id, None)
