"""The README's Quickstart runs as written, and trains like plain jax.jit does."""

import re
from pathlib import Path

import jax
import numpy as np

README = Path(__file__).parent.parent / "README.md"


def quickstart_code() -> str:
    text = README.read_text()
    section = text[text.index("## Quickstart"):text.index("## API overview")]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quickstart_runs_and_matches_plain_jit():
    code = quickstart_code()
    scope: dict = {}
    exec(compile(code, "README Quickstart", "exec"), scope)
    assert "explain" in code and scope["executable"].plan.inputs
    # The same loop through plain jax.jit (one device) gives the same losses and parameters.
    ref_scope: dict = {}
    plain = code.replace("autoshard.parallelize(train_step)", "jax.jit(train_step)")
    plain = plain.split("executable = ")[0]
    exec(compile(plain, "README Quickstart (jax.jit)", "exec"), ref_scope)
    np.testing.assert_allclose(scope["loss"], ref_scope["loss"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(scope["state"].params),
                    jax.tree.leaves(ref_scope["state"].params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
