"""ZeRO finds the parameters of a step differentiated with plain ``jax.grad`` (no marker)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
import hlo
from autoshard._program import trace_program
from autoshard.ir._jaxpr import flatten_args
from autoshard.methods._data import read_with_the_batch
from models import assert_trees_close, copy_tree, make_case, make_state

N = 8  # devices (conftest)
TX = optax.adam(1e-2, eps=1e-3)


def mlp_case():
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(16, 64)) * 0.1, jnp.float32),
              "b1": jnp.zeros(64), "w2": jnp.asarray(rng.normal(size=(64, 8)) * 0.1, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    return (params, TX.init(params)), (x, y)


def adam_step(value_and_grad):
    def step(state, batch):
        params, opt = state

        def loss_fn(p):
            h = jnp.tanh(batch[0] @ p["w1"] + p["b1"])
            return jnp.mean((h @ p["w2"] - batch[1]) ** 2)
        loss, grads = value_and_grad(loss_fn)(params)
        updates, opt = TX.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss
    return step


def wire_bytes(f):
    return sum(c.wire_bytes * c.count
               for c in hlo.collectives(f.get_last_executable().get_hlo_text()))


@pytest.mark.parametrize("method", [autoshard.Zero3Parallel, autoshard.Zero2Parallel])
def test_zero_with_plain_jax_grad_shards_the_parameters_like_the_marker(method):
    state, batch = mlp_case()
    plain = autoshard.parallelize(adam_step(jax.value_and_grad), donate_argnums=(),
                                  method=method())
    marked = autoshard.parallelize(adam_step(autoshard.value_and_grad), donate_argnums=(),
                                   method=method())
    ref = jax.jit(adam_step(jax.value_and_grad))
    s, r = copy_tree(state), copy_tree(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "found no parameters"
        for _ in range(3):
            s, loss = plain(s, batch)
            r, ref_loss = ref(r, batch)
            np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        marked(copy_tree(state), batch)
    assert_trees_close(s, r, rtol=1e-5, atol=1e-6)
    # every Adam moment is stored split over the 8 devices, and so is every parameter with
    # ZeRO-3 (ZeRO-2 keeps them whole)
    ex = plain.get_last_executable()
    params, (adam, _) = ex.get_input_placement_specs()[0]
    split_params = method is autoshard.Zero3Parallel
    for leaf, spec, is_param in zip(
            jax.tree.leaves((state[0], state[1][0].mu, state[1][0].nu)),
            jax.tree.leaves((params, adam.mu, adam.nu)), [True] * 3 + [False] * 6, strict=True):
        local = spec.shard_shape(leaf.shape)
        rows = leaf.shape[0] // N if split_params or not is_param else leaf.shape[0]
        assert local == (rows,) + leaf.shape[1:], (spec, local)
    assert any("parameters found without a gradient marker" in n for n in ex.plan.notes)
    # the collectives are the marker's (all-gather of parameters, reduce of gradients), not
    # the 2x data parallelism's bytes of resharded activations
    assert wire_bytes(plain) <= 1.1 * wire_bytes(marked)
    kinds = {c.kind for c in hlo.collectives(ex.get_hlo_text())}
    assert "all-to-all" not in kinds


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_parameters_found_without_a_marker_are_the_differentiated_arguments(kind):
    """On a flax TrainState (params, Adam moments, an int step): exactly the params."""
    model, x, y = make_case(kind, batch=16)
    state = make_state(model, x)

    def step(value_and_grad):
        def train_step(state, batch):
            def loss_fn(params):
                return jnp.mean((state.apply_fn(params, batch[0]) - batch[1]) ** 2)
            loss, grads = value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), loss
        return train_step

    def program(value_and_grad):
        args = (state, (x, y))
        return trace_program(step(value_and_grad), args, flatten_args(args, ()),
                             batch_argnums=(1,), donate_argnums=(), num_micro_batches=1)[0]
    marked, plain = program(autoshard.value_and_grad), program(jax.value_and_grad)
    expected = [i for i, p in enumerate(marked.param_invars) if p]
    assert len(expected) == len(jax.tree.leaves(state.params))
    assert read_with_the_batch(plain) == expected


def test_no_parameters_found_names_the_state_and_the_fix():
    """A step whose update never meets the batch rows: nothing to find, and the warning
    says which inputs it looked at and what to call instead."""
    def step(state, batch):
        w, v = state
        g = jax.grad(lambda w: jnp.mean(batch) * jnp.sum(w ** 2))(w)  # w never meets a row
        return (w - 0.1 * g, v + 1.0), jnp.mean(batch)
    f = autoshard.parallelize(step, donate_argnums=(), method=autoshard.Zero3Parallel())
    state = (jnp.ones((8, 4)), jnp.zeros((8,)))
    with pytest.warns(RuntimeWarning, match=r"found no parameters.*returns updated arg0\[0\], "
                      r"arg0\[1\].*autoshard.value_and_grad\(loss_fn\)\(params\)"):
        f(state, jnp.ones((16, 3)))
