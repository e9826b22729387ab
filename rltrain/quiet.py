"""Quiet, honest run output: third-party warnings that tell a user nothing are filtered once per process,
and what they stood for is said once, in one line, by the driver.

`filter_third_party_warnings()` runs in every worker before it imports megatron (and in the driver);
`quiet_driver(device)` runs in the driver before Ray starts and returns the one note worth printing. Keep
this module free of torch, Ray and megatron imports: the `rltrain` command imports it before any of them.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import warnings

# (start of the message, module regex of the code that warns): warnings.filterwarnings matches both from
# the start.
MEGATRON_NOISE = (
    # Four or five per process when megatron imports (one per module that has a fused fallback); the
    # driver's `kernel_note` says once what is missing and what it costs.
    ("Transformer Engine and Apex are not installed", "megatron"),  # also megatron_fsdp
    ("Apex is not installed", "megatron"),  # per model build: Torch norms instead of Apex's fused ones
    # megatron's own TransformerConfig default (cuda_graph_scope="full") trips its own deprecation on every
    # model build; rlplan does not capture megatron's graphs, so nothing for the user to change.
    ("full scope is deprecated", r"megatron\.core\.transformer"),
    # megatron's DistributedOptimizer.zero_grad reads `.grad` of its fp32 shard views (its source says
    # "throws grad-access warning"). On CPU the same read is attributed to rltrain.megatron.cpu_compat,
    # which filters it there.
    ("The .grad attribute of a Tensor that is not a leaf", r"megatron\.core\.optimizer"),
)

# torch deprecations that megatron-core 0.16's checkpoint loading trips on every resume (FutureWarning;
# nothing for a user to change). On CPU the ShardedTensor one is attributed to rltrain.megatron.cpu_compat.
TORCH_DEPRECATION_NOISE = (
    ("`load_state_dict` is deprecated", r"megatron\.core\.dist_checkpointing"),
    ("Please use DTensor instead and we are deprecating ShardedTensor", r"(megatron|rltrain\.megatron)"),
)
# megatron compares every rank's "common" checkpoint dict with rank 0's on each save and logs the
# difference. With the distributed optimizer (dp_reshardable) the other data-parallel ranks always carry
# the optimizer's `param_state` key there and rank 0 does not: a known, harmless difference, dropped. Any
# other difference is still logged.
MEGATRON_CKPT_LOGGER = "megatron.core.dist_checkpointing.validation"
BENIGN_COMMON_DIFF = re.compile(
    r"Rank \d+ common state dict differs from rank 0 common state dict\. Keys only on rank 0: \[\], "
    r"Keys only on \d+: \[\('optimizer', 'param_state'\)\], Mismatched keys: \[\]$"
)

# Ray 2.60 logs the first at every `ray.init`, and the second at the first `ray.init` on a machine (it
# writes ~/.ray/auth_token): a user's very first run. The token is Ray's default and needs no action.
RAY_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_TOKEN_AUTH_MESSAGE = "Token authentication is enabled for this Ray cluster"
RAY_TOKEN_CREATED_MESSAGE = "Generated new authentication token"


# Ray logs this at every local `ray.init`, on whatever line the console is on (the progress bar's): the run
# started Ray itself, so it says nothing. "Connected to Ray cluster" (cluster.ray_address) is kept.
RAY_WORKER_LOGGER = "ray._private.worker"
RAY_LOCAL_MESSAGE = "Started a local Ray instance"


class _DropMessages(logging.Filter):
    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


class _DropMatching(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def filter_third_party_warnings() -> None:
    """Ignore the warnings in MEGATRON_NOISE and TORCH_DEPRECATION_NOISE and megatron's benign checkpoint
    log line in this process. Idempotent; call before importing megatron (its import-time warnings are
    emitted once and cannot be filtered afterwards)."""
    for message, module in MEGATRON_NOISE:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    for message, module in TORCH_DEPRECATION_NOISE:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)
    ckpt = logging.getLogger(MEGATRON_CKPT_LOGGER)
    if not any(isinstance(f, _DropMatching) for f in ckpt.filters):
        ckpt.addFilter(_DropMatching(BENIGN_COMMON_DIFF))


def kernel_note(device: str) -> str | None:
    """One line when megatron runs without Transformer Engine / Apex on this machine, else None."""
    missing = [name for module, name in (("transformer_engine", "Transformer Engine"), ("apex", "Apex"))
               if importlib.util.find_spec(module) is None]  # fmt: skip
    if not missing:
        return None
    cost = "no effect on CPU runs" if device == "cpu" else "slower on GPUs: unfused kernels"
    return f"note: no {' / '.join(missing)}: megatron uses its plain torch implementations ({cost})"


def quiet_driver(device: str) -> str | None:
    """Filter the driver's noise (before `ray.init`) and return the note to print once, if any."""
    filter_third_party_warnings()
    ray_auth = logging.getLogger(RAY_TOKEN_AUTH_LOGGER)
    if not any(isinstance(f, _DropMessages) for f in ray_auth.filters):
        ray_auth.addFilter(_DropMessages(RAY_TOKEN_AUTH_MESSAGE, RAY_TOKEN_CREATED_MESSAGE))
    ray_worker = logging.getLogger(RAY_WORKER_LOGGER)
    if not any(isinstance(f, _DropMessages) for f in ray_worker.filters):
        ray_worker.addFilter(_DropMessages(RAY_LOCAL_MESSAGE))
    return kernel_note(device)
