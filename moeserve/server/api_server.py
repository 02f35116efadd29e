"""`moeserve serve`: the front end process (uvicorn + FastAPI) and the engine process behind it.

Start-up: check the checkpoint, bind the port, spawn the engine (it loads the model while HTTP
already answers /health with 503), print where it listens and, once the engine is ready, the KV
capacity. SIGTERM/SIGINT drain: new requests get 503, running ones get --shutdown-timeout to
finish, then the engine and the front end exit (0). A second signal stops at once. If the engine
dies, requests in flight get 500, new ones 503, and the server exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path

import uvicorn

from moeserve.config.model_config import ModelConfig
from moeserve.engine.tokenizer import Tokenizer
from moeserve.server.app import ServerState, build_app
from moeserve.server.chat import ChatTemplate
from moeserve.server.config import ServerConfig
from moeserve.server.engine_client import EngineClient
from moeserve.server.messages import Ready
from moeserve.server.metrics import ServerMetrics

logger = logging.getLogger("moeserve.server")

# After the drain, how long uvicorn waits for responses still being written.
GRACEFUL_CLOSE_S = 5.0


def _say(message: str, err: bool = False) -> None:
    print(f"moeserve: {message}", file=sys.stderr if err else sys.stdout, flush=True)


def _bind(host: str, port: int) -> socket.socket:
    """Listen before the engine loads, so a port in use fails fast and --port 0 works."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _load_tokenizer(path: Path) -> tuple[Tokenizer | None, ChatTemplate | None]:
    tokenizer = Tokenizer.load(path) if path.is_dir() else None
    if tokenizer is None:
        logger.warning("no tokenizer.json in %s: only token-id prompts will work", path)
        return None, None
    try:
        template = ChatTemplate.from_tokenizer_config(tokenizer.config)
    except Exception as e:  # a template jinja2 cannot compile only disables chat
        logger.warning("the chat template does not compile (%s): /v1/chat/completions is off", e)
        template = None
    return tokenizer, template


class _Server(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting our drain instead of closing the listener at once."""

    def __init__(self, config: uvicorn.Config, on_first_signal) -> None:
        super().__init__(config)
        self._on_first_signal = on_first_signal
        self._signalled = False

    def handle_exit(self, sig: int, frame: object) -> None:
        """First signal: drain; second: stop now."""
        # Runs in a signal handler: only hand the work to the event loop. Not recording the
        # signal keeps uvicorn from re-raising it after serve() returns (our exit code stands).
        if self._signalled:
            self.should_exit = self.force_exit = True
            return
        self._signalled = True
        self._on_first_signal()


async def _serve(config: ServerConfig, sock: socket.socket, tokenizer, template) -> int:
    metrics = ServerMetrics(config.model_name)
    client = EngineClient(config, tokenizer, metrics)
    state = ServerState(config, client, tokenizer, template, metrics)
    uv_config = uvicorn.Config(
        build_app(state),
        log_level=config.log_level,
        access_log=config.access_log,
        lifespan="off",
        timeout_graceful_shutdown=int(GRACEFUL_CLOSE_S),
    )
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    async def drain_and_exit() -> None:
        running = len(client.children)
        _say(f"shutting down: {running} running request(s) get up to {config.shutdown_timeout:g}s to finish")
        aborted = await client.drain(config.shutdown_timeout)
        if aborted:
            _say(f"aborted {aborted} request(s) still running after --shutdown-timeout")
        await client.shutdown()
        server.should_exit = True

    def on_signal() -> None:
        loop.call_soon_threadsafe(lambda: tasks.add(loop.create_task(drain_and_exit())))

    def on_ready(info: Ready) -> None:
        _say(
            f"engine ready (pid {info.pid}): {info.model_type} {info.dtype} on {info.device}; KV cache "
            f"{info.kv_capacity_tokens} tokens ({info.num_kv_pages} pages of {info.page_size}); "
            f"max_model_len {info.max_model_len}"
        )

    def on_dead(message: str) -> None:
        _say(f"error: {message}; shutting down", err=True)
        server.should_exit = True

    server = _Server(uv_config, on_signal)
    client.start(on_ready, on_dead)
    host, port = sock.getsockname()[:2]
    _say(f"serving {config.model_name!r} on http://{host}:{port} (engine process pid {client.proc.pid}, loading)")
    try:
        await server.serve(sockets=[sock])
    finally:
        await client.shutdown()
    return 1 if client.state == "dead" else 0


def run_server(config: ServerConfig) -> int:
    """Run the server until it is stopped; return the process exit code."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = Path(config.engine.model)
    ModelConfig.from_path(path)  # a bad model path is refused here, before anything starts
    tokenizer, template = _load_tokenizer(path)
    sock = _bind(config.host, config.port)
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(config, sock, tokenizer, template))
