"""``recom_rec.ps.wrap``: stage the next batches' PS rows while the current batch trains."""
from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Iterator, List

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .tier import tiers_of

_END = object()


def _find_kjts(batch: Any, out: List[KeyedJaggedTensor], depth: int = 0) -> List[KeyedJaggedTensor]:
    if depth > 4:
        return out
    if isinstance(batch, KeyedJaggedTensor):
        out.append(batch)
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            _find_kjts(item, out, depth + 1)
    elif isinstance(batch, dict):
        for item in batch.values():
            _find_kjts(item, out, depth + 1)
    elif hasattr(batch, "sparse_features"):  # torchrec.datasets.utils.Batch
        _find_kjts(batch.sparse_features, out, depth + 1)
    return out


class _Wrapped:
    """The loop: the dataloader is read in the training thread; each batch's staging is a job on
    its tiers' worker threads (native code, no GIL: csrc/ps/ps_stage.c), submitted
    ``prefetch`` batches ahead and waited for when the batch is handed out."""

    def __init__(self, dataloader: Iterable, model, prefetch: int) -> None:
        if int(prefetch) < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.dataloader = dataloader
        self.model = model
        self.prefetch = int(prefetch)

    def __len__(self) -> int:
        return len(self.dataloader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        tiers = tiers_of(self.model)
        if not tiers:
            yield from self.dataloader
            return
        # A batch trained before wrap() (no prefetch) keeps its rows pinned until the next
        # prepare; the loop has moved on, so unpin it before staging ahead.
        for tier in tiers:
            tier.release_sync()
            tier.join()
            tier.set_depth(self.prefetch)
        batches = iter(self.dataloader)
        queue: deque = deque()  # (batch, [(tier, pending job)]) staged or staging, in order

        def stage_next() -> None:
            batch = next(batches, _END)
            if batch is _END:
                return
            jobs = []
            try:
                for kjt in _find_kjts(batch, []):
                    for tier in tiers:
                        if tier.uses(kjt):
                            pending = tier.submit(kjt)
                            if pending is not None:
                                jobs.append((tier, pending))
            except BaseException:
                drop(jobs)
                raise
            queue.append((batch, jobs))

        def drop(jobs) -> None:
            """Wait for jobs whose batch will not be trained and unpin their slots."""
            for tier, pending in jobs:
                try:
                    _, handle = tier.finish(pending)
                except BaseException:  # noqa: BLE001 - a failed job gave its slots back itself
                    continue
                tier.release(handle)

        def release(staged) -> None:
            for tier, kjt, handle in staged:
                tier.unregister_prepared(kjt)
                tier.release(handle)

        current: list = []
        for tier in tiers:  # batches not handed out by this loop are refused until it ends
            tier.wrap_loops += 1
        try:
            for _ in range(self.prefetch):
                stage_next()
            while queue:
                batch, jobs = queue.popleft()
                staged = []
                try:
                    for tier, pending in jobs:
                        remapped, handle = tier.finish(pending)
                        staged.append((tier, pending.kjt, handle))
                        tier.register_prepared(pending.kjt, remapped, handle)
                except BaseException:
                    release(staged)
                    drop(jobs[len(staged) + 1:])
                    raise
                current = staged
                stage_next()  # the next batch stages while this one trains
                yield batch
                release(current)  # the batch handed out is done
                current = []
        finally:
            release(current)
            while queue:
                drop(queue.popleft()[1])
            for tier in tiers:
                tier.wrap_loops -= 1


def wrap(dataloader: Iterable, model, prefetch: int = 1) -> _Wrapped:
    """Iterate ``dataloader`` while the next ``prefetch`` batches' PS rows are staged (id lookup,
    store pulls, evictions) on each PS-backed module's worker thread. The module's forward then
    uses the staged remap. Results are the same as without ``wrap``."""
    return _Wrapped(dataloader, model, prefetch)
