"""`moeserve eval`: loss, perplexity and top-1 accuracy (main model and MTP) on held-out Python."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import shlex
import subprocess
import sys
import time
from pathlib import Path


def add_eval_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `moeserve eval`."""
    from moeserve.engine.generate_cli import add_engine_args

    p = subparsers.add_parser(
        "eval", help="held-out loss, perplexity and top-1 accuracy (main model and MTP)"
    )
    add_engine_args(p)
    p.add_argument("--max-eval-tokens", type=int, default=131072, help="held-out tokens to score")
    p.add_argument("--context", type=int, default=None, help="window length (default: max_model_len - 1)")
    p.add_argument("--corpus-roots", nargs="*", default=None, help="'stdlib', 'site-packages' or folders")
    p.add_argument("--no-mtp", action="store_true", help="skip the MTP module")
    p.add_argument("--output-file", type=Path, default=None, help="also write the JSON result here")
    p.add_argument("--verbose", action="store_true", help="log engine start-up")
    p.set_defaults(func=run_eval)


def _commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def run_eval(args: argparse.Namespace) -> int:
    """Load the model, score the held-out windows, print (and optionally write) the JSON result."""
    from moeserve.engine.generate_cli import engine_kwargs, model_path
    from moeserve.engine.llm import LLM
    from moeserve.eval.corpus import HELD_OUT_PER_MILLE, iter_documents, resolve_roots
    from moeserve.eval.evaluate import evaluate, token_windows

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    start = time.monotonic()
    model = model_path(args)
    llm = LLM(model, **engine_kwargs(args))
    if llm.tokenizer is None:
        raise ValueError(f"{model} has no tokenizer.json: eval needs one to tokenize the corpus")
    # score() keeps one position free for a generated token, so a window is one shorter.
    context = min(args.context or llm.core.max_model_len, llm.core.max_model_len - 1)
    roots = resolve_roots(args.corpus_roots)
    # Held-out text is ~3-4 bytes a token; read generously and let the token cap cut.
    docs = iter_documents("eval", 8 * args.max_eval_tokens + 65536, roots)
    windows = token_windows(llm.tokenizer, docs, context, args.max_eval_tokens)
    if not windows:
        raise ValueError("the held-out slice of this corpus is empty")
    result = {
        "model": str(model),
        **evaluate(llm.core, windows, with_mtp=not args.no_mtp),
        "num_windows": len(windows),
        "context": context,
        "corpus": {
            "roots": [str(r) for r in roots],
            "held_out": f"{HELD_OUT_PER_MILLE / 10:g}% of files by key hash",
        },
        "device": _device_name(llm.core.device),
        "dtype": str(llm.core.dtype).removeprefix("torch."),
        "python": sys.version.split()[0],
        "elapsed_s": round(time.monotonic() - start, 1),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _commit(),
        "command": "moeserve " + shlex.join(sys.argv[1:]),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_file:
        args.output_file.parent.mkdir(parents=True, exist_ok=True)
        args.output_file.write_text(text + "\n")
    return 0
