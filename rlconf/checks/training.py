"""Rules of the training sections: estimator needs, optimizers, checkpoint contents, trainer settings, sampling and the PPO loss.

Each rule registers itself in rlconf.rules with `@rule(name, fields...)` when this module is imported
(rlconf.validate imports every check module, in the order the docs list the rules).
"""

from __future__ import annotations

from collections.abc import Iterator

from rlconf.config import (
    CHECKPOINT_CONTENTS,
    Optim,
    RLConfig,
    RolloutConfig,
)
from rlconf.errors import Issue, error, warning
from rlconf.plan.roles import checkpointed_roles, trained_roles
from rlconf.rules import rule


@rule("estimator-needs", "algorithm.adv_estimator", "rollout.n", "critic.enable")
def estimator_needs(c: RLConfig) -> Iterator[Issue]:
    """grpo, rloo, grpo_passk and gpg need rollout.n >= 2; gae needs a critic; a critic without gae is
    unused."""
    est = c.algorithm.adv_estimator
    if est in ("grpo", "rloo", "grpo_passk", "gpg") and c.rollout.n < 2:
        yield error(
            "rollout.n",
            f"{est} compares responses to the same prompt, but rollout.n = {c.rollout.n}",
            "set rollout.n >= 2 (4-16 is common)",
            "estimator-needs",
        )
    if est == "gae" and not c.critic.enable:
        yield error(
            "critic.enable",
            "adv_estimator gae needs a value model, but the critic is disabled",
            "set critic.enable: true, or use algorithm.adv_estimator: grpo",
            "estimator-needs",
        )
    if est != "gae" and c.critic.enable:
        yield warning(
            "critic.enable",
            f"the critic is trained but {est} does not use its values",
            "set critic.enable: false, or use algorithm.adv_estimator: gae",
            "estimator-needs",
        )


def _optim_checks(prefix: str, o: Optim, total_steps: int) -> Iterator[Issue]:
    p = f"{prefix}.optim"
    if o.lr <= 0:
        yield error(
            f"{p}.lr", f"learning rate must be > 0, got {o.lr}", "use e.g. 1e-6 for an actor", "optim"
        )
    if o.min_lr < 0 or (o.lr > 0 and o.min_lr > o.lr):
        yield error(
            f"{p}.min_lr", f"min_lr = {o.min_lr} must be in [0, lr = {o.lr}]", "set min_lr <= lr", "optim"
        )
    if o.lr_warmup_init < 0 or (o.lr > 0 and o.lr_warmup_init > o.lr):
        yield error(
            f"{p}.lr_warmup_init", f"lr_warmup_init = {o.lr_warmup_init} must be in [0, lr]", "set 0", "optim"
        )
    if not 0.0 <= o.lr_warmup_steps_ratio <= 1.0:
        yield error(
            f"{p}.lr_warmup_steps_ratio",
            f"must be in [0, 1], got {o.lr_warmup_steps_ratio}",
            "use e.g. 0.05",
            "optim",
        )
    if o.lr_warmup_steps is not None and not 0 <= o.lr_warmup_steps <= total_steps:
        yield error(
            f"{p}.lr_warmup_steps",
            f"warmup of {o.lr_warmup_steps} steps is outside the run's 0..{total_steps} steps",
            f"use at most trainer.total_steps = {total_steps}",
            "optim",
        )
    if o.lr_decay_steps is not None and o.lr_decay_steps < 1:
        yield error(
            f"{p}.lr_decay_steps", f"must be >= 1, got {o.lr_decay_steps}", "or null for total steps", "optim"
        )
    if o.lr_wsd_decay_steps is not None and o.lr_wsd_decay_steps < 1:
        yield error(
            f"{p}.lr_wsd_decay_steps", f"must be >= 1, got {o.lr_wsd_decay_steps}", "or null", "optim"
        )
    if o.weight_decay < 0:
        yield error(f"{p}.weight_decay", f"must be >= 0, got {o.weight_decay}", "use e.g. 0.01", "optim")
    for i, b in enumerate(o.betas):
        if not 0.0 <= b < 1.0:
            yield error(f"{p}.betas[{i}]", f"must be in [0, 1), got {b}", "use e.g. [0.9, 0.999]", "optim")
    if o.eps <= 0:
        yield error(f"{p}.eps", f"must be > 0, got {o.eps}", "use e.g. 1e-8", "optim")
    if o.clip_grad < 0:
        yield error(f"{p}.clip_grad", f"must be >= 0, got {o.clip_grad}", "use 1.0, or 0 to disable", "optim")


@rule("optim", "*.optim.*")
def optim(c: RLConfig) -> Iterator[Issue]:
    """lr > 0, min_lr <= lr, warmup within the run, sane Adam settings (actor, and critic when enabled)."""
    for spec in trained_roles(c):
        yield from _optim_checks(spec.section, spec.section_of(c).optim, c.trainer.total_steps)


@rule("checkpoint-contents", "*.checkpoint.*", "trainer.save_freq")
def checkpoint_contents(c: RLConfig) -> Iterator[Issue]:
    """load_contents is within save_contents; no duplicates; the actor saves the model."""
    for spec, ck in checkpointed_roles(c):
        prefix = spec.section
        for name in ("save_contents", "load_contents"):
            items = getattr(ck, name)
            for i, item in enumerate(items):
                if items.index(item) != i:
                    yield warning(
                        f"{prefix}.checkpoint.{name}[{i}]",
                        f"{item!r} is listed twice",
                        "remove it",
                        "checkpoint-contents",
                    )
        missing = [x for x in ck.load_contents if x not in ck.save_contents]
        if missing:
            yield error(
                f"{prefix}.checkpoint.load_contents",
                f"loads {', '.join(missing)} which save_contents never writes",
                f"add {', '.join(missing)} to save_contents or drop it from load_contents "
                f"(allowed: {', '.join(CHECKPOINT_CONTENTS)})",
                "checkpoint-contents",
            )
        if "model" not in ck.save_contents and c.trainer.save_freq > 0:
            yield error(
                f"{prefix}.checkpoint.save_contents",
                "checkpoints without `model` cannot resume training",
                "add model to save_contents",
                "checkpoint-contents",
            )


@rule("trainer", "trainer.*")
def trainer_rules(c: RLConfig) -> Iterator[Issue]:
    """Save/test frequencies are >= 0, resume_path mode names a path, retention keeps >= 1."""
    t = c.trainer
    for name in ("save_freq", "test_freq", "critic_warmup"):
        if getattr(t, name) < 0:
            yield error(
                f"trainer.{name}", f"must be >= 0, got {getattr(t, name)}", "use 0 to disable", "trainer"
            )
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        yield error(
            "trainer.resume_from_path",
            "resume_mode is resume_path but no resume_from_path is given",
            "set resume_from_path to a checkpoints/global_step_N folder, or use resume_mode: auto",
            "trainer",
        )
    if t.max_ckpt_to_keep is not None and t.max_ckpt_to_keep < 1:
        yield error(
            "trainer.max_ckpt_to_keep",
            f"must be >= 1, got {t.max_ckpt_to_keep}",
            "or null to keep all",
            "trainer",
        )
    if t.max_bad_steps < 1:
        yield error("trainer.max_bad_steps", f"must be >= 1, got {t.max_bad_steps}",
                    "use e.g. 3 (bad steps in a row before the run stops)", "trainer")  # fmt: skip
    if not t.output_dir.strip():
        yield error("trainer.output_dir", "is empty: the run would write into the current directory",
                    "name a folder, e.g. --trainer.output_dir outputs/my-run", "trainer")  # fmt: skip
    if c.critic.enable and t.critic_warmup >= t.total_steps > 0:
        yield warning("trainer.critic_warmup", "the actor never updates: critic_warmup >= total_steps",
                      "lower critic_warmup", "trainer")  # fmt: skip


@rule(
    "generation-records", "logging.val_generations", "logging.rollout_data_dir", "logging.validation_data_dir"
)
def generation_records(c: RLConfig) -> Iterator[Issue]:
    """The validation samples to record are >= 0, the generation folders are named when set, and what is
    recorded at validation has a validation to come from."""
    log, t = c.logging, c.trainer
    if log.val_generations < 0:
        yield error("logging.val_generations", f"must be >= 0, got {log.val_generations}",
                    "use e.g. 10, or 0 to record none", "generation-records")  # fmt: skip
    for name in ("rollout_data_dir", "validation_data_dir"):
        if (folder := getattr(log, name)) is not None and not folder.strip():
            yield error(f"logging.{name}", "is empty", "name a folder (a relative one is under "
                        "trainer.output_dir), or null to write none", "generation-records")  # fmt: skip
    if not t.test_freq and not t.val_before_train:
        asked = [n for n, on in (("val_generations", log.val_generations > 0),
                                 ("validation_data_dir", log.validation_data_dir is not None)) if on]  # fmt: skip
        for name in asked:
            yield warning(f"logging.{name}", "nothing is recorded: the run never validates (trainer.test_freq "
                          "is 0 and val_before_train is false)", "set trainer.test_freq (e.g. 10) or "
                          "trainer.val_before_train: true", "generation-records")  # fmt: skip


VLLM_ONLY_ROLLOUT_FIELDS = ("gpu_memory_utilization", "max_num_seqs", "free_cache_engine")
"""Rollout fields that only rollout.engine: vllm reads (rltrain/rollout/vllm_adapter.py)."""


MIN_TEMPERATURE = 1e-3
"""Smallest sampling temperature: logits / temperature stays finite in fp32 for any logit below 3e35."""
MAX_TEMPERATURE = 100.0
"""Largest sampling temperature: above it sampling is uniform noise in all but name."""


@rule("sampling", "rollout.*", "data.max_prompt_length", "model.arch.max_position_embeddings")
def sampling(c: RLConfig) -> Iterator[Issue]:
    """Sampling parameters are in range; sequences fit the model."""
    r = c.rollout
    if not MIN_TEMPERATURE <= r.temperature <= MAX_TEMPERATURE:  # NaN fails too
        yield error("rollout.temperature", f"training rollouts must sample with a temperature in [{MIN_TEMPERATURE}"
                    f", {MAX_TEMPERATURE}], got {r.temperature} (logits / temperature overflows below it)",
                    "use a temperature > 0 (1.0 is usual)", "sampling")  # fmt: skip
    if not 0 < r.top_p <= 1:
        yield error("rollout.top_p", f"must be in (0, 1], got {r.top_p}", "use 1.0 to disable", "sampling")
    for path, top_k in (("rollout.top_k", r.top_k), ("rollout.val.top_k", r.val.top_k)):
        if top_k == 0 or top_k < -1:
            yield error(path, f"must be >= 1, or -1 to disable, got {top_k}", "use -1", "sampling")
    if not 0 <= r.min_p < 1:
        yield error("rollout.min_p", f"must be in [0, 1), got {r.min_p}", "use 0 to disable", "sampling")
    if not 0 < r.gpu_memory_utilization <= 1:
        yield error("rollout.gpu_memory_utilization", f"must be in (0, 1], got {r.gpu_memory_utilization}",
                    "use e.g. 0.5", "sampling")  # fmt: skip
    if not (r.val.temperature == 0 or MIN_TEMPERATURE <= r.val.temperature <= MAX_TEMPERATURE):
        yield error("rollout.val.temperature", f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                    f"got {r.val.temperature}", "use 0 for greedy", "sampling")  # fmt: skip
    if not 0 < r.val.top_p <= 1:
        yield error("rollout.val.top_p", f"must be in (0, 1], got {r.val.top_p}", "use 1.0", "sampling")
    if r.engine == "embedded":
        # Fields only the vLLM adapter reads: a changed value would silently do nothing.
        for name in VLLM_ONLY_ROLLOUT_FIELDS:
            if getattr(r, name) != getattr(RolloutConfig(), name):
                yield warning(f"rollout.{name}", "applies to rollout.engine: vllm only; the embedded engine "
                              "does not read it", f"remove rollout.{name}, or set rollout.engine: vllm",
                              "sampling")  # fmt: skip
    if c.model.path is None:
        need = c.data.max_prompt_length + r.max_response_length
        if need > c.model.arch.max_position_embeddings:
            yield error(
                "rollout.max_response_length",
                f"prompt + response = {need} tokens exceeds model.arch.max_position_embeddings = "
                f"{c.model.arch.max_position_embeddings}",
                "shorten data.max_prompt_length / rollout.max_response_length or raise max_position_embeddings",
                "sampling",
            )


@rule(
    "ppo-loss",
    "actor.clip_ratio*",
    "actor.entropy_coeff",
    "actor.kl_loss_coef",
    "actor.use_kl_loss",
    "algorithm.*",
    "critic.cliprange_value",
)
def ppo_loss(c: RLConfig) -> Iterator[Issue]:
    """Clip ranges are positive, dual clip > 1, coefficients >= 0; KL in loss and reward is doubled."""
    a = c.actor
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        v = getattr(a, name)
        if v is not None and v <= 0:
            yield error(f"actor.{name}", f"must be > 0, got {v}", "use e.g. 0.2", "ppo-loss")
    if a.clip_ratio_c <= 1:
        yield error(
            "actor.clip_ratio_c", f"dual-clip bound must be > 1, got {a.clip_ratio_c}", "use 3.0", "ppo-loss"
        )
    for name in ("entropy_coeff", "kl_loss_coef"):
        if getattr(a, name) < 0:
            yield error(
                f"actor.{name}", f"must be >= 0, got {getattr(a, name)}", "use 0 to disable", "ppo-loss"
            )
    if a.use_kl_loss and c.algorithm.use_kl_in_reward:
        yield warning("actor.use_kl_loss", "KL is penalised twice (in the loss and in the reward)",
                      "choose one: actor.use_kl_loss or algorithm.use_kl_in_reward", "ppo-loss")  # fmt: skip
    al = c.algorithm
    if not 0 <= al.gamma <= 1:
        yield error(
            "algorithm.gamma", f"must be in [0, 1], got {al.gamma}", "use 1.0 for outcome rewards", "ppo-loss"
        )
    if not 0 <= al.lam <= 1:
        yield error("algorithm.lam", f"must be in [0, 1], got {al.lam}", "use 0.95", "ppo-loss")
    if al.kl_ctrl.kl_coef < 0:
        yield error("algorithm.kl_ctrl.kl_coef", "must be >= 0", "use e.g. 0.001", "ppo-loss")
    if al.kl_ctrl.type == "adaptive" and al.kl_ctrl.target_kl <= 0:
        yield error(
            "algorithm.kl_ctrl.target_kl", "adaptive control needs target_kl > 0", "use e.g. 0.1", "ppo-loss"
        )
    if c.critic.enable and c.critic.cliprange_value <= 0:
        yield error("critic.cliprange_value", "must be > 0", "use 0.5", "ppo-loss")
