"""Shared pieces of the in-process benchmarks: prompts, the engine, and result records."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
from pathlib import Path
from typing import Any


def random_prompts(num: int, length: int, vocab_size: int, seed: int, stream: str = "") -> list[list[int]]:
    """Token ids drawn uniformly from [1000, 100000) (as the peer figures were), within the vocab.

    A `stream` name gives prompts no seed of another stream reproduces (int seeds cannot promise
    that: Python seeds 2 and 2 + 2**32 alike).
    """
    rng = random.Random(f"{stream}:{seed}" if stream else seed)
    low, high = min(1000, vocab_size // 2), min(100_000, vocab_size)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(num)]


def git_commit() -> str:
    """$MOESERVE_COMMIT when set (copies whose .git is missing or stale), else git's answer, else 'unknown'."""
    env = os.environ.get("MOESERVE_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: str) -> str:
    """Human name of the device results were measured on."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def _command() -> str:
    """How this process was started, as a user would type it."""
    program = Path(sys.argv[0])
    if program.name in ("moeserve", "__main__.py"):
        return "moeserve " + " ".join(sys.argv[1:])
    return "python " + " ".join([str(program), *sys.argv[1:]])


def record(name: str, device: str, **fields: Any) -> dict:
    """A result object with the fields every benchmark file carries (out_tok_s and seconds are
    None for rows that time something other than a generation workload)."""
    return {
        "name": name,
        "device": device_name(device),
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "command": _command(),
        "out_tok_s": None,
        "seconds": None,
        **fields,
    }


def write_results(path: str | None, records: list[dict]) -> None:
    """Append records to a JSON list file (created when missing)."""
    if not path:
        return
    file = Path(path)
    existing = json.loads(file.read_text()) if file.is_file() else []
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(existing + records, indent=1) + "\n")


def add_workload_args(p: argparse.ArgumentParser, batch_name: str, batch_default: int) -> None:
    """Flags describing the synthetic workload."""
    p.add_argument(batch_name, type=int, default=batch_default)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--name", default=None, help="workload name recorded in the results")
    p.add_argument("--output-file", default=None, help="append results to this JSON list")
    p.add_argument("--prompt-seed", type=int, default=0)
