"""Write the trained model as an original-layout DeepSeek-V3 checkpoint (bf16 safetensors).

Names are the Hugging Face ones: routed experts one by one (`mlp.experts.{e}.gate_proj.weight`,
...), the MTP module as decoder layer `num_hidden_layers` with its enorm/hnorm/eh_proj/
shared_head.norm. The MTP module's embedding and output head are the main model's (shared, as in
DeepSeek-V3), so the file stores them once; moeserve's loader ties them back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from train_demo.config import generation_config, hf_config
from train_demo.model import DemoModel

_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


def _hf_name(name: str, num_layers: int) -> str:
    if name.startswith("mtp."):
        rest = name[len("mtp.") :]
        rest = rest if rest.startswith(_MTP_OWN) else rest[len("layer.") :]
        return f"model.layers.{num_layers}.{rest}"
    if name.startswith(("embed_tokens.", "layers.", "norm.")):
        return f"model.{name}"
    return name


def hf_state_dict(model: DemoModel, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names; routing biases stay float32 as in V3."""
    out: dict[str, torch.Tensor] = {}
    num_layers = model.cfg.num_hidden_layers
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        hf = _hf_name(name, num_layers)
        if hf.endswith("experts.w13_weight"):
            prefix, inter = hf[: -len("w13_weight")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].to(dtype).contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].to(dtype).contiguous()
        elif hf.endswith("experts.w2_weight"):
            prefix = hf[: -len("w2_weight")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].to(dtype).contiguous()
        elif hf.endswith("e_score_correction_bias"):
            out[hf] = t.float().contiguous()
        else:
            out[hf] = t.to(dtype).contiguous()
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def save_checkpoint(model: DemoModel, out_dir: Path) -> int:
    """Write config.json, generation_config.json and model.safetensors; return the weights' bytes.

    The safetensors file is written beside and renamed into place, so a run cut off mid-save
    still leaves the previous complete checkpoint.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", hf_config(model.cfg))
    _write_json(out_dir / "generation_config.json", generation_config(model.cfg))
    tmp = out_dir / "model.safetensors.tmp"
    save_file(hf_state_dict(model), str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)
    os.replace(tmp, out_dir / "model.safetensors")
    return (out_dir / "model.safetensors").stat().st_size
