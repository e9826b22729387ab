"""Import a verl (Megatron trainer) config: translate its keys to rlplan paths, report what did not map.

`rlconf import-verl [verl.yaml] [override ...]` reads a verl trainer config (the `ppo_megatron_trainer`
layout, resolved or not) and/or Hydra-style overrides (`key=value`, `+key=value`, `++key=value`,
`~key`), maps every known key with `VERL_KEYS` (one row per verl key; the table is also the source of
docs/migrating-from-verl.md), and validates the result with rlplan's rules and plan.

Design choices
- The table is data: `VerlKey(verl, rlplan, note, convert, reason, verl_default)`. A row with `rlplan`
  None says why the key has no rlplan equivalent (`reason`: unsupported, ignored-by-verl, not-needed,
  deprecated-in-verl). Rows for the per-role families (megatron, optim, checkpoint, profiler) are
  generated from one list per family. A row key ending in `.*` covers every key under it.
- No key is dropped silently: each input key is mapped, reported unmapped with its row's reason, or
  reported as an unknown verl key with a did-you-mean against the table.
- verl's defaults are applied where they differ from rlplan's and change the run (`verl_default` on a
  row; e.g. `trainer.device` is cuda in verl), so an override list translates to the run verl would have
  made. rlplan-specific consequences (the ref in the actor's layout, the embedded rollout at the actor's
  tp, the critic enabled by gae) are added as derived settings. All of these are listed in the report.
Modules: `table` (the key table and its converters), `translate` (Hydra input and translation),
`report` (text / JSON / YAML output and the migration guide). rlconf.docs imports this package, never the
reverse.
- Pure: standard library, PyYAML and rlconf only (no torch, ray or megatron).
"""

from rlconf.verl.keys import REASONS, SKIP, Converter, Reason, VerlKey, VerlValueError
from rlconf.verl.report import (
    PAGE_HEADER,
    RLPLAN_ONLY_RULES,
    format_report,
    issue_origin,
    migration_page,
    to_yaml,
    translation_to_dict,
    verl_context,
)
from rlconf.verl.table import VERL_KEYS, find_row
from rlconf.verl.translate import (
    Derived,
    Mapped,
    Override,
    Translation,
    Unmapped,
    flatten_verl,
    gather_input,
    parse_override,
    parse_value,
    resolve_interpolations,
    translate,
    translate_sources,
)

__all__ = [
    "PAGE_HEADER",
    "REASONS",
    "RLPLAN_ONLY_RULES",
    "SKIP",
    "VERL_KEYS",
    "Converter",
    "Derived",
    "Mapped",
    "Override",
    "Reason",
    "Translation",
    "Unmapped",
    "VerlKey",
    "VerlValueError",
    "find_row",
    "flatten_verl",
    "format_report",
    "gather_input",
    "issue_origin",
    "migration_page",
    "parse_override",
    "parse_value",
    "resolve_interpolations",
    "to_yaml",
    "translate",
    "translate_sources",
    "translation_to_dict",
    "verl_context",
]
