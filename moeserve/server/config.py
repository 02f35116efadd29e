"""Server knobs: where to listen, limits on requests, and how shutdown and health behave."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.config.engine_config import EngineConfig

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerConfig:
    """Everything `moeserve serve` needs besides the engine's own config."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    # Larger bodies get 413 before they are parsed; 16 MiB holds a 1M-token id list.
    max_request_bytes: int = 16 << 20
    # SIGTERM: running requests get this long to finish before they are aborted.
    shutdown_timeout: float = 30.0
    # /health turns 503 when requests are in flight and the engine has been silent this long.
    health_stall_timeout: float = 60.0
    # Loading a large checkpoint (and, later, capturing CUDA graphs) can take minutes.
    engine_start_timeout: float = 1800.0
    # The idle engine sends a heartbeat this often (stats for /metrics and /health).
    heartbeat_interval: float = 1.0
    access_log: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port <= 65535, f"port must be in 0..65535, got {self.port}"),
            (self.max_request_bytes >= 1024, "max_request_bytes must be >= 1024"),
            (self.shutdown_timeout >= 0, "shutdown_timeout must be >= 0"),
            (self.health_stall_timeout > 0, "health_stall_timeout must be > 0"),
            (self.engine_start_timeout > 0, "engine_start_timeout must be > 0"),
            (self.heartbeat_interval > 0, "heartbeat_interval must be > 0"),
            # An idle engine is only heard from once per heartbeat: a shorter timeout would flap.
            (
                self.health_stall_timeout >= 2 * self.heartbeat_interval,
                f"health_stall_timeout must be >= 2 x heartbeat_interval ({2 * self.heartbeat_interval:g}s)",
            ),
            (self.log_level in LOG_LEVELS, f"log_level must be one of {LOG_LEVELS}"),
            (self.api_key is None or self.api_key != "", "api_key must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def model_name(self) -> str:
        """The name clients put in `model` (vLLM's default: the path as given)."""
        return self.served_model_name or self.engine.model
