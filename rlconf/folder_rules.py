"""Validate rule `model-folder-paths`: the model folders a config names hold no name that leads outside them.

Registered into rlconf.validate's rule table (validate.py imports this module at its end). A filesystem rule:
`rlconf validate` and `rltrain` start check it, before any weight, tokenizer or config file is opened by a
loader; the loaders check again at run time (rlconf.safe_paths is the one check both use).
"""

from __future__ import annotations

from collections.abc import Iterator

from rlconf.config import RLConfig
from rlconf.errors import Issue, error
from rlconf.plan.roles import model_folders
from rlconf.safe_paths import FOLDER_PATHS_RULE, model_folder_escapes


def model_folder_paths(c: RLConfig) -> Iterator[Issue]:
    """Every file a model folder names (model.safetensors.index.json weight_map entries) and every symlink in
    it (weights, config.json, tokenizer files) resolves inside the folder: no `..`, no absolute path, no
    symlink to elsewhere (a Hugging Face hub cache snapshot's links into its own blobs/ are inside)."""
    models = [(key, folder) for key, folder, _ in model_folders(c)]
    folders = [models[0], ("model.tokenizer_path", c.model.tokenizer_path), *models[1:]]
    for path, folder in folders:
        if folder is None:
            continue
        for escape in model_folder_escapes(folder):
            yield error(path, str(escape), "use a model folder whose files are all inside it (copy the files "
                        "in instead of naming or linking them)", FOLDER_PATHS_RULE)  # fmt: skip
