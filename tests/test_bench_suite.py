"""The benchmark suite runs end to end on the smallest sizes and writes what it promises.

The suite runs in a subprocess (its own 8 virtual devices and its own SIGALRM timeouts, which
must not replace pytest-timeout's). Timings are reported by the suite, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "suite.py"
RECORD_FIELDS = ("model", "plan", "family", "mesh_shape", "status", "error", "step_time_s",
                 "step_time_ratio_to_best_manual", "planning_time_s", "compile_time_s",
                 "collective_bytes", "peak_bytes_per_device")
KINDS = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}


def run_suite(out: Path, *args: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(SUITE), "--quick", "--out", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "suite.json").read_text())


def test_suite_end_to_end(tmp_path):
    plans = ("single:jit,manual:dp,manual:megatron,autoshard:DataParallel,"
             "autoshard:ShardParallel-1d,autoshard:PipeshardParallel")
    result = run_suite(tmp_path, "--models", "mlp", "--plans", plans, "--repeats", "2",
                       "--sweep-layers", "")
    for name in ("suite.json", "suite.md", "suite_step_ratio.png", "suite_memory.png",
                 "suite_planning_vs_layers.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    machine = result["machine"]
    assert machine["num_devices"] == 8 and machine["jax"] and "git_commit" in machine
    by_plan = {r["plan"]: r for r in result["records"]}
    assert set(by_plan) == set(plans.split(","))
    for record in result["records"]:
        for field in RECORD_FIELDS:
            assert field in record, (record["plan"], field)
    for plan in ("single:jit", "manual:dp", "manual:megatron", "autoshard:DataParallel",
                 "autoshard:ShardParallel-1d"):
        r = by_plan[plan]
        assert r["status"] == "ok", (plan, r["error"])
        assert r["step_time_s"] > 0 and r["compile_time_s"] > 0
        assert set(r["collective_bytes"]) == KINDS
        assert r["peak_bytes_per_device"] > 0
        assert r["loss_matches_single"], plan     # every plan computes the same first loss
    assert by_plan["manual:dp"]["mesh_shape"] == [8]
    assert by_plan["manual:dp"]["collective_bytes"]["all-reduce"] > 0
    dp = by_plan["manual:dp"]    # one group of 8 devices: an all-reduce sends 2 * 7/8 of it
    assert dp["total_wire_bytes"] == pytest.approx(1.75 * dp["total_collective_bytes"])
    assert by_plan["single:jit"]["total_collective_bytes"] == 0
    best = min(by_plan[p]["step_time_s"] for p in ("manual:dp", "manual:megatron"))
    ratio = by_plan["autoshard:ShardParallel-1d"]["step_time_ratio_to_best_manual"]
    assert ratio == pytest.approx(by_plan["autoshard:ShardParallel-1d"]["step_time_s"] / best)
    assert by_plan["autoshard:ShardParallel-1d"]["planning_time_s"] >= 0
    assert by_plan["autoshard:ShardParallel-1d"]["ilp_objective_s"] is not None
    assert by_plan["autoshard:PipeshardParallel"]["status"] in ("ok", "skipped")
    assert "## mlp" in (tmp_path / "suite.md").read_text()


def test_suite_records_a_failing_pair_and_goes_on(tmp_path):
    # 3 devices do not divide the batch of 16: data parallelism fails, single-device runs.
    result = run_suite(tmp_path, "--models", "mlp", "--plans", "single:jit,autoshard:DataParallel",
                       "--num-devices", "3", "--repeats", "2", "--sweep-layers", "")
    by_plan = {r["plan"]: r for r in result["records"]}
    assert by_plan["single:jit"]["status"] == "ok"
    failed = by_plan["autoshard:DataParallel"]
    assert failed["status"] == "error" and "divisible" in failed["error"]
    assert "error" in (tmp_path / "suite.md").read_text()


def _suite_module(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_ilp_stats_prefer_structured_fields_and_fall_back_to_notes():
    import dataclasses
    from types import SimpleNamespace

    from autoshard.sharding.plan import Objective

    plans = _suite_module("suite_plans")
    notes = ("meshes tried: (8,) 1.0 ms", "ILP: 1234 columns, 56 rows")
    stats = plans.ilp_stats(SimpleNamespace(objective=Objective(communication_s=2e-3),
                                            notes=notes))
    assert stats["ilp_columns"] == 1234 and stats["ilp_rows"] == 56     # from the notes
    assert stats["ilp_objective_s"] == pytest.approx(2e-3)
    assert stats["ilp_communication_s"] == pytest.approx(2e-3)          # every field kept

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Structured(Objective):
        num_columns: int = 7
        num_rows: int = 3

    stats = plans.ilp_stats(SimpleNamespace(objective=Structured(), notes=notes))
    assert stats["ilp_columns"] == 7 and stats["ilp_rows"] == 3         # fields win over notes
    old = plans.ilp_stats(SimpleNamespace(objective=None,
                                          notes=("planned in 0.5 s (99 ILP columns)",)))
    assert old["ilp_columns"] == 99 and old["planner_reported_s"] == 0.5


def test_round_robin_stops_on_budget_after_min_rounds():
    measure = _suite_module("suite_measure")

    class Fake:
        def __init__(self):
            self.error, self.calls = None, 0

        def __call__(self, timed):
            self.calls += timed

    steppers = {"a": Fake(), "b": Fake()}
    measure.time_interleaved(steppers, warmup=1, repeats=8, budget_s=0.0, min_rounds=3)
    assert [s.calls for s in steppers.values()] == [3, 3]
    measure.time_interleaved(steppers, warmup=0, repeats=4, budget_s=60.0, min_rounds=2)
    assert [s.calls for s in steppers.values()] == [7, 7]
