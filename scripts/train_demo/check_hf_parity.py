"""Check that an exported checkpoint gives the same logits in moeserve and transformers.

python scripts/train_demo/check_hf_parity.py CHECKPOINT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moeserve import LLM  # noqa: E402


def max_logit_diff(path: str, length: int = 256, seed: int = 0) -> float:
    """Largest |moeserve - transformers| main-model logit over one random prompt (float32, CPU)."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    llm = LLM(path, dtype="float32", device="cpu", num_kv_pages=64)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, ref.config.vocab_size, (1, length), generator=gen)
    with torch.no_grad():
        theirs = ref.eval()(ids).logits[0]
    return (llm.core.score(ids[0].tolist()) - theirs).abs().max().item()


if __name__ == "__main__":
    import transformers

    diff = max_logit_diff(sys.argv[1])
    print(
        f"transformers {transformers.__version__}: max |logit diff| = {diff:.2e} ({'ok' if diff < 1e-3 else 'MISMATCH'})"
    )
