"""``import autoshard`` loads only the front end and what a first ``parallelize`` needs:
scipy (the ILP) loads with the first plan, the pipeline with the first pipeline name
(issue 23; the time itself is measured by benchmarks/import_time.py)."""

import subprocess
import sys

CODE = """
import sys
import autoshard
print(sorted(m for m in ("scipy", "autoshard.pipeline", "mpi4py", "ray") if m in sys.modules))
method = autoshard.PipeshardParallel(num_micro_batches=2)
print(type(method).__module__, "autoshard.pipeline" in sys.modules)
from autoshard import UniformStageOption
print(UniformStageOption.__name__, "PipeshardParallel" in dir(autoshard))
"""


def test_import_loads_neither_scipy_nor_the_pipeline():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "[]", "autoshard.pipeline.method True", "UniformStageOption True"], out.stdout


def test_an_unknown_name_is_an_attribute_error():
    import autoshard

    try:
        autoshard.PipeShardParallel  # noqa: B018
    except AttributeError as e:
        assert "has no attribute 'PipeShardParallel'" in str(e)
    else:
        raise AssertionError("expected AttributeError")
