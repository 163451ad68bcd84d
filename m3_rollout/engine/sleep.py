"""Sleep / wake-up: hand the engine's device memory to the trainer between generation phases.

Governing idea: storages are released *in place*. ``UntypedStorage.resize_(0)`` frees a storage's
memory while every tensor viewing it keeps its identity, shape, strides and offset: a parameter,
the packed-projection buffer it is a row slice of (``model/fused.py``), the views weight sync
cached at set-up, the KV cache the runner and the decode graphs hold. Growing the storage back
(``resize_(nbytes)``) gives new memory at a new address, and every view follows it, so nothing
is re-wired at wake-up and ``packed_ok``'s pointer checks still hold (offsets are unchanged).

NOTE (CUDA graphs): a captured graph replays raw pointers, which the new addresses invalidate.
The decode graphs are dropped at sleep (their private memory pool is freed with them, which also
returns the activation memory) and re-captured at wake-up: one warm-up + capture per batch size,
about what the engine's start-up spent on them (``wake_up``'s record reports it as
``graph_capture_seconds``). Keeping the addresses instead would need a virtual-memory allocator
(cuMemMap remapping, as vLLM's CuMemAllocator does); re-capture is the simpler correct choice.

Levels (``MemoryHandoff.sleep``): 1 drops the page pool's contents (KV, index keys, routing
records), the MSA prefill scratch (contents never outlive a call) and the decode graphs; 2 also
copies the weights to host memory (pinned on CUDA) and frees their device copies. While asleep,
NOTHING may read or write a released tensor: its storage has no memory (an access is a segfault /
illegal address, not an exception). The engine refuses steps, scoring and requests; weight updates
must wait for ``wake_up`` at level 2.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

GIB = 2**30

# The allocation function: grow / shrink a storage to ``nbytes`` in place. Injected so CPU tests
# can count bytes and fail allocations (a fake out-of-memory) without a GPU.
Resize = Callable[[torch.UntypedStorage, int], None]


def resize_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    """The real allocation function: ``storage.resize_(nbytes)`` (device allocator, new address).

    Raises torch.OutOfMemoryError when the device cannot hold ``nbytes``."""
    storage.resize_(nbytes)


def check_sleep_level(level) -> None:
    """Raises ValueError unless ``level`` is a sleep level: 1 (free the KV cache) or 2 (also move
    the weights to host memory). Backends that forward ``sleep`` to engines elsewhere (the EP
    service's workers) check it first, so a bad level is the caller's error there too."""
    if level not in (1, 2):
        raise ValueError(f"sleep(level={level!r}): level must be 1 (free the KV cache) or 2 (also weights)")


class WakeUpError(RuntimeError):
    """``wake_up`` ran out of memory; the engine stays asleep at its level and may retry."""


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages behind ``tensors`` (views of one buffer share one: packed
    projections, tied embeddings), in first-seen order."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen[s.data_ptr()] = s
    return list(seen.values())


def check_resizable(what: str, storages: list[torch.UntypedStorage]) -> None:
    """Raises ValueError when a storage cannot be released in place (mmap-ed or numpy-backed)."""
    fixed = [s for s in storages if not s.resizable()]
    if fixed:
        raise ValueError(
            f"sleep: {len(fixed)} {what} storage(s) cannot be released in place (not resizable, e.g. "
            "mmap-ed or numpy-backed tensors); load the model onto its device with a copy (.to(device))"
        )


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """uint8 [nbytes] tensor over ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ReleasedStorages:
    """Storages released to 0 bytes, with what :meth:`restore` puts back.

    Args:
        what: name for records and messages ("KV cache", "weights").
        storages: distinct storages (``unique_storages``), all resizable.
        keep_contents: copy the bytes to host memory first (pinned for CUDA) and copy them back at
            restore (weights); False = the contents are dropped and restored as zeros (caches).
        resize: the allocation function.
    Raises ValueError (before releasing anything) when a storage is not resizable.
    """

    def __init__(self, what: str, storages: list[torch.UntypedStorage], keep_contents: bool, resize: Resize):
        check_resizable(what, storages)
        self.what, self.storages, self.resize = what, storages, resize
        self.nbytes = [s.nbytes() for s in storages]
        self.host: list[torch.Tensor] | None = None
        self.pinned = bool(storages) and storages[0].device.type == "cuda"
        if keep_contents:
            self.host = []
            for s in storages:
                h = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=self.pinned)
                h.copy_(_bytes_view(s), non_blocking=self.pinned)
                self.host.append(h)
            if self.pinned:
                torch.cuda.synchronize()  # the copies must land before the memory is freed
        for s in storages:
            resize(s, 0)

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)

    def restore(self) -> None:
        """Grow every storage back (zeros, or the kept contents). On an out-of-memory the storages
        grown so far are released again (contents still kept on the host) and the error re-raised."""
        grown = []
        try:
            for s, n in zip(self.storages, self.nbytes):
                self.resize(s, n)
                grown.append(s)
        except torch.OutOfMemoryError:
            for s in grown:
                self.resize(s, 0)
            raise
        if self.host is None:
            for s in self.storages:
                _bytes_view(s).zero_()
        else:
            for s, h in zip(self.storages, self.host):
                _bytes_view(s).copy_(h, non_blocking=self.pinned)
            if self.pinned:
                torch.cuda.synchronize()  # the host copies may be freed once restore returns

    def release_again(self) -> None:
        """Free restored storages again without copying (undoes a :meth:`restore` whose later
        steps failed; the host contents, if any, are still the ones to restore)."""
        for s in self.storages:
            self.resize(s, 0)


class MemoryHandoff:
    """The sleep / wake state machine over an engine's device memory.

    States: awake (level 0), asleep at level 1 (caches released), asleep at level 2 (caches and
    weights released). ``sleep(level)`` from level L releases what the levels above L add (0 bytes
    when ``level <= L``); ``wake_up`` from any level restores everything (weights first, then the
    caches, then the decode graphs); when already awake it does nothing.

    Args:
        cache_tensors: tensors whose contents may be dropped (page pool, routing records).
        weight_tensors: the model's parameters and buffers.
        release_graphs / capture_graphs: drop / re-capture the decode graphs (runner callbacks).
        device: the engine's device (CUDA: ``empty_cache`` after releasing, so the memory goes
            back to the driver for other processes too).
        oom_hint: what to lower when wake-up runs out of memory (named in :class:`WakeUpError`).
        resize: the allocation function (``resize_storage``; tests inject a counting fake).
    """

    def __init__(
        self,
        cache_tensors: list[torch.Tensor],
        weight_tensors: Callable[[], Iterable[torch.Tensor]],
        release_graphs: Callable[[], None],
        capture_graphs: Callable[[], None],
        device: torch.device,
        oom_hint: str,
        resize: Resize = resize_storage,
    ):
        self.cache_tensors, self.weight_tensors = cache_tensors, weight_tensors
        self.release_graphs, self.capture_graphs = release_graphs, capture_graphs
        self.device, self.oom_hint, self.resize = device, oom_hint, resize
        self.level = 0
        self.weight_generation = 0  # wake-ups that re-allocated the weights (new addresses)
        self._caches: ReleasedStorages | None = None
        self._weights: ReleasedStorages | None = None
        self.last_sleep: dict | None = None
        self.last_wake: dict | None = None

    @property
    def weights_offloaded(self) -> bool:
        """The weights' device storages are released (level 2): nothing may touch a parameter."""
        return self._weights is not None

    def sleep(self, level: int) -> dict:
        """Release the memory of ``level`` (1 or 2; see the class docstring). The caller has checked
        that no step is in flight and reset its page manager.

        Returns (and keeps as ``last_sleep``) {"level": level now, "gb_freed": GiB released by this
        call, "seconds": wall time}. Raises ValueError for another level or a storage that cannot
        be released (nothing changed then).
        """
        check_sleep_level(level)
        t0 = time.perf_counter()
        caches = unique_storages(self.cache_tensors) if self._caches is None else []
        weights = unique_storages(self.weight_tensors()) if level == 2 and self._weights is None else []
        check_resizable("KV cache", caches)
        check_resizable("weights", weights)
        freed = 0
        if self._caches is None:
            self.release_graphs()
            self._caches = ReleasedStorages("KV cache", caches, False, self.resize)
            freed += self._caches.total_bytes
        if weights:
            self._weights = ReleasedStorages("weights", weights, True, self.resize)
            freed += self._weights.total_bytes
        self.level = max(self.level, level)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.last_sleep = {"level": self.level, "gb_freed": freed / GIB, "seconds": time.perf_counter() - t0}
        return self.last_sleep

    def wake_up(self) -> dict:
        """Restore the weights (level 2), the caches (zeroed) and the decode graphs.

        Returns (and keeps as ``last_wake``) {"level": the level woken from (0 = was awake),
        "gb_restored": GiB re-allocated, "seconds": wall time, "graph_capture_seconds": of which
        re-capturing the decode graphs}.

        Raises:
            WakeUpError: out of memory (``torch.OutOfMemoryError``) anywhere on the way; what was
                restored by this call is released again, so the handoff stays asleep at its level
                and ``wake_up`` may be retried once memory is free.
        """
        t0 = time.perf_counter()
        was = self.level
        if was == 0:
            self.last_wake = {"level": 0, "gb_restored": 0.0, "seconds": 0.0, "graph_capture_seconds": 0.0}
            return self.last_wake
        parts = [r for r in (self._weights, self._caches) if r is not None]
        done: list[ReleasedStorages] = []
        try:
            for r in parts:
                failed = f"{r.what} ({r.total_bytes / GIB:.3f} GiB)"
                r.restore()
                done.append(r)
            failed = "decode graphs (re-capture)"
            t_graphs = time.perf_counter()
            self.capture_graphs()
        except torch.OutOfMemoryError as exc:
            self.release_graphs()
            for r in done:
                r.release_again()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            need = " + ".join(f"{r.what} {r.total_bytes / GIB:.3f} GiB" for r in parts)
            raise WakeUpError(
                f"wake_up: out of memory on {self.device} re-allocating the {failed}; the engine needs {need} "
                f"back: {self.oom_hint}, or free the trainer's device memory before waking. The engine stays "
                f"asleep (level {was}); call wake_up() again to retry. ({exc})"
            ) from exc
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the restores are queued; the record times them
        restored = sum(r.total_bytes for r in parts)
        self.weight_generation += self._weights is not None
        self._weights = self._caches = None
        self.level = 0
        end = time.perf_counter()
        self.last_wake = {
            "level": was,
            "gb_restored": restored / GIB,
            "seconds": end - t0,
            "graph_capture_seconds": end - t_graphs,
        }
        return self.last_wake

    def metrics(self) -> dict:
        """Flat numbers for ``LLMEngine.metrics``: the current level and the last transitions."""
        out = {"sleep_level": self.level}
        if self.last_sleep is not None:
            out.update(sleep_gb_freed=self.last_sleep["gb_freed"], sleep_seconds=self.last_sleep["seconds"])
        if self.last_wake is not None:
            out.update(
                wake_gb_restored=self.last_wake["gb_restored"],
                wake_seconds=self.last_wake["seconds"],
                wake_graph_capture_seconds=self.last_wake["graph_capture_seconds"],
            )
        return out
