"""`moeserve bench ...`: registers each benchmark's subcommand."""

from __future__ import annotations

import argparse

from moeserve.bench import latency, offline, serve


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `moeserve bench` and its subcommands."""
    bench = subparsers.add_parser("bench", help="benchmarks: serve (HTTP), offline and latency (in-process)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for module in _MODULES:
        module.add_parser(sub)


# Each benchmark module exposes add_parser(subparsers); imports stay light (heavy ones lazily inside).
_MODULES: list = [latency, offline, serve]
