"""rltrain.quiet drops megatron's known-harmless checkpoint noise (the distributed optimizer's per-rank
`param_state` key in the common dict; torch deprecations on resume) and keeps every other message."""

from __future__ import annotations

import logging
import warnings

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
