"""A two-stage pipeline train step run in every launched process, and its one-process reference.

The model is GPT-like: a token embedding shared by the input and the output projection (so its
gradient is summed over both stages), two MLP blocks with a stage boundary between them, Adam
after clipping by the global gradient norm (a reduction over both stages).
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import autoshard

STEPS = 3
BLOCKING = False
VOCAB, DIM = 32, 16


class MLPBlock(nn.Module):
    dim: int = DIM

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(2 * self.dim)(nn.LayerNorm()(x))
        return x + nn.Dense(self.dim)(nn.gelu(h))


class TinyGPT(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, DIM)
        x = MLPBlock()(embed(tokens))
        autoshard.mark_pipeline_boundary()
        x = MLPBlock()(x)
        return embed.attend(nn.LayerNorm()(x))


def make_state_and_tokens():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, size=(8, 9)), jnp.int32)
    model = TinyGPT()
    params = model.init(jax.random.key(0), tokens[:, :-1])
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2, eps=1e-3))
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx), tokens


def train_step(state, tokens):
    loss, grads = autoshard.value_and_grad(lambda p: _loss(state, p, tokens))(state.params)
    return state.apply_gradients(grads=grads), loss


STAGES = {
    # one stage per process: 2 devices each, copies between processes shard for shard
    "uniform": None,
    # 2 devices on process 0, 1 on process 1: copies as single-device pieces
    "2+1": ([[0], [1]], [(1, 2), (1, 1)], [(2,), (1,)], [{}, {}]),
    # the same devices, stage 0 laid out as a 1x2 mesh (a different plan from "2+1")
    "1x2+1": ([[0], [1]], [(1, 2), (1, 1)], [(1, 2), (1,)], [{}, {}]),
    # the same stages as "2+1", stage 0 planned with other options
    "2+1 rows on x": (
        [[0], [1]],
        [(1, 2), (1, 1)],
        [(2,), (1,)],
        [{"force_batch_dim_to_mesh_dim": 0}, {}],
    ),
}


def pipeline_method(devices=None, stages="uniform"):
    from autoshard.pipeline import ManualStageOption, PipeshardParallel, UniformStageOption

    manual = STAGES[stages]
    return PipeshardParallel(
        devices=devices,
        num_micro_batches=2,
        layer_option="manual",
        blocking=BLOCKING,
        stage_option=UniformStageOption(num_stages=2)
        if manual is None
        else ManualStageOption(*manual),
    )


def train_pipeline(stages=("uniform",), steps: int = STEPS, devices=None):
    """Per stage layout: losses, and the parameters this process can read (by path), after
    ``steps`` steps.

    In a launched job each process reads the parameters of the stage(s) it owns; the loss is
    readable everywhere. ``stages`` may be a dict from rank to stage layout (to make processes
    disagree).
    """
    if isinstance(stages, dict):
        stages = stages[jax.process_index()]
    out = {
        "process": jax.process_index(),
        "transfer_address": jax.config.read("jax_cross_host_transfer_socket_address"),
    }
    for layout in stages:
        state, tokens = make_state_and_tokens()
        if layout == "2+1":  # a state committed to a device of this process (each its own)
            state = jax.device_put(state, jax.local_devices()[0])
        used = list(devices or jax.devices())[: 4 if STAGES[layout] is None else 3]
        step = autoshard.parallelize(train_step, method=pipeline_method(used, layout))
        with _counting_planner_calls() as planned:
            step.get_executable(state, tokens)
        losses = []
        for _ in range(steps):
            state, loss = step(state, tokens)
            losses.append(float(loss))  # every process reads it: it is on every device
        ex = step.get_last_executable()
        out[layout] = {
            "losses": losses,
            "params": {
                jax.tree_util.keystr(path): np.asarray(leaf)
                for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
                if leaf.is_fully_addressable
            },
            "stage_devices": [len(m.devices.flat) for m in ex.rank_meshes],
            "stage_processes": [
                sorted({d.process_index for d in m.devices.flat}) for m in ex.rank_meshes
            ],
            "moves": dict(ex.move.counts),
            "sums": _sums(ex),
            "planner_calls": len(planned),
        }
    return out


def _sums(ex) -> list:
    """Per cross-stage sum: its shape, the devices its all-reduce spans, the all-reduces in its
    compiled program, and how many of its terms the audit sees copied between sub-meshes."""
    terms = [{str(t) for t in s.sum.terms} for s in ex.sums]
    moved = [t.value.split(" ")[0] for t in ex.audit().transfers]
    return [
        {
            "shape": s.shape,
            "devices": len(s.mesh.devices.flat),
            "all_reduces": sum(
                1 for line in s.compiled.as_text().splitlines() if " all-reduce(" in line
            ),
            "moved_terms": sum(1 for v in moved if v in ts),
        }
        for s, ts in zip(ex.sums, terms, strict=True)
    ]


@contextlib.contextmanager
def _counting_planner_calls():
    """The planner's calls for the pipeline's tasks while the block runs (one entry each)."""
    from autoshard.pipeline import tasks as pipeline_tasks

    calls, plan_auto = [], pipeline_tasks.plan_auto

    def counted(*args, **kwargs):
        calls.append(1)
        return plan_auto(*args, **kwargs)

    pipeline_tasks.plan_auto = counted
    try:
        yield calls
    finally:
        pipeline_tasks.plan_auto = plan_auto


def pipeline_without_transfer_address():
    """Build the pipeline after clearing the transfer address ``autoshard.init`` set."""
    jax.config.update("jax_cross_host_transfer_socket_address", "")
    state, tokens = make_state_and_tokens()
    step = autoshard.parallelize(train_step, method=pipeline_method())
    step.get_executable(state, tokens)


def train_jit(steps: int = STEPS):
    """The same steps through a single-device ``jax.jit``, and the first gradient's global
    norm (above the clipping threshold, so clipping is exercised)."""
    state, tokens = make_state_and_tokens()
    step = jax.jit(train_step)
    grads = jax.grad(lambda p: _loss(state, p, tokens))(state.params)
    losses = []
    for _ in range(steps):
        state, loss = step(state, tokens)
        losses.append(float(loss))
    params = {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
    }
    return {"losses": losses, "params": params, "grad_norm": float(optax.tree.norm(grads))}


def _loss(state, params, tokens):
    logits = state.apply_fn(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
