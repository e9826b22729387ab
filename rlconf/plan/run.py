"""The plan parts the controller, the rollout, the tools and the data loader run from: every value rltrain
reads outside the megatron engine and the algorithm, with each "None means X" of the config decided here
once (`run_plan`, `rollout_plan`, `tool_plan`, `data_plan`, `reward_plan`, `tokenizer_path`).

`rlconf.plan.assemble` builds them into the TrainerPlan (`TrainerPlan.run`, `.rollout`, `.data`, `.reward`);
code that runs one part outside a run (tests, benchmarks) builds it from a config section with the same
functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlconf.config import (
    DataConfig,
    MegatronConfig,
    ModelConfig,
    MultiTurnConfig,
    RewardConfig,
    RLConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlconf.run_paths import in_run_folder
from rlconf.seeding import resolve_seed


# ============================================================================================ the run
@dataclass(frozen=True)
class ClusterPlan:
    """Where the run's processes run (cluster.*, what the plan's Resources do not hold)."""

    device: str
    """cpu, cuda or npu (cluster.device)."""
    ray_address: str | None
    """The Ray cluster to join (cluster.ray_address); None: RAY_ADDRESS, else a one-node local instance."""
    connect_timeout_s: float
    """Longest wait for the Ray cluster to answer (cluster.connect_timeout_s)."""
    cpus_per_worker: float
    """CPUs Ray reserves for each worker process; also its torch threads (cluster.cpus_per_worker)."""


@dataclass(frozen=True)
class LoggingPlan:
    """Where metrics go (logging.*)."""

    backends: tuple[str, ...]
    """console, jsonl, tensorboard, wandb."""
    level: str
    """Log level of the controller and workers."""
    plot_reward: bool
    """Write reward_curve.png to the output folder at the end of the run."""
    val_generations: int
    """Validation responses recorded at each validation in val_generations.jsonl (0: none)."""
    rollout_data_dir: str | None
    """Folder of each training step's generations, STEP.jsonl (logging.rollout_data_dir resolved: a relative
    path is under the output folder); None: not written."""
    validation_data_dir: str | None
    """Folder of each validation's generations, STEP.jsonl, resolved as rollout_data_dir; None: not written."""


@dataclass(frozen=True)
class RunPlan:
    """The run as a whole: names, folder, length, seed, validation, the divergence guard, the cluster."""

    seed: int
    """trainer.seed: the root of every random stream (rlconf.seeding)."""
    project_name: str
    experiment_name: str
    output_dir: str
    """The run folder (trainer.output_dir)."""
    total_steps: int
    """Training steps of the run (trainer.total_steps, or trainer.total_epochs x batches per epoch)."""
    total_epochs: int | None
    """trainer.total_epochs when the steps are counted in epochs, else None."""
    max_bad_steps: int
    """Consecutive non-finite steps after which the run stops (trainer.max_bad_steps)."""
    test_freq: int
    """Validate every test_freq steps and after the last (0: never)."""
    val_before_train: bool
    """Validate once before the first step."""
    critic_warmup: int
    """Steps in which only the critic updates (trainer.critic_warmup)."""
    resume_mode: str
    """auto, disable or resume_path (trainer.resume_mode)."""
    accept_config_changes: bool
    """A resume may change the run's config (recorded in config_history.jsonl)."""
    params_dtype: str
    """The models' parameter dtype (model.params_dtype): a device's peak FLOP/s is read at it."""
    cluster: ClusterPlan
    logging: LoggingPlan


def run_plan(c: RLConfig, total_steps: int | None = None) -> RunPlan:
    """The RunPlan of `c`; `total_steps`: the plan's count (RunLength), else trainer.total_steps."""
    t, k, log = c.trainer, c.cluster, c.logging
    return RunPlan(
        seed=t.seed,
        project_name=t.project_name,
        experiment_name=t.experiment_name,
        output_dir=t.output_dir,
        total_steps=t.total_steps if total_steps is None else total_steps,
        total_epochs=t.total_epochs,
        max_bad_steps=t.max_bad_steps,
        test_freq=t.test_freq,
        val_before_train=t.val_before_train,
        critic_warmup=t.critic_warmup,
        resume_mode=t.resume_mode,
        accept_config_changes=t.accept_config_changes,
        params_dtype=c.model.params_dtype,
        cluster=ClusterPlan(k.device, k.ray_address, k.connect_timeout_s, k.cpus_per_worker),
        logging=LoggingPlan(
            tuple(log.backends), log.level, log.plot_reward, log.val_generations,
            _optional_in_run_folder(t.output_dir, log.rollout_data_dir),
            _optional_in_run_folder(t.output_dir, log.validation_data_dir),
        ),
    )  # fmt: skip


def _optional_in_run_folder(output_dir: str, path: str | None) -> str | None:
    return None if path is None else in_run_folder(output_dir, path)


# ============================================================================================ tools
@dataclass(frozen=True)
class ToolPlan:
    """Multi-turn, tool-using rollouts (rollout.multi_turn with enable: true), limits resolved."""

    tools: tuple[str, ...]
    """Built-in names (calculator, python) or package.module:function|Class specs."""
    max_assistant_turns: int
    """Most model turns per response."""
    max_tool_response_length: int
    """Most characters of one tool output shown to the model."""
    max_total_tokens: int
    """Most tokens of one response, the model's and the tools' together (null in the config:
    rollout.max_response_length)."""
    tool_timeout_s: float
    """Wall-clock limit of one tool call."""
    tool_memory_mib: int
    """Address-space limit of the python sandbox's subprocess."""
    max_parallel_tools: int
    """Tool calls run at once (>= 1), each in its own tool worker process."""
    sandbox: str
    """isolated (namespaces, seccomp; rltrain/tools/sandbox.py) or none (trusted code only)."""
    interaction: str | None
    """package.module:Class of an environment giving feedback and rewards; None: tools only."""

    @property
    def isolated(self) -> bool:
        """Model-written python code runs in the sandbox."""
        return self.sandbox != "none"


def tool_plan(mt: MultiTurnConfig, max_response_length: int | None = None) -> ToolPlan:
    """The ToolPlan of `mt` (`max_response_length`: rollout.max_response_length, what a null
    max_total_tokens means; default: RolloutConfig's)."""
    if max_response_length is None:
        max_response_length = RolloutConfig.max_response_length
    return ToolPlan(
        tools=tuple(mt.tools),
        max_assistant_turns=mt.max_assistant_turns,
        max_tool_response_length=mt.max_tool_response_length,
        max_total_tokens=mt.max_total_tokens if mt.max_total_tokens is not None else max_response_length,
        tool_timeout_s=mt.tool_timeout_s,
        tool_memory_mib=mt.tool_memory_mib,
        max_parallel_tools=max(1, mt.max_parallel_tools),
        sandbox=mt.sandbox,
        interaction=mt.interaction,
    )


# ============================================================================================ rollout
@dataclass(frozen=True)
class SamplingPlan:
    """How one kind of rollout samples a token (training or validation)."""

    temperature: float
    """0: greedy."""
    top_p: float
    top_k: int
    """-1: off."""
    min_p: float


@dataclass(frozen=True)
class RolloutPlan:
    """The rollout's engine settings and sampling (rollout.*), resolved. Responses per training prompt are
    the plan's BatchPlan.responses_per_prompt."""

    engine: str
    """embedded (the actor's megatron modules) or vllm."""
    max_response_length: int
    """Most generated tokens of one response."""
    stop_token_ids: tuple[int, ...]
    """Token ids that end a response besides EOS."""
    train: SamplingPlan
    """Sampling of training rollouts (rollout.temperature, top_p, top_k, min_p)."""
    val: SamplingPlan
    """Sampling of validation rollouts (rollout.val.temperature, top_p; no top-k, no min-p)."""
    val_responses_per_prompt: int
    """rollout.val.n."""
    tensor_parallel_size: int
    """The rollout's tensor-parallel size (rollout.tensor_model_parallel_size; null: the actor's)."""
    cuda_graph: bool
    """Decode with CUDA graphs where the device supports them (vLLM: not enforce_eager)."""
    free_cache_engine: bool
    """vLLM sleeps after each generation, so training gets the device memory back."""
    gpu_memory_utilization: float
    """vLLM's share of the device memory."""
    max_num_seqs: int
    """vLLM's most sequences in one batch."""
    push_timeout_s: float
    """Separate rollout: longest wait of one weight push before it counts as failed."""
    router_replay: bool
    """actor.router_replay: training rollouts record the experts each token was routed to."""
    multi_turn: ToolPlan | None
    """The agent loop's tools and limits (rollout.multi_turn.enable); None: one response per prompt."""

    def sampling(self, validate: bool) -> SamplingPlan:
        return self.val if validate else self.train


def rollout_plan(
    r: RolloutConfig, rollout_tp: int | None = None, router_replay: bool = False, actor_tp: int | None = None
) -> RolloutPlan:
    """The RolloutPlan of `r`; `rollout_tp`: the plan's rollout layout tp (a run's). Without it (an engine
    built outside a run): the section's, null meaning the actor's `actor_tp` (default: MegatronConfig's)."""
    if rollout_tp is None:
        if actor_tp is None:
            actor_tp = MegatronConfig.tensor_model_parallel_size
        rollout_tp = r.tensor_model_parallel_size or actor_tp
    return RolloutPlan(
        engine=r.engine,
        max_response_length=r.max_response_length,
        stop_token_ids=tuple(r.stop_token_ids),
        train=SamplingPlan(r.temperature, r.top_p, r.top_k, r.min_p),
        val=SamplingPlan(r.val.temperature, r.val.top_p, r.val.top_k, 0.0),
        val_responses_per_prompt=r.val.n,
        tensor_parallel_size=rollout_tp,
        cuda_graph=r.cuda_graph,
        free_cache_engine=r.free_cache_engine,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_num_seqs=r.max_num_seqs,
        push_timeout_s=r.push_timeout_s,
        router_replay=router_replay,
        multi_turn=tool_plan(r.multi_turn, r.max_response_length) if r.multi_turn.enable else None,
    )


# ============================================================================================ data
@dataclass(frozen=True)
class DataPlan:
    """Prompts: files or a synthetic task, keys, batch sizes, truncation and order (data.*)."""

    train_files: tuple[str, ...]
    """Training prompt files (.jsonl / .parquet); empty: the synthetic task."""
    val_files: tuple[str, ...]
    """Validation prompt files; empty: the synthetic task's validation set when train_files is empty too."""
    synthetic_task: str
    """count, copy, add or mul."""
    prompt_key: str
    """Field (dotted path) holding the prompt."""
    answer_key: str
    """Field (dotted path) holding the ground truth."""
    train_batch_size: int
    """Prompts per training step."""
    val_batch_size: int
    """Prompts per validation batch."""
    max_prompt_length: int
    """Most prompt tokens."""
    truncation: str
    """error, left, right or filter: what a longer prompt gets."""
    apply_chat_template: bool
    """Render prompts with the tokenizer's chat template."""
    shuffle: bool
    """Shuffle the training prompts each epoch."""
    seed: int
    """Seed of the prompt order and the synthetic task (data.seed; null: trainer.seed)."""


def data_plan(d: DataConfig, trainer_seed: int | None = None) -> DataPlan:
    """The DataPlan of `d`; `trainer_seed`: what a null data.seed means (default: TrainerConfig's)."""
    return DataPlan(
        train_files=tuple(d.train_files),
        val_files=tuple(d.val_files),
        synthetic_task=d.synthetic_task,
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        train_batch_size=d.train_batch_size,
        val_batch_size=d.val_batch_size,
        max_prompt_length=d.max_prompt_length,
        truncation=d.truncation,
        apply_chat_template=d.apply_chat_template,
        shuffle=d.shuffle,
        seed=resolve_seed(d.seed, TrainerConfig.seed if trainer_seed is None else trainer_seed),
    )


# ============================================================================================ reward
@dataclass(frozen=True)
class OverlongPlan:
    """DAPO's soft penalty on responses that run into the length limit."""

    length: int
    """Tokens before max_response_length where the penalty starts (reward.overlong_buffer.len)."""
    penalty_factor: float
    """The penalty at the limit."""


@dataclass(frozen=True)
class RewardPlan:
    """The rule reward the controller scores responses with (reward.*; a reward model is a plan role)."""

    function: str
    """A built-in reward name or a package.module:function / path/to/file.py:function spec."""
    overlong: OverlongPlan | None
    """The overlong penalty on training rewards (reward.overlong_buffer.enable); None: off."""


def reward_plan(r: RewardConfig) -> RewardPlan:
    o = r.overlong_buffer
    return RewardPlan(r.function, OverlongPlan(o.len, o.penalty_factor) if o.enable else None)


# ============================================================================================ tokenizer
@dataclass(frozen=True)
class TokenizerPlan:
    """Where the run's tokenizer comes from."""

    path: str | None
    """The folder read (model.tokenizer_path, null: model.path); None: the built-in character tokenizer."""
    key: str
    """The config path that names it (model.tokenizer_path or model.path), for errors."""
    vocab_size: int
    """The policy's vocabulary (model.arch.vocab_size): the built-in tokenizer must fit in it."""


def tokenizer_plan(m: ModelConfig) -> TokenizerPlan:
    """The TokenizerPlan of the model section `m` (a run's: the plan's effective model section)."""
    own = m.tokenizer_path is not None
    return TokenizerPlan(
        path=m.tokenizer_path if own else m.path,
        key="model.tokenizer_path" if own else "model.path",
        vocab_size=m.arch.vocab_size,
    )
