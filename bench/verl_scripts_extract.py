"""Re-extract bench/verl_scripts.json from a verl git checkout: the override list each of the 46 launch scripts
passes to Python, with its shell variables resolved by bash itself.

Each script runs under bash in a scratch folder with `python` / `python3` replaced by a recorder (it writes
its argv and exits 0) and `ray`, `srun`, `conda`, `nvidia-smi`, `hf`, `huggingface-cli`, `scontrol` and
`hostname` by inert stand-ins, `sleep` and `ulimit` made no-ops, no network (`unshare --net`, when the
machine allows it) and only the environment of `ENV` (values a script reads from the environment without a
default, or that pick its Megatron branch). The recorded argv minus `-m module` and the Hydra
`--config-path` / `--config-name` options is the override list. Paths are then made portable: a model path
becomes `{models}/NAME` (NAME: the folder's last part; `MODEL_NAMES` for scripts that leave it empty), data
paths go under `{data}/`, and `config_keys` lists what a script's named config sets on top of verl's
ppo_megatron_trainer (read from the config files, written out in `CONFIG_KEYS`).

Run: `python bench/verl_scripts_extract.py GIT_DIR [--check]` (GIT_DIR: a verl checkout's .git or a bare
mirror); `--check` compares with the committed file instead of writing it. The scripts are verl's (Apache-2.0);
this repository keeps only the resolved override lists, as data.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "verl_scripts.json"
WORK = "/tmp/verlwd"  # the scripts' working directory: $PWD-relative paths start here

ENV: dict[str, dict[str, str]] = {
    "examples/gspo_trainer/test_gspo_qwen30b_a3b_ep.sh": {"HDFS_ROOT": "/root", "DATA_ROOT": "/root"},
    "tests/special_npu/run_qwen3_30b_grpo_mindspeed.sh": {"USE_DUMMY_MODEL": "False"},
    "examples/gspo_trainer/run_qwen3_32b_gspo_npu.sh": {"sp_size": "4"},  # read before the script sets it
    "examples/gspo_trainer/run_qwen30b_gspo.sh": {"ARNOLD_WORKER_GPU": "8", "ARNOLD_WORKER_NUM": "2"},
    "examples/grpo_trainer/run_deepseek671b_math_megatron_80gb.sh": {"CKPT_DIR": "/root/ckpt/dsv3"},
    "examples/grpo_trainer/run_moonlight16b_math_megatron.sh": {"DIST_CKPT_PATH": "/root/dist_ckpt"},
    "examples/grpo_trainer/run_qwen2_5_vl-7b-megatron.sh": {"DIST_CKPT_PATH": "/root/dist_ckpt"},
    "examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh": {
        "aime24_test_path": "/root/verl/dataset/aime-2024.parquet"
    },
    "examples/sapo_trainer/run_qwen30b_sapo.sh": {
        "SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "64",
        "SLURM_JOB_NODELIST": "node1",
    },
    "tests/special_e2e/run_fully_async_policy.sh": {"ACTOR_STRATEGY": "megatron"},
    "tests/special_e2e/run_one_step_off_policy.sh": {"ACTOR_STRATEGY": "megatron"},
    "tests/special_e2e/run_transferqueue.sh": {"ACTOR_STRATEGY": "megatron"},
}  # fmt: skip
"""Environment per script (the census records it as the entry's `env`)."""

NOTES: dict[str, dict[str, str]] = {
    "examples/ppo_trainer/run_moonlight16b_a3b_gsm8k_megatron.sh": {
        "LLM": "<unset in the script: the Moonlight-16B-A3B-Instruct it downloads>"
    },
    "examples/router_replay/run_qwen30_a3b_megatron_sglang.sh": {
        "HF_MODEL_PATH": "<empty in the script: a Qwen3-30B-A3B folder>", "TRAIN_DATA_PATH": "<unset: gsm8k>"
    },
    "examples/router_replay/run_qwen30_a3b_megatron_vllm.sh": {
        "HF_MODEL_PATH": "<empty in the script: a Qwen3-30B-A3B folder>", "TRAIN_DATA_PATH": "<unset: gsm8k>"
    },
}  # fmt: skip
"""Values a script leaves empty that the census fills with a stand-in (recorded in `env`, not set)."""

MODEL_NAMES = {
    "examples/ppo_trainer/run_moonlight16b_a3b_gsm8k_megatron.sh": "Moonlight-16B-A3B-Instruct",
    "examples/router_replay/run_qwen30_a3b_megatron_sglang.sh": "Qwen3-30B-A3B",
    "examples/router_replay/run_qwen30_a3b_megatron_vllm.sh": "Qwen3-30B-A3B",
}
RENAME = {"<path_to_dsv3_config>": "DeepSeek-V3", "DeepSeek-V3-config-verl": "DeepSeek-V3"}
EMPTY_DATA = ("gsm8k/train.parquet", "gsm8k/test.parquet")  # router_replay scripts leave their data unset
MODEL_KEYS = ("actor_rollout_ref.model.path", "critic.model.path", "reward_model.model.path",
              "actor_rollout_ref.model.tokenizer_path", "critic.model.tokenizer_path")  # fmt: skip
ENTRY_MODULES = ("verl.trainer.main_ppo", "verl.experimental.fully_async_policy.fully_async_main",
                 "verl.experimental.one_step_off_policy.main_ppo", "verl.experimental.transfer_queue.main_ppo")  # fmt: skip

# What each named config sets on top of ppo_megatron_trainer (its own keys, as overrides; a long chat template
# is summarised).
_MULTI_TURN = ["data.return_raw_chat=True", "actor_rollout_ref.hybrid_engine=True",
               "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.multi_turn.enable=True",
               "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5"]  # fmt: skip
CONFIG_KEYS: dict[str, list[str]] = {
    "gsm8k_multiturn_megatron_grpo": ["data.max_prompt_length=1024", "data.max_response_length=1024",
                                      "data.train_batch_size=256", *_MULTI_TURN],
    "geo3k_multiturn_megatron_grpo": ["data.max_prompt_length=2048", "data.max_response_length=2048",
                                      "data.train_batch_size=256", "data.return_multi_modal_inputs=False",
                                      "actor_rollout_ref.model.custom_chat_template='<a Qwen2.5-VL chat "
                                      "template with tool calls>'", *_MULTI_TURN],
    "fully_async_ppo_megatron_trainer": [
        "async_training.staleness_threshold=0.1", "async_training.trigger_parameter_sync_step=4",
        "async_training.require_batches=1", "async_training.partial_rollout=True",
        "async_training.use_rollout_log_probs=True", "async_training.compute_prox_log_prob=False",
        "async_training.use_trainer_do_validate=False", "async_training.checkpoint_engine.enable=True",
        "async_training.checkpoint_engine.device_buffer_size_M=4096",
        "async_training.checkpoint_engine.overlap_broadcast_and_consume=False", "rollout.nnodes=1",
        "rollout.n_gpus_per_node=8", "rollout.n=4", "rollout.total_rollout_steps=100", "rollout.total_epochs=10",
        "rollout.test_freq=1", "data.gen_batch_size=1", "actor_rollout_ref.actor.use_rollout_log_probs=True",
    ],
    "one_step_off_ppo_megatron_trainer": [
        "rollout.nnodes=1", "rollout.n_gpus_per_node=8", "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.calculate_log_probs=True", "algorithm.rollout_correction.bypass_mode=True",
    ],
    "transfer_queue_ppo_megatron_trainer": [
        "transfer_queue.enable=True", "transfer_queue.num_global_batch=1",
        "transfer_queue.storage_backend=AsyncSimpleStorageManager", "transfer_queue.num_data_storage_units=8",
    ],
}  # fmt: skip

_RECORDER = """#!{python}
import json, os, sys
args = sys.argv[1:]
if len(args) > 1 and args[0] == "-m" and args[1] in {modules!r}:
    with open(os.environ["SHIM_OUT"], "a") as f:
        f.write(json.dumps(args) + "\\n")
sys.exit(0)
"""
_SRUN = '#!/bin/bash\nwhile [[ $# -gt 0 && "$1" == -* ]]; do case "$1" in -w|-N|-n) shift 2;; *) shift;; esac; done\nexec "$@"\n'


def _shims(folder: Path) -> Path:
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    recorder = _RECORDER.format(python=sys.executable, modules=set(ENTRY_MODULES))
    for name, text in (("python3", recorder), ("python", recorder), ("srun", _SRUN),
                       ("scontrol", "#!/bin/sh\necho node1\n"), ("hostname", "#!/bin/sh\necho 10.0.0.1\n"),
                       *((t, "#!/bin/sh\nexit 0\n") for t in ("ray", "conda", "nvidia-smi", "hf",
                                                                "huggingface-cli"))):  # fmt: skip
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (folder / "bashenv.sh").write_text("ulimit() { :; }\nsleep() { :; }\n")
    return bin_dir


def run_script(git_dir: str, path: str, shims: Path) -> list[str]:
    """The argv the script passes to `python -m <entry>` (bash resolves every variable)."""
    text = subprocess.run(["git", "--git-dir", git_dir, "show", f"HEAD:{path}"], check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    script, out = Path(WORK) / "script.sh", shims.parent / "argv.jsonl"
    script.write_text(text)
    out.unlink(missing_ok=True)
    env = {"BASH_ENV": str(shims.parent / "bashenv.sh"), "HOME": "/root", "PATH": f"{shims}:/usr/bin:/bin",
           "SHIM_OUT": str(out), **ENV.get(path, {})}  # fmt: skip
    cmd = ["bash", str(script)]
    if shutil.which("unshare") and subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"],
                                                   capture_output=True).returncode == 0:  # fmt: skip
        cmd = ["unshare", "--user", "--map-root-user", "--net", *cmd]
    subprocess.run(cmd, cwd=WORK, env=env, capture_output=True, timeout=60)
    lines = out.read_text().splitlines() if out.exists() else []
    if len(lines) != 1:
        raise RuntimeError(f"{path}: {len(lines)} trainer calls recorded (expected 1)")
    return list(json.loads(lines[0]))


def _data_path(p: str) -> str:
    return "{data}/" + p.replace(WORK + "/", "").lstrip("/")


def entry_of(path: str, argv: list[str]) -> dict[str, Any]:
    """The census entry of one script: its entry module, config name, environment and portable overrides."""
    module, rest = argv[1], argv[2:]
    config, overrides, i = "ppo_trainer", [], 0
    while i < len(rest):
        arg = rest[i]
        if arg.startswith(("--config-path", "--config-name")):
            value = arg.split("=", 1)[1] if "=" in arg else rest[i + 1]
            i += 0 if "=" in arg else 1
            if arg.startswith("--config-name"):
                config = value.removesuffix(".yaml")
        else:
            overrides.append(_portable(path, arg))
        i += 1
    return {"script": path, "entry": module, "config": config, "env": {**ENV.get(path, {}), **NOTES.get(path, {})},
            "config_keys": CONFIG_KEYS.get(config, []), "overrides": overrides}  # fmt: skip


def _portable(path: str, text: str) -> str:
    key, _, value = text.partition("=")
    bare = key.lstrip("+~")
    if bare in MODEL_KEYS:
        name = value.rstrip("/").rsplit("/", 1)[-1] if value else MODEL_NAMES[path]
        return f"{key}={{models}}/{RENAME.get(name, name)}"
    if bare in ("data.train_files", "data.val_files"):
        value = value or EMPTY_DATA[bare == "data.val_files"]
        if value.startswith("["):
            return f"{key}=[" + ", ".join(f"'{_data_path(x)}'" for x in re.findall(r"'([^']*)'", value)) + "]"
        return f"{key}={_data_path(value)}"
    if "tool_config_path" in bare:
        return f"{key}={value.replace(WORK + '/', '')}"
    if WORK in value:
        return f"{key}={value.replace(WORK + '/', '/root/')}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("git_dir", help="a verl checkout's .git folder or a bare mirror")
    parser.add_argument("--check", action="store_true", help="compare with the committed file, write nothing")
    args = parser.parse_args(argv)
    committed = json.loads(DATA.read_text(encoding="utf-8"))
    commit = subprocess.run(["git", "--git-dir", args.git_dir, "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        shims = _shims(Path(tmp))
        scripts = [
            entry_of(s["script"], run_script(args.git_dir, s["script"], shims)) for s in committed["scripts"]
        ]
    new = {"verl_commit": commit, "scripts": scripts}
    if args.check:
        same = new == committed
        print("bench/verl_scripts.json is " + ("up to date" if same else "different from the extraction"))
        return 0 if same else 1
    DATA.write_text(json.dumps(new, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {DATA.relative_to(ROOT)} ({len(scripts)} scripts at verl {commit[:7]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
