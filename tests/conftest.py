"""Test set-up: 8 virtual CPU devices, forced before JAX initialises its backends."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
) + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

import autoshard  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_cache():
    yield
    autoshard.clear_executable_cache()


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
    """Runs a test under both of XLA's SPMD partitioners (custom_partitioning tests)."""
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", before)
