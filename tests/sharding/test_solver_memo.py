"""Resharding costs shared across ILPs (``reshard_memo.MEMO``, issue 26 item 8) and the pricing-only
planner call (``plan_auto(compare_data_parallel=False)``): both leave every plan as it was."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import mlp, mse, sgd_step
from _util import plan_fn

from autoshard.sharding import AutoShardingOption, plan_auto, planner, reshard_memo
from autoshard.sharding.cost import CostModel

STEP = sgd_step(mse(mlp))
ARGS = ((jnp.ones((64, 256)), jnp.ones((256, 64))), jnp.ones((16, 64)), jnp.ones((16, 64)))


def plan(**opt):
    return plan_fn(STEP, ARGS, batch=[0, 0, 1, 1], aliases=[(0, 0), (1, 1)], **opt)[1]


@pytest.fixture
def reshards(monkeypatch):
    """Counts CostModel.reshard calls (what the memo saves)."""
    calls = []
    real = CostModel.reshard

    def counted(self, *args):
        calls.append(self.mesh_shape)
        return real(self, *args)
    monkeypatch.setattr(CostModel, "reshard", counted)
    return calls


def test_the_memo_gives_the_plans_of_unshared_costs(monkeypatch, reshards):
    # Without it: every ILP starts from empty tables, as when each ILP kept its own.
    monkeypatch.setattr(reshard_memo, "MEMO", reshard_memo._Memo(0))
    alone = [plan(logical_mesh_shape=(2, 4)), plan(logical_mesh_shape=(2, 4))]
    assert len(reshards) > 0
    memo = reshard_memo._Memo(reshard_memo.MEMO_MAX_BYTES)
    monkeypatch.setattr(reshard_memo, "MEMO", memo)
    reshards.clear()
    first = plan(logical_mesh_shape=(2, 4))
    priced = len(reshards)
    second = plan(logical_mesh_shape=(2, 4))
    assert priced > 0 and len(reshards) == priced  # the second plan priced nothing again
    tables = [t for (cost, *_), t in memo.tables.items() if cost.mesh_shape == (2, 4)]
    assert any(m is not None for t in tables for m in t.matrices.values())  # pairwise edges
    for got in (first, second):
        assert got.explain() == alone[0].explain()
        assert got.in_specs == alone[0].in_specs and got.out_specs == alone[0].out_specs
        assert got.objective == alone[0].objective


def test_the_byte_bound_evicts_the_oldest_cost_models(monkeypatch):
    memo = reshard_memo._Memo(reshard_memo.MEMO_MAX_BYTES)
    monkeypatch.setattr(reshard_memo, "MEMO", memo)
    a = plan(logical_mesh_shape=(2, 4))
    plan(logical_mesh_shape=(4, 2))
    meshes = [cost.mesh_shape for cost, *_ in memo.tables]
    assert (2, 4) in meshes and (4, 2) in meshes
    # What the bound counts: the matrices' data and a fixed price per entry.
    tables = list(memo.tables.values())
    assert memo.nbytes == sum(
        reshard_memo.MEMO_ENTRY_BYTES * (len(t.costs) + len(t.matrices))
        + sum(m.nbytes for m in t.matrices.values() if m is not None) for t in tables) > 0
    # Over the bound when an ILP starts: the cost models memoised first go until it fits.
    first = next(iter(memo.tables))
    old = memo.tables[first]
    memo.max_bytes = memo.nbytes - 1
    again = plan(logical_mesh_shape=(2, 4))
    assert first[0].mesh_shape == (2, 4) and memo.tables[first] is not old  # evicted, rebuilt
    assert memo.tables[first].costs == old.costs
    memo.max_bytes = 0  # nothing kept from one ILP to the next
    plan(logical_mesh_shape=(4, 2))
    assert len(memo.tables) == 1 and next(iter(memo.tables))[0].mesh_shape == (4, 2)
    assert again.explain() == a.explain()


def test_pricing_only_plans_skip_the_data_parallel_comparison(monkeypatch):
    calls = []
    real = planner._data_parallel_objective

    def counted(*args):
        calls.append(1)
        return real(*args)
    monkeypatch.setattr(planner, "_data_parallel_objective", counted)
    shown = plan()
    assert not calls   # solved when first read (explain(), save()), not while planning
    assert shown.objective.data_parallel_s is not None and len(calls) == 1
    assert shown.objective.data_parallel_s is not None and len(calls) == 1   # once
    priced = _plan_priced()
    assert len(calls) == 1  # not solved again
    assert priced.objective.data_parallel_s is None
    assert priced.objective == dataclasses.replace(shown.objective, _data_parallel_s=None)
    assert priced.in_specs == shown.in_specs and priced.intermediates == shown.intermediates
    assert priced.explain() == "\n".join(
        line for line in shown.explain().splitlines()
        if "pure data parallel on the same mesh" not in line)


def _plan_priced():
    closed = jax.make_jaxpr(STEP)(*ARGS)
    n = len(jax.tree.leaves(ARGS))
    return plan_auto(closed, num_devices=8, option=AutoShardingOption(show_progress=False),
                     in_paths=[f"in{i}" for i in range(n)],
                     out_paths=[f"out{i}" for i in range(len(closed.jaxpr.outvars))],
                     batch_invars=[False, False, True, True], aliases=[(0, 0), (1, 1)],
                     compare_data_parallel=False)


def test_matrices_are_never_written_through(monkeypatch):
    """An edge's accumulated costs are its own arrays: the memoised matrix stays as priced."""
    memo = reshard_memo._Memo(reshard_memo.MEMO_MAX_BYTES)
    monkeypatch.setattr(reshard_memo, "MEMO", memo)
    plan(logical_mesh_shape=(2, 4))
    saved = {k: m.copy() for t in memo.tables.values() for k, m in t.matrices.items()
             if m is not None}
    plan(logical_mesh_shape=(2, 4))
    for t in memo.tables.values():
        for k, m in t.matrices.items():
            if k in saved:
                np.testing.assert_array_equal(m, saved[k])


def test_the_per_axis_matrix_is_reshard_per_axis_float_for_float():
    """``reshard_memo.per_axis_matrix`` prices each distinct pair of axis places once; every entry
    is the float ``CostModel.reshard_per_axis`` gives (what decides an edge's exactness)."""
    from autoshard.sharding.spec import candidate_specs
    for mesh in [(2, 4), (2, 2, 2), (4, 1, 2)]:
        cost = CostModel(mesh, (5e-6, 2e-5, 1e-5)[:len(mesh)], (1e-10, 1e-9, 3e-10)[:len(mesh)],
                         devices_per_host=4)
        shape = (8, 16, 4)
        specs = list(candidate_specs(shape, mesh))
        srcs, dsts = specs[::2] + specs[:3], specs[1::2] + specs[:2]
        got = reshard_memo.per_axis_matrix(cost, srcs, dsts, shape, 2)
        want = np.array([[cost.reshard_per_axis(a, b, shape, 2) for b in dsts] for a in srcs])
        assert len(srcs) > 5 and (got != 0).any()
        np.testing.assert_array_equal(got, want)
