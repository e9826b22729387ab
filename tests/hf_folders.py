"""Complete Hugging Face model folders for real-size models without their weights' bytes, for tests that plan
and validate them: beside a config.json, a safetensors file whose header lists every tensor the loader reads
(rlconf.model_files.hf_tensors) and whose data is a sparse hole (a 30B model costs no disk), and the built-in
32-token tokenizer. `rlconf validate` accepts such a folder exactly as it accepts the real download."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from rlconf.model_files import hf_tensors
from rlconf.model_spec import read_model_arch
from rltrain.tokenizer import CharTokenizer


def complete_folder(path: str | os.PathLike[str]) -> str:
    """Add sparse bf16 safetensors weights and a tokenizer to a folder that holds only config.json."""
    arch = read_model_arch(os.fspath(path))
    header, offset = {}, 0
    for name, shape in hf_tensors(arch).items():
        n = 2
        for s in shape:
            n *= s
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    f = Path(path) / "model.safetensors"
    with open(f, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        out.truncate(8 + len(text) + offset)  # a hole: no blocks written
    CharTokenizer().save_pretrained(os.fspath(path))
    return os.fspath(path)
