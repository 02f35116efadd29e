"""`moeserve serve`: the OpenAI-compatible server (its heavy imports happen when it runs)."""

from __future__ import annotations

import argparse
import os
import sys

from moeserve.engine.generate_cli import add_engine_args, engine_config


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `moeserve serve`."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start-up)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    p.add_argument(
        "--api-key", default=os.environ.get("MOESERVE_API_KEY"), help="require `Authorization: Bearer KEY` on /v1 (default: $MOESERVE_API_KEY)"
    )
    p.add_argument("--max-request-bytes", type=int, default=16 << 20, help="larger bodies get 413")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    p.add_argument("--health-stall-timeout", type=float, default=60.0, help="/health is 503 after this long without engine progress")
    p.add_argument("--engine-start-timeout", type=float, default=1800.0)
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Build the configs and run the server until it is stopped."""
    from moeserve.server.config import ServerConfig

    try:
        from moeserve.server.api_server import run_server
    except ImportError as e:
        print(f"moeserve serve: error: {e.name or e} is missing: pip install 'moeserve[server]'", file=sys.stderr)
        return 1
    config = ServerConfig(
        engine=engine_config(args),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or (None if args.model else "moeserve-demo"),
        api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        health_stall_timeout=args.health_stall_timeout,
        engine_start_timeout=args.engine_start_timeout,
        access_log=args.access_log,
        log_level=args.log_level,
    )
    return run_server(config)
