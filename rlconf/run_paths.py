"""Where and how long the paths a run writes get. `in_run_folder` resolves a path the config gives relative
to the run folder (profile.save_path, logging.*_data_dir, checkpoints/). How long: `trainer.output_dir` (and
an absolute `profile.save_path`) must leave room for the deepest file a run writes under it, within the
filesystem's limits (NAME_MAX per component, PATH_MAX for the whole path), so that a too long folder is
refused before training instead of failing at the first save with "File name too long".

The deepest file: a staged save's `checkpoints/global_step_N.tmp-<10>/<role>/huggingface/` plus the longest
leaf a save writes there (an atomic write's `.NAME.tmp-<8>` of the longest tokenizer or index file, megatron's
`__<rank>_<n>.distcp`): `LEAF_ALLOWANCE` characters. A filesystem rule: it reads the limits of the filesystem
that holds (the nearest existing parent of) the folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from rlconf.config import RLConfig
from rlconf.errors import Issue, error

RULE = "output-dir-length"
LEAF_ALLOWANCE = 64
"""Characters kept for a file name inside a checkpoint's role folder (the longest rlplan and megatron write
is `.model.safetensors.index.json.tmp-xxxxxxxx`, 41)."""
_NAME_MAX, _PATH_MAX = 255, 4096  # Linux's, where the filesystem does not say


def in_run_folder(output_dir: str, path: str) -> str:
    """`path` as the run writes it: a relative one is under the run folder (trainer.output_dir)."""
    return os.path.normpath(os.path.join(output_dir, path))


def _limits(path: str) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the filesystem holding `path` or its nearest existing parent."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        return os.pathconf(p, "PC_NAME_MAX"), os.pathconf(p, "PC_PATH_MAX")
    except (OSError, ValueError):
        return _NAME_MAX, _PATH_MAX


def deepest_file(c: RLConfig) -> str:
    """The longest path (relative to trainer.output_dir) a run of `c` writes, leaf as LEAF_ALLOWANCE x's."""
    steps = max(c.trainer.total_steps, 1) if c.trainer.total_epochs is None else 10**12  # epochs: a bound
    role = "critic" if c.algorithm.adv_estimator == "gae" else "actor"
    return f"checkpoints/global_step_{steps}.tmp-{'x' * 10}/{role}/huggingface/{'x' * LEAF_ALLOWANCE}"


def _issues(path_name: str, folder: str, deepest: str, what: str) -> Iterator[Issue]:
    name_max, path_max = _limits(folder)
    target = os.path.abspath(folder)
    long = [part for part in target.split(os.sep) if len(part.encode()) > name_max]
    fix = (
        f"use a shorter {path_name} (a folder name of at most {name_max} bytes, a path well under {path_max})"
    )
    if long:
        yield error(path_name, f"a folder name in it is {len(long[0].encode())} bytes ({long[0][:40]}...); "
                    f"the filesystem allows at most {name_max} (NAME_MAX)", fix, RULE)  # fmt: skip
        return
    full = len(os.path.join(target, deepest).encode()) + 1  # PATH_MAX counts the terminating NUL
    if full > path_max:
        yield error(path_name, f"{len(target.encode())} bytes long: {what} would be {full - 1} bytes "
                    f"({os.path.join('...', deepest)}), over the filesystem's PATH_MAX of {path_max}", fix,
                    RULE)  # fmt: skip


def output_dir_length(c: RLConfig) -> Iterator[Issue]:
    """trainer.output_dir (and an absolute profile.save_path) leaves room for the deepest file a run writes,
    within NAME_MAX per folder name and PATH_MAX for the whole path."""
    if c.trainer.output_dir:
        yield from _issues("trainer.output_dir", c.trainer.output_dir, deepest_file(c),
                           "the deepest file a checkpoint writes under it")  # fmt: skip
    p = c.profile
    if p.tool != "none" and os.path.isabs(p.save_path):
        # step_N/ROLE/rank_R/ and a trace file name
        yield from _issues("profile.save_path", p.save_path, f"step_{10**12}/{'x' * 32}/rank_00000/{'x' * 96}",
                           "the deepest profile file")  # fmt: skip
