"""Held-out quality of a checkpoint: loss, perplexity, top-1 accuracy, MTP accuracy, baselines.

The held-out documents (see corpus.py) are tokenized as in training, `<bos> doc <eos>` one after
another, and cut into consecutive windows of `context` tokens. In each window every position but
the last is scored on the next token through `EngineCore.score`, and the first MTP module on the
token after next. The MTP module runs on the loaded engine model with a ForwardBatch built the
way the model runner builds one, so it uses the engine's own paged attention (its KV layer is
the one after the main model's). Row i of the MTP pass reads the main model's final hidden
state at i and the true token i + 1, as in training and in speculative decoding.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from moeserve.core.batch import ScheduledRequest
from moeserve.core.request import Request
from moeserve.core.sampling_params import SamplingParams
from moeserve.engine.engine import EngineCore
from moeserve.engine.tokenizer import Tokenizer


def token_windows(
    tokenizer: Tokenizer, docs: Iterable[str], context: int, max_tokens: int
) -> list[list[int]]:
    """Consecutive windows of `context` tokens over `<bos> doc <eos> ...`, about max_tokens in all."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    stream: list[int] = []
    for doc in docs:
        stream += [t for t in (bos,) if t is not None]
        stream += tokenizer.encode(doc, add_special_tokens=False)
        stream += [t for t in (eos,) if t is not None]
        if len(stream) > max_tokens:
            break
    stream = stream[: max_tokens + 1]
    windows = [stream[i : i + context] for i in range(0, len(stream), context)]
    return [w for w in windows if len(w) >= 3]


@torch.inference_mode()
def mtp_logits(core: EngineCore, ids: list[int]) -> torch.Tensor:
    """Logits [T-2, vocab] (float32, CPU) of the first MTP module: row i predicts ids[i + 2]."""
    model = core.runner.model
    if not model.mtp:
        raise ValueError("this checkpoint has no MTP (NextN) layer to evaluate")
    req = Request("eval-mtp", list(ids), SamplingParams(max_tokens=1))
    if not core.kv.allocate(req, len(ids)):
        raise RuntimeError("not enough free KV pages for the MTP pass")
    try:
        fb = core.runner.prepare([ScheduledRequest(req, len(ids))])
        hidden = model(fb.input_ids, fb.positions, fb)
        # Row i pairs hidden[i] with token i + 1; the last row has no next token and gets a
        # placeholder, which causal attention keeps from reaching any earlier row.
        next_ids = torch.roll(fb.input_ids, -1)
        logits, _ = model.mtp[0](next_ids, fb.positions, hidden, fb)
        return logits[:-2].float().cpu()
    finally:
        core.kv.release(req)


@dataclass
class Tally:
    """Running sums over scored positions."""

    nll: float = 0.0
    tokens: int = 0
    correct: int = 0
    mtp_tokens: int = 0
    mtp_correct: int = 0
    mtp_agree: int = 0
    targets: Counter = field(default_factory=Counter)

    def add_window(self, ids: list[int], logits: torch.Tensor, mtp: torch.Tensor | None) -> None:
        """Score one window given its main logits [T, V] and MTP logits [T-2, V] (or None)."""
        target = torch.tensor(ids[1:])
        main = logits[:-1]
        self.nll += torch.nn.functional.cross_entropy(main, target, reduction="sum").item()
        predicted = main.argmax(-1)
        self.correct += int((predicted == target).sum())
        self.tokens += len(target)
        self.targets.update(ids[1:])
        if mtp is not None:
            mtp_pred = mtp.argmax(-1)
            self.mtp_correct += int((mtp_pred == target[1:]).sum())
            # What one MTP draft token needs to be accepted: agree with the main model's next pick.
            self.mtp_agree += int((mtp_pred == predicted[1:]).sum())
            self.mtp_tokens += len(mtp_pred)

    def metrics(self) -> dict:
        """The figures: model versus a unigram baseline fitted to these very targets (optimistic)."""
        loss = self.nll / max(self.tokens, 1)
        probs = [c / self.tokens for c in self.targets.values()] if self.tokens else []
        out = {
            "num_tokens": self.tokens,
            "loss": round(loss, 4),
            "perplexity": round(math.exp(loss), 3),
            "top1_accuracy": round(self.correct / max(self.tokens, 1), 4),
            "unigram_top1_accuracy": round(max(probs, default=0.0), 4),
            "unigram_loss": round(-sum(p * math.log(p) for p in probs), 4),
        }
        if self.mtp_tokens:
            out["mtp_num_tokens"] = self.mtp_tokens
            out["mtp_top1_accuracy"] = round(self.mtp_correct / self.mtp_tokens, 4)
            out["mtp_agrees_with_main_top1"] = round(self.mtp_agree / self.mtp_tokens, 4)
        return out


def evaluate(core: EngineCore, windows: list[list[int]], with_mtp: bool = True) -> dict:
    """Score every window with the main model (EngineCore.score) and, if present, the MTP module."""
    tally = Tally()
    has_mtp = with_mtp and len(core.runner.model.mtp) > 0
    for ids in windows:
        logits = core.score(ids)
        tally.add_window(ids, logits, mtp_logits(core, ids) if has_mtp else None)
    return tally.metrics()
