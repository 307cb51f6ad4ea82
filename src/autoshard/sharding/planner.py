"""plan_auto: trace graph -> strategies per logical mesh -> ILP -> the cheapest ShardingPlan.

Needs no devices: only abstract values and the mesh shape, so a plan for a cluster far larger
than this machine can be computed, printed and costed here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np
from jax.extend import core
from jax.sharding import PartitionSpec
from tqdm.auto import tqdm

from . import solver
from .alpa_units import alpa_objective
from .assemble import make_plan
from .build import (
    build_problem,
    data_parallel_variant,
)
from .cost import ClusterCosts, CostModel, device_speed, dominated_meshes
from .flops import eqn_roles, model_flops
from .graph import Graph, build_graph
from .highs import concurrently
from .ilp import build_ilp
from .least_memory import least_memory
from .memory import warm as warm_memory
from .no_plan import no_plan_error, state_bytes_lower_bound, state_too_large
from .options import DEFAULT_MEMORY_TRADEOFF, AutoShardingOption
from .pareto import expert_choice, least_peak, plan_trade_off
from .partial_sums import fold_partial_sums
from .plan import ShardingPlan, later
from .problem import Problem
from .repeats import tie_repeated
from .solver import (
    Solution,
    build_and_solve,
    cutoff_bound_s,
    ruled_out_without_rows,
    solve_ilp,
    with_rows,
)
from .spec import from_partition_spec
from .zero_update import zero_update

DEFAULT_AXIS_NAMES = {1: ("x",), 2: ("x", "y")}


def mesh_candidates(num_devices: int, option: AutoShardingOption,
                    rank: int | None = None,
                    devices_per_host: int | None = None) -> list[tuple[int, ...]]:
    """1-D, then every 2-D factorization (both orders), unless the option fixes the shape.

    On several hosts (``devices_per_host`` dividing ``num_devices``) also the 3-D meshes
    ``(a, hosts / a, devices_per_host)``: the hosts split two ways (e.g. data x a second
    model axis across nodes) and one axis inside each host, as Megatron-LM lays out its
    tensor x data parallelism where the hosts do not factor into two good 2-D axes."""
    if option.logical_mesh_shape is not None:
        shape = option.logical_mesh_shape
        if int(np.prod(shape)) != num_devices:
            raise ValueError(
                f"logical_mesh_shape {shape} holds {int(np.prod(shape))} devices but the method "
                f"has {num_devices}. Choose a shape whose product is {num_devices}.")
        return [shape]
    if option.force_data_parallel:
        return [(num_devices,)] if rank in (None, 1) else [(1, num_devices)]
    found = [(num_devices,)] if rank in (None, 1) else []
    if rank in (None, 2):
        found += [(a, num_devices // a) for a in range(2, num_devices)
                  if num_devices % a == 0]
    if rank in (None, 3) and devices_per_host and 1 < devices_per_host < num_devices and (
            num_devices % devices_per_host == 0):
        hosts = num_devices // devices_per_host
        found += [(a, hosts // a, devices_per_host) for a in range(2, hosts) if hosts % a == 0]
    return found or [(1,) * (rank - 1) + (num_devices,)]


class Outpriced(ValueError):
    """No mesh has a plan under ``plan_auto``'s ``cutoff_s``: ``reasons`` says, per mesh, the
    bound (or plan) that reached it; ``errors`` holds the meshes that had no plan at all."""

    def __init__(self, cutoff_s: float, reasons: dict, errors: list):
        self.cutoff_s, self.reasons, self.errors = cutoff_s, reasons, errors
        shown = "; ".join(f"{m}: {why}" for m, why in list(reasons.items())[:4])
        more = f" (and {len(reasons) - 4} more)" if len(reasons) > 4 else ""
        super().__init__(
            f"No mesh has a plan faster than the cutoff, {cutoff_s:.4g} s per step "
            f"({len(reasons)} mesh(es) ruled out by bounds: {shown}{more}). Without cutoff_s "
            "the planner would return its best plan, slower than that.")


def plan_auto(closed_jaxpr: core.ClosedJaxpr, *, num_devices: int, option: AutoShardingOption,
              in_paths: Sequence[str], out_paths: Sequence[str], batch_invars: Sequence[bool],
              aliases: Sequence[tuple[int, int]] = (),
              axis_names: Sequence[str] | None = None,
              devices_per_host: int | None = None,
              cluster: ClusterCosts | None = None,
              fixed_in_specs: Sequence[PartitionSpec | None] | None = None,
              top_mults: dict[int, tuple[float, float]] | None = None,
              compare_data_parallel: bool = True,
              batch_dims: dict | None = None,
              cutoff_s: float | None = None,
              skip_meshes: dict | None = None,
              mesh_bounds: dict | None = None,
              mesh_failures: dict | None = None) -> ShardingPlan:
    """Plan every array of ``closed_jaxpr`` over ``num_devices`` devices (no devices needed).

    ``fixed_in_specs``: per input, the PartitionSpec it arrives in (over ``axis_names``, or
    the default names of each candidate mesh), or None to let the planner choose: e.g. the
    layout a producer gives a value, so the plan reshards it where the cost model sees it.
    A program with nothing to place (no inputs, outputs or equations) gets the trivial plan.

    ``top_mults``: top-level equation index -> (times it runs per step, times its own
    collectives run): the micro-batch loop of gradient accumulation runs its equations
    ``num_micro_batches`` times and reduces the accumulated gradients once.

    ``devices_per_host``: how many consecutive devices share a host (None: one host); axes
    that cross hosts cost the inter-host link. ``cluster`` (an ``autoshard.Cluster``) gives
    the links, FLOP/s and memory instead: its links price every axis where it lies, its
    device's speed the compute term, its memory the budget (unless the option sets one).
    Only a budget the option sets (or the default that weighs memory) offers the
    reduce-scatters of gradients into their update's shards (``build.build_problem``'s
    ``scatter_gradients``): a cluster's memory keeps the ILP's size.

    ``batch_dims``: value site -> the dim holding the batch's rows; with
    ``force_batch_dim_to_mesh_dim`` that dim of every value follows the forced axis
    (``build.build_problem``).

    ``cutoff_s``: seconds a plan must beat (the best step time another method found, e.g. a
    pipeline's): meshes whose cost lower bound or LP bound reaches it are not solved, as
    meshes that cannot beat the best one found here are not; when no mesh can, ``Outpriced``
    is raised. The bounds are exact, so the plan returned is the one found without it.

    ``skip_meshes``: mesh shape -> why it is not searched (reported in ``meshes_pruned``),
    e.g. the meshes an easier variant of the same program found no plan on.
    ``mesh_bounds``: filled with mesh shape -> seconds no plan of that mesh costs less than
    (the cost and LP bounds found here, a solved plan's objective less its gap): bounds of
    an easier variant of the program (its costs no higher on every mesh) rule meshes out of
    a harder one's search (``skip_meshes``).
    ``mesh_failures``: filled with mesh shape -> why it has no plan (the solver's error), for
    the meshes whose ILP was solved and found none.

    ``compare_data_parallel``: also solve pure data parallel on the chosen mesh, the figure
    ``explain()`` shows beside the plan (``Objective.data_parallel_s``; a second, easier ILP).
    Callers that only price the plan (a pipeline's tasks, candidates of a search) pass False:
    every other field of the plan is the same, ``data_parallel_s`` is None.

    Meshes that cannot win are not solved: a mirror of a mesh whose axes all cost no more
    (``cost.dominated_meshes``), a mesh on which the state alone cannot fit the budget, and a
    mesh whose lower bound (every ILP variable at its cheapest strategy, no resharding) is
    already above the best objective found. Large ILPs (``solver.CUTOFF_MIN_COLUMNS``) are
    solved best-first by their LP relaxation, and one whose LP bound reaches the best
    objective found is skipped (``solver.solve_ilp``'s cutoff; deterministic).
    """
    n_in, n_out = len(closed_jaxpr.jaxpr.invars), len(closed_jaxpr.jaxpr.outvars)
    for name, seq, n in (("in_paths", in_paths, n_in), ("batch_invars", batch_invars, n_in),
                         ("out_paths", out_paths, n_out)):
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries but the jaxpr has {n}; give one "
                             "per flat leaf.")
    for i, o in aliases:
        if not (0 <= i < n_in and 0 <= o < n_out):
            raise ValueError(f"aliases entry ({i}, {o}) is out of range for {n_in} inputs and "
                             f"{n_out} outputs.")
    if num_devices < 1:
        raise ValueError(f"num_devices ({num_devices}) must be at least 1.")
    if fixed_in_specs is not None and len(fixed_in_specs) != n_in:
        raise ValueError(f"fixed_in_specs has {len(fixed_in_specs)} entries but the jaxpr has "
                         f"{n_in} inputs; give one PartitionSpec or None per flat leaf.")
    user_budget = option.memory_budget_per_device is not None  # before a cluster fills it in
    # The default weighs memory (``pareto.expert_choice``): it offers the gradients'
    # reduce-scatters into their update's shards (ZeRO) as a user's budget does. Not where
    # the devices' memory bounds the plan (a cluster's: the fastest plan within it), nor for
    # a micro-batch loop (``top_mults``: its accumulators' sharded layouts compiled to 1.29x
    # the estimate, tests/test_micro_batch_plan.py), nor under Alpa's data-parallel options.
    weigh_memory = (option.memory_tradeoff is None and not user_budget and not top_mults
                    and (cluster is None or cluster.memory_bytes is None)
                    and not option.force_data_parallel and not option.prefer_reduce_scatter)
    if cluster is not None:
        if cluster.num_devices != num_devices:
            raise ValueError(
                f"num_devices ({num_devices}) differs from the {cluster.num_devices} devices of "
                f"the cluster ({cluster.name}). Plan for the cluster's device count or describe "
                "the cluster you run on.")
        if devices_per_host not in (None, cluster.devices_per_host):
            raise ValueError(
                f"devices_per_host ({devices_per_host}) differs from the cluster's "
                f"({cluster.devices_per_host}). Give one of the two.")
        if option.memory_budget_per_device is None and cluster.memory_bytes is not None:
            option = dataclasses.replace(option, memory_budget_per_device=cluster.memory_bytes)
        devices_per_host = cluster.devices_per_host
        speed = device_speed(cluster.flop_s, cluster.byte_s)
    else:
        speed = contextlib.nullcontext()
    rank = len(axis_names) if axis_names is not None else None
    shapes = mesh_candidates(num_devices, option, rank, devices_per_host)
    options = [_shape_option(option, shape, cluster) for shape in shapes]
    graph = build_graph(closed_jaxpr, list(in_paths), list(out_paths), top_mults)
    graph.memo["roles"] = eqn_roles(closed_jaxpr)  # for Objective.model_flops
    graph.memo["aliases"] = tuple(aliases)  # donated state shares its buffer (memory.liveness)
    pruned = _prune(graph, shapes, options, devices_per_host)
    for shape, why in (skip_meshes or {}).items():
        pruned.setdefault(tuple(shape), why)
    warned: set[str] = set()
    tried, best, best_ilp, errors = [], None, None, []
    outpriced: list = []  # meshes ruled out by cutoff_s (before any plan was found)
    with speed:
        bar = tqdm(list(zip(shapes, options, strict=True)), desc="autoshard: planning",
                   disable={None: None, True: False, False: True}[option.show_progress],
                   leave=False)
        built = []  # (shape, problem, ILP or None for an empty program)
        known = mesh_bounds if mesh_bounds is not None else {}  # filled for the caller

        def bounded(shape, bound):
            if bound is not None:
                known[shape] = max(known.get(shape, bound), bound)
            return bound
        for shape, shape_option in bar:
            if shape in pruned:
                continue
            bar.set_postfix_str(f"mesh {shape}")
            names = _axis_names(axis_names, shape)
            prob = build_problem(graph, shape, shape_option, batch_invars=batch_invars,
                                 aliases=aliases, warned=warned,
                                 devices_per_host=devices_per_host, axis_names=names,
                                 fixed_in_specs=_fixed_specs(fixed_in_specs, closed_jaxpr,
                                                             names),
                                 alpa_costs=option.mesh_alpha is not None
                                 and option.mesh_beta is not None, batch_dims=batch_dims,
                                 scatter_gradients=user_budget or weigh_memory)
            if option.force_data_parallel and option.prefer_reduce_scatter and (
                    fixed_in_specs is None):
                zero_update(prob)   # ZeRO-2: only the update leaves data parallelism
            fold_partial_sums(prob)   # sums of partial sums reduced once (tied embeddings)
            prob.notes.append(
                f"{tie_repeated(prob, batch_invars)} variables tied to identical ones")
            if cutoff_s is not None:  # the cheap bound first: no ILP for a mesh it rules out
                bound = bounded(shape, lower_bound_s(prob))
                if bound >= cutoff_s:
                    pruned[shape] = (f"cost lower bound {bound * 1e3:.4f} ms >= cutoff "
                                     f"{cutoff_s * 1e3:.4f} ms")
                    outpriced.append(shape)
                    continue
            # under a cutoff the memory rows come when a mesh is solved (with_rows):
            # bounds without them rule most meshes out (Table 1's whole-mesh candidates)
            budget = shape_option.memory_budget_per_device
            built.append((shape, prob, build_ilp(
                prob, time_limit_s=option.solver_time_limit_s,
                memory_budget=None if cutoff_s is not None else budget,
                node_limit=option.solver_node_limit,
                mip_gap=option.solver_mip_gap) if graph.nodes else None, budget))
        if len(built) > 1 and all(ilp is not None and ilp.total >= solver.CUTOFF_MIN_COLUMNS
                                  for _, _, ilp, _ in built):
            # Large ILPs are solved best-first (lowest LP bound first), so the cutoff skips
            # the meshes that cannot win; small ones keep the candidate order.
            # (without the memory rows: ordering needs no tighter bound, and the cutoff
            # asks for the full relaxation only where this one does not reach it)
            # (the LPs run side by side: HiGHS releases the GIL; Table 1's 39.1B row spent a
            # quarter of its planning in these, one after the other)
            # (under a cutoff, large ILPs first try the bound of their blocks, a second
            # where Table 1's 3-D meshes' relaxations stalled for their whole time share)
            lps = concurrently([functools.partial(cutoff_bound_s, ilp, cutoff_s)
                                for _, _, ilp, _ in built])
            bounds = [bounded(shape, b) for (shape, *_), b in zip(built, lps, strict=True)]
            order = sorted(range(len(built)), key=lambda i: (
                bounds[i] is None, bounds[i] or 0.0, i))
            built = [built[i] for i in order]
        for shape, prob, ilp, budget in built:
            beat = cutoff_s if best is None else best[2].objective_s
            what = "cutoff" if best is None else "best"
            if beat is not None:
                bound = bounded(shape, lower_bound_s(prob))
                if bound >= beat:
                    pruned[shape] = (f"cost lower bound {bound * 1e3:.4f} ms >= {what} "
                                     f"{beat * 1e3:.4f} ms")
                    outpriced.append(shape)
                    continue
            try:
                sol = None if ilp is None else ruled_out_without_rows(ilp, budget, beat)
                if sol is None and ilp is not None:
                    ilp = with_rows(ilp, budget)
                    if weigh_memory:   # the memory model the re-solves read, on the idle core
                        sol, _ = concurrently([functools.partial(solve_ilp, ilp, cutoff_s=beat),
                                               functools.partial(warm_memory, prob)],
                                              solvers=1)
                    else:
                        sol = solve_ilp(ilp, cutoff_s=beat)
                elif sol is None:
                    sol = Solution(choice={}, status="optimal", objective_s=0.0, solve_s=0.0)
            except (ValueError, RuntimeError) as err:  # no plan on this mesh: the next one
                errors.append((prob, err))
                pruned[shape] = "no plan: " + str(err).split(";")[0]
                if mesh_failures is not None:
                    mesh_failures[shape] = str(err).split(";")[0]
                continue
            bounded(shape, sol.bound_s)
            if sol.status == "optimal" and ilp is not None and not ilp.approximate:
                # the ILP's own optimum within its gap (an approximate ILP's objective is
                # its plan's exact cost, not a bound)
                # (a memory round's solve stops at solver.ROUNDS_GAP where that is wider)
                gap = option.solver_mip_gap
                if sol.info.get("memory_rounds"):
                    gap = max(gap, solver.ROUNDS_GAP)
                bounded(shape, sol.objective_s / (1 + gap))
            if sol.bound_s is not None:  # the ILP showed no plan of this mesh can win
                pruned[shape] = (f"ILP bound {sol.bound_s * 1e3:.4f} ms >= {what} "
                                 f"{beat * 1e3:.4f} ms ({sol.status})")
                outpriced.append(shape)
                continue
            if best is None and cutoff_s is not None and sol.objective_s >= cutoff_s:
                pruned[shape] = (f"plan {sol.objective_s * 1e3:.4f} ms >= cutoff "
                                 f"{cutoff_s * 1e3:.4f} ms")
                outpriced.append(shape)
                continue
            tried.append((shape, sol.objective_s))
            if best is None or sol.objective_s < best[2].objective_s * (1 - 1e-9) - 1e-15:
                best, best_ilp = (shape, prob, sol), ilp
        bar.close()
        if best is None:
            if outpriced:
                raise Outpriced(cutoff_s, {m: pruned[m] for m in outpriced}, errors)
            if not errors:
                raise state_too_large(pruned, option.memory_budget_per_device, graph)
            raise no_plan_error(errors, options[0], graph)
        plans = _Plans(best[1], _axis_names(axis_names, best[0]))
        if best_ilp is not None:
            tradeoff = (DEFAULT_MEMORY_TRADEOFF if option.memory_tradeoff is None
                        else option.memory_tradeoff)
            best = best[:2] + (_memory_choice(best_ilp, best[2], tradeoff, weigh_memory,
                                              plans),)
        plan = _finish(best, tried, pruned, option, batch_invars, graph, plans,
                       compare_data_parallel)
        if "found" in best[2].info:   # explain()'s trade-off table (sharding/pareto.py)
            rows = later(plan_trade_off, plan, best_ilp, best[2], plans)
            plan = dataclasses.replace(plan, objective=dataclasses.replace(
                plan.objective, _trade_off=rows))
    return plan if cluster is None else dataclasses.replace(plan, cluster=cluster.describe())


def _memory_choice(ilp, fastest: Solution, tradeoff: float, weigh_memory: bool,
                   make) -> Solution:
    """The plan taken on the chosen mesh from its fastest: ``least_memory``'s (the time rule)
    or, where the default weighs memory, ``pareto.expert_choice`` among the fastest,
    least_memory's and ``least_peak``'s plans (``make``: a solution's plan).

    ``least_memory`` and ``least_peak`` solve side by side, both from the fastest plan. Until
    session 29 ``least_peak`` searched again from least_memory's plan where that one saved
    memory (the plans of the two solves one after the other): a third solve, which the
    32-layer decoder ran (planning 9.0 s against 6.0 s) for the plan the first search had
    found. least_memory's plan stays a candidate: on a scanned GPT (tests/sharding/
    test_loops.py) and a one-layer one it is the one taken, at a few percent more time."""
    if not weigh_memory:
        return least_memory(ilp, fastest, tradeoff)
    # The memory model's choice-free parts (liveness, transients) once, not by both threads
    # (computed beside the first solve already where the mesh's problem has not changed).
    warm_memory(ilp.prob)

    def least_memory_and_plans():
        # least_memory solves faster than least_peak (the 16-layer decoder: 1.0 against
        # 1.5 s): its thread then makes the plans expert_choice reads of the fastest and its
        # own (0.2 s of the planning that was after both solves).
        kept = least_memory(ilp, fastest, tradeoff)
        for sol in (kept, *kept.info.get("found", ())):
            make(sol)
        return kept
    kept, peak = concurrently([least_memory_and_plans,
                               functools.partial(least_peak, ilp, fastest)])
    return expert_choice(ilp, kept, make, least_peak_found=(peak,))


def _fixed_specs(fixed_in_specs, closed_jaxpr, names):
    """``fixed_in_specs`` in the planner's form (axis indices) for a mesh of ``names``."""
    if fixed_in_specs is None:
        return None
    out = []
    for i, (pspec, v) in enumerate(zip(fixed_in_specs, closed_jaxpr.jaxpr.invars, strict=True)):
        if pspec is None:
            out.append(None)
            continue
        unknown = sorted({n for e in pspec if e is not None
                          for n in ((e,) if isinstance(e, str) else e)} - set(names))
        rank = len(getattr(v.aval, "shape", ()))
        if unknown or len(pspec) > rank:
            raise ValueError(
                f"fixed_in_specs entry {i} ({pspec}) does not fit input {i} of rank {rank} on "
                f"a mesh with axes {names}: it names {unknown or 'more dims than the input'}. "
                "Use the mesh's axis names (axis_names=) and at most one entry per dim.")
        out.append(from_partition_spec(pspec, rank, names))
    return out


class _Plans:
    """``make_plan`` of one mesh's solutions, each choice made once: the default's choice
    (``pareto.expert_choice``), ``_finish`` and explain()'s trade-off table read the same
    plans. ``plans(sol, dp)`` is ``make_plan(prob, sol, names, dp_objective=dp)``."""

    def __init__(self, prob: Problem, names: tuple[str, ...]):
        self.prob, self.names = prob, names
        self._made: dict[tuple, ShardingPlan] = {}

    def __call__(self, sol: Solution, dp_objective=None) -> ShardingPlan:
        key = tuple(sorted(sol.choice.items()))
        plan = self._made.get(key)
        if plan is None:
            plan = self._made[key] = make_plan(self.prob, sol, self.names, dp_objective=None)
        if dp_objective is None and plan.objective.solver_status == sol.status:
            return plan
        return dataclasses.replace(plan, objective=dataclasses.replace(
            plan.objective, _data_parallel_s=dp_objective, solver_status=sol.status))


def _finish(best, tried, pruned, option, batch_invars, graph, plans: _Plans,
            compare_data_parallel: bool = True) -> ShardingPlan:
    shape, prob, sol = best
    dp = (None if not compare_data_parallel
          else best[2].objective_s if option.force_data_parallel or not graph.nodes
          else later(_data_parallel_objective, prob, batch_invars, option))
    plan = plans(sol, dp)
    alpa = None
    if option.mesh_alpha is not None and option.mesh_beta is not None:
        alpa = alpa_objective(plan, option.mesh_alpha, option.mesh_beta,
                              force_data_parallel=option.force_data_parallel)
    objective = dataclasses.replace(
        plan.objective, num_columns=sol.num_ilp_vars, num_rows=sol.info.get("rows", 0),
        num_edge_columns=sol.info.get("edge_vars", 0),
        meshes_tried=tuple((tuple(s), o) for s, o in tried),
        meshes_pruned=tuple((tuple(s), why) for s, why in pruned.items()),
        flops=program_flops(graph), model_flops=model_flops(graph, graph.memo["roles"]),
        alpa_units=alpa, memory_budget_per_device=option.memory_budget_per_device)
    notes = list(plan.notes)
    if len(tried) > 1:
        notes.append("meshes tried: " + ", ".join(f"{s} {o * 1e3:.4f} ms" for s, o in tried))
    # No wall-clock time here: the same program and options must give an identical plan.
    notes.append(f"ILP: {sol.num_ilp_vars} columns, {sol.info.get('rows', 0)} rows")
    if "expert_choice" in sol.info:
        notes.append("the default weighs memory: " + sol.info["expert_choice"])
    if "least_memory" in sol.info:
        notes.append("least memory among plans within memory_tradeoff of the fastest: "
                     + sol.info["least_memory"])
    return dataclasses.replace(plan, objective=objective, notes=tuple(notes))


def _shape_option(option: AutoShardingOption, shape, cluster) -> AutoShardingOption:
    """The option for one mesh shape: the cluster's link costs unless the option gives some.

    ``force_batch_dim_to_mesh_dim`` naming the only axis of more than one device is data
    parallel: every value holding batch rows keeps them split over all devices (Alpa forces
    the batch dim of every value, not only of the inputs, onto that axis).
    """
    a = option.force_batch_dim_to_mesh_dim
    if a is not None and a < len(shape) and [n > 1 for n in shape].count(True) == 1 \
            and shape[a] > 1:
        option = dataclasses.replace(option, force_data_parallel=True)
    if cluster is None or (option.mesh_alpha is not None and option.mesh_beta is not None):
        return option
    alpha, beta = cluster.mesh_costs(shape)
    return dataclasses.replace(option, mesh_alpha=option.mesh_alpha or alpha,
                               mesh_beta=option.mesh_beta or beta)


def _prune(graph: Graph, shapes, options, devices_per_host) -> dict[tuple[int, ...], str]:
    """Meshes not worth solving, with the reason: dominated mirrors, state over the budget."""
    pruned: dict[tuple[int, ...], str] = {}
    if options[0].force_batch_dim_to_mesh_dim is None:  # axis indices mean nothing otherwise
        costs = []
        for shape, opt in zip(shapes, options, strict=True):
            model = CostModel.from_option(shape, opt, devices_per_host)
            costs.append((model.alpha, model.beta))
        for j, i in sorted(dominated_meshes(shapes, costs).items()):
            pruned[shapes[j]] = f"mesh {shapes[i]} has the same axes on links no slower"
    budget = options[0].memory_budget_per_device
    if budget is not None:
        for shape in shapes:
            state = state_bytes_lower_bound(graph, shape)
            if state > budget and shape not in pruned:
                pruned[shape] = (f"its inputs alone need >= {state:,} B per device (budget "
                                 f"{budget:,} B)")
    return pruned


def lower_bound_s(prob: Problem) -> float:
    """A lower bound of the ILP objective: each variable at its cheapest allowed strategy.

    Resharding edges cost >= 0 and nodes tied into one variable share their choice, so the sum
    over variables of the cheapest summed node cost bounds every plan of this mesh from below.
    """
    per_var: dict[int, np.ndarray] = {}
    for node in prob.graph.nodes:
        costs = np.array([s.comm_s * node.comm_times + s.compute_s * node.mult
                          for s in prob.strategies[node.id]])
        r = prob.var(node.id)
        per_var[r] = per_var[r] + costs if r in per_var else costs
    allowed: dict[int, set[int]] = {}
    for node_id, ks in prob.allowed.items():
        r = prob.var(node_id)
        allowed[r] = allowed[r] & ks if r in allowed else set(ks)
    total = 0.0
    for r, costs in per_var.items():
        ks = sorted(allowed.get(r, range(len(costs))))
        total += float(costs[ks].min()) if ks else 0.0
    return total


def program_flops(graph: Graph) -> float:
    """Floating-point operations of the whole program (matrix products and convolutions)."""
    total = 0.0
    for node in graph.nodes:
        if node.kind == "dot_general":
            (lc, _), _ = node.params["dimension_numbers"]
            out = graph.values[node.outputs[0]].shape
            total += 2.0 * math.prod(out) * math.prod(
                node.in_avals[0].shape[d] for d in lc) * node.mult
        elif node.kind == "conv_general_dilated":
            dn = node.params["dimension_numbers"]
            lhs, rhs = node.in_avals[0].shape, node.in_avals[1].shape
            out = graph.values[node.outputs[0]].shape
            groups = node.params.get("feature_group_count", 1)
            kernel = math.prod(rhs[d] for d in dn.rhs_spec[2:])
            total += 2.0 * math.prod(out) * (lhs[dn.lhs_spec[1]] // groups) * kernel * node.mult
    return total


def _axis_names(axis_names, shape) -> tuple[str, ...]:
    if axis_names is not None:
        return tuple(axis_names)
    return DEFAULT_AXIS_NAMES.get(len(shape), tuple(f"a{i}" for i in range(len(shape))))


def _data_parallel_objective(prob: Problem, batch_invars, option) -> float | None:
    """The objective of pure data parallel on the same mesh (batch split over every axis).

    Solved with resharding forbidden outright (a much easier ILP); a program that cannot run
    without some resharding is solved again with resharding priced as forbidden.
    """
    dp = data_parallel_variant(prob, batch_invars)
    for no_reshard in (True, False):
        dp.no_reshard = no_reshard
        try:
            return build_and_solve(dp, time_limit_s=option.solver_time_limit_s,
                                   memory_budget=None,
                                   node_limit=option.solver_node_limit,
                                   mip_gap=option.solver_mip_gap).objective_s
        except (ValueError, RuntimeError):
            continue
    return None


__all__ = ["plan_auto", "mesh_candidates", "Graph"]
