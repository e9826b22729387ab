"""Program output quoted in the guides, regenerated from the commands that print it.

Each `Excerpt` names a region of a page (`<!-- generated:NAME -->` ... `<!-- /generated -->`), the commands
whose output it quotes, the small input files they read (written into a fresh folder first) and which lines
it keeps. `rlconf docs` runs them and writes the region: a `text` block of `$ COMMAND` lines, each followed
by the lines it kept (`...` where lines were left out). tests/test_docs.py runs them again and fails when a
committed page differs, so a change of wording, rules, presets or plan shows up there.

`rlconf` commands run in-process when the command layer passes its `main` (`rlconf docs` does; rlconf never
imports presets); everything else, and `rlconf` without it, runs as `python -m PROGRAM.cli` in a subprocess.
Output that needs a GPU, a long run or another machine is not here: such blocks are marked
`<!-- recorded: ... -->` in the page, with the command that made them and why they are not re-run.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

RlconfMain = Callable[[Sequence[str]], int]
"""rlconf.cli.main: runs one rlconf command from its arguments and returns its exit code."""

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: subprocesses import rlconf / rltrain / presets from here."""


@dataclass(frozen=True)
class Excerpt:
    """One quoted output: `commands` run in order in one folder holding `files`; each must exit `exit`.

    `keep` selects the quoted lines of each command's output (all of them when empty): `rule:NAME` the
    issue lines of rule NAME with their indented `fix:` lines, `line:PREFIX` every line starting with
    PREFIX, `from:PREFIX` the lines from the first that starts with PREFIX up to a blank line, and
    `from:PREFIX:N` N lines from there. A command's `/models/...` path is the folder's `models/...`, and the
    folder's path is shown as `/` in the output (`/tmp/x/models/m` as `/models/m`).
    """

    name: str
    commands: tuple[str, ...]
    keep: tuple[str, ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    exit: int = 0


def _yaml(*lines: str) -> str:
    return "\n".join(lines) + "\n"


TINY_GRPO = "preset: tiny-grpo"
_QWEN_EDITED = (
    '{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 32, "hidden_size": 64, '
    '"intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
    '"max_position_embeddings": 256, "rope_theta": 1000000.0, '
    '"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": true}'
)
_CLIMBING_INDEX = (
    '{"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../outside/x.safetensors", '
    '"lm_head.weight": "model.safetensors"}}'
)

MY_RUN = _yaml("# my_run.yaml", "preset: tiny-ppo", "actor:", "  optim:", "    lr: 2e-3", "    lr_warmup_steps: 5",
               "    lr_decay_style: cosine", "trainer:", "  total_steps: 50", "  save_freq: 10")  # fmt: skip
"""concepts.md's run file: the page shows it (region input-my-run) and the excerpts read it."""
INPUTS: tuple[tuple[str, str, str], ...] = (("input-my-run", "yaml", MY_RUN),)
"""Input files the pages show (region name, block language, text), written from the text the excerpts read."""

EXCERPTS: tuple[Excerpt, ...] = (
    # docs/troubleshooting.md
    Excerpt("validate-typo", ("rlconf validate typo.yaml",), exit=2, files=(("typo.yaml", _yaml(
        TINY_GRPO, "actor:", "  optim:", "    learning_rate: 1e-6", "  loss_agg_mode: token_mean", "trainer:",
        "  total_steps: ten")),)),
    Excerpt("flag-type", ("rltrain tiny-grpo --actor.optim.lr abc",), exit=2),
    Excerpt("validate-presets", ("rlconf validate syntax.yaml", "rlconf validate preset.yaml",
                                 "rlconf show conflict.yaml --preset tiny-grpo"), exit=2, files=(
        ("syntax.yaml", _yaml(TINY_GRPO, "rollout:", "  n: [1, 2")),
        ("preset.yaml", _yaml("preset: tiny-grpoo")),
        ("conflict.yaml", _yaml("preset: tiny-ppo")))),
    Excerpt("rule-world", ("rlconf validate world.yaml",), ("rule:world-divisible-by-model-parallel",), exit=2,
            files=(("world.yaml", _yaml(TINY_GRPO, "cluster:", "  gpus_per_node: 4", "actor:", "  megatron:",
                                        "    tensor_model_parallel_size: 3")),)),
    Excerpt("rule-heads", ("rlconf validate groups.yaml", "rlconf validate heads.yaml"),
            ("rule:heads-divisible-by-tp",), exit=2, files=(
        ("groups.yaml", _yaml(TINY_GRPO, "model:", "  arch:", "    num_attention_heads: 6",
                              "    num_query_groups: 3", "    kv_channels: 16", "cluster:", "  gpus_per_node: 2",
                              "actor:", "  megatron:", "    tensor_model_parallel_size: 2")),
        ("heads.yaml", _yaml(TINY_GRPO, "cluster:", "  gpus_per_node: 8", "rollout:",
                             "  tensor_model_parallel_size: 8")))),
    Excerpt("rule-layers", ("rlconf validate pp.yaml", "rlconf validate pp-embedding.yaml",
                            "rlconf validate vpp.yaml"), ("rule:layers-divisible-by-pp",), exit=2, files=(
        ("pp.yaml", _yaml(TINY_GRPO, "cluster:", "  gpus_per_node: 4", "actor:", "  megatron:",
                          "    pipeline_model_parallel_size: 4")),
        ("pp-embedding.yaml", _yaml(TINY_GRPO, "cluster:", "  gpus_per_node: 4", "actor:", "  megatron:",
                                    "    pipeline_model_parallel_size: 4",
                                    "    account_for_embedding_in_pipeline_split: true")),
        ("vpp.yaml", _yaml(TINY_GRPO, "actor:", "  megatron:", "    virtual_pipeline_model_parallel_size: 2")))),
    Excerpt("validate-pools", ("rlconf validate ref.yaml",), exit=2, files=(("ref.yaml", _yaml(
        "preset: tiny-ppo", "cluster:", "  gpus_per_node: 2", "actor:", "  megatron:",
        "    tensor_model_parallel_size: 2", "ref:", "  megatron:", "    tensor_model_parallel_size: 1", "critic:",
        "  placement: separate", "  num_devices: 2")),)),
    Excerpt("validate-sp", ("rlconf validate sp.yaml",), files=(("sp.yaml", _yaml(
        TINY_GRPO, "actor:", "  megatron:", "    sequence_parallel: true")),)),
    Excerpt("rule-model-config-json", ("rlconf plan --preset tiny-grpo --set model.path=Qwen-edited",),
            ("rule:model-config-json",), exit=2, files=(("Qwen-edited/config.json", _QWEN_EDITED),)),
    Excerpt("rule-batch", ("rlconf validate mini.yaml", "rlconf validate micro.yaml", "rlconf validate dp.yaml",
                           "rlconf validate budget.yaml"),
            ("rule:mini-batch-divides-batch", "rule:mini-batch-covers-micro", "rule:batch-divisible-by-dp-micro",
             "rule:token-budget-fits-sequence"), exit=2, files=(
        ("mini.yaml", _yaml(TINY_GRPO, "actor:", "  ppo_mini_batch_size: 3", "  ppo_micro_batch_size_per_gpu: 8")),
        ("micro.yaml", _yaml(TINY_GRPO, "actor:", "  ppo_mini_batch_size: 4", "  ppo_micro_batch_size_per_gpu: 64")),
        ("dp.yaml", _yaml(TINY_GRPO, "cluster:", "  gpus_per_node: 3", "actor:",
                          "  ppo_micro_batch_size_per_gpu: 1")),
        ("budget.yaml", _yaml(TINY_GRPO, "data:", "  max_prompt_length: 128", "rollout:",
                              "  max_response_length: 256", "model:", "  arch:", "    max_position_embeddings: 512",
                              "actor:", "  use_dynamic_bsz: true", "  ppo_max_token_len_per_gpu: 256")))),
    Excerpt("validate-algo", ("rlconf validate algo.yaml",), exit=2, files=(("algo.yaml", _yaml(
        TINY_GRPO, "algorithm:", "  adv_estimator: gae", "actor:", "  optim:", "    lr: 0.0", "  checkpoint:",
        "    save_contents: [model]", "trainer:", "  resume_mode: resume_path")),)),
    Excerpt("validate-data", ("rlconf validate lengths.yaml", "rlconf validate reward.yaml",
                              "rlconf validate prof.yaml"), exit=2, files=(
        ("lengths.yaml", _yaml(TINY_GRPO, "data:", "  max_prompt_length: 128", "rollout:",
                               "  max_response_length: 256")),
        ("reward.yaml", _yaml(TINY_GRPO, "reward:", "  function: exact-match", "data:",
                              "  train_files: [data/train.csv]")),
        ("data/train.csv", "prompt,answer\n"),
        ("prof.yaml", _yaml(TINY_GRPO, "profile:", "  tool: nsys", "  ranks: [3]", "  steps: [0, 200]",
                            "  roles: [critic_update]")))),
    # docs/concepts.md
    Excerpt("show-my-run", ("rlconf show my_run.yaml --set actor.optim.lr=1e-4",), ("from:  optim:5",),
            files=(("my_run.yaml", MY_RUN),)),
    Excerpt("plan-lr-warmup", ("rlconf plan --preset tiny-grpo --set actor.optim.lr=1e-4 "
                               "--set actor.optim.lr_warmup_steps=5 --set actor.optim.lr_decay_style=cosine",),
            ("from:lr schedule actor:4",)),
    Excerpt("plan-critic-pool", ("rlconf plan --preset tiny-ppo --set cluster.gpus_per_node=3 "
                                 "--set critic.placement=separate --set critic.num_devices=1 "
                                 "--set actor.ppo_micro_batch_size_per_gpu=2",), ("from:resources:",)),
    # docs/checkpoints.md
    Excerpt("plan-checkpoints", ("rlconf plan --preset tiny-grpo --set trainer.total_steps=25 "
                                 "--set trainer.save_freq=10 --set trainer.max_ckpt_to_keep=2 "
                                 "--set actor.checkpoint.async_save=true "
                                 "--set actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",),
            ("from:checkpoints:",)),
    # docs/separate-rollout.md
    Excerpt("plan-separate-rollout", ("rlconf plan --preset tiny-grpo --set cluster.gpus_per_node=3 "
                                      "--set rollout.placement=separate --set rollout.num_devices=1 "
                                      "--set algorithm.off_policy_steps=1",),
            ("from:resources:", "line:  rollout weight push:")),
    # docs/gpus.md
    Excerpt("plan-layouts-7b", ("rlconf plan --preset qwen2.5-7b-grpo-tp4pp2",),
            ("from:layouts (rank:3", "from:  actor grid:3")),
    Excerpt("plan-memory-1-5b", ("rlconf plan --preset qwen2.5-1.5b-grpo",), ("from:memory estimate:5",)),
    Excerpt("plan-memory-exceeds", ("rlconf plan --preset qwen2.5-1.5b-grpo --set cluster.device_memory_gib=24",),
            exit=2),
    # docs/hardware.md
    Excerpt("device-npu-missing", ("rltrain tiny-grpo --cluster.device npu",),
            ("line:command line:", "rule:device-available"), exit=2),
    # docs/security.md
    Excerpt("rule-model-folder-paths", ("rlconf validate --preset tiny-grpo --set model.path=/models/tiny",),
            ("rule:model-folder-paths",), exit=2, files=(
        ("models/tiny/config.json", _QWEN_EDITED.replace('"rope_theta": 1000000.0, ', "")),
        ("models/tiny/model.safetensors.index.json", _CLIMBING_INDEX))),
)  # fmt: skip


def _issue_lines(lines: list[str], rule: str) -> list[int]:
    picked, inside = [], False
    for i, line in enumerate(lines):
        if re.match(rf"(error|warning) \[{re.escape(rule)}\] ", line):
            inside = True
        elif not line.startswith(" "):
            inside = False
        if inside:
            picked.append(i)
    return picked


def _from_lines(lines: list[str], spec: str) -> list[int]:
    prefix, _, count = spec.rpartition(":") if spec[-1].isdigit() else (spec, "", "")
    start = next((i for i, line in enumerate(lines) if line.startswith(prefix)), None)
    if start is None:
        return []
    if count:
        return list(range(start, min(start + int(count), len(lines))))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return list(range(start, end))


def _select(lines: list[str], spec: str) -> list[int]:
    kind, _, arg = spec.partition(":")
    if kind == "rule":
        return _issue_lines(lines, arg)
    if kind == "line":
        return [i for i, line in enumerate(lines) if line.startswith(arg)]
    if kind == "from":
        return _from_lines(lines, arg)
    raise ValueError(f"unknown selector {spec!r}")


def kept_lines(lines: list[str], keep: Sequence[str]) -> tuple[list[str], set[str]]:
    """The lines `keep` selects (see Excerpt), in output order with `...` where lines were left out, and the
    selectors that matched."""
    if not keep:
        return list(lines), set()
    picked: set[int] = set()
    matched = set()
    for spec in keep:
        if found := _select(lines, spec):
            matched.add(spec)
            picked.update(found)
    out, last = [], -1
    for i in sorted(picked):
        if last >= 0 and i > last + 1:
            out.append("...")
        out.append(lines[i])
        last = i
    return out, matched


def run_command(command: str, cwd: Path, rlconf_main: RlconfMain | None = None) -> tuple[int, str]:
    """Run one documented command in `cwd`: (exit code, stdout and stderr as printed)."""
    argv = shlex.split(command)
    if argv[0] == "rlconf" and rlconf_main is not None:
        buffer, before = io.StringIO(), os.getcwd()
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
                code = rlconf_main(argv[1:])
        finally:
            os.chdir(before)
        return code, buffer.getvalue()
    # A user's shell: without what an in-process rltrain (a test's, say) set for its own workers.
    env = {
        **{k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"},
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",  # stdout and stderr interleave as on a terminal
    }
    result = subprocess.run([sys.executable, "-m", f"{argv[0]}.cli", *argv[1:]], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, check=False)  # fmt: skip
    return result.returncode, result.stdout


def excerpt_text(excerpt: Excerpt, rlconf_main: RlconfMain | None = None) -> str:
    """The region body of `excerpt`: its commands run in a fresh folder, their kept lines in a text block."""
    blocks, matched = [], set()
    with tempfile.TemporaryDirectory(prefix="rlplan-docs-") as tmp:
        folder = Path(tmp).resolve()
        for name, text in excerpt.files:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text, encoding="utf-8")
        for command in excerpt.commands:
            shown = command.replace(" /models/", f" {folder}/models/").replace(
                "=/models/", f"={folder}/models/"
            )
            code, out = run_command(shown, folder, rlconf_main)
            out = out.replace(f"{folder}/", "/")
            if code != excerpt.exit:
                raise RuntimeError(f"`{command}` exited {code}, the docs say {excerpt.exit}:\n{out}")
            kept, found = kept_lines(out.splitlines(), excerpt.keep)
            matched |= found
            blocks.append("\n".join([f"$ {command}", *kept]))
    if missing := [spec for spec in excerpt.keep if spec not in matched]:
        raise RuntimeError(f"{excerpt.name}: {missing} selected nothing in the output of {excerpt.commands}")
    return "```text\n" + "\n\n".join(blocks) + "\n```\n"
