"""The RL controller (placeholder until the end-to-end issue lands): validates, writes the run folder."""

from __future__ import annotations

import json
from pathlib import Path

from rlconf.config import RLConfig
from rlconf.load import config_to_dict, dump_yaml
from rlconf.plan import TrainerPlan, plan_to_dict


def run_training(config: RLConfig, plan: TrainerPlan) -> int:
    out = Path(config.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_yaml(config_to_dict(config)))
    (out / "plan.json").write_text(json.dumps(plan_to_dict(plan), indent=2))
    print(f"wrote {out / 'config.yaml'} and {out / 'plan.json'}")
    return 0
