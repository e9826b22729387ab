"""Whole GRPO steps: `rltrain` on a preset's workloads and TRL's GRPOTrainer on the same workload, each in
a process of its own; one JSON report (issue 22 item 4; the numbers go to docs/benchmarks.md).

Workloads (`--workloads`, comma-separated):
- preset: the preset as it is. qwen2.5-1.5b-grpo: 64 prompts x 8 responses x up to 1,024 tokens, 4
  mini-batches per step (the old log-prob pass runs), KL loss with the ref: the issue's 37 s step.
- realistic: the preset with responses of real-run lengths: every row ends (its EOS forced) at a length
  drawn from a long-tailed distribution whose mean is `--realistic-share` (0.4) of the maximum
  (rltrain/megatron/inference.py FORCE_EOS_ENV; a random-init model never samples EOS itself). Issue 36's
  goal: tokens/s per GPU within 15% of the preset's (`realistic_over_preset`).
- onestep: 16 prompts x 8 responses x up to 512 tokens (`--onestep-response-length`; capped at the
  preset's own), one mini-batch (one optimizer step per rollout: the plan skips the old log-prob pass),
  KL loss coefficient 0.001. TRL runs this one (`--trl`, when `trl` is importable).
- NAME:off (e.g. `--workloads preset:off,preset`): workload NAME with `--off-env` in rltrain's environment
  (default: the training kernels of 2026-12-04 off, rltrain/megatron/fused.py TRAIN_KERNELS_OFF_ENV), so a
  change is timed against the path before it in one call; its report key is rlplan_NAME_off.
- NAME@DIR (e.g. `--workloads preset@.before,preset`): workload NAME run by the rlplan tree in DIR (its
  working directory and first on PYTHONPATH), e.g. an older commit unpacked there by `mkdir .before && git
  archive COMMIT rltrain rlconf presets bench pyproject.toml | tar -x -C .before`, so two commits are timed
  one after the other on the same machine; its report key is rlplan_NAME_at_<DIR's name>.

rlplan: `python -m rltrain.cli PRESET --trainer.total_steps N --trainer.test_freq 0
--trainer.val_before_train false --trainer.save_freq 0` (plus `--cluster.cpus_per_worker 4` on cuda, as the
issue's command, and any `--set PATH=VALUE`). From its metrics.jsonl: every step's timing/*, perf/* and the
summary over steps 2..N (median, min, max; step 1 warms up); from its plan.json: the log-prob passes, each
engine's sequence layout (`sequence_layout`: packed THD micro-batches wherever the plan supports them, the
default, `--set model.use_remove_padding=false` for padded rows) and the memory estimate of every phase of the policy pool next to the measured peak of that role call
(`perf/max_memory_allocated_gib/<phase>`, max over steps; accelerators only), with measured / estimate and
whether it is within +-15%.

TRL: `GRPOTrainer` on a random-init HF Qwen2 of the preset's shape (bf16 on cuda), the same synthetic
prompts, a character-level tokenizer over rlplan's built-in vocabulary (what a preset without model.path
uses), `num_generations` = rollout.n, one optimizer step per generation of prompts x n completions
(`--trl-micro-batch` rows per forward/backward, gradient accumulation over the rest), `beta` = the KL
coefficient, no gradient checkpointing. Seconds per step = the median gap between optimizer-step ends over
steps 3.. (a callback timestamps them).

On the GPU machine (bench/device_setup.sh first; trl carried as a wheel for the TRL column):
    python3 bench/grpo_step_gpu.py --preset qwen2.5-1.5b-grpo --steps 4 --trl --out $OUT
CPU smoke test (tiny model; TRL is skipped when not installed):
    .venv/bin/python bench/grpo_step_gpu.py --preset tiny-grpo --steps 3 --out /tmp/grpo_step
Writes grpo_step.json to --out and prints one summary line per workload.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import trace_gaps

WITHIN = 0.15
"""The issue's goal: the plan's memory estimate within +-15% of the measured peak."""
PHASES = ("generate", "old_log_prob", "ref", "update_actor")


def preset_config(name: str) -> Any:
    from presets import PRESETS

    return PRESETS[name].build()


def workload_flags(name: str, cfg: Any, response_length: int) -> list[str]:
    if name in ("preset", "realistic"):
        return []
    if name == "onestep":
        length = min(response_length, cfg.rollout.max_response_length)
        return ["--data.train_batch_size", "16", "--actor.ppo_mini_batch_size", "16", "--rollout.max_response_length",
                str(length), "--actor.use_kl_loss", "true", "--actor.kl_loss_coef", "0.001"]  # fmt: skip
    raise SystemExit(f"unknown workload {name!r}: expected preset or onestep")


def spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def memory_table(plan: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The policy pool's phase estimates (GiB per device) next to the measured peak of each role call."""
    pool = next(p for p in plan["memory"]["pools"] if "actor" in p["roles"])
    out = []
    for phase in pool["phases"]:
        key = f"perf/max_memory_allocated_gib/{phase['phase']}"
        measured = [r[key] for r in rows if r.get(key) is not None]
        peak = max(measured) if measured else None
        ratio = peak / phase["total_gib"] if peak is not None and phase["total_gib"] else None
        out.append({
            "phase": phase["phase"],
            "estimate_gib": phase["total_gib"],
            "measured_gib": peak,
            "measured_over_estimate": ratio,
            "within_15pct": None if ratio is None else abs(ratio - 1.0) <= WITHIN,
        })  # fmt: skip
    return out


def sequence_layout(plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each engine's micro-batch layout in the plan (packed THD or padded) and the plan's reason."""
    return {
        e["role"]: {"packed": e["remove_padding"], "why": e["remove_padding_reason"]}
        for e in plan["engines"]
        if e["role"] != "rollout"
    }


def run_rlplan(
    preset: str,
    workload: str,
    flags: list[str],
    steps: int,
    out: Path,
    env: dict[str, str] | None = None,
    tree: Path | None = None,
) -> dict[str, Any]:
    """One workload's rltrain run (by the rlplan tree in `tree` when given) and its report."""
    folder = (out / f"rlplan_{workload}").resolve()  # absolute: a tree's run has its own working directory
    env = dict(env or {})
    if tree is not None:
        tree = tree.resolve()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "rltrain.cli", preset, "--trainer.total_steps", str(steps), "--trainer.test_freq",
           "0", "--trainer.val_before_train", "false", "--trainer.save_freq", "0", "--trainer.output_dir",
           str(folder), *flags]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env={**os.environ, **env}, cwd=tree
    )
    wall = time.perf_counter() - t0
    (out / f"rlplan_{workload}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return {"command": " ".join(cmd[2:]), "failed": done.returncode, "stderr_tail": done.stderr[-3000:]}
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((folder / "plan.json").read_text())
    # Profiles (`--set profile.tool=torch ...`): each role call's key_averages table next to the json, one
    # level deep (the run folder nests them six deep, past what a device call brings back).
    profiles = []
    for table in sorted((folder / "profile").glob("**/summary.txt")):
        flat = out / f"profile_{workload}_{'_'.join(table.relative_to(folder / 'profile').parent.parts)}.txt"
        flat.write_text(table.read_text())
        profiles.append(flat.name)
        trace = table.with_name("trace.json")
        if trace.exists():  # where the device waited for the host (bench/trace_gaps.py)
            gaps = flat.with_name(flat.stem.replace("profile_", "trace_gaps_", 1) + ".json")
            gaps.write_text(json.dumps(trace_gaps.summarize(trace), indent=1))
            profiles.append(gaps.name)
    timed = rows[1:] or rows  # step 1 warms up (allocator, CUDA graphs, lazy imports)
    keep = ("timing/", "perf/", "rollout/logprob_diff_max", "response/length_mean")
    summary = {k: spread([r[k] for r in timed if isinstance(r.get(k), int | float)])
               for k in sorted({k for r in timed for k in r}) if k.startswith(keep)}  # fmt: skip
    return {
        "command": " ".join(f"{k}={v}" for k, v in env.items()) + " rltrain " + " ".join(cmd[3:]),
        "tree": str(tree) if tree is not None else None,
        "wall_s_incl_startup": wall,
        "passes": plan["passes"],
        # The micro-batch layout of each engine's log-prob and update passes (packed THD or padded), and why.
        "sequence_layout": sequence_layout(plan),
        "steps": [{k: v for k, v in r.items() if k == "step" or k.startswith(keep)} for r in rows],
        "summary_steps_2_n": summary,
        "memory": memory_table(plan, rows),
        "memory_estimate_roles": [{"role": r["role"], "estimate_gib": r["total_gib"]} for r in plan["memory"]["roles"]],
        "profiles": profiles,
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------ TRL
def trl_child(args: argparse.Namespace) -> int:
    """The TRL side, in its own process: writes trl.json into --out."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Qwen2Config, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.trl_cpu import char_tokenizer
    from rltrain.data import synthetic_sample
    from rltrain.megatron.hf_weights import hf_config_from_arch
    from rltrain.rewards import load_reward_function

    cfg = preset_config(args.preset)
    w = json.loads(args.trl_workload)
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda and cfg.model.params_dtype == "bfloat16" else torch.float32
    out = Path(args.out)
    tok = char_tokenizer(out / "trl_tokenizer")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**hf_config_from_arch(cfg.model.arch, dtype)))
    # From a folder: with beta > 0 TRL builds its reference model from the policy's name_or_path.
    folder = Path(tempfile.mkdtemp(prefix="trl_model"))
    model.save_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    task = cfg.data.synthetic_task
    prompts = [synthetic_sample(task, cfg.trainer.seed, i) for i in range((args.steps + 1) * w["prompts"])]
    data = Dataset.from_list([{"prompt": p, "answer": a} for p, a in prompts])
    score = load_reward_function(cfg.reward.function)

    def reward(completions, answer, prompts, **_):
        return [float(score(c, a, p)) for c, a, p in zip(completions, answer, prompts, strict=True)]

    rows = w["prompts"] * w["n"]
    micro = min(args.trl_micro_batch, rows)
    accum = rows // micro
    trl_args = GRPOConfig(
        output_dir=str(out / "trl_out"), use_cpu=not cuda, bf16=dtype == torch.bfloat16, max_steps=args.steps,
        learning_rate=cfg.actor.optim.lr, num_generations=w["n"], per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum, steps_per_generation=accum, max_completion_length=w["response_length"],
        temperature=cfg.rollout.temperature, beta=w["kl_coef"], gradient_checkpointing=False, logging_steps=1,
        report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=cfg.trainer.seed,
    )  # fmt: skip
    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=trl_args, train_dataset=data,
                          processing_class=tok, callbacks=[StepTimes()])  # fmt: skip
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    gaps = [b - a for a, b in itertools.pairwise(ends)][1:]  # steps 3..
    import trl

    report = {
        "trl": trl.__version__,
        "workload": w,
        "micro_batch": micro,
        "grad_accum": accum,
        "dtype": str(dtype),
        "s_per_step": spread(gaps),
        "wall_s": time.perf_counter() - t0,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "log_history": trainer.state.log_history,
    }
    (out / "trl.json").write_text(json.dumps(report, indent=2, default=str))
    return 0


def run_trl(args: argparse.Namespace, cfg: Any, out: Path) -> dict[str, Any]:
    if importlib.util.find_spec("trl") is None:
        return {"skipped": "trl is not importable in this environment"}
    w = {"prompts": 16, "n": cfg.rollout.n, "kl_coef": 0.001,
         "response_length": min(args.onestep_response_length, cfg.rollout.max_response_length)}  # fmt: skip
    cmd = [sys.executable, __file__, "--trl-child", "--preset", args.preset, "--steps", str(args.steps + 2),
           "--trl-workload", json.dumps(w), "--trl-micro-batch", str(args.trl_micro_batch), "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    (out / "trl.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return {"failed": done.returncode, "stderr_tail": done.stderr[-3000:]}
    report = json.loads((out / "trl.json").read_text())
    report.pop("log_history", None)  # kept in trl.json
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-1.5b-grpo")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workloads", default="preset,onestep")
    parser.add_argument("--onestep-response-length", type=int, default=512)
    parser.add_argument("--realistic-share", type=float, default=0.4, help="mean response length / maximum")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="extra rltrain flag (a list: PATH='V1 V2')",
    )
    parser.add_argument(
        "--trl", action="store_true", help="also run TRL's GRPOTrainer on the onestep workload"
    )
    parser.add_argument("--trl-micro-batch", type=int, default=16)
    parser.add_argument(
        "--off-env",
        default=None,
        help="NAME=VALUE set for a workload written NAME:off in --workloads (default: the training kernels of "
        "2026-12-04 off, rltrain/megatron/fused.py TRAIN_KERNELS_OFF_ENV=swiglu,rope,wgrad)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/grpo_step"))
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl-workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.trl_child:
        return trl_child(args)
    cfg = preset_config(args.preset)
    # PATH=VALUE, or PATH=V1 V2 for a list field (e.g. profile.roles)
    extra = [f for kv in args.set for f in (f"--{kv.split('=', 1)[0]}", *kv.split("=", 1)[1].split())]
    if cfg.cluster.device == "cuda":
        extra = ["--cluster.cpus_per_worker", "4", *extra]
    report: dict[str, Any] = {"preset": args.preset, "steps": args.steps, "device": cfg.cluster.device}
    try:
        import torch

        report["torch"] = torch.__version__
        report["device_name"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    for workload in args.workloads.split(","):
        # NAME:off runs workload NAME with --off-env set (the path before a change, side by side with NAME);
        # NAME@DIR runs it with the rlplan tree in DIR (another commit, side by side with this one).
        workload, _, tree = workload.partition("@")
        name, _, off = workload.partition(":")
        flags = workload_flags(name, cfg, args.onestep_response_length) + extra
        from rltrain.megatron.inference import FORCE_EOS_ENV

        env = {FORCE_EOS_ENV: str(args.realistic_share)} if name == "realistic" else {}
        if off:
            from rltrain.megatron.fused import TRAIN_KERNELS_OFF_ENV

            key, _, value = (args.off_env or f"{TRAIN_KERNELS_OFF_ENV}=swiglu,rope,wgrad").partition("=")
            env[key] = value
        label = workload.replace(":", "_") + (f"_at_{Path(tree).resolve().name.lstrip('.')}" if tree else "")
        result = run_rlplan(
            args.preset, label, flags, args.steps, out, env or None, Path(tree) if tree else None
        )
        report[f"rlplan_{label}"] = result
        s = result.get("summary_steps_2_n", {})
        if s:
            phases = ", ".join(
                f"{p} {s[f'timing/{p}_s']['median']:.3g}" for p in PHASES if s.get(f"timing/{p}_s")
            )
            layout = ", ".join(f"{r} {'packed' if v['packed'] else 'padded'}"
                               for r, v in result["sequence_layout"].items())  # fmt: skip
            print(f"{label}: {s['timing/step_s']['median']:.3g} s/step, {s['perf/throughput']['median']:.4g} "
                  f"tokens/s per device; {phases}; {layout}", flush=True)  # fmt: skip
        else:
            print(f"{label}: failed (see rlplan_{label}.log)", flush=True)
    tput = {w: report.get(f"rlplan_{w}", {}).get("summary_steps_2_n", {}).get("perf/throughput")
            for w in ("preset", "realistic")}  # fmt: skip
    if tput["preset"] and tput["realistic"]:
        report["realistic_over_preset"] = tput["realistic"]["median"] / tput["preset"]["median"]
        print(f"realistic / preset tokens/s per device: {report['realistic_over_preset']:.2f}", flush=True)
    if args.trl:
        report["trl"] = run_trl(args, cfg, out)
        ours = report.get("rlplan_onestep", {}).get("summary_steps_2_n", {}).get("timing/step_s")
        theirs = report["trl"].get("s_per_step")
        if ours and theirs:
            report["trl_over_rlplan"] = theirs["median"] / ours["median"]
            print(f"onestep: TRL {theirs['median']:.3g} s/step -> rlplan is {report['trl_over_rlplan']:.2f}x")
    (out / "grpo_step.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'grpo_step.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
