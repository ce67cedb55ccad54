"""The base model: a single-file SDXL checkpoint whose header we can read (no torch)."""
from __future__ import annotations

from pathlib import Path

from lora_worker.host.safetensors import HeaderError, missing_sdxl_families, read_header
from lora_worker.errors import BaseModelInvalid


def check_base_model(path: Path) -> None:
    """BaseModelInvalid unless the header parses and holds the U-Net and both text encoders."""
    try:
        header = read_header(path)
    except (OSError, HeaderError) as exc:
        raise BaseModelInvalid({"base_model_path": [f"Not a readable safetensors file: {exc}"]}) from exc
    missing = missing_sdxl_families(header)
    if missing:
        raise BaseModelInvalid({"base_model_path": [
            "Not an SDXL checkpoint: no " + ", ".join(missing) + " weights."]})
