"""``sharding.highs.milp``: HiGHS through highspy, checked against ``scipy.optimize.milp`` (the
same solver's scipy front end) on small problems and on one large enough for the
interior-point root."""

import highspy
import numpy as np
import pytest
import scipy.sparse as sparse
from scipy.optimize import Bounds, LinearConstraint
from scipy.optimize import milp as scipy_milp

from autoshard.sharding import highs


def _knapsack(n: int, seed: int = 0, items: int = 3):
    """Choose one of ``items`` items per group (rows ``sum x = 1``) under a shared weight
    row."""
    rng = np.random.default_rng(seed)
    c = rng.uniform(1, 10, items * n)
    pick = sparse.kron(sparse.eye(n), np.ones((1, items))).tocsr()
    weight = rng.uniform(0, 1, (1, items * n))
    cons = [LinearConstraint(pick, 1, 1),
            LinearConstraint(weight, -np.inf, 1.4 * weight.sum() / items)]
    return c, cons


@pytest.mark.parametrize("integer", [True, False])
def test_matches_scipy_milp(integer):
    c, cons = _knapsack(30)
    integrality = np.full(len(c), 1 if integer else 0)
    bounds = (np.zeros(len(c)), np.ones(len(c)))
    ours = highs.milp(c, integrality=integrality, bounds=bounds, constraints=cons,
                      options={"time_limit": 60.0, "mip_rel_gap": 0.0})
    theirs = scipy_milp(c, integrality=integrality, bounds=Bounds(*bounds), constraints=cons,
                        options={"time_limit": 60.0, "mip_rel_gap": 0.0})
    assert ours.status == theirs.status == highs.OPTIMAL
    assert ours.fun == pytest.approx(theirs.fun, rel=1e-9)
    assert ours.x.shape == (len(c),)
    assert (ours.mip_node_count is not None) == integer
    if integer:
        assert set(np.round(ours.x, 6)) <= {0.0, 1.0}


def test_infeasible_and_limits_use_scipys_codes():
    c, cons = _knapsack(10)
    n = len(c)
    bounds = (np.zeros(n), np.ones(n))
    impossible = cons + [LinearConstraint(np.ones((1, n)), 11, 11)]  # one item per group: 10
    res = highs.milp(c, integrality=np.ones(n), bounds=bounds, constraints=impossible)
    assert res.status == highs.INFEASIBLE and res.x is None and res.fun is None
    c, cons = _knapsack(400, seed=3)
    res = highs.milp(c, integrality=np.ones(len(c)), bounds=(np.zeros(len(c)), np.ones(len(c))),
                     constraints=cons, options={"node_limit": 1, "mip_rel_gap": 0.0})
    assert res.status in (highs.OPTIMAL, highs.STOPPED)
    assert res.mip_node_count <= 1


def test_large_problems_solve_their_lp_by_interior_point(monkeypatch):
    """At ``IPM_MIN_ROWS`` rows the LP (and an ILP's root LP) is solved by the interior-point
    method, with the same optimum as scipy's (simplex) front end."""
    chosen = []
    real = highspy.Highs.setOptionValue

    def record(self, name, value):
        chosen.append((name, value))
        return real(self, name, value)
    monkeypatch.setattr(highspy.Highs, "setOptionValue", record)
    n = highs.IPM_MIN_ROWS
    c, cons = _knapsack(n, seed=1)
    bounds = (np.zeros(len(c)), np.ones(len(c)))
    for integer, option in ((False, "solver"), (True, "mip_lp_solver")):
        chosen.clear()
        integrality = np.full(len(c), 1 if integer else 0)
        ours = highs.milp(c, integrality=integrality, bounds=bounds, constraints=cons,
                          options={"mip_rel_gap": 1e-6})
        theirs = scipy_milp(c, integrality=integrality, bounds=Bounds(*bounds),
                            constraints=cons, options={"mip_rel_gap": 1e-6})
        assert (option, "ipm") in chosen
        assert ours.status == theirs.status == highs.OPTIMAL
        assert ours.fun == pytest.approx(theirs.fun, rel=1e-5)
    # Few rows, or many columns per row (as the pair-priced ILPs): the simplex; and no
    # presolve where such a problem is large.
    wide = highs.IPM_MAX_COLUMNS_PER_ROW + 1
    for groups, items, presolve in ((50, 3, True), (n, wide, True),
                                    (n, -(-highs.NO_PRESOLVE_MIN_COLUMNS // n), False)):
        chosen.clear()
        c, cons = _knapsack(groups, items=items)
        bounds = (np.zeros(len(c)), np.ones(len(c)))
        res = highs.milp(c, integrality=np.zeros(len(c)), bounds=bounds, constraints=cons)
        theirs = scipy_milp(c, integrality=np.zeros(len(c)), bounds=Bounds(*bounds),
                            constraints=cons)
        assert res.status == highs.OPTIMAL and res.fun == pytest.approx(theirs.fun, rel=1e-9)
        assert not any(value == "ipm" for _, value in chosen)
        assert (("presolve", "off") not in chosen) == presolve


def test_unknown_option_is_refused():
    c, cons = _knapsack(3)
    with pytest.raises(ValueError, match=r"\['threads'\].*time_limit, node_limit"):
        highs.milp(c, integrality=np.ones(len(c)), bounds=(np.zeros(9), np.ones(9)),
                   constraints=cons, options={"threads": 2})
