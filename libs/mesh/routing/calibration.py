"""TimeScale: how many real seconds a predicted second of prefill takes, fitted from prefill workers' reports, so
that a cost model made for other hardware (the defaults describe DeepSeek-V3 on H800; a CPU mesh is ~1000x
slower) still predicts queues on the real clock.

Between two reports of one worker the router knows, in predicted seconds, the queue at the first, what it sent
there in between, and the queue at the second, so the work done. When the prediction says the worker had work
all along (no arrival after its queue ran dry, and still busy at the second report, by the prediction or by the
report), the interval was all work, and interval / work done is the ratio of real to predicted time. When the
hardware is slower than predicted that is exact; when faster, the worker may have finished early, and the sample
lies between the truth and the current scale: either way the fit moves toward the truth. Samples are smoothed
in log space; one far off moves the fit 2x at once, so a mesh 1000x off is fitted within ten busy intervals.
Work is counted in the cost model's own seconds (not scaled ones), so a sample never depends on the fit itself.
One writer: the LoadView that owns it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class TimeScale:
    def __init__(self, smoothing: float = 0.2, max_ratio: float = 1e4) -> None:
        self.value = 1.0
        self.smoothing = smoothing
        self.max_ratio = max_ratio
        self.num_samples = 0

    def observe(
        self,
        start_s: float,
        start_queue_s: float,
        arrivals: Sequence[tuple[float, float]],
        end_s: float,
        end_queue_s: float,
        has_queue_at_end: bool,
    ) -> None:
        """Two reports of one worker: its queue at each and what was sent there in between ((when, work), in
        order), work and queues in the cost model's seconds."""
        interval_s = end_s - start_s
        if interval_s <= 0 or (start_queue_s <= 0 and not arrivals):
            return
        busy_until = start_s + start_queue_s * self.value
        for at_s, work_s in arrivals:
            if at_s > busy_until:
                return  # it may have idled, waiting for this one
            busy_until += work_s * self.value
        if busy_until < end_s and not has_queue_at_end:
            return  # done before the report: nothing says how early
        done_s = start_queue_s + sum(work_s for _, work_s in arrivals) - end_queue_s
        if done_s <= 0:
            return
        step = math.log(min(max(interval_s / done_s, 1 / self.max_ratio), self.max_ratio) / self.value)
        if abs(step) > math.log(2):  # far off: go at once, at most 2x per sample
            step = math.copysign(math.log(2), step)
        else:
            step *= self.smoothing
        self.value *= math.exp(step)
        self.num_samples += 1
