"""``DataLoader``: each process's local batches become global arrays placed as a step expects.

In a multi-process job every process reads its own rows; ``jax.make_array_from_process_local_data``
stitches them into one global array with the sharding the executable wants (from
``Executable.get_input_placement_specs()``), so the step never reshards its input. A background
thread prepares the next ``prefetch_size`` batches while the current step runs.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, Sharding

_END = object()


class DataLoader:
    """Iterate global, correctly placed batches built from this process's local batches.

    ``input_iter``: an iterable of batches (pytrees of numpy arrays holding this process's
    rows). ``placement_specs``: a pytree like one batch whose leaves are the shardings the step
    wants (``executable.get_input_placement_specs()[1]`` for the second argument), or
    ``jax.ShapeDtypeStruct``s carrying a sharding and the global shape (then each local batch is
    checked against it). ``prefetch_size``: batches prepared ahead in a background thread (0:
    none, each batch is placed when asked for).
    """

    def __init__(self, input_iter: Iterable, placement_specs: Any, prefetch_size: int = 1):
        if not isinstance(prefetch_size, int) or isinstance(prefetch_size, bool) or (
                prefetch_size < 0):
            raise ValueError(
                f"prefetch_size ({prefetch_size!r}) must be a non-negative int (batches placed "
                "ahead of the step; 0 places each batch when it is asked for).")
        leaves, self._treedef = jax.tree.flatten(
            placement_specs, is_leaf=lambda x: isinstance(x, Sharding | jax.ShapeDtypeStruct))
        for path, leaf in zip(_paths(placement_specs), leaves, strict=True):
            sharding = getattr(leaf, "sharding", leaf)
            if not isinstance(sharding, Sharding):
                raise TypeError(
                    f"placement_specs{path} ({leaf!r}) must be a jax.sharding.Sharding or a "
                    "jax.ShapeDtypeStruct with a sharding; take them from "
                    "executable.get_input_placement_specs().")
        self._specs = leaves
        self._paths = _paths(placement_specs)
        self._source = iter(input_iter)
        self.prefetch_size = prefetch_size
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if prefetch_size:
            self._queue = queue.Queue(maxsize=prefetch_size)
            self._thread = threading.Thread(target=self._fill, name="autoshard-data-prefetch",
                                            daemon=True)
            self._thread.start()

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        if self._queue is None:
            return self.place(next(self._source))
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # later calls end too
            raise StopIteration
        if isinstance(item, _Failure):
            self._queue.put(_END)
            raise item.error
        return item

    def place(self, batch):
        """One local batch as global arrays with the placement of ``placement_specs``."""
        leaves, treedef = jax.tree.flatten(batch)
        if treedef != self._treedef:
            raise ValueError(
                f"A batch has the structure {treedef}, but placement_specs has {self._treedef}. "
                "Pass the placement specs of the batch argument only, e.g. "
                "executable.get_input_placement_specs()[1].")
        placed = [_place(np.asarray(x), spec, path)
                  for x, spec, path in zip(leaves, self._specs, self._paths, strict=True)]
        return jax.tree.unflatten(treedef, placed)

    def close(self) -> None:
        """Stop the prefetch thread (it finishes the batch it is placing)."""
        self._stop.set()
        if self._queue is not None:
            while self._thread is not None and self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _fill(self):
        try:
            for batch in self._source:
                item = self.place(batch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if self._stop.is_set():
                    return
            self._queue.put(_END)
        except BaseException as e:  # re-raised by __next__ in the consuming thread
            self._queue.put(_Failure(e))


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _place(local: np.ndarray, spec, path: str):
    sharding = getattr(spec, "sharding", spec)
    global_shape = tuple(spec.shape) if isinstance(spec, jax.ShapeDtypeStruct) else None
    num_spec_dims = len(sharding.spec) if isinstance(sharding, NamedSharding) else 0
    if num_spec_dims > local.ndim:
        raise ValueError(
            f"batch{path}: the local batch has shape {local.shape} ({local.ndim} dims) but its "
            f"placement {sharding.spec} names {num_spec_dims} dims. Give arrays of the rank "
            "the step was compiled for.")
    if global_shape is not None:
        expected = expected_local_shape(sharding, global_shape)
        if expected != local.shape:
            raise ValueError(
                f"batch{path}: this process's local batch has shape {local.shape}, but the "
                f"placement {_describe(sharding)} of the global shape {global_shape} expects "
                f"{expected} from process {jax.process_index()} of {jax.process_count()}. Give "
                f"each process {expected[0] if expected else 0} rows (the global batch divided "
                "among the processes), or compile the step for another batch size.")
    try:
        return jax.make_array_from_process_local_data(sharding, local, global_shape)
    except (ValueError, TypeError, AssertionError) as e:
        raise ValueError(
            f"batch{path}: the local batch of shape {local.shape} does not fit the placement "
            f"{_describe(sharding)}: {e}. Each dim split over devices of this process must "
            "divide evenly among them.") from e


def expected_local_shape(sharding: Sharding, global_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the block of ``global_shape`` that this process's devices hold together."""
    indices = sharding.addressable_devices_indices_map(global_shape).values()
    shape = []
    for dim, size in enumerate(global_shape):
        starts, stops = set(), set()
        for index in indices:
            start, stop, _ = index[dim].indices(size)
            starts.add(start)
            stops.add(stop)
        shape.append(max(stops) - min(starts) if starts else size)
    return tuple(shape)


def _describe(sharding) -> str:
    if isinstance(sharding, NamedSharding):
        return f"{sharding.spec} on mesh {dict(sharding.mesh.shape)}"
    return str(sharding)


def _paths(tree) -> list[str]:
    flat = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, Sharding | jax.ShapeDtypeStruct))[0]
    return [jax.tree_util.keystr(p) for p, _ in flat]


__all__ = ["DataLoader"]
