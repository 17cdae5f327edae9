"""Scheduler options (flags, PDFLASH_* environment variables, or a config file: pdflash.config)."""

from __future__ import annotations

import dataclasses

from pdflash.config import ConfigError, ServerOptions, option
from pdflash.tls import check_client_options


@dataclasses.dataclass
class SchedulerConfig(ServerOptions):
    port: int = option(50052, "port to bind (0 = pick a free one)")
    token_budget: int = option(256, "verify tokens in flight (sum of block lengths); a block larger than this still runs, alone")
    byte_budget: int = option(0, "projected expert bytes in flight; 0 = unlimited (only tokens limit admission)")
    lease_s: float = option(30.0, "a ticket's budget is reclaimed this many seconds after Admit unless released or renewed")
    max_wait_s: float = option(30.0, "longest an Admit waits for budget; then RESOURCE_EXHAUSTED with a retry delay")
    max_waiting: int = option(1024, "demands queued at once; beyond it Admit answers RESOURCE_EXHAUSTED")
    max_waiting_per_session: int = option(4, "demands one session may have queued at once")
    max_bypass: int = option(8, "times newer demands may be seated past a blocked one before admission waits for it (0 = strict order)")
    metrics_port: int = option(9102, "Prometheus /metrics HTTP port (0 = any free port, -1 = off)")
    ticket_secret: str = option("", "HMAC-SHA256 key for ticket signatures (the verifier's --ticket-secret must match); empty = tickets are not signed", secret=True)
    verifier: str = option("", "verifier address host:port: after admitting a demand, send the verifier a Prefetch hint with its projected expert union, so offloaded experts start streaming before the Verify arrives (best effort, never delays admission); empty = no hints (pdflash up sets it)")
    upstream_tls_ca: str = option("", "PEM CA that signed the verifier's certificate: send the hints over TLS")
    upstream_tls_cert: str = option("", "PEM client certificate for the verifier (when it requires mutual TLS)")
    upstream_tls_key: str = option("", "PEM private key of --upstream-tls-cert")

    def validate(self) -> None:
        self.validate_server()
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
        for name in ("max_waiting", "max_waiting_per_session"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.max_bypass < 0:
            raise ConfigError(f"--max-bypass {self.max_bypass}: must be >= 0 (0 = strict order)")
        if self.verifier and ":" not in self.verifier:
            raise ConfigError(f"--verifier {self.verifier!r}: expected host:port (or empty: no prefetch hints)")
        check_client_options(self.upstream_tls_ca, self.upstream_tls_cert, self.upstream_tls_key, "upstream_tls")
