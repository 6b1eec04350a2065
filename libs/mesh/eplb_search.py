"""Local search for mesh.eplb: better placements near a given one, an exact group partition for small cases, and
a new placement renamed into the current one's slots. All over one domain (a node, or every GPU), one layer.

Placements here are phy2log arrays: slot s on GPU s // (len(phy2log) // num_gpus); a GPU's load is the sum over
its slots of weight / replica count.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-9


class _Search:
    """One domain's placement under improvement. Written only by `apply_*`; `moves` counts slots that differ
    from where the search started."""

    def __init__(self, weight: np.ndarray, phy2log: np.ndarray, num_gpus: int, replicas: bool) -> None:
        self.weight = np.asarray(weight, dtype=np.float64)
        self.start = phy2log.copy()
        self.phy2log = phy2log.copy()
        self.num_gpus = num_gpus
        self.per_gpu = len(phy2log) // num_gpus
        self.slot_gpu = np.arange(len(phy2log)) // self.per_gpu
        self.replicas = replicas  # whether replica counts may change
        self.counts = np.bincount(phy2log, minlength=len(weight))
        self.holds = np.zeros((num_gpus, len(weight)), dtype=np.int64)
        np.add.at(self.holds, (self.slot_gpu, phy2log), 1)

    @property
    def moves(self) -> int:
        return int((self.phy2log != self.start).sum())

    def loads(self) -> np.ndarray:
        per_slot = self.weight[self.phy2log] / self.counts[self.phy2log]
        return per_slot.reshape(self.num_gpus, self.per_gpu).sum(axis=1)

    def _move_cost(self, slots: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """Change in `moves` when slots take experts (arrays that broadcast together)."""
        before = self.phy2log[slots] != self.start[slots]
        after = experts != self.start[slots]
        return after.astype(np.int64) - before.astype(np.int64)

    def best_swap(self, loads: np.ndarray, budget: int | None) -> tuple[float, int, int] | None:
        """The swap of a slot of the heaviest GPU with a slot elsewhere that leaves the pair's heavier GPU
        lightest, if it is lighter than the heaviest was: (new pair max, slot a, slot b)."""
        h = int(np.argmax(loads))
        a = np.flatnonzero(self.slot_gpu == h)  # (A,)
        b = np.flatnonzero(self.slot_gpu != h)  # (B,)
        if not len(b):
            return None
        per_slot = self.weight[self.phy2log] / self.counts[self.phy2log]
        ra, rb = per_slot[a][:, None], per_slot[b][None, :]
        ea, eb, gb = self.phy2log[a][:, None], self.phy2log[b][None, :], self.slot_gpu[b][None, :]
        pair_max = np.maximum(loads[h] - ra + rb, loads[gb] - rb + ra)  # (A, B)
        valid = (ea != eb) & (self.holds[h, eb] == 0) & (self.holds[gb, ea] == 0) & (pair_max < loads[h] - _EPS)
        rank = pair_max
        if budget is not None:  # slot a takes eb, slot b takes ea
            cost = self._move_cost(a[:, None], eb) + self._move_cost(b[None, :], ea)
            valid &= self.moves + cost <= budget
            rank = -(loads[h] - pair_max) / np.maximum(cost, 0.5)  # the most gain per moved slot
        if not valid.any():
            return None
        flat = int(np.argmin(np.where(valid, rank, np.inf)))
        i, j = divmod(flat, len(b))
        return float(rank[i, j]), int(a[i]), int(b[j])

    def apply_swap(self, a: int, b: int) -> None:
        ea, eb = self.phy2log[a], self.phy2log[b]
        ga, gb = self.slot_gpu[a], self.slot_gpu[b]
        self.holds[ga, ea] -= 1
        self.holds[gb, eb] -= 1
        self.holds[ga, eb] += 1
        self.holds[gb, ea] += 1
        self.phy2log[a], self.phy2log[b] = eb, ea

    def best_rereplication(self, loads: np.ndarray, budget: int | None) -> tuple[float, int, int] | None:
        """A spare replica (of an expert with 2+) that becomes a replica of an expert on the heaviest GPU, if
        that lowers the heaviest GPU of all: (new max, slot, new expert)."""
        if not self.replicas:
            return None
        h = int(np.argmax(loads))
        targets = np.unique(self.phy2log[self.slot_gpu == h])  # (T,)
        targets = targets[self.counts[targets] < self.num_gpus]
        spares = np.flatnonzero(self.counts[self.phy2log] >= 2)  # (B,)
        if not len(targets) or not len(spares):
            return None
        w, c = self.weight, self.counts
        eb, gb = self.phy2log[spares], self.slot_gpu[spares]
        gpus = np.arange(self.num_gpus)[None, None, :]  # (1, 1, G)
        # every copy of target t gets lighter, every other copy of eb heavier; slot b swaps its load
        t_delta = (w[targets] / (c[targets] + 1) - w[targets] / c[targets])[:, None, None]  # (T, 1, 1)
        b_delta = (w[eb] / (c[eb] - 1) - w[eb] / c[eb])[None, :, None]  # (1, B, 1)
        holds_t = self.holds[:, targets].T[:, None, :]  # (T, 1, G)
        holds_b = self.holds[:, eb].T[None, :, :] - (gpus == gb[None, :, None])  # (1, B, G)
        at_b = gpus == gb[None, :, None]  # (1, B, G)
        slot_swap = np.where(at_b, (w[targets] / (c[targets] + 1))[:, None, None] - (w[eb] / c[eb])[None, :, None], 0)
        new_loads = loads[None, None, :] + holds_t * t_delta + holds_b * b_delta + slot_swap  # (T, B, G)
        new_max = new_loads.max(axis=2)  # (T, B)
        valid = (targets[:, None] != eb[None, :]) & (self.holds[gb, :][:, targets].T == 0)
        valid &= new_max < loads.max() - _EPS
        rank = new_max
        if budget is not None:
            cost = self._move_cost(spares[None, :], targets[:, None])
            valid &= self.moves + cost <= budget
            rank = -(loads.max() - new_max) / np.maximum(cost, 0.5)
        if not valid.any():
            return None
        flat = int(np.argmin(np.where(valid, rank, np.inf)))
        i, j = divmod(flat, len(spares))
        return float(rank[i, j]), int(spares[j]), int(targets[i])

    def resolve_duplicates(self) -> None:
        """Turn every second copy of an expert on one GPU into a replica of the expert (not on that GPU) that
        leaves the heaviest GPU lightest, whatever that costs: placements keep their replicas apart."""
        for gpu, expert in zip(*np.nonzero(self.holds > 1), strict=True):
            while self.holds[gpu, expert] > 1:
                slot = int(np.flatnonzero((self.slot_gpu == gpu) & (self.phy2log == expert))[-1])
                targets = np.flatnonzero((self.holds[gpu] == 0) & (self.counts < self.num_gpus))
                if not len(targets):
                    return
                peaks = [self._peak_after_rereplication(slot, int(t)) for t in targets]
                self.apply_rereplication(slot, int(targets[int(np.argmin(peaks))]))

    def _peak_after_rereplication(self, slot: int, expert: int) -> float:
        old = self.phy2log[slot]
        self.apply_rereplication(slot, expert)
        peak = float(self.loads().max())
        self.apply_rereplication(slot, old)
        return peak

    def apply_rereplication(self, slot: int, expert: int) -> None:
        old, gpu = self.phy2log[slot], self.slot_gpu[slot]
        self.holds[gpu, old] -= 1
        self.holds[gpu, expert] += 1
        self.counts[old] -= 1
        self.counts[expert] += 1
        self.phy2log[slot] = expert


def improve(
    weight: np.ndarray, phy2log: np.ndarray, num_gpus: int, max_moves: int | None, replicas: bool = True
) -> np.ndarray:
    """Local search on one domain: swaps, then re-replication when no swap helps, while the heaviest GPU gets
    lighter and at most max_moves slots differ from `phy2log` (None: no limit). Each step lowers the sum of
    squared GPU loads, so it ends."""
    search = _Search(weight, np.asarray(phy2log, dtype=np.int64), num_gpus, replicas)
    if replicas and max_moves is None:
        search.resolve_duplicates()
    for _ in range(8 * len(phy2log)):
        loads = search.loads()
        swap = search.best_swap(loads, max_moves)
        if swap is not None and max_moves is None:
            search.apply_swap(swap[1], swap[2])
            continue
        rereplication = search.best_rereplication(loads, max_moves)
        if swap is not None and (rereplication is None or swap[0] <= rereplication[0]):
            search.apply_swap(swap[1], swap[2])
        elif rereplication is not None:
            search.apply_rereplication(rereplication[1], rereplication[2])
        else:
            break
    return search.phy2log


def lightest_partition(weight: np.ndarray, num_bins: int, bound: float, max_steps: int = 20_000) -> np.ndarray | None:
    """Branch and bound: items (heaviest first) into num_bins equal-size bins with the heaviest bin below
    `bound`; the best found within max_steps, or None."""
    per_bin = len(weight) // num_bins
    order = np.argsort(-weight, kind="stable")
    loads = [0.0] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    best: list[np.ndarray] = []
    state = {"bound": bound - _EPS, "steps": 0}

    def place(k: int) -> None:
        state["steps"] += 1
        if state["steps"] > max_steps:
            return
        if k == len(order):
            state["bound"] = max(loads) - _EPS
            best[:] = [np.array(sorted(b)) for b in bins]
            return
        item, seen = int(order[k]), set()
        for b in range(num_bins):
            key = (round(loads[b], 9), len(bins[b]))  # bins alike so far lead to the same subtrees
            if len(bins[b]) == per_bin or key in seen or loads[b] + weight[item] >= state["bound"]:
                continue
            seen.add(key)
            loads[b] += weight[item]
            bins[b].append(item)
            place(k + 1)
            bins[b].pop()
            loads[b] -= weight[item]

    place(0)
    return np.stack(best) if best else None


def _match(new_holds: np.ndarray, cur_holds: np.ndarray) -> np.ndarray:
    """Greedy matching of new bins to current bins by shared items: target bin of each new bin."""
    overlap = np.minimum(new_holds[:, None, :], cur_holds[None, :, :]).sum(axis=2)  # (N, N)
    target = np.full(len(new_holds), -1)
    free_new, free_cur = np.ones(len(new_holds), bool), np.ones(len(new_holds), bool)
    for _ in range(len(new_holds)):
        masked = np.where(free_new[:, None] & free_cur[None, :], overlap, -1)
        i, j = divmod(int(np.argmax(masked)), len(new_holds))
        target[i] = j
        free_new[i], free_cur[j] = False, False
    return target


def align(new: np.ndarray, current: np.ndarray, num_gpus: int, num_domains: int, num_experts: int) -> np.ndarray:
    """`new` with its domains (nodes) and then GPUs within each domain renamed, and slots within a GPU ordered,
    so that as many slots as possible keep the expert they hold in `current`. Loads do not change."""
    gpus_per_domain = num_gpus // num_domains
    new_gpus = new.reshape(num_gpus, -1)
    cur_gpus = current.reshape(num_gpus, -1)

    def holds(gpus: np.ndarray) -> np.ndarray:
        out = np.zeros((len(gpus), num_experts), dtype=np.int64)
        np.add.at(out, (np.repeat(np.arange(len(gpus)), gpus.shape[1]), gpus.ravel()), 1)
        return out

    domain_target = _match(holds(new_gpus.reshape(num_domains, -1)), holds(cur_gpus.reshape(num_domains, -1)))
    result = np.empty_like(cur_gpus)
    for d_new, d_cur in enumerate(domain_target):
        src = new_gpus[d_new * gpus_per_domain : (d_new + 1) * gpus_per_domain]
        dst = slice(d_cur * gpus_per_domain, (d_cur + 1) * gpus_per_domain)
        gpu_target = _match(holds(src), holds(cur_gpus[dst]))
        for g_new, g_cur in enumerate(gpu_target):
            result[dst.start + g_cur] = _keep_slots(src[g_new], cur_gpus[dst.start + g_cur])
    return result.ravel()


def _keep_slots(experts: np.ndarray, current: np.ndarray) -> np.ndarray:
    """`experts` ordered so that each stays in a slot where `current` has it already."""
    remaining = list(experts)
    out = np.full(len(current), -1)
    for slot, expert in enumerate(current):
        if expert in remaining:
            remaining.remove(expert)
            out[slot] = expert
    out[out < 0] = remaining
    return out
