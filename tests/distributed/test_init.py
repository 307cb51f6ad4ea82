"""init/shutdown: where the settings of a multi-process job come from, and the errors."""

from __future__ import annotations

import jax
import pytest

import autoshard
from autoshard import _api, _config
from autoshard.distributed import _runtime

LAUNCHERS = ("AUTOSHARD_COORDINATOR_ADDRESS", "AUTOSHARD_NUM_PROCESSES", "AUTOSHARD_PROCESS_ID",
             "JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID",
             "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "OMPI_COMM_WORLD_SIZE",
             "OMPI_COMM_WORLD_RANK", "OMPI_MCA_orte_hnp_uri")


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_settings_from_autoshard_launch_variables(env):
    env.setenv("AUTOSHARD_COORDINATOR_ADDRESS", "127.0.0.1:5000")
    env.setenv("AUTOSHARD_NUM_PROCESSES", "4")
    env.setenv("AUTOSHARD_PROCESS_ID", "3")
    env.setenv("SLURM_JOB_ID", "77")  # the launcher's own variables win
    settings, source = _runtime.resolve_settings({})
    assert settings == {"coordinator_address": "127.0.0.1:5000", "num_processes": 4,
                        "process_id": 3}
    assert source == "autoshard.launch"


@pytest.mark.parametrize("nodes, host", [("node001", "node001"), ("node001,gpu2", "node001"),
                                         ("node[003-015],gpu2", "node003"),
                                         ("node[007,009-011]", "node007")])
def test_settings_from_slurm(env, nodes, host):
    env.setenv("SLURM_JOB_ID", "4097")
    env.setenv("SLURM_NTASKS", "8")
    env.setenv("SLURM_PROCID", "5")
    env.setenv("SLURM_STEP_NODELIST", nodes)
    settings, source = _runtime.resolve_settings({})
    assert source == "slurm"
    assert settings == {"coordinator_address": f"{host}:61441", "num_processes": 8,
                        "process_id": 5}


def test_settings_from_open_mpi_and_explicit_overrides(env):
    env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    env.setenv("OMPI_COMM_WORLD_RANK", "1")
    env.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911")
    settings, source = _runtime.resolve_settings({})
    assert settings == {"coordinator_address": "10.96.0.1:62624", "num_processes": 2,
                        "process_id": 1}
    settings, source = _runtime.resolve_settings({"coordinator_address": "h:1"})
    assert settings["coordinator_address"] == "h:1"
    assert source == "openmpi and keyword arguments (coordinator_address)"


def test_open_mpi_5_needs_a_coordinator_address(env):
    env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    env.setenv("OMPI_COMM_WORLD_RANK", "0")
    with pytest.raises(RuntimeError, match=r"needs coordinator_address and the openmpi "
                                           r"environment gave no coordinator_address"):
        _runtime.resolve_settings({})
    env.setenv("AUTOSHARD_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    assert _runtime.resolve_settings({})[0]["coordinator_address"] == "10.0.0.1:1234"


def test_setting_errors_name_the_value(env):
    with pytest.raises(RuntimeError, match=r"no launcher was detected .* Pass "
                                           r"coordinator_address='host:port'"):
        _runtime.resolve_settings({})
    good = {"coordinator_address": "h:1", "num_processes": 2, "process_id": 0}
    with pytest.raises(ValueError, match=r"process_id \(2\) must be below num_processes \(2\)"):
        _runtime.resolve_settings({**good, "process_id": 2})
    with pytest.raises(ValueError, match=r"coordinator_address \('h'\) must be 'host:port'"):
        _runtime.resolve_settings({**good, "coordinator_address": "h"})
    env.setenv("SLURM_JOB_ID", "1")
    env.setenv("SLURM_NTASKS", "many")
    env.setenv("SLURM_PROCID", "0")
    with pytest.raises(ValueError, match=r"SLURM_NTASKS \('many'\) must be a non-negative"):
        _config.detected_processes()


def test_init_errors(env, monkeypatch):
    monkeypatch.setattr(_api, "_state", {"cluster": None})
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['num_hosts'\]"):
        autoshard.init("distributed", num_hosts=2)
    with pytest.raises(TypeError, match=r"init\(cluster='local'\) takes no keyword"):
        autoshard.init("local", num_processes=2)
    jax.devices()  # the backends exist in this test process: too late to join a job
    with pytest.raises(RuntimeError, match=r"must come before the first JAX computation"):
        autoshard.init("distributed", coordinator_address="127.0.0.1:1", num_processes=1,
                       process_id=0)
    assert _api._state["cluster"] is None
    assert not jax.distributed.is_initialized()


@pytest.fixture
def transfer_flag():
    flag = _runtime.TRANSFER_FLAG
    before = jax.config.read(flag)
    jax.config.update(flag, "")
    yield flag
    jax.config.update(flag, before)
    _runtime._state.pop("transfer_address_set", None)


def test_joining_gives_the_process_a_transfer_address_unless_one_is_set(transfer_flag):
    _runtime._set_transfer_address("localhost:5000")
    host, _, port = jax.config.read(transfer_flag).rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0  # loopback job: loopback transfers
    assert _runtime._state["transfer_address_set"]
    jax.config.update(transfer_flag, "10.0.0.7:7000")  # the user's choice is kept
    _runtime._state.pop("transfer_address_set")
    _runtime._set_transfer_address("localhost:5000")
    assert jax.config.read(transfer_flag) == "10.0.0.7:7000"
    assert "transfer_address_set" not in _runtime._state
