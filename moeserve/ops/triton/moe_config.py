"""Block-size configs for the fused MoE kernels: tuned JSON files per shape and GPU, else defaults.

A config covers one call: how tokens are grouped (`DENSE`, `MODE`, `BLOCK_M`) and the tile shape
of each of the two GEMMs (`up`: gate/up with SiLU-and-mul, `down`). Files are written by
`python -m moeserve.ops.triton.tune_moe` and map a token count (the bucket) to a config; a call
uses the bucket nearest its token count. A GPU with no file of its own takes one tuned on another
GPU of its architecture (an H800 or H20 runs the H100's or H200's tiles): the tiles fit the same
shared memory and use the same instructions, and even tuned for another chip they beat the
defaults, which use neither TMA nor the wide prompt-size tiles.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"
# Extra directory searched first, for configs tuned on a machine without rebuilding the package.
CONFIG_DIR_ENV = "MOESERVE_MOE_CONFIG_DIR"

MODES = ("gemv", "swap", "dot")
# The dense path computes every token against each hit expert; past this it wastes too much.
DENSE_MAX_TOKENS = 16
GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")  # and optional "TMA" (default off)
# A config may also set "ACT_TMA", and its down GEMM "PERSISTENT" (both default off): see fused_moe.

Config = dict[str, Any]


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_name(device: torch.device) -> str:
    """A file-name-safe GPU name ("NVIDIA_H200"); "cpu" for the interpreter."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device).replace(" ", "_").replace("/", "_")


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability ((9, 0) on Hopper); None for the interpreter."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def config_file_name(experts: int, inter: int, hidden: int, device: str, dtype: torch.dtype) -> str:
    """The JSON file holding the tuned configs of one (shape, GPU, dtype)."""
    return f"E={experts},I={inter},H={hidden},device={device},dtype={_dtype_name(dtype)}.json"


def _gemm(block_n: int, block_k: int, warps: int = 4, stages: int = 3, group_m: int = 1) -> dict:
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m, "num_warps": warps, "num_stages": stages}


def default_config(tokens: int, experts: int, topk: int, dtype: torch.dtype = torch.bfloat16) -> Config:
    """A reasonable config for `tokens` when no tuned file exists, picked by tokens per expert."""
    config = _default_for_load(tokens, experts, topk)
    if dtype == torch.float32:
        # fp32 tiles take twice the shared memory per stage.
        for part in ("up", "down"):
            config[part]["num_stages"] = min(config[part]["num_stages"], 2)
    return config


def _default_for_load(tokens: int, experts: int, topk: int) -> Config:
    per_expert = tokens * topk / experts
    if tokens <= 2:
        # Seed 001: so few tokens that sorting costs more than computing masked rows; one or two
        # rows waste nothing in a GEMV, where an MMA tile would be 7/8 padding.
        return {"DENSE": True, "MODE": "gemv", "BLOCK_M": _next_pow2(tokens), "up": _gemm(16, 256, 4, 1),
                "down": _gemm(32, 128, 4, 1)}
    if tokens <= DENSE_MAX_TOKENS:
        return {"DENSE": True, "MODE": "swap", "BLOCK_M": 16, "up": _gemm(32, 128, 4, 4), "down": _gemm(64, 128, 4, 4)}
    if per_expert <= 8:
        # Seed 002's swapAB: weight rows fill the MMA's M side, the few tokens its N side.
        return {"DENSE": False, "MODE": "swap", "BLOCK_M": 16, "up": _gemm(32, 128, 4, 4), "down": _gemm(64, 128, 4, 4)}
    if per_expert <= 32:
        return {"DENSE": False, "MODE": "swap", "BLOCK_M": 32, "up": _gemm(64, 64, 4, 4), "down": _gemm(128, 64, 4, 4)}
    if per_expert <= 128:
        return {"DENSE": False, "MODE": "dot", "BLOCK_M": 64, "up": _gemm(64, 64, 4, 3, 8), "down": _gemm(128, 64, 4, 3, 8)}
    return {"DENSE": False, "MODE": "dot", "BLOCK_M": 128, "up": _gemm(64, 64, 8, 3, 8), "down": _gemm(128, 64, 8, 3, 8)}


def validate_config(config: Config, tokens: int) -> str | None:
    """Why `config` cannot run `tokens` tokens, or None when it can."""
    for key in ("DENSE", "MODE", "BLOCK_M", "up", "down"):
        if key not in config:
            return f"missing key {key!r}"
    if config["MODE"] not in MODES:
        return f"MODE must be one of {MODES}, got {config['MODE']!r}"
    bm = config["BLOCK_M"]
    if bm < 1 or bm & (bm - 1):
        return f"BLOCK_M must be a power of two, got {bm}"
    if config["MODE"] != "gemv" and bm < 16:
        return "tl.dot needs BLOCK_M >= 16"
    if config["DENSE"] and tokens > bm:
        return f"the dense path needs tokens <= BLOCK_M ({tokens} > {bm})"
    for part in ("up", "down"):
        gemm = config[part]
        if any(k not in gemm for k in GEMM_KEYS):
            return f"{part} needs keys {GEMM_KEYS}"
        if config["MODE"] != "gemv" and min(gemm["BLOCK_N"], gemm["BLOCK_K"]) < 16:
            return "tl.dot needs BLOCK_N and BLOCK_K >= 16"
        if gemm.get("TMA") and config["MODE"] == "gemv":
            return "TMA weight tiles feed tl.dot: not with MODE gemv"
    if config.get("ACT_TMA") and (config["DENSE"] or config["MODE"] != "dot" or not config["down"].get("TMA")):
        return "ACT_TMA (activations in block order, read by TMA) needs the sorted dot path with a TMA down GEMM"
    if config["up"].get("PERSISTENT"):
        return "PERSISTENT is a down-GEMM option"
    if config["down"].get("PERSISTENT") and not config.get("ACT_TMA"):
        return "a PERSISTENT down GEMM reads its activations by TMA: it needs ACT_TMA"
    return None


def _read(path: Path) -> tuple[dict[int, Config], dict]:
    raw = json.loads(path.read_text())
    return {int(k): v for k, v in raw.items() if not k.startswith("_")}, raw.get("_meta", {})


@functools.lru_cache(maxsize=64)
def load_configs(experts: int, inter: int, hidden: int, device: str, dtype: torch.dtype,
                 capability: tuple[int, int] | None = None) -> dict[int, Config] | None:
    """{bucket token count: config} from the first file for this GPU; else, given the GPU's
    `capability`, from the first file tuned on another GPU of that capability; else None."""
    name = config_file_name(experts, inter, hidden, device, dtype)
    dirs = [Path(os.environ[CONFIG_DIR_ENV])] if os.environ.get(CONFIG_DIR_ENV) else []
    folders = [*dirs, CONFIG_DIR]
    for folder in folders:
        path = folder / name
        if path.is_file():
            logger.info("fused MoE configs from %s", path)
            return _read(path)[0]
    if capability is None:
        return None
    pattern = config_file_name(experts, inter, hidden, "*", dtype)
    for folder in folders:
        for path in sorted(folder.glob(pattern)):
            configs, meta = _read(path)
            if tuple(meta.get("capability") or ()) == tuple(capability):
                logger.info("no fused MoE configs tuned on %s: using %s (tuned on %s, the same architecture)",
                            device, path, meta.get("device"))
                return configs
    return None


def pick_config(
    configs: dict[int, Config] | None, tokens: int, experts: int, topk: int, dtype: torch.dtype = torch.bfloat16
) -> Config:
    """The config of the bucket nearest `tokens` that can run it; the default if none can."""
    for bucket in sorted(configs or {}, key=lambda b: (abs(b - tokens), b)):
        problem = validate_config(configs[bucket], tokens)
        if problem is None:
            return configs[bucket]
        logger.debug("tuned config for %d tokens unusable at %d (%s)", bucket, tokens, problem)
    return default_config(tokens, experts, topk, dtype)


@functools.lru_cache(maxsize=1024)
def _cached_config(experts: int, inter: int, hidden: int, device: tuple, dtype: torch.dtype, tokens: int,
                   topk: int) -> Config:
    name, capability = device
    return pick_config(load_configs(experts, inter, hidden, name, dtype, capability), tokens, experts, topk, dtype)


@functools.lru_cache(maxsize=16)
def _device_cached(device: torch.device) -> tuple[str, tuple[int, int] | None]:
    """(file-name GPU name, compute capability)."""
    return device_name(device), device_capability(device)


def config_change_points(
    experts: int, inter: int, hidden: int, device: str, dtype: torch.dtype, topk: int, lo: int, hi: int,
    capability: tuple[int, int] | None = None,
) -> list[int]:
    """The first token count in lo..hi of each distinct config: running those reaches every kernel variant."""
    configs = load_configs(experts, inter, hidden, device, dtype, capability)
    seen: set[str] = set()
    points = []
    for tokens in range(lo, hi + 1):
        key = json.dumps(pick_config(configs, tokens, experts, topk, dtype), sort_keys=True)
        if key not in seen:
            seen.add(key)
            points.append(tokens)
    return points


def warm_up_sizes(w13: torch.Tensor, topk: int, lo: int, hi: int) -> list[int]:
    """config_change_points for the fused MoE over these stacked weights."""
    experts, two_inter, hidden_size = w13.shape
    name, capability = _device_cached(w13.device)
    return config_change_points(experts, two_inter // 2, hidden_size, name, w13.dtype, topk, lo, hi, capability)


def get_config(hidden: torch.Tensor, w13: torch.Tensor, topk: int) -> Config:
    """The config for one fused MoE call, from its inputs' shapes, dtype and device."""
    experts, two_inter, hidden_size = w13.shape
    return _cached_config(experts, two_inter // 2, hidden_size, _device_cached(hidden.device), hidden.dtype,
                          hidden.shape[0], topk)
