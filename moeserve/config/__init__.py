"""Typed, frozen configuration objects."""

from moeserve.config.engine_config import EngineConfig
from moeserve.config.model_config import ModelConfig, RopeConfig

__all__ = ["EngineConfig", "ModelConfig", "RopeConfig"]
