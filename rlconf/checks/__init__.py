"""The checks of rlconf.validate, one module per concern; importing a module registers its rules in rlconf.rules.

`values` (types, positive sizes), `layout` (layouts and pools), `training`, `inputs` (reward functions,
tokenizer, tools), `loss`, `data`, `model`, `run` (seeds, limits, resume, output, profile) and `setup`
(model sources, cluster, folder paths, LoRA). Cross-section facts come from rlconf.plan.roles.
"""
