"""``recom_rec.ps.wrap``: prepare the next batches' PS rows in a background thread."""
from __future__ import annotations

import queue
import threading
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
        q: "queue.Queue" = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def release(staged) -> None:
            for tier, kjt, _, handle in staged:
                tier.unregister_prepared(kjt)
                tier.release(handle)

        # On a GPU the thread works on the first tier's stream: batches the dataloader moves to the
        # device there are ordered before the staging, and nothing waits on the training stream.
        device = tiers[0]._device()

        def worker() -> None:
            with tiers[0]._on_side(device):
                work()

        def work() -> None:
            try:
                for batch in self.dataloader:
                    if stop.is_set():
                        return
                    staged = []
                    try:
                        for kjt in _find_kjts(batch, []):
                            for tier in tiers:
                                if tier.uses(kjt):
                                    remapped, handle = tier.stage(kjt)
                                    staged.append((tier, kjt, remapped, handle))
                    except BaseException:
                        release(staged)
                        raise
                    if not put((batch, staged)):
                        release(staged)
                        return
                put(_END)
            except BaseException as exc:  # handed to the training loop
                put(exc)

        # A batch trained before wrap() (no prefetch) keeps its rows pinned until the next
        # prepare; the loop has moved on, so unpin it before staging ahead.
        for tier in tiers:
            tier.release_sync()
            tier.join()  # batches made before wrap() are ordered before the thread's staging
        thread = threading.Thread(target=worker, name="recom_rec.ps.wrap", daemon=True)
        thread.start()
        previous: list = []
        try:
            while True:
                release(previous)  # the batch handed out last is done
                previous = []
                item = q.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, staged = item
                for tier, kjt, remapped, handle in staged:
                    tier.register_prepared(kjt, remapped, handle)
                previous = staged
                yield batch
        finally:
            stop.set()
            release(previous)
            while thread.is_alive():
                try:
                    item = q.get(timeout=0.05)
                except queue.Empty:
                    continue
                if isinstance(item, tuple):
                    release(item[1])
            while not q.empty():
                item = q.get_nowait()
                if isinstance(item, tuple):
                    release(item[1])


def wrap(dataloader: Iterable, model, prefetch: int = 1) -> _Wrapped:
    """Iterate ``dataloader`` while a background thread stages the next ``prefetch`` batches'
    PS rows (id lookup, store pulls, evictions) for every PS-backed module in ``model``. The
    module's forward then uses the staged remap. Results are the same as without ``wrap``."""
    return _Wrapped(dataloader, model, prefetch)
