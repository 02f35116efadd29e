"""moeserve: a small, fast inference server for DeepSeek-style Mixture-of-Experts models."""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from moeserve.core.sampling_params import SamplingParams
    from moeserve.engine.llm import LLM


def __getattr__(name: str) -> Any:
    # Lazy so that light tools (the planner, the bench client) do not pay for importing torch.
    if name == "LLM":
        from moeserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from moeserve.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
