"""Every python block of README.md runs as written, and computes what plain jax.jit does.

Blocks run in this process (8 CPU devices, a fresh scope, a temporary working directory),
except those marked ``<!-- readme-test: mpirun -np N[, D devices per process] -->`` on the line
before them: those need several processes and run as scripts under ``mpirun`` (skipped, with
the reason, where Open MPI or the native MPI extension is missing).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard

README = Path(__file__).parent.parent / "README.md"
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<how>[^>]*?) -->\n)?```python\n(?P<code>.*?)```",
                   re.S)
MARKER = re.compile(r"mpirun -np (?P<np>\d+)(?:, (?P<devices>\d+) devices per process)?$")


def blocks() -> list[tuple[str, str, str]]:
    """(section heading, run marker or "", code) of each python block, in README order."""
    text = README.read_text()
    found = []
    for m in BLOCK.finditer(text):
        heading = re.findall(r"^#+ (.+)$", text[:m.start()], re.M)[-1]
        found.append((heading, m.group("how") or "", m.group("code")))
    return found


def block(heading: str) -> str:
    (code,) = [code for h, how, code in blocks() if h.startswith(heading)]
    return code


def run(code: str, name: str) -> dict:
    scope: dict = {"__name__": "__readme__"}
    exec(compile(code, f"README {name}", "exec"), scope)
    return scope


def assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def test_every_python_block_is_tested_here():
    """A block added to the README needs a check below (or a mpirun marker)."""
    in_process = [h for h, how, _ in blocks() if not how]
    assert in_process == ["Quickstart", "Pipeline parallelism (`PipeshardParallel`)",
                          "Planning for a cluster you do not have",
                          "Choosing tensor, pipeline and data parallelism (`AutoParallel`)",
                          "Custom partitioning rules",
                          "Memory: the default, the fastest and the smallest plan, budgets",
                          "Micro-batches: what accumulated steps return",
                          "JAX `custom_partitioning`",
                          "Alpa: pipeline parallelism (`tests/pipeline_parallel`)",
                          "Alpa: shard parallel (`ShardParallel`, `AutoShardingOption`)"]
    marked = [(h, how) for h, how, _ in blocks() if how]
    assert marked == [("MPI (`autoshard.mpi`, mpi4jax's token-returning API)", "mpirun -np 2"),
                      ("Running on several hosts", "mpirun -np 2, 4 devices per process"),
                      ("mpi4jax", "mpirun -np 2")]
    assert all(MARKER.match(how) for _, how in marked)
    text = README.read_text()
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in text[
        text.index("## Quickstart"):text.index("```python")]


# -- blocks run in this process -------------------------------------------------------------------
def test_quickstart_runs_and_matches_plain_jit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = block("Quickstart")
    scope = run(code, "Quickstart")
    assert "explain" in code and scope["executable"].plan.inputs
    # The same loop through plain jax.jit (one device) gives the same losses and parameters.
    plain = code.replace("autoshard.parallelize(train_step)", "jax.jit(train_step)")
    ref_scope = run(plain.split("executable = ")[0], "Quickstart (jax.jit)")
    np.testing.assert_allclose(scope["loss"], ref_scope["loss"], rtol=1e-4)
    assert_trees_close(scope["state"].params, ref_scope["state"].params, rtol=1e-4)


def test_micro_batch_block_returns_what_the_whole_batch_step_returns(capsys):
    code = block("Micro-batches: what accumulated steps return")
    scope = run(code, "Micro-batches")
    loss, correct, count = capsys.readouterr().out.split()
    _, want_loss, want = jax.jit(scope["step"])(scope["p"], scope["batch"])
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    assert (int(correct), int(count)) == (int(want["correct"]), want["count"]) == (
        int(want["correct"]), 32)


def test_memory_block_shows_the_trade_off_and_keeps_a_budget(capsys):
    scope = run(block("Memory: the default"), "Memory")
    out = capsys.readouterr().out
    assert "trade-off on mesh (2, 4)" in out
    rows = scope["plan"].objective.trade_off
    assert rows[0].role.startswith("chosen")
    assert scope["smallest"].memory < scope["chosen"].memory
    assert all(r.memory >= scope["smallest"].memory for r in rows)
    assert scope["budget"] < scope["chosen"].memory
    assert scope["plan"].objective.peak_bytes_per_device < (
        scope["fastest"].objective.peak_bytes_per_device)   # the default weighed memory
    if "executable" not in scope:   # a budget the estimate cannot keep: by how much, and a fix
        assert "compiles to" in out and "Raise memory_budget_per_device to" in out, out


def test_pipeline_block_trains_like_jit_and_prints_text(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = block("Pipeline parallelism")
    scope = run(code, "Pipeline parallelism")
    printed = capsys.readouterr().out
    start = run(code.split("method = ")[0], "Pipeline parallelism (set-up)")
    want_params, want_loss = jax.jit(start["train_step"])(start["params"], start["batch"])
    np.testing.assert_allclose(scope["loss"], want_loss, rtol=1e-5)
    assert_trees_close(scope["params"], want_params)
    # readable text, not dataclass dumps (issue 21 item 9)
    assert "pipeline audit: predicted against compiled" in printed
    assert "simulation of 1f1b: 2 stages on 2 ranks, 4 micro-batches" in printed
    assert "bubble 4 rank-time (20.0% of all rank time idle)" in printed
    assert "PipelineAudit(" not in printed and "Simulation(" not in printed
    assert "no divergence" in printed and "DIVERGENCE" not in printed


def test_auto_parallel_block_picks_a_stage_per_host_on_a_slow_link(capsys):
    scope = run(block("Choosing tensor, pipeline"), "AutoParallel")
    est = scope["estimate"]
    assert est.num_stages == 2                     # one stage per host of the slow link
    fits = [c for c in est.candidates if not c.dropped]
    assert est.step_s == min(c.step_s for c in fits) and len(fits) >= 2
    # the whole mesh is priced last, under the fastest pipeline's time: outpriced here
    whole = est.candidates[0]
    assert whole.num_stages == 1 and "can beat the fastest pipeline's" in whole.dropped
    printed = capsys.readouterr().out
    assert "chosen: 2 stages" in printed and "1 stage" in printed


def test_planning_block_plans_256_devices_and_saves_the_plan(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    scope = run(block("Planning for a cluster"), "Planning for a cluster")
    plan = scope["plan"]
    assert np.prod(plan.mesh_shape) == 256 and "estimated step time" in capsys.readouterr().out
    assert autoshard.ShardingPlan.load(tmp_path / "mlp_256.json") == plan
    assert scope["step"].method.plan == plan


def test_custom_partitioning_block_keeps_rows_split_and_matches_jit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = run(block("Custom partitioning"), "Custom partitioning")
    step = scope["step"]

    def plain(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.abs(jnp.fft.fft(x * w)) ** 2))(w)

    w = jnp.linspace(0.5, 1.5, 16)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 16)), jnp.float32)
    np.testing.assert_allclose(step(w, x), jax.jit(plain)(w, x), rtol=1e-5, atol=1e-6)
    hlo = step.get_last_executable().get_hlo_text()
    ffts = re.findall(r"= (c64\[[\d,]+\])\S* fft\(", hlo)
    assert ffts == ["c64[8,16]", "c64[8,16]"], ffts   # forward and backward, 8 rows per device
    assert "all-gather" not in hlo and hlo.count(" all-reduce(") == 1  # the gradient only


# -- the Compatibility section ---------------------------------------------------------------------
def test_custom_partitioning_compat_block_runs_as_with_jax(tmp_path, monkeypatch):
    """The block moved over from jax.experimental.custom_partitioning: rows stay split, the
    static argument's default applies, and a wrong lower_fn raises JAX's wording."""
    monkeypatch.chdir(tmp_path)
    code = block("JAX `custom_partitioning`")
    scope = run(code, "JAX custom_partitioning")
    y, x = scope["y"], scope["x"]
    np.testing.assert_allclose(y, 2.0 * np.asarray(x))
    assert {s.data.shape for s in y.addressable_shards} == {(2, 4)}
    # the same block on JAX's own class computes the same (only the import differs)
    theirs = run(code.replace("from autoshard import custom_partitioning",
                              "from jax.experimental.custom_partitioning import "
                              "custom_partitioning").split("def wrong_partition")[0], "JAX's")
    np.testing.assert_allclose(theirs["y"], y)


def test_alpa_pipeline_compat_block_gives_alpas_schedule_and_stage_dp(capsys):
    scope = run(block("Alpa: pipeline parallelism"), "Alpa pipeline")
    s, stages = scope["s"], scope["stages"]
    assert s.num_clock == 7 and len(s.schedules) == s.num_clock
    covered = [i for (start, end), _, _ in stages for i in range(start, end)]
    assert covered == list(range(4))                      # the stages cover the 4 layers
    assert all(0 <= m < len(scope["submeshes"]) for _, m, _ in stages)  # submesh indices
    assert np.isfinite(scope["objective"]) and scope["objective"] > 0
    assert "Clock 0 : (0, 0)" in capsys.readouterr().out  # Alpa's clock table, printed


def test_alpa_shard_compat_block_reports_alpas_objective():
    """With Alpa's cost parameters the objective is in Alpa's units (the block checks the
    number); without them the same plan reports autoshard's own estimate in seconds."""
    scope = run(block("Alpa: shard parallel"), "Alpa shard parallel")
    ex = scope["ex"]
    assert ex.auto_sharding_objective == pytest.approx(scope["expected"])
    seconds = autoshard.parallelize(scope["step"], method=autoshard.ShardParallel(
        devices=scope["mesh"], auto_sharding_option=autoshard.AutoShardingOption(
            force_data_parallel=True, memory_tradeoff=0.0))).get_executable(
        scope["w"], scope["x"]).auto_sharding_objective
    assert 0 < seconds < 1e-2 < scope["expected"]      # seconds, not Alpa's units


def test_mpi4jax_compat_block_runs_under_mpirun(tmp_path):
    # every rank holds arange(4) + 10 * rank: the sum over 2 ranks is 2 * arange(4) + 10
    assert _rank_values("mpi4jax", tmp_path) == [("0", "10. 12. 14. 16."),
                                                 ("1", "10. 12. 14. 16.")]


# -- what the snippets print ----------------------------------------------------------------------
def test_executable_audit_prints_as_a_table():
    def step(w, x):
        return w - 0.1 * autoshard.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    f = autoshard.parallelize(step)
    f(jnp.ones((32, 32)), jnp.ones((64, 32)))
    text = str(f.get_last_executable().audit())
    assert text.startswith("audit: predicted against compiled collectives")
    assert "Audit(" not in text and "AuditRow(" not in text


def test_a_one_device_plan_explains_without_per_leaf_noise():
    def step(params, x):
        return {k: v * 2 for k, v in params.items()}, x.sum()

    params = {f"w{i}": jnp.ones((3, 5)) for i in range(4)}
    method = autoshard.ShardParallel(devices=jax.devices()[:1])
    f = autoshard.parallelize(step, method=method)
    f(params, jnp.ones((7, 3)))
    text = f.get_last_executable().plan.explain()
    assert text.count("one device: every leaf is whole") == 1
    assert "no dim divides" not in text and "   [" not in text, text  # no per-leaf notes


def test_planning_writes_no_progress_bar_to_a_log(capfd):
    # stderr is a file here, as in a piped log: tqdm's bar stays off (disable=None)
    def step(w, x):
        return w - 0.1 * autoshard.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    assert autoshard.AutoShardingOption().show_progress is None  # default: on a terminal only
    autoshard.parallelize(step)(jnp.ones((16, 16)), jnp.ones((32, 16)))
    assert "autoshard: planning" not in capfd.readouterr().err


# -- blocks that need several processes ---------------------------------------------------------
def _mpirun(how: str, script: Path, cwd: Path, timeout: int = 300):
    if shutil.which("mpirun") is None:
        pytest.skip("needs Open MPI's mpirun (`make test` installs libopenmpi-dev openmpi-bin)")
    if find_spec("mpi4py") is None:
        pytest.skip("needs mpi4py (`make native` installs it)")
    m = MARKER.match(how)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={m.group('devices') or 1}"
    cmd = ["mpirun", "--oversubscribe", "-np", m.group("np"), sys.executable, str(script)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _marked(heading: str) -> tuple[str, str]:
    ((how, code),) = [(how, code) for h, how, code in blocks() if h.startswith(heading)]
    return how, code


def _rank_values(heading: str, tmp_path) -> list[tuple[str, str]]:
    """The block under ``heading`` run under mpirun: the sorted ``rank r: [values]`` lines."""
    if not (Path(autoshard.__file__).parent / "mpi" / "_ffi.so").exists():
        pytest.skip("needs the native MPI extension (`make native` builds it)")
    how, code = _marked(heading)
    (tmp_path / "snippet.py").write_text(code)
    printed = _mpirun(how, tmp_path / "snippet.py", tmp_path)
    return sorted(re.findall(r"rank (\d): \[([^\]]*)\]", printed))


def test_mpi_block_runs_under_mpirun(tmp_path):
    # ranks hold arange(4) + rank: the sum over 2 ranks is 2 * arange(4) + 1
    assert _rank_values("MPI (", tmp_path) == [("0", "1. 3. 5. 7."), ("1", "1. 3. 5. 7.")]


def test_multi_process_block_starts_fresh_then_resumes_from_its_checkpoint(tmp_path):
    how, code = _marked("Running on several hosts")
    (tmp_path / "snippet.py").write_text(code)
    # each process runs the block twice: a first run (no checkpoint yet), then a restart
    (tmp_path / "twice.py").write_text(
        "code = open('snippet.py').read()\n"
        "for run in ('first run', 'restart'):\n"
        "    exec(compile(code, f'README multi-process block ({run})', 'exec'), {})\n")
    _mpirun(how, tmp_path / "twice.py", tmp_path)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["4", "8"]
    # the checkpoint holds what 8 steps of plain jax.jit on the global batches give
    scope = run(code.split("autoshard.init")[0] + code[code.index("def train_step"):
                                                       code.index("state = {")],
                "Running on several hosts (definitions)")
    batches = [list(scope["local_batches"](rank, 16)) for rank in range(2)]
    state = {"w": jnp.zeros((16, 4)), "step": jnp.zeros((), jnp.int32)}
    ref = jax.jit(scope["train_step"])
    for _ in range(2):
        for parts in zip(*batches, strict=True):
            state, _ = ref(state, jax.tree.map(lambda *p: np.concatenate(p), *parts))
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])), state)
    saved = autoshard.restore_checkpoint(tmp_path / "ckpt", 8, like)
    assert int(saved["step"]) == 8
    np.testing.assert_allclose(saved["w"], state["w"], rtol=1e-5, atol=1e-6)

