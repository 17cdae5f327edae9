"""Scheduler options (flags, PDFLASH_* environment variables, or a config file: pdflash.config)."""

from __future__ import annotations

import dataclasses

from pdflash.config import ConfigError, option
from pdflash.tls import check_server_options

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclasses.dataclass
class SchedulerConfig:
    host: str = option("127.0.0.1", "address to bind (internal service: loopback by default)")
    port: int = option(50052, "port to bind (0 = pick a free one)")
    token_budget: int = option(256, "verify tokens in flight (sum of block lengths); a block larger than this still runs, alone")
    byte_budget: int = option(0, "projected expert bytes in flight; 0 = unlimited (only tokens limit admission)")
    lease_s: float = option(30.0, "a ticket's budget is reclaimed this many seconds after Admit unless released or renewed")
    max_wait_s: float = option(30.0, "longest an Admit waits for budget; then RESOURCE_EXHAUSTED with a retry delay")
    max_waiting: int = option(1024, "demands queued at once; beyond it Admit answers RESOURCE_EXHAUSTED")
    max_waiting_per_session: int = option(4, "demands one session may have queued at once")
    max_bypass: int = option(8, "times newer demands may be seated past a blocked one before admission waits for it (0 = strict order)")
    metrics_port: int = option(9102, "Prometheus /metrics HTTP port (0 = any free port, -1 = off)")
    grace_s: float = option(5.0, "shutdown grace period for in-flight RPCs")
    log_level: str = option("info", "debug, info, warning, error")
    ticket_secret: str = option("", "HMAC-SHA256 key for ticket signatures (the verifier's --ticket-secret must match); empty = tickets are not signed", secret=True)
    tls_cert: str = option("", "PEM certificate chain: serve TLS (with --tls-key)")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_ca: str = option("", "PEM CA bundle: require client certificates signed by it (mutual TLS)")

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: must be in [0, 65535]")
        if self.token_budget < 1:
            raise ConfigError(
                f"--token-budget {self.token_budget}: must be >= 1 (1 runs one verify at a time; "
                "a block larger than the budget is still admitted when nothing else is in flight)"
            )
        if self.byte_budget < 0:
            raise ConfigError(f"--byte-budget {self.byte_budget}: must be >= 0 (0 = unlimited)")
        for name in ("lease_s", "max_wait_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be > 0 seconds")
        if self.grace_s < 0:
            raise ConfigError(f"--grace-s {self.grace_s}: must be >= 0 seconds")
        for name in ("max_waiting", "max_waiting_per_session"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.max_bypass < 0:
            raise ConfigError(f"--max-bypass {self.max_bypass}: must be >= 0 (0 = strict order)")
        check_server_options(self.tls_cert, self.tls_key, self.tls_ca)
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level!r}: choose one of {', '.join(LOG_LEVELS)}")
