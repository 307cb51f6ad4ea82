"""DataLoader: local batches become arrays placed as the executable expects, prefetched."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from models import copy_tree, make_case, make_state, train_step


def _batches(n, rows=16, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield (rng.normal(size=(rows, 16)).astype(np.float32),
               rng.normal(size=(rows, 8)).astype(np.float32))


def test_batches_are_placed_as_the_executable_expects_and_train():
    model, x, y = make_case("mlp")
    state = make_state(model, x)
    ref_state = copy_tree(state)
    step = autoshard.parallelize(train_step, method=autoshard.DataParallel())
    specs = step.get_executable(state, (x, y)).get_input_placement_specs()[1]
    loader = autoshard.DataLoader(_batches(3), specs, prefetch_size=2)
    reference = jax.jit(train_step)
    for batch, local in zip(loader, _batches(3), strict=True):
        assert batch[0].sharding == specs[0] and batch[1].sharding == specs[1]
        np.testing.assert_array_equal(np.asarray(batch[0]), local[0])
        state, loss = step(state, batch)
        ref_state, ref_loss = reference(ref_state, local)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    with pytest.raises(StopIteration):
        next(loader)
    with pytest.raises(StopIteration):
        next(loader)


def test_prefetch_reads_ahead_in_a_background_thread():
    produced = []

    def source():
        for i in range(6):
            produced.append((i, threading.current_thread().name))
            yield {"x": np.full((8, 2), i, np.float32)}

    mesh = jax.make_mesh((8,), ("data",))
    specs = {"x": NamedSharding(mesh, P("data"))}
    loader = autoshard.DataLoader(source(), specs, prefetch_size=2)
    first = next(loader)
    deadline = time.monotonic() + 10
    while len(produced) < 4 and time.monotonic() < deadline:  # 1 taken + 2 queued + 1 waiting
        time.sleep(0.01)
    assert len(produced) == 4
    assert produced[0][1] == "autoshard-data-prefetch"
    assert np.asarray(first["x"])[0, 0] == 0.0
    loader.close()
    sync = autoshard.DataLoader(source(), specs, prefetch_size=0)
    assert np.asarray(next(sync)["x"])[0, 0] == 0.0


def test_shape_mismatch_names_both_shapes():
    mesh = jax.make_mesh((8,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    specs = (jax.ShapeDtypeStruct((16, 16), np.float32, sharding=sharding),)
    loader = autoshard.DataLoader([(np.zeros((12, 16), np.float32),)], specs, prefetch_size=1)
    with pytest.raises(ValueError, match=r"batch\[0\]: this process's local batch has shape "
                                         r"\(12, 16\), but the placement .* of the global "
                                         r"shape \(16, 16\) expects \(16, 16\)"):
        next(loader)
    bad_rank = autoshard.DataLoader([np.zeros((8,), np.float32)],
                                    NamedSharding(mesh, P("data", None)), prefetch_size=0)
    with pytest.raises(ValueError, match=r"local batch has shape \(8,\) \(1 dims\) but its "
                                         r"placement .* names 2 dims"):
        next(bad_rank)
    uneven = autoshard.DataLoader([np.zeros((12, 2), np.float32)], sharding, prefetch_size=0)
    with pytest.raises(ValueError, match=r"local batch of shape \(12, 2\) does not fit"):
        next(uneven)


def test_errors_of_the_source_and_arguments():
    mesh = jax.make_mesh((8,), ("data",))

    def broken():
        yield np.zeros((8,), np.float32)
        raise OSError("disk gone")

    loader = autoshard.DataLoader(broken(), NamedSharding(mesh, P("data")))
    next(loader)
    with pytest.raises(OSError, match="disk gone"):
        next(loader)
    with pytest.raises(ValueError, match=r"prefetch_size \(-1\) must be a non-negative int"):
        autoshard.DataLoader([], NamedSharding(mesh, P()), prefetch_size=-1)
    with pytest.raises(TypeError, match=r"placement_specs\['x'\] \('data'\) must be a "
                                        r"jax.sharding.Sharding"):
        autoshard.DataLoader([], {"x": "data"})
    with pytest.raises(ValueError, match="A batch has the structure"):
        next(autoshard.DataLoader([(np.zeros(8),)], NamedSharding(mesh, P()), prefetch_size=0))
