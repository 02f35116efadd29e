"""The `moeserve` command line: one subcommand per tool, each registered by its own package."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="moeserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # Registration imports stay light: each command imports its heavy modules when it runs.
    from moeserve.bench.cli import add_bench_parser
    from moeserve.engine.generate_cli import add_generate_parser
    from moeserve.eval.cli import add_eval_parser
    from moeserve.planner.cli import add_plan_parser
    from moeserve.server.cli import add_serve_parser

    add_generate_parser(sub)
    add_eval_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `moeserve` console script."""
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        # Bad models, flags or inputs are the user's to fix: say what, without a traceback.
        print(f"moeserve {args.command}: error: {e}", file=sys.stderr)
        code = 1
    sys.exit(code)
