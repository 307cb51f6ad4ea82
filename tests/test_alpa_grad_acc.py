"""Gradient accumulation read as Alpa's two modules (accumulate_grad, apply_grad).

Ports (written here) of Alpa's ``tests/shard_parallel/test_gradient_accumulation.py``:
``test_gradient_accumulation_single_host``, ``test_gradient_accumulation_2d_mesh`` and
``test_gradient_accumulation_reduce_scatter``. Alpa compiles a step with
``num_micro_batches`` as two executables and its tests split ``get_hlo_text()`` on
``"HloModule"``: the gradient reduction belongs to the first, the update (and, under
``prefer_reduce_scatter``, the one all-gather of the updated parameters) to the second.
autoshard compiles one module (the micro-batch loop, one reduction after it, the update);
``get_hlo_text()`` cuts it there (``sharding.hlo.accumulate_apply_modules``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training.train_state import TrainState
from jax.sharding import Mesh

import autoshard
from autoshard.sharding import hlo


class DenseStack(nn.Module):
    """Alpa's ``MLPModel``: ``num_layers`` Dense layers of ``hidden`` features, no activation."""
    num_layers: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.num_layers):
            x = nn.Dense(self.hidden)(x)
        return x


def mlp_sgd_step(batch_size=256, hidden=16, num_layers=2):
    """Alpa's ``get_mlp_train_state_and_step`` (SGD with momentum, value_and_grad), smaller."""
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (batch_size, hidden))
    y = jax.random.normal(jax.random.PRNGKey(1), (batch_size, hidden))
    model = DenseStack(num_layers, hidden)
    state = TrainState.create(apply_fn=model.apply, params=model.init(key, x),
                              tx=optax.sgd(1e-2, momentum=0.9))

    def step(state, batch):
        def loss(p):
            return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)
        val, grads = autoshard.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), val

    return step, state, {"x": x, "y": y}


def run_accumulated(mesh_shape, prefer_reduce_scatter=False, num_micro_batches=2):
    step, state, batch = mlp_sgd_step()
    expected = jax.jit(step)(state, batch)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(mesh_shape), ("x", "y"))
    option = autoshard.AutoShardingOption(
        allow_all_to_all=False, prefer_reduce_scatter=prefer_reduce_scatter,
        mesh_alpha=(1.0, 1.0), mesh_beta=(1.0, 1.0), memory_tradeoff=0.0, show_progress=False)
    f = autoshard.parallelize(step, donate_argnums=(), method=autoshard.ShardParallel(
        devices=mesh, num_micro_batches=num_micro_batches, auto_sharding_option=option))
    actual = f(state, batch)
    np.testing.assert_allclose(actual[1], expected[1], rtol=1e-5, atol=1e-6)
    for a, e in zip(jax.tree.leaves(actual[0].params), jax.tree.leaves(expected[0].params),
                    strict=True):
        np.testing.assert_allclose(a, e, rtol=5e-4, atol=5e-4)
    return f.get_last_executable()


def modules(ex) -> list[str]:
    """Alpa's split: ``_, accumulate_grad, apply_grad = text.split("HloModule")``."""
    empty, *parts = ex.get_hlo_text().split("HloModule")
    assert empty == ""
    return ["HloModule" + p for p in parts]


def kinds(text: str) -> list[str]:
    return sorted(c.kind for c in hlo.collectives(text))


def test_single_host_reduces_once_in_accumulate_and_applies_without_collectives():
    """test_gradient_accumulation_single_host: (1, 4) mesh, 2 micro-batches: one all-reduce
    in accumulate_grad (after the loop: none inside it), no collective in apply_grad."""
    ex = run_accumulated((1, 4))
    accumulate, apply = modules(ex)
    found = hlo.collectives(accumulate)
    assert [(c.kind, c.in_loop) for c in found] == [("all-reduce", False)]
    assert kinds(apply) == []
    assert " while(" in accumulate and " while(" not in apply


def test_2d_mesh_reduces_in_accumulate_only():
    """test_gradient_accumulation_2d_mesh: (2, 2) mesh: accumulate_grad's collectives are
    all-reduces, apply_grad has none."""
    ex = run_accumulated((2, 2))
    accumulate, apply = modules(ex)
    assert kinds(accumulate) and set(kinds(accumulate)) == {"all-reduce"}
    assert kinds(apply) == []


def test_reduce_scatter_then_one_all_gather_in_apply():
    """test_gradient_accumulation_reduce_scatter: prefer_reduce_scatter on (1, 4): one
    reduction in accumulate_grad (XLA:CPU lowers the reduce-scatter as an all-reduce that the
    update slices per device, combined with the bias sums), one all-gather of every updated,
    split kernel in apply_grad (gathered in one buffer, as apply_plan does)."""
    ex = run_accumulated((1, 4), prefer_reduce_scatter=True)
    accumulate, apply = modules(ex)
    assert kinds(accumulate) == ["all-reduce"]
    assert kinds(apply) == ["all-gather"]
    # the update of each split kernel reads its device's slice of the reduced gradient
    assert apply.count("partition-id()") == 1 and "%partition-id" in apply


def test_the_two_modules_are_the_compiled_module_cut_once():
    """Every collective and every non-constant instruction of the compiled entry is in
    exactly one module; each module parses as HLO; the apply module takes the accumulate
    module's outputs as its last parameters."""
    from jaxlib import _hlo

    ex = run_accumulated((1, 4), prefer_reduce_scatter=True)
    whole = ex.get_compiled_hlo_text()
    assert whole.count("HloModule") == 1
    accumulate, apply = modules(ex)
    assert sorted(kinds(accumulate) + kinds(apply)) == kinds(whole)
    entry = hlo.computations(whole)
    entry = next(b for b in entry.values() if b.startswith("ENTRY"))
    own = [line.split(" = ")[0].strip().removeprefix("ROOT ") for line in entry.splitlines()[1:]
           if " = " in line and not any(f" {op}(" in line for op in (
               "parameter", "constant", "partition-id"))]
    defined = [line.split(" = ")[0].strip().removeprefix("ROOT ")
               for part in (accumulate, apply)
               for line in next(b for b in hlo.computations(part).values()
                                if b.startswith("ENTRY")).splitlines()[1:]
               if " = " in line and " parameter(" not in line and " constant(" not in line
               and " partition-id(" not in line]
    assert sorted(own) == sorted(d for d in defined if not d.endswith("_outputs"))
    root = next(line for line in accumulate.splitlines() if "_accumulate_grad_outputs = " in line)
    outputs = root.split("tuple(")[1].rstrip(")").split(", ")
    apply_entry = next(b for b in hlo.computations(apply).values() if b.startswith("ENTRY"))
    first = apply_entry.count(" parameter(") - len(outputs)
    for i, name in enumerate(outputs):
        assert re.search(rf"{re.escape(name)} = \S+ parameter\({first + i}\)", apply_entry)
    for part in (accumulate, apply):
        assert _hlo.hlo_module_from_text(part).name.endswith(("_accumulate_grad", "_apply_grad"))


def test_without_micro_batches_the_text_is_the_compiled_module():
    ex = run_accumulated((1, 4), num_micro_batches=1)
    assert ex.get_hlo_text() == ex.get_compiled_hlo_text()
    assert ex.get_hlo_text().count("HloModule") == 1


def test_a_module_without_the_accumulation_scope_is_not_cut():
    text = jax.jit(lambda x: jax.lax.fori_loop(0, 2, lambda i, c: c * 2, x)).lower(
        jnp.ones(4)).compile().as_text()
    assert " while(" in text
    assert hlo.accumulate_apply_modules(text) is None


@pytest.mark.parametrize("method", [autoshard.DataParallel, autoshard.Zero2Parallel])
def test_fixed_plan_methods_read_the_same_way(method):
    """DataParallel reduces every gradient with one all-reduce; Zero2Parallel reduce-scatters
    them (the same all-reduce, sliced by the update on XLA:CPU) and gathers the 4 updated
    parameters in apply_grad (its fixed plan leaves them to XLA: one all-gather each)."""
    step, state, batch = mlp_sgd_step()
    f = autoshard.parallelize(step, donate_argnums=(), method=method(num_micro_batches=2))
    f(state, batch)
    accumulate, apply = modules(f.get_last_executable())
    assert kinds(accumulate) == ["all-reduce"]
    assert kinds(apply) == ([] if method is autoshard.DataParallel else ["all-gather"] * 4)
