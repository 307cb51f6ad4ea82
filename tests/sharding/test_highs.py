"""``sharding.highs.milp``: HiGHS through highspy, checked against ``scipy.optimize.milp`` (the
same solver's scipy front end) on small problems and on ones large enough for the simplex-first
path and its interior-point fallback."""

import highspy
import numpy as np
import pytest
import scipy.sparse as sparse
from scipy.optimize import Bounds, LinearConstraint
from scipy.optimize import milp as scipy_milp

from autoshard.sharding import highs


def _knapsack(n: int, seed: int = 0, items: int = 3, capacity: float = 1.4):
    """Choose one of ``items`` items per group (rows ``sum x = 1``) under a shared weight
    row (``capacity`` times a random choice's mean weight)."""
    rng = np.random.default_rng(seed)
    c = rng.uniform(1, 10, items * n)
    pick = sparse.kron(sparse.eye(n), np.ones((1, items))).tocsr()
    weight = rng.uniform(0, 1, (1, items * n))
    cons = [LinearConstraint(pick, 1, 1),
            LinearConstraint(weight, -np.inf, capacity * weight.sum() / items)]
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


def _recorded_options(monkeypatch) -> list:
    """The (name, value) of every HiGHS option set from now on."""
    chosen = []
    real = highspy.Highs.setOptionValue

    def record(self, name, value):
        chosen.append((name, value))
        return real(self, name, value)
    monkeypatch.setattr(highspy.Highs, "setOptionValue", record)
    return chosen


def _large_knapsack(integer: bool, weight: bool = True):
    c, cons = _knapsack(highs.IPM_MIN_ROWS, seed=1, capacity=0.9)
    if not weight:
        cons = cons[:1]
    return dict(c=c, integrality=np.full(len(c), 1 if integer else 0),
                bounds=(np.zeros(len(c)), np.ones(len(c))), constraints=cons,
                options={"mip_rel_gap": 1e-6})


def _scipy_fun(problem) -> float:
    res = scipy_milp(problem["c"], integrality=problem["integrality"],
                     bounds=Bounds(*problem["bounds"]), constraints=problem["constraints"],
                     options=problem["options"])
    assert res.status == highs.OPTIMAL
    return res.fun


@pytest.mark.parametrize("integer", [False, True])
def test_large_problems_try_the_dual_simplex_first(monkeypatch, integer):
    """At ``IPM_MIN_ROWS`` rows the LP is first solved by the dual simplex within
    ``SIMPLEX_ITERATIONS_PER_ROW`` iterations per row: an LP is done there; the knapsack's
    binding weight row leaves its LP fractional, so the ILP then goes the interior-point
    path (its root LP by the interior-point method, the branch and bound HiGHS's)."""
    chosen = _recorded_options(monkeypatch)
    problem = _large_knapsack(integer)
    ours = highs.milp(**problem)
    rows = highs.IPM_MIN_ROWS + 1
    assert chosen[:3] == [("output_flag", False), ("mip_rel_gap", 1e-6),
                          ("simplex_iteration_limit",
                           int(highs.SIMPLEX_ITERATIONS_PER_ROW * rows))]
    runs = sum(1 for name, _ in chosen if name == "output_flag")
    assert runs == (2 if integer else 1)  # the fractional LP, then the ILP
    assert (("mip_lp_solver", "ipm") in chosen) == integer
    assert ("solver", "ipm") not in chosen
    assert ours.status == highs.OPTIMAL
    assert ours.fun == pytest.approx(_scipy_fun(problem), rel=1e-5)
    if integer:
        assert set(np.round(ours.x, 6)) <= {0.0, 1.0}


def test_an_integral_lp_optimum_is_the_ilps(monkeypatch):
    """Without the weight row the LP's vertex optimum is integral: it is returned as the ILP's
    optimum with no branch and bound run."""
    chosen = _recorded_options(monkeypatch)
    problem = _large_knapsack(integer=True, weight=False)
    ours = highs.milp(**problem)
    assert ours.status == highs.OPTIMAL and ours.mip_node_count == 0 and ours.mip_gap == 0.0
    assert set(np.round(ours.x, 9)) <= {0.0, 1.0}
    assert ours.fun == pytest.approx(_scipy_fun(problem), rel=1e-9)
    assert sum(1 for name, _ in chosen if name == "output_flag") == 1  # one HiGHS run


def test_a_start_basis_solves_another_objective_from_there(monkeypatch):
    """The LP optimum's basis comes back (``Result.basis``) and starts a solve of the same rows
    under another objective (``start``: the planner's least_memory and least_peak re-solves):
    the same optimum as from scratch, in fewer simplex iterations."""
    iterations = []
    real = highspy.Highs.run

    def run(self):
        status = real(self)
        iterations.append(self.getInfo().simplex_iteration_count)
        return status
    monkeypatch.setattr(highspy.Highs, "run", run)
    problem = _large_knapsack(integer=False)
    first = highs.milp(**problem)
    assert first.status == highs.OPTIMAL and first.basis is not None
    other = dict(problem, c=problem["c"] * np.random.default_rng(2).uniform(0.95, 1.05,
                                                                        len(problem["c"])))
    cold = highs.milp(**other)
    warm = highs.milp(**other, start=first.basis)
    assert warm.status == cold.status == highs.OPTIMAL
    assert warm.fun == pytest.approx(cold.fun, rel=1e-9)
    assert iterations[2] < iterations[1] / 2, iterations
    # A small problem goes to scipy.optimize.milp: no basis, and a start is ignored.
    c, cons = _knapsack(30)
    small = dict(c=c, integrality=np.zeros(len(c)), bounds=(np.zeros(len(c)), np.ones(len(c))),
                 constraints=cons)
    assert highs.milp(**small).basis is None
    assert highs.milp(**small, start=first.basis).fun == pytest.approx(
        highs.milp(**small).fun, rel=1e-12)


@pytest.mark.parametrize("integer,option", [(False, "solver"), (True, "mip_lp_solver")])
def test_a_stalled_simplex_hands_over_to_interior_point(monkeypatch, integer, option):
    """A dual simplex that reaches its iteration limit (degenerate LPs: the per-axis ILPs of
    Table 1's pipeline tasks) leaves the problem to the interior-point method."""
    monkeypatch.setattr(highs, "SIMPLEX_ITERATIONS_PER_ROW", 0.01)
    chosen = _recorded_options(monkeypatch)
    problem = _large_knapsack(integer)
    ours = highs.milp(**problem)
    assert ("simplex_iteration_limit", int(0.01 * (highs.IPM_MIN_ROWS + 1))) in chosen
    assert (option, "ipm") in chosen
    assert ours.status == highs.OPTIMAL
    assert ours.fun == pytest.approx(_scipy_fun(problem), rel=1e-5)


def test_wide_and_small_problems_stay_on_the_simplex(monkeypatch):
    n = highs.IPM_MIN_ROWS
    chosen = _recorded_options(monkeypatch)
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


def test_concurrently_runs_the_calls_side_by_side_and_keeps_their_order(monkeypatch):
    import threading
    monkeypatch.setattr(highs, "SOLVER_THREADS", 2)
    both = threading.Barrier(2, timeout=20)   # passed only when the two run at once

    def call(i):
        both.wait()
        return i
    assert highs.concurrently([lambda: call(1), lambda: call(2)]) == [1, 2]

    def fails():
        raise ValueError("no plan")
    with pytest.raises(ValueError, match="no plan"):
        highs.concurrently([lambda: 3, fails])
    monkeypatch.setattr(highs, "SOLVER_THREADS", 1)
    assert highs.concurrently([lambda: 4, lambda: 5]) == [4, 5]


def test_concurrently_runs_each_call_in_the_callers_context(monkeypatch):
    from autoshard.sharding.cost import byte_cost, device_speed, flop_cost
    monkeypatch.setattr(highs, "SOLVER_THREADS", 2)
    with device_speed(2.0, 3.0):
        priced = highs.concurrently([lambda: flop_cost(10.0, 1), lambda: byte_cost(10.0, 2)])
    assert priced == [20.0, 15.0]


def test_an_lp_solved_alone_takes_the_parallel_dual_simplex_to_the_serial_ones_vertex(
        monkeypatch):
    """An LP of the simplex-first path that has the cores to itself runs HiGHS's parallel
    dual simplex (``PARALLEL_SIMPLEX``), as does one ``concurrently`` runs beside work that
    does not solve (``solvers=1``); two run side by side stay serial, and so does a solve
    nested inside a call that shares the cores. The vertex is the serial simplex's, to the
    last digit."""
    monkeypatch.setattr(highs, "SOLVER_THREADS", 2)
    chosen = _recorded_options(monkeypatch)
    problem = _large_knapsack(integer=False, weight=False)
    alone = highs.milp(**problem)
    parallel = ("simplex_strategy", highs.PARALLEL_SIMPLEX)
    assert parallel in chosen
    chosen.clear()
    side_by_side = highs.concurrently([lambda: highs.milp(**problem),
                                       lambda: highs.milp(**problem)])
    assert parallel not in chosen
    for res in side_by_side:
        assert np.array_equal(res.x, alone.x) and res.fun == alone.fun
    chosen.clear()
    beside, nothing = highs.concurrently([lambda: highs.milp(**problem), lambda: None],
                                         solvers=1)
    assert parallel in chosen and nothing is None
    assert np.array_equal(beside.x, alone.x)
    chosen.clear()
    nested = highs.concurrently([lambda: highs.concurrently(
        [lambda: highs.milp(**problem), lambda: None], solvers=1), lambda: None])
    assert parallel not in chosen   # inside a call that shares the cores already
    assert np.array_equal(nested[0][0].x, alone.x)


def _owner_and_waiter(cache, result):
    """What two threads got asking ``once`` for one key, the second while the first computes
    it (``result``: a value, or an exception to raise); a ValueError as its message. And the
    number of times it was computed."""
    import threading
    import time
    started, calls = threading.Event(), []

    def compute():
        calls.append(1)
        started.set()
        time.sleep(0.2)   # the second thread asks while this one computes
        if isinstance(result, Exception):
            raise result
        return result

    def ask(wait):
        if wait:
            started.wait(20)
        try:
            return highs.once(cache, "task", compute)
        except ValueError as err:
            return str(err)
    return highs.concurrently([lambda: ask(False), lambda: ask(True)]), len(calls)


def test_once_computes_a_key_one_time_while_other_threads_wait_for_it(monkeypatch):
    monkeypatch.setattr(highs, "SOLVER_THREADS", 2)
    cache = {}
    assert _owner_and_waiter(cache, "plan") == (["plan", "plan"], 1)
    assert cache == {"task": "plan"}
    assert highs.once(cache, "task", lambda: "again") == "plan"


def test_once_hands_an_error_to_the_waiting_thread_and_keeps_nothing(monkeypatch):
    monkeypatch.setattr(highs, "SOLVER_THREADS", 2)
    cache = {}
    got = _owner_and_waiter(cache, ValueError("no plan within the memory"))
    assert got == (["no plan within the memory"] * 2, 1)
    assert cache == {}
    assert highs.once(cache, "task", lambda: "planned") == "planned"   # computed again
