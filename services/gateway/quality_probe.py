"""A rollout's quality probe: its golden prompts (RolloutGates.quality_prompts, rendered to token ids by the gateway
when the rollout started) answered greedily by the stable version and by the canary, compared token for token
(mesh.rollout_gates.compare_answers).

Every gateway runs it (`RolloutProbes`: only the gateway may start generations, mesh.access) and records the
outcome in the rollout's entry, where the balancers' controller judges by it (services/balancer/rollouts.py). It
calls the workers straight over gRPC, as a request's pipeline does but without routing: Prefill.PrefillStream to
a prefill worker it picks, pushing to a decode worker it picks, then Decode.Stream. Each version's pair
(`pair_for`) is that version's own workers where a pool has some, else others of its side of the split (a canary of
decode workers only is probed behind a stable prefill worker, as its conversations are served), the least busy
first. No API, no tenant, no usage record: a probe is billed to nobody and is no sample for the latency gates; no
Route call, so the balancers' view of load is as without it. Each answer has a cache salt of its own, so it reuses
no KV that another version (or another probe) computed, from a device cache or the KV store.

Greedy answers are deterministic for given weights, but a near tie can tip with the batch an answer shares on some
engines; so a difference is confirmed before it fails the gate: both versions answer that prompt again, and it
stands only if both repeat their first answers exactly, up to the first difference (otherwise the probe is
inconclusive and runs again).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence

import grpc
import grpc.aio

from mesh import metrics, rpc
from mesh.discovery import KnownWorker, WorkerRegistry
from mesh.logging import get_logger
from mesh.pb import common_pb2, decode_pb2, decode_pb2_grpc, events_pb2, prefill_pb2, prefill_pb2_grpc
from mesh.rollout_gates import MATCH, MISMATCH, NOT_RUN, ProbeOutcome, compare_answers, first_difference
from mesh.rollouts import RUNNING, RolloutConflict, RolloutStore

ANSWER_TIMEOUT_S = 60.0  # one golden prompt's answer, prefill to the last token
MAX_RECORD_TRIES = 5  # compare-and-sets lost to the balancers' decisions before an outcome is left unrecorded
NOT_FINISHED = common_pb2.FINISH_REASON_UNSPECIFIED
log = get_logger(__name__)


class ProbeError(Exception):
    """An answer could not be had (a worker failed or is unreachable): the probe did not run."""


Pair = tuple[common_pb2.WorkerInfo, common_pb2.WorkerInfo]  # (prefill, decode)


def _least_busy(workers: Sequence[KnownWorker]) -> common_pb2.WorkerInfo:
    return min(workers, key=lambda w: (w.load.num_running + w.load.num_waiting, w.worker_id)).info


def pair_for(registry: WorkerRegistry, rollout: events_pb2.Rollout, is_canary: bool) -> Pair | None:
    """The (prefill, decode) pair that answers for one version: in each pool, its own workers first, then others of
    its side of the split, then any (as a conversation on that side would be served). None when a pool is empty or
    the version has no worker in either (a probe of the other version's workers would prove nothing)."""
    version = rollout.canary_version if is_canary else rollout.stable_version
    picked = []
    num_own = 0
    for role in (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE):
        workers = registry.workers(role, rollout.model)
        if not workers:
            return None
        own = [w for w in workers if w.info.version == version]
        side = [w for w in workers if (w.info.version == rollout.canary_version) == is_canary]
        num_own += len(own)
        picked.append(_least_busy(own or side or workers))
    return (picked[0], picked[1]) if num_own else None


class QualityProbe:
    """Stateless: every run picks its workers from the registry as it is then."""

    def __init__(self, registry: WorkerRegistry, channels: rpc.Channels) -> None:
        self.registry = registry  # read only here
        self.channels = channels  # the gateway's, with its certificate: only the gateway starts generations

    async def run(self, rollout: events_pb2.Rollout) -> ProbeOutcome:
        stable = pair_for(self.registry, rollout, is_canary=False)
        canary = pair_for(self.registry, rollout, is_canary=True)
        if stable is None or canary is None:
            side = "stable" if stable is None else "canary"
            return ProbeOutcome(NOT_RUN, f"quality probe not run: the {side} version has no worker for the model")
        prompts = rollout.gates.quality_prompts
        try:
            answers = await asyncio.gather(*(self._answers(rollout, pair) for pair in (stable, canary)))
            outcome = compare_answers([p.text for p in prompts], *answers)
            if outcome.result == MISMATCH:
                outcome = await self._confirmed(rollout, (stable, canary), answers, outcome)
        except ProbeError as exc:
            return ProbeOutcome(NOT_RUN, f"quality probe not run: {exc}")
        log.info(
            "quality probe",
            rollout_id=rollout.rollout_id,
            result=outcome.result,
            reason=outcome.reason,
            stable=[w.worker_id for w in stable],
            canary=[w.worker_id for w in canary],
        )
        return outcome

    async def _answers(self, rollout: events_pb2.Rollout, pair: Pair) -> list[list[int]]:
        max_tokens = rollout.gates.quality_max_tokens
        return list(
            await asyncio.gather(
                *(
                    self.answer(rollout.model, list(p.token_ids), max_tokens, pair)
                    for p in rollout.gates.quality_prompts
                )
            )
        )

    async def _confirmed(
        self,
        rollout: events_pb2.Rollout,
        pairs: tuple[Pair, Pair],
        answers: Sequence[list[list[int]]],
        outcome: ProbeOutcome,
    ) -> ProbeOutcome:
        """`outcome` if both versions answer every differing prompt again exactly as before; inconclusive if not."""
        stable, canary = answers
        for index in range(len(stable)):
            position = first_difference(stable[index], canary[index])
            if position is None:
                continue
            token_ids = list(rollout.gates.quality_prompts[index].token_ids)
            # up to the first difference is enough: a rerun that repeats both answers that far confirms it
            num_tokens = position + 1
            again = await asyncio.gather(*(self.answer(rollout.model, token_ids, num_tokens, p) for p in pairs))
            if again != [stable[index][:num_tokens], canary[index][:num_tokens]]:
                return ProbeOutcome(NOT_RUN, f"quality probe inconclusive: prompt {index}'s answers changed on a rerun")
        return outcome

    async def answer(self, model: str, token_ids: list[int], max_tokens: int, pair: Pair) -> list[int]:
        """One greedy answer from one (prefill, decode) pair; raises ProbeError when a worker fails."""
        prefill, decode = pair
        request_id = f"probe-{secrets.token_hex(8)}"
        request = prefill_pb2.PrefillRequest(
            request_id=request_id,
            model=model,
            prompt_token_ids=token_ids,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens),
            cache_salt=f"kvmesh-quality-probe:{request_id}",  # its own: no KV computed by another version reused
            decode_address=decode.address,
            decode_worker_id=decode.worker_id,
            decode_data_address=decode.data_address,
        )
        metadata = rpc.metadata(request_id)
        is_held_by_decode = False
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                responses = prefill_pb2_grpc.PrefillStub(self.channels.get(prefill.address)).PrefillStream(
                    request, metadata=metadata
                )
                first = await responses.read()
                if first is grpc.aio.EOF:
                    raise ProbeError(f"prefill worker {prefill.worker_id} answered nothing")
                token_ids = [first.first_token_id]
                if first.finish_reason != NOT_FINISHED:
                    return token_ids
                is_held_by_decode = True
                while await responses.read() is not grpc.aio.EOF:  # until decode holds the KV
                    pass
                stream = decode_pb2_grpc.DecodeStub(self.channels.get(decode.address)).Stream(
                    decode_pb2.StreamRequest(request_id=request_id), metadata=metadata
                )
                async for batch in stream:
                    if batch.finish_reason == common_pb2.FINISH_REASON_ABORT:
                        raise ProbeError(f"decode worker {decode.worker_id} aborted the answer")
                    token_ids += batch.token_ids
                    if batch.finish_reason != NOT_FINISHED:
                        is_held_by_decode = False
                        return token_ids
                raise ProbeError(f"decode worker {decode.worker_id} ended the stream early")
        except grpc.aio.AioRpcError as error:
            raise ProbeError(
                f"{error.code().name} from {prefill.worker_id}/{decode.worker_id}: {error.details()}"
            ) from None
        except TimeoutError:
            raise ProbeError(
                f"no answer from {prefill.worker_id}/{decode.worker_id} within {ANSWER_TIMEOUT_S:g} s"
            ) from None
        finally:
            if is_held_by_decode:  # decode would also drop it after its attach timeout
                await self._abort(decode, request_id)

    async def _abort(self, decode: common_pb2.WorkerInfo, request_id: str) -> None:
        try:
            await decode_pb2_grpc.DecodeStub(self.channels.get(decode.address)).Abort(
                decode_pb2.AbortRequest(request_id=request_id),
                timeout=rpc.ABORT_TIMEOUT_S,
                metadata=rpc.metadata(request_id),
            )
        except grpc.aio.AioRpcError as error:
            log.info("probe abort failed", request_id=request_id, code=error.code().name)


class RolloutProbes:
    """Every gateway follows the rollout bucket and runs each running rollout's probe until one recorded outcome
    is final (match or mismatch), writing it into the rollout's entry (`Rollout.quality`, a compare-and-set) for the
    balancers to judge by: from the moment it hears of the rollout, in the background; after a run that could not
    compare (not_run), again an interval later. Written only by the bucket's follower and the runs it starts."""

    def __init__(self, store: RolloutStore, probe: QualityProbe) -> None:
        self.store = store
        self.probe = probe
        self._tasks: dict[str, asyncio.Task[None]] = {}  # rollout id -> its run (or its wait for the next one)
        self._following: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Follow the bucket (without JetStream: no rollouts, nothing to probe)."""
        try:
            self._following = await self.store.follow(self.on_rollout)
        except Exception:
            log.warning("no rollout bucket: no quality probes", exc_info=True)

    async def stop(self) -> None:
        for task in [self._following, *self._tasks.values()]:
            if task is not None:
                task.cancel()
        self._tasks.clear()

    def on_rollout(self, rollout: events_pb2.Rollout) -> None:
        task = self._tasks.get(rollout.rollout_id)
        if rollout.state != RUNNING:
            if task is not None:
                task.cancel()  # decode aborts the answers it was streaming
                del self._tasks[rollout.rollout_id]
            return
        is_final = rollout.quality.result in (MATCH, MISMATCH)
        if rollout.gates.quality_prompts and not is_final and (task is None or task.done()):
            self._tasks[rollout.rollout_id] = asyncio.get_running_loop().create_task(self._run(rollout))

    async def _run(self, rollout: events_pb2.Rollout) -> None:
        if rollout.quality.result == NOT_RUN:  # the last run could not compare: the next one an interval later
            next_at_s = rollout.quality.at_ms / 1000 + max(rollout.check_interval_s, 1.0)
            await asyncio.sleep(max(next_at_s - time.time(), 0.0))
        try:
            outcome = await self.probe.run(rollout)
        except Exception as exc:  # anything unforeseen: recorded as not run, and tried again
            log.warning("quality probe failed", rollout_id=rollout.rollout_id, exc_info=True)
            outcome = ProbeOutcome(NOT_RUN, f"quality probe not run: {type(exc).__name__}")
        try:
            await self._record(rollout.rollout_id, outcome)
        except Exception:  # NATS away: the next write to the rollout starts another run
            log.warning("quality probe outcome not recorded", rollout_id=rollout.rollout_id, exc_info=True)

    async def _record(self, rollout_id: str, outcome: ProbeOutcome) -> None:
        for _ in range(MAX_RECORD_TRIES):
            found = await self.store.get(rollout_id)
            if found is None:
                return
            rollout, revision = found
            if rollout.state != RUNNING or rollout.quality.result in (MATCH, MISMATCH):
                return  # decided meanwhile, or another gateway's run was recorded first
            rollout.quality.CopyFrom(
                events_pb2.QualityOutcome(result=outcome.result, reason=outcome.reason, at_ms=int(time.time() * 1000))
            )
            try:
                await self.store.update(rollout, revision)
            except RolloutConflict:  # a balancer's decision landed first: read again
                continue
            metrics.ROLLOUT_QUALITY_PROBES.labels(model=rollout.model, result=outcome.result).inc()
            return
