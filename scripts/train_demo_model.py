"""Train moeserve's demo model: a small DeepSeek-V3 (MLA, noaux_tc MoE, one MTP module) on Python.

The corpus is the running interpreter's stdlib and site-packages `.py` files (see
moeserve/eval/corpus.py for the dedup and the fixed held-out slice). The run is bounded by wall
time: the cosine schedule follows elapsed time (or steps, whichever ends first), and the
checkpoint is rewritten every --save-every-s seconds, so a cut-off run leaves a usable model.

    PYTHONUNBUFFERED=1 python scripts/train_demo_model.py --out /tmp/demo   # ~8 min on one H200
    python scripts/train_demo_model.py --preset tiny --device cpu --max-steps 5 --out /tmp/tiny \\
        --corpus-roots stdlib --max-train-bytes 300000 --tokenizer-bytes 300000
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from train_demo.config import PRESETS, DemoConfig  # noqa: E402
from train_demo.data import (  # noqa: E402
    BatchSampler,
    encode_documents,
    eval_windows,
    save_tokenizer,
    train_tokenizer,
)
from train_demo.export import save_checkpoint  # noqa: E402
from train_demo.model import DemoModel, update_routing_bias  # noqa: E402

from moeserve.eval.corpus import iter_documents, resolve_roots  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "checkpoints" / "demo_model")
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--corpus-roots", nargs="*", default=None, help="'stdlib', 'site-packages' or folders")
    p.add_argument("--max-train-bytes", type=float, default=800e6)
    p.add_argument("--tokenizer-bytes", type=float, default=24e6, help="text the BPE merges are learned on")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--eval-bytes", type=float, default=2e6, help="held-out text watched during training")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows scored at each checkpoint")
    p.add_argument("--corpus-time-s", type=float, default=75.0, help="stop encoding more text after this")
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's max_position_embeddings")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="DeepSeek-V3's lambda for the MTP loss")
    p.add_argument("--bias-update-rate", type=float, default=1e-3, help="DeepSeek-V3's gamma")
    p.add_argument("--time-budget-s", type=float, default=450.0, help="whole run, corpus to final save")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--save-every-s", type=float, default=60.0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA")
    p.add_argument("--compile-timeout-s", type=float, default=120.0, help="give up compiling, train eagerly")
    p.add_argument("--summary-file", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


START = time.monotonic()


def log(message: str) -> None:
    """One progress line, with the wall time since start."""
    print(f"[{time.monotonic() - START:7.1f}s] {message}", flush=True)


def build_data(
    args: argparse.Namespace, cfg: DemoConfig, device: torch.device
) -> tuple[Tokenizer, BatchSampler, torch.Tensor, dict]:
    """Tokenizer, training sampler and held-out windows, all from the corpus."""
    roots = resolve_roots(args.corpus_roots)
    log(f"corpus roots: {[str(r) for r in roots]}")
    docs = iter_documents("train", int(args.max_train_bytes), roots)
    head, head_bytes = [], 0
    for doc in docs:
        head.append(doc)
        head_bytes += len(doc.encode())
        if head_bytes >= args.tokenizer_bytes:
            break
    tok = train_tokenizer(head, args.vocab_size or cfg.vocab_size)
    log(f"tokenizer: {tok.get_vocab_size()} tokens learned on {head_bytes / 1e6:.1f} MB ({len(head)} files)")
    save_tokenizer(tok, args.out)

    def all_docs():
        yield from head
        yield from docs

    deadline = START + args.corpus_time_s
    stream, n_bytes = encode_documents(tok, all_docs(), deadline=deadline)
    held_out, _ = encode_documents(tok, iter_documents("eval", int(args.eval_bytes), roots))
    log(
        f"train stream: {len(stream) / 1e6:.2f}M tokens from {n_bytes / 1e6:.1f} MB ({n_bytes / max(len(stream), 1):.2f} B/token)"
    )
    log(f"held-out stream: {len(held_out) / 1e6:.3f}M tokens")
    seq_len = args.seq_len or cfg.max_position_embeddings
    sampler = BatchSampler(stream, seq_len, args.batch_size, device, args.seed)
    windows = eval_windows(held_out, seq_len, args.eval_windows, device)
    return tok, sampler, windows, {"train_tokens": int(len(stream)), "train_bytes": int(n_bytes)}


def make_optimizer(model: DemoModel, args: argparse.Namespace, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; matrices decay, norms do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lr_at(args: argparse.Namespace, step: int, progress: float) -> float:
    """Linear warm-up, then cosine from lr to lr * min_lr_ratio over the run's progress (0..1)."""
    warm = min(1.0, (step + 1) / args.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * warm * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine)


@torch.no_grad()
def held_out_loss(
    model: DemoModel, windows: torch.Tensor, batch: int, autocast: Callable[[], Any]
) -> tuple[float, float]:
    """Mean next-token and MTP loss over the held-out windows."""
    model.eval()
    totals = [0.0, 0.0]
    for i in range(0, len(windows), batch):
        with autocast():
            loss, mtp_loss, _ = model(windows[i : i + batch])
        n = len(windows[i : i + batch])
        totals[0] += loss.item() * n
        totals[1] += mtp_loss.item() * n
    model.train()
    return totals[0] / max(len(windows), 1), totals[1] / max(len(windows), 1)


def _compile_timeout(signum: int, frame: object) -> None:
    raise TimeoutError("compiling took longer than --compile-timeout-s")


class Trainer:
    """The optimisation loop: steps, balancing-bias updates, logging, periodic checkpoints."""

    def __init__(self, model: DemoModel, args: argparse.Namespace, device: torch.device) -> None:
        self.model, self.args, self.device = model, args, device
        self.opt = make_optimizer(model, args, device)
        use_bf16 = device.type == "cuda"
        self.autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)
        want_compile = args.compile if args.compile is not None else device.type == "cuda"
        self.step_model = torch.compile(model) if want_compile else model
        self.step = 0
        self.tokens = 0

    def _loss_backward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The first compiled step compiles forward and backward; a compiler that takes too long
        # is interrupted (SIGALRM) and the run goes on eagerly rather than losing its budget.
        guard = self.step == 0 and self.step_model is not self.model and hasattr(signal, "SIGALRM")
        if guard:
            signal.signal(signal.SIGALRM, _compile_timeout)
            signal.setitimer(signal.ITIMER_REAL, self.args.compile_timeout_s)
        try:
            with self.autocast():
                loss, mtp_loss, loads = self.step_model(batch)
            (loss + self.args.mtp_weight * mtp_loss).backward()
        finally:
            if guard:
                signal.setitimer(signal.ITIMER_REAL, 0)
        return loss, mtp_loss, loads

    def train_step(self, batch: torch.Tensor, lr: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimiser step; returns the (detached) losses and the expert loads."""
        for group in self.opt.param_groups:
            group["lr"] = lr
        try:
            loss, mtp_loss, loads = self._loss_backward(batch)
        except Exception as e:  # a compiler problem must not cost the run: fall back to eager
            if self.step_model is self.model:
                raise
            log(f"torch.compile failed ({type(e).__name__}: {str(e)[:300]}); continuing eagerly")
            self.opt.zero_grad(set_to_none=True)
            self.step_model = self.model
            loss, mtp_loss, loads = self._loss_backward(batch)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        update_routing_bias(self.model, loads.detach(), self.args.bias_update_rate)
        self.step += 1
        self.tokens += batch.shape[0] * (batch.shape[1] - 1)
        return loss.detach(), mtp_loss.detach(), loads.detach()


def run(args: argparse.Namespace) -> dict:
    """The whole pipeline; returns the run summary."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = PRESETS[args.preset]
    tok, sampler, windows, corpus_info = build_data(args, cfg, device)
    cfg = cfg.with_vocab(max(args.vocab_size or cfg.vocab_size, tok.get_vocab_size()))
    model = DemoModel(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in model.mtp.parameters())
    log(
        f"model: {n_params / 1e6:.2f}M parameters ({n_mtp / 1e6:.2f}M in the MTP module), {json.dumps(asdict(cfg))}"
    )
    trainer = Trainer(model, args, device)
    summary = {"preset": args.preset, "parameters": n_params, "mtp_parameters": n_mtp, "config": asdict(cfg)}
    summary.update(corpus_info, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    summary.update(train_loop(trainer, sampler, windows))
    summary["weights_bytes"] = save_checkpoint(model, args.out)
    summary["held_out_loss"], summary["held_out_mtp_loss"] = held_out_loss(
        model, windows, args.batch_size, trainer.autocast
    )
    summary["total_seconds"] = round(time.monotonic() - START, 1)
    log(
        f"saved {args.out} ({summary['weights_bytes'] / 2**20:.2f} MiB weights); summary {json.dumps(summary)}"
    )
    if args.summary_file:
        args.summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def train_loop(trainer: Trainer, sampler: BatchSampler, windows: torch.Tensor) -> dict:
    """Train until the time budget or max_steps; log, evaluate and checkpoint along the way."""
    args = trainer.args
    train_start = time.monotonic()
    # Leave time at the end for the final save and held-out pass.
    deadline = START + args.time_budget_s - 10.0
    last_save = last_log = train_start
    log_tokens, loss_sum, mtp_sum, n_logged = 0, 0.0, 0.0, 0
    while True:
        now = time.monotonic()
        by_time = (now - train_start) / max(deadline - train_start, 1e-6)
        by_steps = trainer.step / args.max_steps if args.max_steps else 0.0
        if by_time >= 1.0 or by_steps >= 1.0:
            break
        loss, mtp_loss, loads = trainer.train_step(
            sampler.next(), lr_at(args, trainer.step, max(by_time, by_steps))
        )
        loss_sum, mtp_sum, n_logged = loss_sum + loss, mtp_sum + mtp_loss, n_logged + 1
        if trainer.step % args.log_every == 0 or trainer.step == 1:
            now = time.monotonic()
            rate = (trainer.tokens - log_tokens) / max(now - last_log, 1e-6)
            imbalance = (loads.max(dim=1).values / loads.mean(dim=1)).max().item()
            log(
                f"step {trainer.step} | {trainer.tokens / 1e6:.1f}M tok | {rate / 1e3:.0f}k tok/s | "
                f"loss {(loss_sum / n_logged).item():.3f} | mtp {(mtp_sum / n_logged).item():.3f} | "
                f"lr {trainer.opt.param_groups[0]['lr']:.2e} | max load/mean {imbalance:.2f}"
            )
            last_log, log_tokens, loss_sum, mtp_sum, n_logged = now, trainer.tokens, 0.0, 0.0, 0
        if time.monotonic() - last_save >= args.save_every_s:
            size = save_checkpoint(trainer.model, args.out)
            held, held_mtp = held_out_loss(trainer.model, windows, args.batch_size, trainer.autocast)
            log(f"checkpoint ({size / 2**20:.2f} MiB) | held-out loss {held:.3f} | mtp {held_mtp:.3f}")
            last_save = time.monotonic()
    return {
        "steps": trainer.step,
        "tokens": trainer.tokens,
        "train_seconds": round(time.monotonic() - train_start, 1),
    }


if __name__ == "__main__":
    run(parse_args())
