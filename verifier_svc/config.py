"""Verifier options (flags, PDFLASH_* environment variables, or a config file: pdflash.config)."""

from __future__ import annotations

import dataclasses
import pathlib

from pdflash.config import ConfigError, option
from pdflash.tls import check_server_options


@dataclasses.dataclass
class VerifierConfig:
    model: str = option("", "target checkpoint directory (config.json + *.safetensors); empty = the embedded demo model")
    host: str = option("127.0.0.1", "address to bind (internal service: loopback by default)")
    port: int = option(50053, "port to bind (0 = pick a free one)")
    device: str = option("auto", "torch device: auto, cpu, cuda, cuda:N")
    dtype: str = option("auto", "auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    max_sessions: int = option(64, "sessions held at once; beyond it Prefill answers RESOURCE_EXHAUSTED")
    session_ttl_s: float = option(120.0, "an idle session is ended after this many seconds")
    max_block_size: int = option(32, "largest verify block (anchor + drafts)")
    max_tokens_limit: int = option(4096, "largest max_tokens a request may ask for")
    max_pending: int = option(128, "Prefill/Verify calls waiting for the device at once; beyond it RESOURCE_EXHAUSTED with a retry delay")
    metrics_port: int = option(9103, "Prometheus /metrics HTTP port (0 = any free port, -1 = off)")
    grace_s: float = option(5.0, "shutdown grace period for in-flight RPCs")
    log_level: str = option("info", "debug, info, warning, error")
    ticket_secret: str = option("", "HMAC-SHA256 key shared with the scheduler: when set, Verify needs a valid, unexpired admission ticket", secret=True)
    tls_cert: str = option("", "PEM certificate chain: serve TLS (with --tls-key)")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_ca: str = option("", "PEM CA bundle: require client certificates signed by it (mutual TLS)")

    def validate(self) -> None:
        if self.model and not (pathlib.Path(self.model) / "config.json").exists():
            raise ConfigError(f"--model {self.model!r}: no config.json there; point it at a checkpoint directory")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: must be in [0, 65535]")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype {self.dtype!r}: choose auto, float32, bfloat16 or float16")
        for name in ("max_sessions", "max_block_size", "max_tokens_limit", "max_pending"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.session_ttl_s <= 0:
            raise ConfigError("--session-ttl-s must be > 0")
        check_server_options(self.tls_cert, self.tls_key, self.tls_ca)
