"""Files shipped inside the package: the default (demo) model."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"


def default_model_path() -> str:
    """The shipped demo checkpoint's folder, used whenever no --model is given."""
    if not (DEMO_MODEL_DIR / "config.json").is_file() or not any(DEMO_MODEL_DIR.glob("*.safetensors")):
        raise FileNotFoundError(
            f"the default model is missing from {DEMO_MODEL_DIR}: reinstall moeserve with its package data, "
            "or pass --model PATH"
        )
    return str(DEMO_MODEL_DIR)
