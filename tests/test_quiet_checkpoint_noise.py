"""rltrain.quiet drops megatron's known-harmless checkpoint noise (the distributed optimizer's per-rank
`param_state` key in the common dict; torch deprecations on resume) and keeps every other message."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import warnings

import pytest

from rltrain import quiet

BENIGN = (
    "Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
    "Keys only on 1: [('optimizer', 'param_state')], Mismatched keys: []"
)
REAL = (
    "Rank 1 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
    "Keys only on 1: [('model', 'step')], Mismatched keys: []"
)


def test_benign_common_state_dict_difference_is_dropped_and_others_are_kept(caplog):
    quiet.filter_third_party_warnings()
    logger = logging.getLogger(quiet.MEGATRON_CKPT_LOGGER)
    with caplog.at_level(logging.WARNING, logger=quiet.MEGATRON_CKPT_LOGGER):
        logger.warning(BENIGN)
        logger.warning(REAL)
    assert [r.getMessage() for r in caplog.records] == [REAL]


def test_resume_deprecations_are_ignored_only_where_megatron_raises_them():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.filter_third_party_warnings()
        for module in ("megatron.core.dist_checkpointing.strategies.torch", "mine"):
            warnings.warn_explicit("`load_state_dict` is deprecated and will be removed", FutureWarning,
                                   "x.py", 1, module=module)  # fmt: skip
    assert [str(w.message) for w in seen] == ["`load_state_dict` is deprecated and will be removed"]


def test_rays_local_instance_line_is_dropped_and_a_cluster_connection_kept(caplog):
    quiet.quiet_driver("cpu")
    log = logging.getLogger(quiet.RAY_WORKER_LOGGER)
    with caplog.at_level(logging.INFO, logger=quiet.RAY_WORKER_LOGGER):
        log.info("Started a local Ray instance.")
        log.info("Connected to Ray cluster.")
    assert [r.getMessage() for r in caplog.records] == ["Connected to Ray cluster."]


RAY_FIRST_INIT = """
import sys
from rltrain.quiet import quiet_driver
from rltrain.ray_group import start_ray
import ray

quiet_driver("cpu")
print("progress-line", end="", flush=True)  # a progress bar's line, still open when Ray starts
start_ray(None, num_cpus=1, temp_dir=sys.argv[1])
ray.shutdown()
print(" end")
"""


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_first_ray_init_on_a_machine_prints_nothing_of_rays(tmp_path):
    """A real local `ray.init` in a fresh home (Ray writes ~/.ray/auth_token there, as on a user's very
    first run): neither the token lines nor "Started a local Ray instance" reach the console, so nothing
    lands on the progress bar's line."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env.update(HOME=str(home), PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="rq") as ray_dir:  # AF_UNIX paths: <= 107 bytes
        result = subprocess.run(
            [sys.executable, "-c", RAY_FIRST_INIT, ray_dir],
            capture_output=True, text=True, timeout=180, env=env, cwd=os.getcwd(),
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (home / ".ray" / "auth_token").exists(), "Ray did not create a token: nothing was tested"
    assert result.stdout == "progress-line end\n"
    for line in ("Generated new authentication token", "Token authentication is enabled",
                 "Started a local Ray instance"):  # fmt: skip
        assert line not in result.stderr, result.stderr
