"""Census of verl's Megatron launch scripts through `rlconf import-verl`: which ones plan, and why the others
are refused.

bench/verl_scripts.json holds the override list of each of 46 run scripts of verl (the commit it names):
the 45 `.sh` files that start verl's trainer (main_ppo, the one-step-off and fully-async entry points) with a
Megatron config or `strategy=megatron`, plus examples/grpo_trainer/run_qwen2-7b_math.sh, the FSDP twin of the
Megatron GRPO example (its offloads translate to megatron's). Each list is what the script passes to
Python, its shell variables resolved by running the script with `python3` replaced by a recorder (values from
the environment: the script's own default; see `env` of an entry); a model path is `{models}/NAME` and data
paths are under `{data}`, filled in here with stand-ins. Keys a script's named config sets on top of verl's
ppo_megatron_trainer (the multi-turn and one-step-off configs) come first (`config_keys`).

Stand-ins: bench/verl_scripts_models.json is the published config.json shape of every model the scripts name
(written into folders with sparse weights and a tokenizer by tests/hf_folders.py, so a folder validates like
the download), and every data path gets a verl-format GSM8K-shaped parquet file.

For each script the census translates, validates and plans (`rlconf.verl.translate`) and records: plans, or
the rule / path / message of the first refusal; keys the table does not know; keys neither mapped nor
reported (silent); warnings about values the import derived itself; and the key values of the result
compared with the script's (model path, layouts, batch sizes, lr, loss, LoRA, offloads: `CHECKS`). A
planned deepseek_v3 (MLA) model is marked: rlplan plans it, rltrain refuses it until MLA is trained.

`python bench/verl_scripts_census.py` prints one line per script; `--write` also rewrites
docs/_generated/verl-scripts-census.json, the record `rlconf docs` renders into docs/migrating-from-verl.md
(tests/test_import_verl_census.py checks that the record is today's census).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "verl_scripts.json"
MODELS = ROOT / "bench" / "verl_scripts_models.json"
RECORD = ROOT / "docs" / "_generated" / "verl-scripts-census.json"

MODEL_KEYS = ("actor_rollout_ref.model.path", "critic.model.path", "reward_model.model.path")
DATA_KEYS = ("data.train_files", "data.val_files")

# verl key -> rlplan path whose value must be the script's (after the table's documented conversion).
CHECKS: tuple[tuple[str, str], ...] = (
    ("actor_rollout_ref.model.path", "model.path"),
    ("algorithm.adv_estimator", "algorithm.adv_estimator"),
    ("data.train_batch_size", "data.train_batch_size"),
    ("data.max_prompt_length", "data.max_prompt_length"),
    ("data.max_response_length", "rollout.max_response_length"),
    ("actor_rollout_ref.rollout.n", "rollout.n"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", "actor.ppo_mini_batch_size"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor.ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.actor.use_dynamic_bsz", "actor.use_dynamic_bsz"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor.ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.actor.optim.lr", "actor.optim.lr"),
    ("actor_rollout_ref.actor.optim.weight_decay", "actor.optim.weight_decay"),
    ("actor_rollout_ref.actor.optim.clip_grad", "actor.optim.clip_grad"),
    ("actor_rollout_ref.actor.use_kl_loss", "actor.use_kl_loss"),
    ("actor_rollout_ref.actor.kl_loss_coef", "actor.kl_loss_coef"),
    ("actor_rollout_ref.actor.clip_ratio_low", "actor.clip_ratio_low"),
    ("actor_rollout_ref.actor.clip_ratio_high", "actor.clip_ratio_high"),
    ("actor_rollout_ref.actor.loss_agg_mode", "actor.loss_agg_mode"),
    ("actor_rollout_ref.actor.entropy_coeff", "actor.entropy_coeff"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode", "actor.policy_loss.loss_mode"),
    ("actor_rollout_ref.model.lora.rank", "actor.lora.rank"),
    ("actor_rollout_ref.model.lora.alpha", "actor.lora.alpha"),
    ("actor_rollout_ref.model.lora_rank", "actor.lora.rank"),
    ("actor_rollout_ref.model.lora_alpha", "actor.lora.alpha"),
    ("critic.optim.lr", "critic.optim.lr"),
    *(
        (f"actor_rollout_ref.{role}.megatron.{name}", f"{role}.megatron.{name}")
        for role in ("actor", "ref")
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "param_offload",
        )
    ),
    ("actor_rollout_ref.actor.megatron.optimizer_offload", "actor.megatron.optimizer_offload"),
    ("critic.megatron.tensor_model_parallel_size", "critic.megatron.tensor_model_parallel_size"),
    ("critic.megatron.pipeline_model_parallel_size", "critic.megatron.pipeline_model_parallel_size"),
    ("actor_rollout_ref.actor.fsdp_config.param_offload", "actor.megatron.param_offload"),
    ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", "actor.megatron.optimizer_offload"),
    ("actor_rollout_ref.ref.fsdp_config.param_offload", "ref.megatron.param_offload"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "actor.megatron.context_parallel_size"),
)


@dataclass(frozen=True)
class Outcome:
    """One script through the import: plans or the first refusal, and what the census found wrong."""

    script: str
    model: str
    plans: bool
    rule: str = ""
    path: str = ""
    reason: str = ""
    not_trainable: str = ""
    """A planned model rltrain refuses at start (rlconf.model_spec.training_gaps): the gap's field."""
    unknown: tuple[str, ...] = ()
    silent: tuple[str, ...] = ()
    about_derived: tuple[str, ...] = ()
    wrong: tuple[str, ...] = ()
    errors: tuple[tuple[str, str], ...] = field(default=())

    @property
    def clean(self) -> bool:
        """Nothing silently mistranslated: every key known and reported, no warning about a derived value,
        every checked value the script's, and a refusal that names its rule and path."""
        named = self.plans or bool(self.rule and self.path)
        return named and not (self.unknown or self.silent or self.about_derived or self.wrong)

    def line(self) -> str:
        head = f"{Path(self.script).name:<52} {self.model:<28}"
        if self.plans:
            verdict = "plans" + (f" (not trainable yet: {self.not_trainable})" if self.not_trainable else "")
        else:
            verdict = f"refused [{self.rule}] {self.path}: {self.reason}"
        flaws = [f"{k}: {', '.join(v)}" for k, v in (("unknown", self.unknown), ("silent", self.silent),
                 ("warns about derived", self.about_derived), ("wrong", self.wrong)) if v]  # fmt: skip
        return f"{head} {verdict}" + (f"  !! {'; '.join(flaws)}" if flaws else "")


def load_scripts() -> list[dict[str, Any]]:
    return list(json.loads(DATA.read_text(encoding="utf-8"))["scripts"])


def build_standins(root: Path, scripts: Sequence[Mapping[str, Any]]) -> None:
    """Model folders for every model the scripts name and a GSM8K-shaped verl parquet for every data path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlconf.errors import ConfigError
    from rltrain.tokenizer import CharTokenizer
    from tests.hf_folders import complete_folder

    for name, cfg in json.loads(MODELS.read_text(encoding="utf-8")).items():
        folder = root / "models" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
        try:
            complete_folder(folder)
        except ConfigError:  # a model rlplan refuses: config.json and the tokenizer are what it reads
            CharTokenizer().save_pretrained(str(folder))
    rows = 2048  # more than any script's data.train_batch_size, so every epoch has a full batch
    table = pa.table({
        "data_source": ["openai/gsm8k"] * rows,
        "prompt": [[{"role": "user", "content": f"What is {i} + 1? Put the answer after ####."}] for i in range(rows)],
        "ability": ["math"] * rows,
        "reward_model": [{"style": "rule", "ground_truth": str(i + 1)} for i in range(rows)],
        "extra_info": [{"split": "train", "index": i} for i in range(rows)],
    })  # fmt: skip
    for entry in scripts:
        for text in [*entry["config_keys"], *entry["overrides"]]:
            for path in re.findall(r"\{data\}/[^'\",\] ]+", text):
                file = root / "data" / path.removeprefix("{data}/")
                if not file.exists():
                    file.parent.mkdir(parents=True, exist_ok=True)
                    pq.write_table(table, file)


def overrides_of(entry: Mapping[str, Any], root: Path) -> list[str]:
    """The script's config keys then its overrides, with the stand-ins' folders filled in."""
    out = []
    for text in [*entry["config_keys"], *entry["overrides"]]:
        out.append(text.replace("{models}", str(root / "models")).replace("{data}", str(root / "data")))
    return out


def _model_of(overrides: Sequence[str]) -> str:
    for text in overrides:
        key, _, value = text.lstrip("+").partition("=")
        if key == "actor_rollout_ref.model.path":
            return value.rsplit("/", 1)[-1]
    return "?"


def _given(overrides: Sequence[str]) -> dict[str, Any]:
    """The verl keys the overrides set (last one wins, deletions removed), values parsed as Hydra does."""
    from rlconf.verl import parse_override

    out: dict[str, Any] = {}
    for text in overrides:
        ov = parse_override(text)
        if ov.op == "delete":
            out = {k: v for k, v in out.items() if k != ov.key and not k.startswith(ov.key + ".")}
        else:
            out[ov.key] = ov.value
    return out


def _same(want: Any, got: Any) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return want is got
    if isinstance(want, int | float) and isinstance(got, int | float):
        return abs(float(want) - float(got)) <= 1e-12 * max(1.0, abs(float(want)))
    if isinstance(got, tuple | list) and isinstance(want, list):
        return list(got) == want
    return bool(want == got)


def check_values(tr: Any, given: Mapping[str, Any]) -> list[str]:
    """`verl key: script value != rlplan value` for each CHECKS key the script sets whose value differs."""
    from rlconf.fields import get_path
    from rlconf.verl.table import FSDP_KEYS

    fsdp = any(str(given.get(k, "")).startswith("fsdp") for k in FSDP_KEYS) or any(
        ".fsdp_config." in k for k in given
    )  # the import's own test for an FSDP script
    wrong = []
    for key, path in CHECKS:
        if key not in given or given[key] is None:
            continue
        if key.endswith(".megatron.param_offload") and fsdp:
            continue  # an FSDP script's megatron keys are not read by verl
        want, got = given[key], get_path(tr.config, path)
        if key == "data.max_response_length" and "actor_rollout_ref.rollout.response_length" in given:
            want = given["actor_rollout_ref.rollout.response_length"]
        ulysses = given.get("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1)
        if fsdp and key == "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" and isinstance(ulysses, int):
            want = want * ulysses  # verl's FSDP budget is one device's share of a Ulysses-split sequence
        if not _same(want, got):
            wrong.append(f"{key}: {want!r} -> {path} = {got!r}")
    return wrong + _check_devices(tr, given)


def _check_devices(tr: Any, given: Mapping[str, Any]) -> list[str]:
    """The trainer's devices are trainer.nnodes x n_gpus_per_node; a rollout pool of its own (verl's one-step-off
    trainer) is rollout.nnodes x n_gpus_per_node more, run separate."""
    c = tr.config
    nodes, per_node = given.get("trainer.nnodes", 1), given.get("trainer.n_gpus_per_node", 8)
    pool = given.get("rollout.nnodes", 1) * given.get("rollout.n_gpus_per_node", 0)
    total = c.cluster.nnodes * c.cluster.gpus_per_node
    rollout = c.rollout.num_devices if c.rollout.placement == "separate" else 0
    if (total - rollout, rollout) != (nodes * per_node, pool):
        return [
            f"devices: trainer {nodes} x {per_node} + rollout pool {pool} -> cluster {total}, rollout {rollout}"
        ]
    return []


def run_one(entry: Mapping[str, Any], root: Path) -> Outcome:
    from rlconf.model_spec import read_model_arch, training_gaps
    from rlconf.verl import translate

    overrides = overrides_of(entry, root)
    given = _given(overrides)
    tr = translate(None, overrides)
    refused_keys = {e.message.partition(" = ")[0] for e in tr.errors if e.rule == "verl-import"}
    reported = {m.verl for m in tr.mapped} | {u.verl for u in tr.unmapped} | refused_keys
    silent = tuple(sorted(set(given) - reported))
    unknown = tuple(u.verl for u in tr.unmapped if u.reason == "unknown")
    derived = {d.rlplan for d in tr.derived}
    about_derived = tuple(f"{w.rule} {w.path}" for w in tr.warnings if w.path.split("[")[0] in derived)
    model = _model_of(entry["overrides"])
    errors = tuple((e.rule, e.path) for e in tr.errors)
    common = {"script": entry["script"], "model": model, "unknown": unknown, "silent": silent,
              "about_derived": about_derived, "errors": errors}  # fmt: skip
    if tr.errors:
        first = tr.errors[0]
        reason = first.message.splitlines()[0].replace(f"{root}/models/", "")
        return Outcome(plans=False, rule=first.rule, path=first.path, reason=reason, **common)
    gaps = training_gaps(read_model_arch(tr.config.model.path)) if tr.config.model.path else []
    return Outcome(plans=tr.plan_checked, not_trainable=", ".join(g[0] for g in gaps),
                   wrong=tuple(check_values(tr, given)), **common)  # fmt: skip


def census(root: Path | None = None) -> list[Outcome]:
    """Every script of bench/verl_scripts.json through the import, on stand-ins written under `root`."""
    scripts = load_scripts()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(root or tmp)
        build_standins(where, scripts)
        return [run_one(entry, where) for entry in scripts]


def record(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The census as the docs record it (no machine paths)."""
    meta = json.loads(DATA.read_text(encoding="utf-8"))
    rows = []
    for o, entry in zip(outcomes, meta["scripts"], strict=True):
        row = asdict(o)
        row.pop("errors")
        row["config"] = entry["config"]
        rows.append(row)
    out = {"verl_commit": meta["verl_commit"], "scripts": rows}
    return json.loads(json.dumps(out))  # tuples as the JSON file holds them (lists)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {RECORD.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    outcomes = census()
    for o in outcomes:
        print(o.line())
    plans = sum(o.plans for o in outcomes)
    trainable = sum(o.plans and not o.not_trainable for o in outcomes)
    unclean = [o for o in outcomes if not o.clean]
    print(f"\n{len(outcomes)} scripts: {plans} plan ({trainable} trainable today), {len(outcomes) - plans} refused; "
          f"{len(unclean)} with a silent mistranslation")  # fmt: skip
    if args.write:
        RECORD.write_text(json.dumps(record(outcomes), indent=1) + "\n", encoding="utf-8")
        print(f"wrote {RECORD.relative_to(ROOT)}")
    return 1 if unclean else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
