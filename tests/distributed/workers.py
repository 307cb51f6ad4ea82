"""Functions the multi-process tests run in every launched process (importable by the workers)."""

from __future__ import annotations

import os
import time

import numpy as np

STEPS = 2
METHODS = ("data", "shard")
MORE_METHODS = ("zero2", "zero3", "accumulate")


def train(methods=METHODS, steps: int = STEPS, devices=None):
    """A few train steps of a tiny MLP per method; losses and final params as numpy.

    ``devices=None`` uses every device of the job (the launched case); the single-process
    reference passes the first 4 devices.
    """
    import jax
    from jax.experimental import multihost_utils

    import autoshard
    from models import make_case, make_state, train_step

    classes = {"data": autoshard.DataParallel, "shard": autoshard.ShardParallel,
               "zero2": autoshard.Zero2Parallel, "zero3": autoshard.Zero3Parallel,
               "accumulate": lambda devices: autoshard.DataParallel(devices=devices,
                                                                    num_micro_batches=2)}
    out = {}
    for name in methods:
        model, x, y = make_case("mlp", batch=16)
        state = make_state(model, x)
        step = autoshard.parallelize(train_step, method=classes[name](devices=devices))
        losses = []
        for _ in range(steps):
            state, loss = step(state, (x, y))
            losses.append(float(loss))  # block between steps (CPU rendezvous on 2 cores)
        if jax.process_count() > 1:
            params = jax.tree.map(
                lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)),
                state.params)
        else:
            params = jax.tree.map(np.asarray, state.params)
        out[name] = {"losses": losses, "params": params}
    out["num_devices"] = jax.device_count()
    out["process"] = jax.process_index()
    return out


def assert_same_run(got, want):
    """Losses and parameters of two runs of ``train`` agree (up to summation order)."""
    import jax

    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(want["params"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def assert_equal_to_one_process_run(results):
    """Both processes of a 2 x 2-device ``train`` run match this process on 4 devices."""
    import jax

    reference = train(devices=jax.devices()[:4])
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["num_devices"] == 4 for r in results)
    for method in METHODS:
        for r in results:
            assert_same_run(r[method], reference[method])


def fail_on(rank: int, message: str):
    import jax

    if jax.process_index() == rank:
        raise ValueError(message)
    return jax.process_index()


def record_pid(pid_dir: str):
    import jax

    with open(os.path.join(pid_dir, f"{jax.process_index()}.pid"), "w") as f:
        f.write(str(os.getpid()))


def die_mid_step(pid_dir: str):
    """Rank 1 kills itself with SIGKILL while rank 0 waits for it in a collective."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    record_pid(pid_dir)
    if jax.process_index() == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), 9)
    return float(multihost_utils.process_allgather(jnp.ones(()), tiled=False).sum())


def hang(pid_dir: str):
    record_pid(pid_dir)
    time.sleep(600)


def reinit_round_trip():
    """shutdown() then init() again in the same processes: a second job works."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    import autoshard

    first = float(multihost_utils.process_allgather(jnp.ones(()) * (jax.process_index() + 1)).sum())
    autoshard.shutdown()
    assert not jax.distributed.is_initialized()
    autoshard.init("distributed")
    second = float(multihost_utils.process_allgather(jnp.ones(()) * 10).sum())
    return first, second, jax.process_count(), jax.device_count()


def plans(batch_rows_by_rank=None):
    """The plan each process agrees on, and the program fingerprint (ranks may trace different
    batch sizes to provoke a mismatch)."""
    import jax

    import autoshard
    from autoshard import distributed
    from models import make_case, make_state, train_step

    rows = 16 if batch_rows_by_rank is None else batch_rows_by_rank[jax.process_index()]
    model, x, y = make_case("mlp", batch=rows)
    state = make_state(model, x)
    f = autoshard.parallelize(train_step, method=autoshard.ShardParallel())
    ex = f.get_executable(state, (x, y))
    agreed = distributed.agree_on_plan("train_step", ex.program, ex.plan)
    planned_once = distributed.agree_on_plan(
        "train_step", ex.program, lambda: (_ for _ in ()).throw(AssertionError("not rank 0"))
        if jax.process_index() else ex.plan)
    return (distributed.program_fingerprint(ex.program), agreed == ex.plan,
            planned_once == ex.plan)


def loader_and_checkpoints(ckpt_dir: str):
    """Restore step 1 (saved by one process on 8 devices) onto this job's DataParallel plan,
    feed two steps from each process's own rows through DataLoader, save step 2."""
    import jax

    import autoshard
    from models import make_case, make_state, train_step

    rank, n = jax.process_index(), jax.process_count()
    model, x, y = make_case("mlp", batch=16)
    step = autoshard.parallelize(train_step, method=autoshard.DataParallel())
    global_batch = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype))
    state_specs, batch_specs = step.get_executable(
        make_state(model, x), global_batch).get_input_placement_specs()
    state = autoshard.restore_checkpoint(ckpt_dir, 1, state_specs)
    rows = slice(rank * 16 // n, (rank + 1) * 16 // n)
    local = [(np.asarray(x)[rows], np.asarray(y)[rows])] * 2
    specs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         global_batch, batch_specs)
    losses = []
    for batch in autoshard.DataLoader(local, specs, prefetch_size=1):
        state, loss = step(state, batch)
        losses.append(float(loss))
    autoshard.save_checkpoint(ckpt_dir, state, step=2)
    return losses
