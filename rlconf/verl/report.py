"""What an import says: the text report, its JSON form, the translated YAML, and the migration guide
(docs/migrating-from-verl.md) generated from the key table."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rlconf.config import RLConfig
from rlconf.errors import Issue
from rlconf.fields import leaf_paths
from rlconf.rules import SUB_RULES
from rlconf.verl.keys import REASONS, VerlKey
from rlconf.verl.table import IN_ACTOR, VERL_KEYS
from rlconf.verl.translate import Translation, nest, plain, rlplan_default, show

# --------------------------------------------------------------------------------------------- report
# What each rlplan rule means for a verl user: where verl would have failed (late), or that the rule is
# rlplan's own (verl runs the setting, rlplan does not).
_LATE_IN_VERL = {
    "batch-layout": "verl's workers assert this when they split the batch, after Ray has started and the "
    "model has loaded",
    "world-divisible-by-model-parallel": "megatron fails when every worker initialises its process groups",
    "heads-divisible-by-tp": "megatron fails while building the model on every worker",
    "layers-divisible-by-pp": "megatron fails while building the model on every worker",
    "model-config-json": "verl's workers fail when they load the model",
    "memory-exceeds-device": "the run goes out of device memory",
    "estimator-needs": "verl runs it, but the estimator cannot learn as configured (e.g. GRPO with n = 1 "
    "gives every response a zero advantage)",
    "positive-size": "verl fails or divides by zero once the workers run",
    "optim": "megatron's scheduler fails or trains with a broken schedule",
    "sampling": "the rollout engine rejects it at the first generation",
    "checkpoint-contents": "the first resume fails",
}
for _sub, _parent in SUB_RULES.items():  # a sub-rule fails in verl where its rule does
    if _parent in _LATE_IN_VERL:
        _LATE_IN_VERL[_sub] = _LATE_IN_VERL[_parent]
RLPLAN_ONLY_RULES: dict[str, str] = {
    "rollout-engine": "rlplan regroups tensor-parallel shards (rollout tp divides or is a multiple of the actor's) "
    "and runs vLLM only where it is installed",
    "ref-layout-matches-actor": IN_ACTOR,
    "engine-support": "rlplan's megatron engine does not run this layout yet",
    "verl-import": "the verl value has no rlplan translation",
    "unknown-key": "the value does not fit rlplan's field",
    "type": "the value does not fit rlplan's field",
    "invalid-choice": "rlplan does not offer this value",
}


# Rules of settings that run in both but give another number in rlplan ("Where the numbers differ").
NUMBERS_DIFFER_RULES: dict[str, str] = {
    "verl-meaning": "verl runs it with the definition the warning names",
}


def verl_context(rule: str) -> tuple[str, str]:
    """('late-in-verl' | 'rlplan-rule' | 'numbers-differ' | 'checked-early', explanation) of an rlplan rule
    for a verl user."""
    if rule in NUMBERS_DIFFER_RULES:
        return "numbers-differ", NUMBERS_DIFFER_RULES[rule]
    if rule in _LATE_IN_VERL:
        return "late-in-verl", _LATE_IN_VERL[rule]
    if rule in RLPLAN_ONLY_RULES:
        return "rlplan-rule", RLPLAN_ONLY_RULES[rule]
    return "checked-early", "rlplan checks it before anything starts"


def issue_origin(tr: Translation, issue: Issue) -> str:
    """The verl key (or derivation) that set the config path an issue names; '' for rlplan defaults."""
    path = issue.path.split("[")[0]
    return tr.origin.get(path, "")


def format_report(tr: Translation) -> str:
    """The text report of `rlconf import-verl`."""
    applied = [m for m in tr.mapped if m.applied]
    out = [
        f"rlconf import-verl: {len(tr.mapped) + len(tr.unmapped)} verl keys: {len(applied)} mapped, "
        f"{len(tr.mapped) - len(applied)} kept rlplan's default, {len(tr.unmapped)} not mapped",
        "",
        "mapped (verl = value -> rlplan = value)",
    ]
    for m in tr.mapped:
        target = (
            f"{m.rlplan} = {show(m.value)}" if m.applied else f"{m.rlplan} (default {show(m.value)} kept)"
        )
        out.append(f"  {m.verl} = {show(m.verl_value)} -> {target}")
        if m.note and (show(m.verl_value) != show(m.value) or not m.applied):
            out.append(f"      {m.note}")
    if tr.derived:
        out += ["", "derived (verl defaults that differ from rlplan's, and what rlplan's design needs)"]
        out += [f"  {d.rlplan} = {show(d.value)}: {d.note}" for d in tr.derived]
    out += ["", f"not mapped ({len(tr.unmapped)})"]
    if not tr.unmapped:
        out.append("  (none)")
    for reason in (
        "unknown",
        "unresolved",
        "unsupported",
        "ignored-by-verl",
        "deprecated-in-verl",
        "not-needed",
    ):
        group = [u for u in tr.unmapped if u.reason == reason]
        if group:
            out.append(f"  {reason} ({REASONS[reason]}):")
            out += [f"    {u.verl} = {show(u.verl_value)}: {u.note}" for u in group]
    if tr.notes:
        out += ["", "notes"] + [f"  {n}" for n in tr.notes]
    out.append("")
    n_err, n_warn = len(tr.errors), len(tr.warnings)
    checked = "rlplan's rules" + (" and plan" if tr.plan_checked else "")
    if not tr.issues:
        out.append(f"validation: ok ({checked})")
    else:
        verdict = "invalid" if n_err else "ok"
        out.append(f"validation: {verdict} ({checked}): {n_err} error(s), {n_warn} warning(s)")
    groups = (
        ("late-in-verl", "fail now, would have failed late (or silently) in verl"),
        ("checked-early", "checked before anything starts"),
        ("rlplan-rule", "rlplan's own rules (verl runs this; rlplan does not)"),
        ("numbers-differ", "runs in both, but the numbers differ (docs/migrating-from-verl.md)"),
    )
    for kind, title in groups:
        items = [i for i in tr.issues if verl_context(i.rule)[0] == kind]
        if not items:
            continue
        out.append(f"  {title}:")
        for issue in items:
            src = issue_origin(tr, issue)
            frm = f" (from {src})" if src and not src.startswith("derived") else (f" ({src})" if src else "")
            out.append(f"    {issue.severity} [{issue.rule}] {issue.path}{frm}: {issue.message}")
            out.append(f"        fix: {issue.fix}")
            out.append(f"        verl: {verl_context(issue.rule)[1]}")
    return "\n".join(out) + "\n"


def translation_to_dict(tr: Translation) -> dict[str, Any]:
    """The report as JSON-ready data (`rlconf import-verl --json`)."""

    def issue(i: Issue) -> dict[str, Any]:
        kind, why = verl_context(i.rule)
        return {
            **dataclasses.asdict(i),
            "verl_key": issue_origin(tr, i),
            "verl_context": kind,
            "in_verl": why,
        }

    return {
        "valid": tr.valid,
        "settings": {k: plain(v) for k, v in tr.settings.items()},
        "mapped": [dataclasses.asdict(m) for m in tr.mapped],
        "unmapped": [dataclasses.asdict(u) for u in tr.unmapped],
        "derived": [dataclasses.asdict(d) for d in tr.derived],
        "notes": list(tr.notes),
        "issues": [issue(i) for i in tr.issues],
        "yaml": to_yaml(tr),
    }


def to_yaml(tr: Translation) -> str:
    """The rlplan config: every imported setting that differs from rlplan's default, each with the verl key
    it came from as a comment."""
    changed = {p: v for p, v in tr.settings.items() if plain(v) != plain(rlplan_default(p))}
    order = {p: i for i, p in enumerate(leaf_paths(RLConfig))}
    ordered = dict(sorted(changed.items(), key=lambda kv: order[kv[0]] if kv[0] in order else len(order)))
    head = [
        "# rlplan config imported from verl by `rlconf import-verl`"
        + (f" ({', '.join(tr.sources)})" if tr.sources else ""),
        f"# {sum(m.applied for m in tr.mapped)} verl keys mapped, {len(tr.derived)} settings derived, "
        f"{len(tr.unmapped)} keys not mapped (see the report). Check it: rlconf validate / rlconf plan.",
    ]
    if not tr.valid:
        head.append(f"# INVALID: {len(tr.errors)} error(s) to fix (rlconf validate lists them).")
    lines: list[str] = []

    def walk(node: Mapping[str, Any], prefix: str, indent: int) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            pad = "  " * indent
            if isinstance(value, dict) and path not in ordered:
                lines.append(f"{pad}{key}:")
                walk(value, path + ".", indent + 1)
                continue
            src = tr.origin.get(path, "")
            comment = f"  # {src}" if src else ""
            lines.append(f"{pad}{key}: {show(value)}{comment}")

    walk(nest(ordered), "", 0)
    return "\n".join(head + lines) + "\n"


# ----------------------------------------------------------------------------------------------- docs
# The page's own generated-file mark (rlconf.docs imports this package, so it cannot borrow docs' HEADER).
PAGE_HEADER = "<!-- generated by `rlconf docs` from `rlconf/verl/table.py`; do not edit by hand -->\n\n"
_FAMILY_TITLES = {
    "megatron": ("Megatron engine (per role)", "The same keys under each role's `megatron` section."),
    "optim": ("Optimizer (actor and critic)", "The same keys under `actor_rollout_ref.actor.optim` and "
              "`critic.optim`."),
    "checkpoint": ("Checkpoint contents (actor and critic)", ""),
    "profiler": ("Per-role profiler", "verl has a profiler section per role; rlplan has one `profile` "
                 "section with `profile.roles`. See [Profiling](profiling.md)."),
}  # fmt: skip
_SECTION_TITLES = (
    ("data.", "data"),
    ("actor_rollout_ref.model.", "actor_rollout_ref.model"),
    ("actor_rollout_ref.actor.", "actor_rollout_ref.actor"),
    ("actor_rollout_ref.ref.", "actor_rollout_ref.ref"),
    ("actor_rollout_ref.rollout.", "actor_rollout_ref.rollout"),
    ("actor_rollout_ref.", "actor_rollout_ref"),
    ("critic.", "critic"),
    ("reward_model.", "reward_model and custom_reward_function"),
    ("custom_reward_function.", "reward_model and custom_reward_function"),
    ("reward.", "reward (verl's current schema; the same translation as the older names)"),
    ("algorithm.", "algorithm"),
    ("trainer.", "trainer"),
    ("global_profiler.", "global_profiler"),
    ("", "Ray, Hydra and the rest"),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _target_cell(row: VerlKey) -> str:
    if row.rlplan is not None:
        return f"`{row.rlplan}`"
    return f"— ({row.reason})"


def _default_cell(row: VerlKey) -> str:
    """What the docs say about a row's verl default (appended to its note)."""
    if not row.has_default:
        return ""
    if "verl's default" in row.note:
        return "; applied when unset"
    return f"{'; ' if row.note else ''}verl's default `{show(row.verl_default)}` applied when unset"


def migration_page() -> str:
    """docs/migrating-from-verl.md, generated from VERL_KEYS (written by `rlconf docs`)."""
    out = [PAGE_HEADER, _PAGE_INTRO, _PAGE_QUICKSTART, _PAGE_CENSUS]
    sections: dict[str, list[VerlKey]] = {}
    for row in VERL_KEYS:
        if row.family:
            continue
        title = next(t for prefix, t in _SECTION_TITLES if row.verl.startswith(prefix))
        sections.setdefault(title, []).append(row)
    out.append("## Key by key\n\n")
    out.append(
        "Every verl key `rlconf import-verl` knows, generated from its table (`rlconf/verl/table.py`). "
        '"—" marks a key with no rlplan setting; the reason is one of: '
        + "; ".join(f"**{k}**: {v}" for k, v in REASONS.items() if k not in ("unknown", "unresolved"))
        + ". A key that ends in `.*` covers every key under it. Keys that are not listed are reported as "
        "unknown.\n\n"
    )
    for title, rows in sections.items():
        out.append(f"### {title}\n\n| verl | rlplan | note |\n|---|---|---|\n")
        for row in rows:
            note = _cell(row.note + _default_cell(row))
            out.append(f"| `{row.verl}` | {_target_cell(row)} | {note} |\n")
        out.append("\n")
    for family, (title, intro) in _FAMILY_TITLES.items():
        rows = [r for r in VERL_KEYS if r.family == family]
        roles: list[str] = []
        table: dict[str, dict[str, VerlKey]] = {}
        for r in rows:
            role, _, suffix = r.verl.partition(f".{family}.")
            if role not in roles:
                roles.append(role)
            table.setdefault(suffix, {})[role] = r
        out.append(f"### {title}\n\n" + (f"{intro}\n\n" if intro else ""))
        out.append(f"| key | {' | '.join(f'`{r}.{family}.`' for r in roles)} | note |\n")
        out.append("|---" * (len(roles) + 2) + "|\n")
        for suffix, by_role in table.items():
            cells = [_target_cell(by_role[r]) if r in by_role else "" for r in roles]
            by_note: dict[str, list[str]] = {}
            for role, r in by_role.items():
                if r.note or r.has_default:
                    by_note.setdefault(r.note + _default_cell(r), []).append(role.rsplit(".", 1)[-1])
            notes = [
                text if len(who) == len(by_role) else f"{', '.join(who)}: {text}"
                for text, who in by_note.items()
            ]
            out.append(f"| `{suffix}` | {' | '.join(cells)} | {_cell(' / '.join(notes))} |\n")
        out.append("\n")
    out.append(_PAGE_DIFFERENCES)
    return "".join(out)


_PAGE_INTRO = """\
# Migrating from verl

rlplan follows verl's and Megatron's field names wherever the concept is the same, so most keys move over
by dropping the `actor_rollout_ref.` prefix. `rlconf import-verl` does the translation for you: it reads a
verl trainer config (the `ppo_megatron_trainer.yaml` layout) and/or the Hydra overrides of a run script,
maps every key it knows, lists every key it cannot map with the reason, and validates the result with
rlplan's rules and plan, so that settings which would fail late in verl (after Ray has started and the
model has loaded) fail now.

<!-- skip-test: a downloaded Qwen2.5-7B folder and GSM8K parquet files; the same commands run in small below -->
```bash
rlconf import-verl \\
    algorithm.adv_estimator=grpo data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=32 data.max_prompt_length=1024 \\
    data.max_response_length=1024 actor_rollout_ref.model.path=$HOME/models/Qwen2.5-7B-Instruct \\
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=8 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \\
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 \\
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 \\
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=5 \\
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.total_epochs=15 -o rlplan.yaml
rlconf plan rlplan.yaml
```

It reads the files a verl run reads: the model folder (config.json and the tokenizer) and the parquet files
that verl's `examples/data_preprocess/gsm8k.py` writes (`data_source`, chat-message `prompt`,
`reward_model.ground_truth`); `rlconf plan` counts their rows to turn the 15 epochs into steps. The file
it writes is a complete config (no preset under it), and the report ends with the command that runs it,
`rltrain --config rlplan.yaml` (here on one node of 8 GPUs). Rows are scored as verl scores them by
default: `reward.function: default_compute_score` picks the scorer by each row's `data_source`
(`openai/gsm8k` here; see [Reward functions](#differences-that-change-numbers) below).

The report has four parts: **mapped** keys (verl key and value -> rlplan path and value, with a note where
the meaning differs), **derived** settings (verl defaults that differ from rlplan's, such as
`trainer.device: cuda`, and what rlplan's design needs, such as the reference policy in the actor's
layout), keys **not mapped** with the reason (unknown keys get a did-you-mean), and the **validation**
result: each error names the rlplan path, the verl key it came from, the fix, and what verl would have
done. The exit code is 0 when the translation validates and 2 when it does not (the file is still
written, marked invalid, so you can fix it); `--json` prints the report as JSON.

Input: a file may hold a resolved config (`python -m verl.trainer.main_ppo --cfg job --resolve ...`
prints one) or a partial one; a `defaults:` list is not resolved (the report says so). Interpolations
`${key}`, `${.sibling}` and `${oc.select:key,default}` are resolved against the other keys. Overrides use
Hydra's syntax: `key=value` and `+key=value` set, `++key=value` forces, `~key` deletes; values are YAML
(`[console,wandb]`, `null`, `1e-6`), quotes keep a string.

Once moved, rlplan's own override syntax is `--actor.optim.lr 1e-6` on `rltrain`, `--set
actor.optim.lr=1e-6` on `rlconf`, or the same nesting in a YAML file. A key rlplan does not have is an
error (`unknown-key`) with a suggestion, never silently ignored.

"""

_PAGE_QUICKSTART = """\
## verl's GSM8K quickstart, in small, on a CPU

The same path with files you can make here: a Qwen2-shaped Hugging Face folder (2 layers, a byte-level BPE
tokenizer trained with `tokenizers` on the task's text with Qwen2's pre-tokenizer, a ChatML chat template, and
weights that stand in for an instruct model: they write `#### N` answers and get about half of the sums right,
guessing the rest) and parquet files of arithmetic word problems in the layout verl's GSM8K preprocessing
writes (`data_source: openai/gsm8k`, chat-message prompts, `reward_model.ground_truth`). From the
repository root:

<!-- skip-test: run by tests/test_verl_quickstart.py, which reads this block -->
```bash
.venv/bin/python bench/verl_gsm8k_small.py verl-small
.venv/bin/rlconf import-verl \\
    algorithm.adv_estimator=grpo \\
    data.train_files=verl-small/data/gsm8k/train.parquet data.val_files=verl-small/data/gsm8k/test.parquet \\
    data.train_batch_size=16 data.max_prompt_length=64 data.max_response_length=8 \\
    actor_rollout_ref.model.path=verl-small/models/tiny-qwen2 actor_rollout_ref.actor.megatron.dtype=float32 \\
    actor_rollout_ref.actor.optim.lr=1e-3 actor_rollout_ref.actor.ppo_mini_batch_size=16 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128 actor_rollout_ref.actor.use_kl_loss=False \\
    actor_rollout_ref.rollout.n=8 trainer.device=cpu trainer.n_gpus_per_node=1 trainer.nnodes=1 \\
    trainer.total_training_steps=40 trainer.test_freq=10 trainer.save_freq=-1 trainer.logger=console \\
    -o verl-small/rlplan.yaml
.venv/bin/rltrain --config verl-small/rlplan.yaml
```

The first command prints:

<!-- generated:verl-setup -->
<!-- /generated -->

The import maps every key (verl's defaults it applies are listed under "derived", among them
`reward.function: default_compute_score`, which scores each row by its `data_source` with verl's GSM8K
rule: the answer after `#### `, compared as a string) and ends with the `rltrain --config` line above:

<!-- generated:verl-import -->
<!-- /generated -->

The run tokenizes the prompts with the folder's chat template, trains through Ray and megatron-core on the
CPU and writes `outputs/rlplan/` (metrics, checkpoints, reward curve):

<!-- generated:verl-run -->
<!-- /generated -->

<!-- generated:verl-summary -->
<!-- /generated -->

GRPO's job here is the one it has on a real instruct model: the policy already knows the format and, most of
the time, the answer, and sampling shows where it still guesses. The sampled reward rises from about 0.5 to about
0.85 within the 40 steps; greedy validation, which always takes the most likely answer, starts high and stays
there. `tests/test_verl_quickstart.py` runs these commands as printed, checks that the reward rises and that the
output is still this record's (`.venv/bin/python bench/docs_run.py --verl` rewrites it).
"""


_PAGE_CENSUS = """\
## verl's own Megatron scripts

`bench/verl_scripts_census.py` runs the override lists of 46 launch scripts of verl (the 45 that start its
trainer with a Megatron config, plus `examples/grpo_trainer/run_qwen2-7b_math.sh`, the FSDP twin of the
Megatron GRPO example) through `rlconf import-verl` on stand-ins: each model folder has the published
config.json of the model the script names (sparse weights, a small tokenizer) and each data path a
verl-format GSM8K-shaped parquet file. It checks that every key is mapped or reported, that no warning is
about a value the import derived, and that the model path, layouts, batch sizes, lr, loss, LoRA and offloads
of the result are the script's; `tests/test_import_verl_census.py` runs it and checks this record
(`bench/verl_scripts_extract.py` re-extracts the override lists from a verl checkout).
"Not trainable yet" would mark a model the plan accepts and `rltrain` still refuses
(`rlconf.model_spec.training_gaps`).

<!-- generated:verl-census -->
<!-- /generated -->

"""

_PAGE_DIFFERENCES = """\
## Differences that change numbers

- **Batch sizes count like verl.** `data.train_batch_size` and `ppo_mini_batch_size` count prompts, and
  `ppo_micro_batch_size_per_gpu` counts responses on one data-parallel rank. One mini-batch is
  `ppo_mini_batch_size x rollout.n` responses, split over dp ranks. verl normalises these numbers
  internally. rlplan checks them and shows them: a batch that does not divide evenly is an error
  (`mini-batch-divides-batch`, `batch-divisible-by-dp-micro`, `mini-batch-covers-micro`), and
  `rlconf plan` prints the per-rank numbers.
- **The rollout runs on the actor's weights.** `rollout.engine: embedded` generates with the actor's
  megatron weights: in the actor's layout when `rollout.tensor_model_parallel_size` is unset (no copy),
  otherwise at that tp without pipeline parallel, resharded from the actor's layout before each
  generation (see [GPUs](gpus.md#gpu-presets)); verl's vllm / sglang settings translate to it. A
  mixture-of-experts model's routed experts are gathered over the expert-parallel and expert-TP groups into
  a replica that holds every expert, split over the rollout's tp.
- **The reference policy** shares the actor's processes, so `ref.megatron` must match `actor.megatron`
  (verl gives the ref its own worker group and layout).
- **The lr schedule advances once per training step**, as in verl. It does not advance once per optimizer
  step. With warmup, step 1 trains at `lr_warmup_init` (0 by default). The plan's lr table shows every step.
- **Steps count from 1 across resumes.** `trainer.total_steps` is the whole run. `trainer.total_epochs`
  works as in verl: the plan derives the steps from the rows of `data.train_files` and shows them.
- **Reward functions** are verl's as they are. `reward.function: path/to/reward.py:compute_score` (what
    `rlconf import-verl` writes for `custom_reward_function.path` / `.name`) imports that file at the
    start of the run and calls the function the way verl does, `compute_score(data_source=...,
    solution_str=..., ground_truth=..., extra_info=...)`, with each row's `data_source` and
    `extra_info` columns. It may return a float or a dict with a `score` key; the dict's other numeric
    values (e.g. `acc`) are logged as `reward_extra/<key>`. `rlconf validate` checks the file without
    running it (it exists, parses and defines the function). Built-ins with verl's semantics:
    `default_compute_score` (by `data_source`: `openai/gsm8k`; `lighteval/MATH`,
    `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`; `math_dapo`, `math`, `aime*`),
    `gsm8k` (strict `#### N`), `gsm8k_flexible` (the last number), `math` (the last `\\boxed{}`,
    normalised) and `math_dapo` (`Answer: X`, Minerva-normalised, score 1 / -1). verl's other sources
    (numina, code contests, geometry3k, search-R1) need a reward file. verl's optional Math-Verify is
    `math_verify` (symbolic equivalence: `\\frac{1}{2}` equals `0.5`; `pip install 'rlplan[math]'`,
    which `rlconf validate` names when it is missing). rlplan's own functions,
    `(response, ground_truth, prompt) -> float`, work too: `exact_match`, `numeric_match`, `format`,
    `digit_match` or `package.module:function`.

- **Ground truth** lives in verl's `reward_model.ground_truth` column; rlplan reads it through
  `data.answer_key: reward_model.ground_truth` (dotted keys look into nested columns), which
  `rlconf import-verl` sets when the config names data files.
- **Defaults differ** in places: `actor.optim.lr` is 1e-3 (tuned for the tiny CPU model; the GPU presets
  use 1e-6), `actor.shuffle` is true, `cluster.device` is cpu and `val_before_train` is false.
  `rlconf import-verl` applies verl's defaults where they differ; otherwise start from a preset and check
  with `rlconf show`, which marks every value that differs from the defaults.
## Where the numbers differ

The losses and estimators of `rltrain/algorithms/` were compared with verl's `core_algos.py` and
`rollout_corr_helper.py` on random inputs (`tests/test_loss_reference.py` checks each one against its
paper's formula). Advantages (gae, grpo, rloo, reinforce_plus_plus_baseline, grpo_passk, gpg), the KL
estimators, entropy, the vanilla, GSPO, GPG, CISPO and SAPO losses with their gradients, and the formulas of
the loss_agg_modes other than seq-mean-token-sum-norm are the same to rounding. These differ:

| quantity | rlplan | verl | why |
|---|---|---|---|
| `actor.loss_agg_mode: seq-mean-token-sum-norm` | (1/G) sum_i sum_t l_it / T over the G non-empty responses of the mini-batch (Dr. GRPO's objective) | sum_i sum_t l_it / T per micro-batch, then divided by the number of micro-batches: rlplan's gradient times the responses of one micro-batch | the paper keeps 1/G; without it the gradient scale grows with the batch and depends on the micro-batch size. `rlconf import-verl` warns with the factor; the direction of the update is the same, and with Adam only `actor.optim.clip_grad` and eps see the scale |
| `token-mean` (and the other means) over a mini-batch | one mean over all the mini-batch's tokens (rows) on every data-parallel rank, whatever the micro-batches | legacy workers: the mean of each micro-batch's own mean (the new engine: global, as rlplan) | the update does not depend on how rows fall into micro-batches |
| rejection sampling (`rollout_rs`) in GAE and REINFORCE++ | rejected tokens get advantage 0 and leave the whitening statistics; the return recursion runs over the response as sampled | the recursion skips rejected tokens like tool observations, so a rejected last token's reward is lost to its whole response (REINFORCE++ also restarts after it) | a rejected token still happened: the rewards after it belong to the tokens before it |
| `rollout_rs: sequence` | rejects when the exact sum of the token log-ratios is outside +-log threshold | sums token log-ratios clamped to +-20 first | the product of the ratios is the paper's rho_seq; no exponential is taken, so nothing overflows. Differs only past a token with \\|log rho\\| > 20 |
| `clip-cov` / `kl-cov` ratio and KL-Cov penalty | the log-ratio is clamped to [-20, 20] (as verl's vanilla, CISPO and SAPO) | not clamped | past e^20 verl's loss overflows (inf, a NaN step, in fp32 past 88) and one negative-advantage token's gradient drowns the batch. Differs only where \\|log pi - log pi_old\\| > 20 |
| `actor/ppo_kl` with `kl-cov` (and `clip-cov`) | mean(log pi_old - log pi) with the log-ratio clamped to +-20, the same k1 estimate as every other loss mode (verl's vanilla clamps the same) | kl-cov: mean \\|log pi - log pi_old\\|; clip-cov: mean(log pi_old - log pi) unclamped | one definition across loss modes keeps runs comparable on one chart |
| `actor/pg_clipfrac` with `kl-cov` | the fraction of tokens that got the KL penalty | not reported | a KL-Cov run shows how much it penalised |
| REINFORCE++ returns through tool observation tokens (multi-turn) | the return carries through masked positions unchanged | restarts after a masked position | the observation is part of the environment, not the end of the episode |

Matching verl (earlier rlplan releases differed): SAPO aggregates its policy term seq-mean-token-mean, its
paper's (1/G) sum_i (1/|y_i|) sum_t (`rlconf validate` warns when `actor.loss_agg_mode` names another mode,
which then aggregates the entropy and KL terms only; GSPO the same); rejected tokens leave the loss mask, so
every loss is a mean over accepted tokens; the sequence IS weight is exp(clamp(sum_t log rho_t, -20, 20)),
truncated at `rollout_is_threshold`; `rollout_corr/kl` is mean(log pi_rollout - log pi_old) without a
clamp.
"""
