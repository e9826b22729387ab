"""The run's random streams: every random draw of a run comes from a seed derived from `trainer.seed`.

One root seed (`trainer.seed`) and one rule: the stream of a purpose at a training step is seeded with
`derive_seed(seed, step, purpose)`, a deterministic 63-bit hash of the three. Streams keyed this way do not
share a generator, so one consumer never shifts another: the validation pass draws from
(seed, step, "validate/i") and the rollout from (seed, step, "rollout"), and a run resumed at step s draws
at every later step exactly what the uninterrupted run drew, however many validation passes, processes or
restarts happened before. Purposes used by rltrain: `rollout`, `validate/<batch>`, `shuffle`, `dropout`
(the last two from the role's `megatron.seed`, which defaults to `trainer.seed`).

`None` seeds in the config (`data.seed`, `*.megatron.seed`) mean "derived from trainer.seed"; the plan
resolves them once (`EngineSettings.seed`, `DataPlan.seed`) and workers read the resolved numbers.
`run_seed` is the same resolution for code that builds an engine or a data loader outside a run (tests,
benchmarks, checkpoint tools), where no trainer section exists: the default `trainer.seed`.

Pure standard library (hashlib), like the rest of rlconf.
"""

from __future__ import annotations

import hashlib

from rlconf.config import TrainerConfig

ROLLOUT = "rollout"
VALIDATE = "validate"
SHUFFLE = "shuffle"
DROPOUT = "dropout"
DP_SHARD = "dp-shard"  # a data-parallel rank's part of a rollout: (rollout seed, dp rank, DP_SHARD)
GENERATE = "generate"  # an engine's sampler outside a run: (megatron seed, call number, GENERATE)
VAL_SAMPLES = "val-samples"  # which validation rows logging.val_generations records: (seed, 0, VAL_SAMPLES)

_SEED_BITS = 63  # torch, numpy and megatron all accept it; a signed 64-bit int never overflows


def derive_seed(seed: int, step: int, purpose: str) -> int:
    """The seed of stream `purpose` at training step `step` of a run seeded with `seed`: a 63-bit integer
    that depends on nothing else (the same on every machine, Python version and process)."""
    key = f"{int(seed)}/{int(step)}/{purpose}".encode()
    digest = hashlib.blake2b(key, digest_size=8, person=b"rlplan-seed").digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def resolve_seed(seed: int | None, trainer_seed: int) -> int:
    """A section's seed: its own when set, else the run's `trainer.seed`."""
    return trainer_seed if seed is None else int(seed)


def run_seed(seed: int | None) -> int:
    """The seed of an engine or loader built outside a run (no plan resolved it): its own when set, else
    the default `trainer.seed`, i.e. what a run with default settings resolves it to."""
    return resolve_seed(seed, TrainerConfig.seed)
