"""Build a model and fill it from a Hugging Face checkpoint folder, or with random weights.

Checkpoint names are the original DeepSeek ones: per-expert weights
(`mlp.experts.{e}.gate_proj.weight`, ...) are stacked into one tensor per layer, and MTP
(NextN) modules are stored as the layers after the last decoder layer. transformers' fused
expert names (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) load too.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from moeserve.config.model_config import ModelConfig
from moeserve.layers.moe import Router
from moeserve.models.deepseek import DeepseekForCausalLM

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_SHARED = re.compile(r"^(.*\.mlp)\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_MTP_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# Checkpoint matrices that moeserve stores stacked with a sibling, so one GEMM computes both.
_STACKED = re.compile(r"^(.*?)\.(gate_proj|up_proj|q_proj|q_a_proj|kv_a_proj_with_mqa)\.(weight|bias)$")

# (model parameter name, index into it, how to lay the checkpoint tensor out to fit, if at all)
Target = tuple[str, tuple, Callable[[torch.Tensor], torch.Tensor] | None]


class CheckpointError(ValueError):
    """A checkpoint folder that does not match its config."""


def safetensors_files(path: Path) -> tuple[list[Path], list[str] | None]:
    """The checkpoint's safetensors files, and its key list when an index names them."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))], list(weight_map)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files, None


def _checkpoint_keys(files: list[Path], keys: list[str] | None) -> list[str]:
    if keys is not None:
        return keys
    out: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.extend(handle.keys())
    return out


def count_mtp_layers(config: ModelConfig, keys: list[str]) -> int:
    """How many of the config's MTP layers the checkpoint actually holds."""
    present = 0
    for j in range(config.num_nextn_predict_layers):
        prefix = f"model.layers.{config.num_hidden_layers + j}."
        if any(k.startswith(prefix) for k in keys):
            present += 1
    return present


def build_model(config: ModelConfig, num_mtp_layers: int, dtype: torch.dtype, device: torch.device) -> DeepseekForCausalLM:
    """Allocate an uninitialised model directly on `device` (no throwaway CPU init)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, num_mtp_layers).to(dtype)
    for module in model.modules():
        # The routing correction bias is float32 in checkpoints and is added to float32 scores.
        if isinstance(module, Router) and module.e_score_correction_bias is not None:
            module.e_score_correction_bias = torch.nn.Parameter(
                module.e_score_correction_bias.float(), requires_grad=False
            )
    return model.to_empty(device=device).requires_grad_(False).eval()


def _shared_expert_target(prefix: str, proj: str, config: ModelConfig) -> Target:
    """The shared MLP (width S * I) as S extra experts after the routed ones (see layers.moe.Experts)."""
    e, s, inter = config.n_routed_experts or 0, config.n_shared_experts, config.moe_intermediate_size
    rows = slice(e, e + s)
    if proj == "down_proj":  # [H, S * I] -> S slices [H, I]
        return f"{prefix}.experts.w2_weight", (rows,), lambda t: t.view(t.shape[0], s, inter).transpose(0, 1)
    half = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
    return f"{prefix}.experts.w13_weight", (rows, half), lambda t: t.view(s, inter, t.shape[1])


def _target(name: str, config: ModelConfig, params: dict[str, torch.Tensor]) -> Target:
    """Map a checkpoint tensor name to where it goes in the model."""
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) >= config.num_hidden_layers:
        j, rest = int(layer.group(1)) - config.num_hidden_layers, layer.group(2)
        name = f"mtp.{j}.{rest}" if rest.startswith(_MTP_OWN) else f"mtp.{j}.layer.{rest}"
    expert = _EXPERT.match(name)
    if expert:
        prefix, e, proj = expert.group(1), int(expert.group(2)), expert.group(3)
        if proj == "down_proj":
            return f"{prefix}.w2_weight", (e,), None
        inter = config.moe_intermediate_size
        half = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        return f"{prefix}.w13_weight", (e, half), None
    fused = _FUSED_EXPERT.match(name)
    if fused:
        suffix = "w13_weight" if fused.group(2) == "gate_up_proj" else "w2_weight"
        return f"{fused.group(1)}.{suffix}", (slice(0, config.n_routed_experts),), None
    shared = _SHARED.match(name)
    if shared and f"{shared.group(1)}.experts.w13_weight" in params:
        return _shared_expert_target(shared.group(1), shared.group(2), config)
    stacked = _STACKED.match(name)
    if stacked:
        prefix, proj, kind = stacked.groups()
        if proj in ("gate_proj", "up_proj"):
            target = f"{prefix}.gate_up_proj.{kind}"
            if target in params:
                half = params[target].shape[0] // 2
                return target, (slice(0, half) if proj == "gate_proj" else slice(half, 2 * half),), None
        else:
            target = f"{prefix}.fused_qkv_a_proj.{kind}"
            if target in params:
                kv_rows = config.kv_cache_dim
                q_rows = params[target].shape[0] - kv_rows
                part = slice(q_rows, q_rows + kv_rows) if proj == "kv_a_proj_with_mqa" else slice(0, q_rows)
                return target, (part,), None
    return name, (), None


def _zero_unbiased_query_rows(
    model: DeepseekForCausalLM, params: dict[str, torch.Tensor], loaded: dict[str, int]
) -> None:
    """With attention_bias but no q_lora, checkpoints bias kv_a_proj_with_mqa but not q_proj:
    the q rows of the fused bias are zero by definition, not missing."""
    config = model.config
    if not (config.attention_bias and config.q_lora_rank is None):
        return
    for name, p in params.items():
        if name.endswith("fused_qkv_a_proj.bias"):
            q_rows = p.shape[0] - config.kv_cache_dim
            p[:q_rows].zero_()
            loaded[name] += q_rows


def _fill_tied(model: DeepseekForCausalLM, params: dict[str, torch.Tensor], loaded: dict[str, int]) -> None:
    """Copy weights a checkpoint may legitimately omit because they are shared."""
    ties = {"lm_head.weight": "model.embed_tokens.weight"} if model.config.tie_word_embeddings else {}
    for j in range(len(model.mtp)):
        ties[f"mtp.{j}.embed_tokens.weight"] = "model.embed_tokens.weight"
        ties[f"mtp.{j}.shared_head.head.weight"] = "lm_head.weight"
    for dst, src in ties.items():
        if loaded.get(dst, 0) == 0 and loaded.get(src, 0) == params[src].numel():
            params[dst].copy_(params[src])
            loaded[dst] = params[dst].numel()


def load_weights(model: DeepseekForCausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into place; refuse unknown, misshapen or missing weights."""
    config = model.config
    params = dict(model.named_parameters())
    loaded = dict.fromkeys(params, 0)
    device = next(iter(params.values())).device
    _zero_unbiased_query_rows(model, params, loaded)
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if _IGNORED.search(key):
                    continue
                pname, index, arrange = _target(key, config, params)
                if pname not in params:
                    raise CheckpointError(f"checkpoint tensor {key!r} has no place in the model ({f.name})")
                dst = params[pname][index] if index else params[pname]
                src = handle.get_tensor(key)
                if arrange is not None and src.numel() == dst.numel():
                    src = arrange(src)
                if tuple(src.shape) != tuple(dst.shape):
                    raise CheckpointError(f"{key!r}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
                dst.copy_(src)
                loaded[pname] += dst.numel()
    _fill_tied(model, params, loaded)
    missing = [n for n, p in params.items() if loaded[n] != p.numel()]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint is missing {len(missing)} weights: {shown}")


def init_dummy_weights(model: DeepseekForCausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights of the right shapes, drawn on the model's device.

    Matrices are normal(0, std), norm scales ones, biases and routing corrections zeros: the
    same recipe as the shared random checkpoint, so routing spreads over experts the same way.
    """
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in params.items():
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif name.endswith(("bias", "e_score_correction_bias")):
            p.zero_()
        else:
            p.fill_(1.0)


def load_model(
    config: ModelConfig,
    path: str | Path | None,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
) -> DeepseekForCausalLM:
    """Build the model on `device` and fill it from `path` (or randomly for load_format='dummy')."""
    if load_format == "dummy":
        model = build_model(config, config.num_nextn_predict_layers, dtype, device)
        init_dummy_weights(model, seed)
        return model
    if path is None:
        raise CheckpointError("a checkpoint path is needed unless load_format='dummy'")
    files, keys = safetensors_files(Path(path))
    num_mtp = count_mtp_layers(config, _checkpoint_keys(files, keys))
    model = build_model(config, num_mtp, dtype, device)
    load_weights(model, files)
    logger.info("loaded %d safetensors files from %s (%d MTP layers)", len(files), path, num_mtp)
    return model
