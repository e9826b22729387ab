"""The plan's estimate of one checkpoint's size on disk: what the free-space check before each save
(rltrain.storage) compares with, and what `rlconf plan` prints.

Per role: the model in params_dtype (megatron's dist checkpoint), the optimizer state (fp32 main parameters
plus Adam's two moments: 12 bytes a parameter; SGD's momentum: 8), a Hugging Face copy in params_dtype when
hf_model is saved, each rank's RNG file, and a fixed allowance for metadata (common.pt, .metadata, manifest).
Measured on tiny-grpo (94,784 fp32 parameters, Adam): 1.81 MB on disk, estimate 2.6 MB; the allowance
dominates there, the per-parameter bytes for real models.
"""

from __future__ import annotations

from rlconf.config import RLConfig
from rlconf.plan.types import DTYPE_BYTES, ModelSpec, RoleCheckpoint

_OPTIM_BYTES = {"adam": 12, "sgd": 8}
_RNG_FILE_BYTES = 64 << 10
_METADATA_BYTES = 1 << 20


def checkpoint_bytes(
    c: RLConfig, roles: tuple[RoleCheckpoint, ...], models: dict[str, ModelSpec], world: dict[str, int]
) -> int:
    """Estimated bytes of one checkpoint of every role in `roles`; `models` and `world` give each role's
    model and rank count."""
    total = 0
    elem = DTYPE_BYTES[c.model.params_dtype]
    for rc in roles:
        params = models[rc.role].params_total
        optim = (c.critic.optim if rc.role == "critic" else c.actor.optim).optimizer
        contents = set(rc.save_contents)
        total += _METADATA_BYTES
        if "model" in contents:
            total += params * elem
        if "optimizer" in contents:
            total += params * _OPTIM_BYTES.get(optim, 12)
        if "hf_model" in contents:
            total += params * elem
        if "extra" in contents:
            total += world[rc.role] * _RNG_FILE_BYTES
    return total
