"""Every fenced block of README.md and docs/*.md says where it comes from, and the ones that quote program
output are checked against today's code.

A command block (bash, sh, shell, console, zsh) runs in tests/test_readme_commands.py or is preceded by
`<!-- skip-test: why -->`. Every other block is preceded by one of:

- `<!-- generated:NAME -->`: `rlconf docs` writes it (tests/test_docs.py regenerates and compares);
- `<!-- checked: tests/FILE.py::TEST -->`: that test compares the block with what today's code prints;
- `<!-- recorded: COMMAND ... -->`: output of a GPU, a multi-node cluster or wall-clock timings, recorded
  once by the command it names (with where and when) and not re-run: the marker says why;
- `<!-- not-output: what it is -->`: an input file, a layout sketch or a template, not program output (such a
  block holds no `$ command` line).

A new block without one of these fails here. The checked blocks' tests are at the end of this file.
"""

from __future__ import annotations

import errno
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlconf.docs import MIGRATION_PAGE, pages_with_regions, region_names

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
"""Every page a reader meets (docs/reference is generated whole by `rlconf docs`)."""
COMMAND_LANGUAGES = ("bash", "sh", "shell", "console", "zsh")
RUN_LANGUAGES = ("bash", "sh")
"""The block languages tests/test_readme_commands.py runs (at the left margin only)."""
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
_MARKER = re.compile(
    r"^\s*<!--\s*(?P<kind>generated|checked|recorded|not-output|skip-test)[:\s](?P<arg>.*?)\s*-->\s*$"
)


@dataclass(frozen=True)
class Block:
    """A fenced block: where it starts (1-based), its language, indent, lines and the line before it."""

    page: Path
    line: int
    lang: str
    indent: str
    lines: tuple[str, ...]
    before: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    """Every fenced block of a markdown page, indented ones (inside list items) included."""
    blocks, lines, i = [], page.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        blocks.append(Block(page, i + 1, m["lang"], m["indent"], tuple(lines[i + 1 : end]), before))
        i = end + 1
    return blocks


def _marker(block: Block) -> tuple[str, str] | None:
    m = _MARKER.match(block.before)
    return (m["kind"], m["arg"].strip()) if m else None


def _source_problem(block: Block) -> str | None:
    """Why an output block's marker does not name a checked source (None when it does)."""
    marker = _marker(block)
    if marker is None or marker[0] == "skip-test":
        return "no <!-- generated:/checked:/recorded:/not-output: --> marker before it"
    kind, arg = marker
    if kind == "generated":
        if arg not in region_names():
            return f"`rlconf docs` writes no region {arg!r}"
        if block.page not in pages_with_regions(ROOT / "docs") and block.page.name != MIGRATION_PAGE:
            return "`rlconf docs` does not refresh this page"
    elif kind == "checked":
        file, _, test = arg.partition("::")
        path = ROOT / file
        if not (path.is_file() and re.search(rf"^def {re.escape(test)}\(", path.read_text(), re.M)):
            return f"no test {arg!r}"
    elif kind == "recorded":
        if len(arg) < 30 or not re.search(r"`[^`]+`", arg):
            return "a recorded block names the `command` that made it, where, and why it is not re-run"
    elif any(line.lstrip().startswith("$ ") for line in block.lines):
        return "a not-output block shows a `$ command`: generate or check its output instead"
    elif len(arg) < 10:
        return "say what the block is"
    return None


def test_every_output_block_names_a_checked_source():
    problems = [f"{b.where}: {problem}" for page in PAGES for b in fenced_blocks(page)
                if b.lang not in COMMAND_LANGUAGES and (problem := _source_problem(b))]  # fmt: skip
    assert problems == [], "\n".join(problems)


def test_every_command_block_runs_in_a_test_or_says_why_not():
    from tests.test_readme_commands import PAGES as RUN_PAGES

    unmarked = []
    for page in PAGES:
        runs = str(page.relative_to(ROOT)) in RUN_PAGES
        for b in fenced_blocks(page):
            if b.lang not in COMMAND_LANGUAGES or (_marker(b) or ("",))[0] == "skip-test":
                continue
            if not runs or b.lang not in RUN_LANGUAGES or b.indent:
                unmarked.append(b.where)
    assert unmarked == [], "run these in tests/test_readme_commands.py or mark them <!-- skip-test: why -->"


def test_the_walker_finds_indented_blocks_and_their_markers(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text("<!-- recorded: `x` on a GPU, 2026-12-01, no GPU in CI -->\n```text\n$ x\n1\n```\n"
                    "- item\n\n    ```console\n    $ y\n    ```\n\n<!-- not-output: an input -->\n```yaml\n"
                    "$ z\n```\n")  # fmt: skip
    recorded, console, yaml = fenced_blocks(page)
    assert (recorded.line, recorded.lang, recorded.lines) == (2, "text", ("$ x", "1"))
    assert (console.lang, console.indent, _marker(console)) == ("console", "    ", None)
    assert _source_problem(recorded) is None
    assert "not-output" in _source_problem(yaml)


# --- stale facts the pages state -----------------------------------------------------------------------------


def test_quickstart_names_every_top_level_key_of_plan_json() -> None:
    from presets import get_preset
    from rlconf.plan import compile_plan, plan_to_dict

    page = (ROOT / "docs" / "quickstart.md").read_text()
    sentence = page.split("Its top-level keys are", 1)[1].split("Every value is\nresolved", 1)[0]
    named = re.findall(r"`(\w+)`", sentence)
    assert named == list(plan_to_dict(compile_plan(get_preset("tiny-grpo"))))


def test_concepts_names_every_part_of_the_plan() -> None:
    from presets import get_preset
    from rlconf.plan import compile_plan, plan_to_dict

    page = (ROOT / "docs" / "concepts.md").read_text()
    section = page.split("## The plan", 1)[1].split("```", 1)[0]
    named = set(re.findall(r"\*\*(\w+)\*\*", section))
    assert named == set(plan_to_dict(compile_plan(get_preset("tiny-grpo")))) - {"version", "roles"}


def test_quickstart_describes_the_main_preset() -> None:
    """The main job's numbers in the quickstart's prose are tiny-grpo's."""
    from presets import get_preset

    c = get_preset("tiny-grpo")
    a, t = c.model.arch, c.trainer
    page = " ".join((ROOT / "docs" / "quickstart.md").read_text().split())
    steps = [t.save_freq * k for k in range(1, t.total_steps // t.save_freq + 1)][-t.max_ckpt_to_keep :]
    for fact in (f"{a.num_layers}-layer model (hidden size {a.hidden_size}, a {a.vocab_size}-token",
                 f"synthetic `{c.data.synthetic_task}` task", f"The reward is `{c.reward.function}`",
                 f"{t.total_steps} steps of {c.data.train_batch_size} prompts x {c.rollout.n} responses",
                 f"every {t.test_freq} steps", " and ".join(f"global_step_{s}" for s in steps),
                 f"(save_freq {t.save_freq}, keep {t.max_ckpt_to_keep})"):  # fmt: skip
        assert fact in page, fact


def test_concepts_critic_warmup_is_tiny_ppos() -> None:
    from presets import get_preset

    warmup = get_preset("tiny-ppo").trainer.critic_warmup
    page = " ".join((ROOT / "docs" / "concepts.md").read_text().split())
    assert (
        f"steps: {warmup} in `tiny-ppo`, so `my_run.yaml`'s own table starts with {warmup} such rows" in page
    )


def test_numbers_the_pages_state_are_the_codes() -> None:
    """Defaults and limits the prose states, read from where the code keeps them."""
    from rlconf.config import RLConfig
    from rltrain.ray_group import PLACEMENT_TIMEOUT_S

    c = RLConfig()
    facts = {
        "troubleshooting.md": [f"`trainer.max_bad_steps` (default {c.trainer.max_bad_steps})",
                               f"rltrain waits up to {PLACEMENT_TIMEOUT_S} s for the placement groups"],
        "multi-node.md": [f"rltrain waits up to {PLACEMENT_TIMEOUT_S} s for Ray to grant each group",
                          f"`cluster.connect_timeout_s` (default {c.cluster.connect_timeout_s:g} s)"],
        "gpus.md": [f"rltrain waits up to {PLACEMENT_TIMEOUT_S} s for Ray to"],
        "separate-rollout.md": [f"(default {c.rollout.push_timeout_s:g}, within [1 s, 1 day])"],
    }  # fmt: skip
    for page, phrases in facts.items():
        text = " ".join((ROOT / "docs" / page).read_text().split())
        for phrase in phrases:
            assert phrase in text, (page, phrase)


def test_docs_cite_only_files_the_repository_has() -> None:
    # The design notes live outside the repository: a page citing them sends the reader nowhere.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    citing = [p.name for p in pages if "DESIGN.md" in p.read_text() and not (ROOT / "DESIGN.md").exists()]
    assert citing == []


def test_presets_the_pages_name_exist() -> None:
    """A preset named in a command of any page (`rltrain NAME`, `--preset NAME`, `preset: NAME`) exists."""
    from presets import PRESETS

    pattern = re.compile(r"(?:rltrain|--preset|preset:|preset )\s*`?((?:tiny|qwen)[\w.-]*[\w])")
    named = {m for page in PAGES for m in pattern.findall(page.read_text())}
    assert (
        len(named) > 5 and named - set(PRESETS) - {"tiny-grpoo"} == set()
    )  # tiny-grpoo: troubleshooting's typo


# --- checked blocks: run-time messages compared with the code that prints them ---------------------------------


def _page_block(page: str, test: str) -> list[str]:
    """The lines of the block of `page` whose marker names `test`, without their indent."""
    blocks = [
        b for b in fenced_blocks(ROOT / "docs" / page) if (_marker(b) or ("", ""))[1].endswith(f"::{test}")
    ]
    assert len(blocks) == 1, f"{page}: one block marked checked: tests/test_docs_excerpts.py::{test}"
    return [line.removeprefix(blocks[0].indent) for line in blocks[0].lines]


def _matches(quoted: str, printed: str) -> bool:
    """A quoted line matches a printed one exactly, or up to a `...` standing for the rest of the line."""
    return printed == quoted or (quoted.endswith("...") and printed.startswith(quoted[:-3]))


def test_worker_failure_excerpt() -> None:
    from rltrain.controller import _worker_failure_fix
    from rltrain.ray_group import WorkerError

    folder = SimpleNamespace(ckpt=SimpleNamespace(complete_steps=lambda: [2, 4]))  # a run with step 4 saved
    printed = []
    for died in (True, False):
        exc = WorkerError("actor", 0, "RuntimeError: boom" if not died else "the process exited", died)
        printed += [f"error: {exc}", f"    fix: {_worker_failure_fix(exc, folder)}"]
    quoted = _page_block("troubleshooting.md", "test_worker_failure_excerpt")
    assert len(quoted) == len(printed) and all(map(_matches, quoted, printed)), printed


def test_divergence_excerpt() -> None:
    from rltrain.guard import DivergenceGuard

    guard = DivergenceGuard(max_bad_steps=2)
    guard.record(3, "advantages")
    guard.record(4, "advantages")
    assert _page_block("troubleshooting.md", "test_divergence_excerpt") == [f"error: {guard.error(4, 2)}"]


def test_storage_excerpt(tmp_path: Path) -> None:
    from rlconf.errors import ConfigError
    from rltrain.storage import storage_error

    exc = storage_error(errno.ENOSPC, "the checkpoint of step 2 does not fit in /data/run/checkpoints", tmp_path,
                        int(2.5 * 2**20), "the checkpoints before it are intact (newest: step 1)")  # fmt: skip
    assert isinstance(exc, ConfigError)
    printed = [line for line in exc.format().splitlines() if line.startswith(("error", "    fix"))]
    free = re.compile(r"[\d.]+ [MG]iB free")  # this machine's free space
    quoted = _page_block("troubleshooting.md", "test_storage_excerpt")
    assert [free.sub("N free", line) for line in quoted] == [free.sub("N free", line) for line in printed]


@pytest.mark.slow
def test_tool_sandbox_excerpt() -> None:
    """`rlconf validate --preset tiny-tool` where unshare is refused (Docker's default seccomp profile, in
    small: tests/test_sandbox.py's filter)."""
    from tests.test_sandbox import _NO_USERNS

    rlconf = str(Path(sys.executable).parent / "rlconf")
    if not Path(rlconf).exists():
        pytest.skip("run from the project's venv: it provides rlconf")
    run = subprocess.run([sys.executable, "-c", _NO_USERNS, rlconf, "validate", "--preset", "tiny-tool"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    quoted = _page_block("troubleshooting.md", "test_tool_sandbox_excerpt")
    assert quoted == ["$ rlconf validate --preset tiny-tool", *run.stderr.splitlines()]


# --- inline quotes of program output ----------------------------------------------------------------------------

_INLINE_OUTPUT = re.compile(r"^(error\b|warning\b|note:|fix:|internal error|bad step|resumed from|pool \w|done:|"
                            r"profile summary|Generated new|Token authentication|\w+Error: |ok |wrote |.*invalid config|"
                            r"\.\.\./|about N|.*(never writes|not available here|deprecated|ASSERT))")  # fmt: skip
INLINE_QUOTES: dict[str, tuple[tuple[str, str], ...]] = {
    # quoted text (as on the page, `...` for what varies) -> (file, the text of that file that prints it); a
    # third-party message quoted from a recorded GPU run has no file here
    "error: rollout worker rank 0 died: ...": (
        ("rltrain/controller.py", 'print(f"error: {exc}\\n    fix: '),
        ("rltrain/ray_group.py", 'super().__init__(f"{role} worker rank {rank} {what}: {message}")'),
        ("rltrain/ray_group.py", 'what = "died" if died else "failed"')),
    "PushError: weight push of stage 0 broke: ... (a peer died or stalled; every push collective waits at most "
    "rollout.push_timeout_s = ... s)": (
        ("rltrain/rollout/push.py", 'f"weight push of stage {self.stage} broke: {_first_line(exc)} (a peer died or '
                                    'stalled; every "\n                f"push collective waits at most '
                                    'rollout.push_timeout_s = {self.timeout_s:g} s)"'),),
    "pool actor_pool:": (("rltrain/ray_group.py", 'print(f"pool {name}: {pool.describe()}"'),),
    "internal error: ...": (("rlconf/cli.py", 'f"internal error: {type(exc).__name__}: {exc}'),),
    "bad step: advantages not finite, update not applied": (
        ("rltrain/metrics.py", 'f"bad step: {record[GUARD_CAUSE_KEY]} not finite, update not applied"'),),
    "warning: .../metrics.jsonl:N: the line of step S was cut off": (
        ("rltrain/metrics_file.py", 'f"warning: {path}:{parsed.torn_lineno}: {which} was cut off'),
        ("rltrain/metrics_file.py", 'f"the line of step {match.group(1)}"')),
    "error [metrics-file] trainer.output_dir: .../metrics.jsonl:N: not JSON: ...": (
        ("rltrain/metrics_file.py", 'f"{path}:{lineno}: {why}: {shown!r}'),
        ("rltrain/metrics_file.py", '"not JSON"'),
        ("rltrain/metrics_file.py", 'RULE = "metrics-file"')),
    "note: no Transformer Engine / Apex: megatron uses its plain torch implementations (...)": (
        ("rltrain/quiet.py", """f"note: no {' / '.join(missing)}: megatron uses its plain torch implementations """
                             """({cost})\""""),),
    "Token authentication is enabled": (("rltrain/quiet.py", '"Token authentication is enabled for this Ray '),),
    "Generated new authentication token and saved to ~/.ray/auth_token": (
        ("ray/_private/authentication/authentication_token_setup.py",
         'f"Generated new authentication token and saved to {token_path}"'),),
    "loads optimizer, extra which save_contents never writes": (
        ("rlconf/checks/training.py", 'f"loads {\', \'.join(missing)} which save_contents never writes"'),),
    "about N MiB each": (("rlconf/plan/render.py", 'f"about {_size_text(ck.size_bytes)} each'),),
    ".../dist_ckpt/__0_0.distcp: content differs from the manifest (crc32 of bytes 0-50331648)": (
        ("rltrain/checkpoint/manifest.py",
         'f"{path}: content differs from the manifest ({_DIGEST} of bytes {offset}-{offset + n})"'),),
    "full scope is deprecated": (("rltrain/quiet.py", '("full scope is deprecated", '),),
    "activities ['cuda'] are not available here": (
        ("rltrain/profiling.py", 'f"activities {self.dropped} are not available here; '),),
    "it->second->use_count > 0 INTERNAL ASSERT FAILED": (),  # torch's own error on the GPU (benchmarks.md)
    "FusedKernelsError: model.fused_kernels: torch.compile cannot build kernels on this machine": (
        ("rltrain/megatron/fused.py", "class FusedKernelsError("),
        ("rltrain/megatron/fused.py", 'f"model.fused_kernels: torch.compile cannot build kernels on this machine "')),
}  # fmt: skip
"""Every inline quote of program output on the pages (a backtick span that reads like an error, warning, note
or progress line, 16 characters or more), with where the code prints it. A new one must be added here."""


def inline_quotes(page: Path) -> list[str]:
    text = re.sub(r"^\s*```.*?^\s*```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    spans = (" ".join(m.split()) for m in re.findall(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)", text))
    return [s for s in spans if len(s) >= 16 and _INLINE_OUTPUT.match(s)]


def _source(file: str) -> str:
    import ray

    path = ROOT / file if (ROOT / file).exists() else Path(ray.__file__).parent.parent / file
    return path.read_text(encoding="utf-8")


def test_every_inline_output_quote_names_the_code_that_prints_it():
    quoted = {q for page in PAGES if page.name != MIGRATION_PAGE for q in inline_quotes(page)}
    assert quoted - set(INLINE_QUOTES) == set(), (
        "add these quotes to INLINE_QUOTES with the code that prints them"
    )
    assert set(INLINE_QUOTES) - quoted == set(), (
        "no page quotes these any more: remove them from INLINE_QUOTES"
    )
    stale = [f"{quote!r}: {file} no longer has {text!r}" for quote, sources in INLINE_QUOTES.items()
             for file, text in sources if text not in _source(file)]  # fmt: skip
    assert stale == [], "\n".join(stale)


def test_inline_quote_finder():
    page = ROOT / "docs" / "troubleshooting.md"
    assert "bad step: advantages not finite, update not applied" in inline_quotes(page)
    assert all(len(q) >= 16 for q in inline_quotes(page))


@pytest.mark.slow
def test_mla_refusal_excerpt(tmp_path: Path) -> None:
    """`rltrain tiny-grpo --model.path DIR` on a deepseek_v3 folder whose routing megatron-core computes
    otherwise (norm_topk_prob: false): the quoted refusal is among its errors."""
    import json

    from tests.hf_folders import complete_folder
    from tests.test_deepseek_v3_config import saved

    (tmp_path / "DIR").mkdir()
    (tmp_path / "DIR" / "config.json").write_text(
        json.dumps(saved(num_experts_per_tok=4, norm_topk_prob=False))
    )
    complete_folder(tmp_path / "DIR")
    run = subprocess.run([sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--model.path", "DIR"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    printed = run.stderr.splitlines()
    for quoted in _page_block("troubleshooting.md", "test_mla_refusal_excerpt"):
        assert any(_matches(quoted, line) for line in printed), (quoted, printed)


@pytest.mark.slow
def test_profile_meta_excerpt(tmp_path: Path) -> None:
    """profiling.md's meta.json: one torch-profiled actor_update call at step 2 on CPU writes these fields and
    values (its pid and wall time differ per run)."""
    import json

    from presets import PRESETS
    from rlconf.load import load_config
    from rlconf.plan import compile_plan
    from rltrain.profiling import Profiler

    config = load_config(None, preset="tiny-grpo", presets=PRESETS, overrides=[
        f"trainer.output_dir={tmp_path}", "profile.tool=torch", "profile.steps=[2]"])  # fmt: skip
    prof = Profiler(compile_plan(config).profile, worker="actor", rank=0, device="cpu")
    prof.set_step(2)
    with prof.profiled("actor_update"):
        sum(range(1000))
    prof.close()
    (written,) = tmp_path.rglob("meta.json")
    meta = json.loads(written.read_text())
    quoted = json.loads("\n".join(_page_block("profiling.md", "test_profile_meta_excerpt")))
    assert list(meta) == list(quoted)
    varying = {"pid", "wall_s"}
    assert {k: v for k, v in meta.items() if k not in varying} == {
        k: v for k, v in quoted.items() if k not in varying
    }


class _CallsSystem:
    """Pickles as a call of os.system: what a forged RNG file would hold (never loaded here)."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, ("true",)


def test_unsafe_checkpoint_excerpt(tmp_path: Path) -> None:
    """security.md's refusal of an RNG file swapped for a pickle that calls os.system."""
    import torch

    from rltrain.checkpoint.safe_load import UnsafeCheckpointError, load_rng_file

    path = tmp_path / "actor" / "rng" / "rank_00000.pt"
    path.parent.mkdir(parents=True)
    torch.save({"python": _CallsSystem()}, path)
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_rng_file(path)
    printed = f"error: {refused.value}".replace(f"{tmp_path}/", ".../")
    assert _page_block("security.md", "test_unsafe_checkpoint_excerpt") == [printed]
