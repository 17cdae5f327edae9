"""Drafter (public front door) options: flags, PDFLASH_* environment variables or a config file."""

from __future__ import annotations

import dataclasses
import pathlib

from pdflash.config import ConfigError, ServerOptions, option
from pdflash.devices import check_device, check_dtype, resolve_device, resolve_dtype
from pdflash.tls import check_auth_token, check_client_options

KINDS = ("none", "ngram", "dflash", "hybrid")


def check_drafter_fits(drafter: str, model: str) -> None:
    """ConfigError (one line) when the DFlash drafter in `drafter` was not made for target `model` (empty =
    the embedded demo target). Reads the two config.json files only; skipped when the default target is
    the stand-in made on first use (it does not exist yet)."""
    from drafter_svc.compat import drafter_mismatch
    from pdflash.defaults import ASSETS, is_embedded_target

    target = model or (str(ASSETS / "target") if is_embedded_target("") else "")
    if not target:
        return
    why = drafter_mismatch(drafter, target)
    if why is not None:
        raise ConfigError(f"--drafter {drafter}: {why}")


@dataclasses.dataclass
class DrafterConfig(ServerOptions):
    model: str = option("", "target checkpoint directory (tokenizer, embedding, LM head); empty = the embedded demo model")
    drafter: str = option("", "DFlash drafter directory (z-lab layout); empty = the embedded demo drafter if shipped, else n-gram only")
    no_dflash: bool = option(False, "serve without a DFlash drafter even if one is shipped (n-gram / none only)")
    default_drafter: str = option("", "default drafter kind: none, ngram, dflash, hybrid (empty = hybrid with DFlash, else ngram)")
    host: str = option("127.0.0.1", "address to bind; use 0.0.0.0 to serve other machines")
    port: int = option(50051, "port to bind (0 = pick a free one)")
    scheduler: str = option("127.0.0.1:50052", "scheduler address host:port")
    verifier: str = option("127.0.0.1:50053", "verifier address host:port")
    block_size: int = option(32, "default verify block (anchor + drafts): the widest a round may verify; 1 = plain autoregressive")
    fixed_width: bool = option(False, "every round drafts block_size - 1 (default: each round's width adapts to what the session's rounds earn)")
    max_block_size: int = option(32, "largest block a request may ask for")
    default_max_tokens: int = option(256, "max_tokens when a request leaves it 0")
    max_tokens_limit: int = option(4096, "largest max_tokens a request may ask for")
    max_prompt_tokens: int = option(8192, "longest prompt accepted (tokens)")
    max_concurrent: int = option(64, "requests generating at once; beyond it Generate answers RESOURCE_EXHAUSTED")
    admit_ahead: bool = option(True, "while a round verifies, reserve the next round's admission (seated only from budget nobody waits for)")
    verify_stream: bool = option(True, "send a request's verify rounds over one Verifier.VerifyStream call instead of one Verify call each")
    ngram_min_match: int = option(3, "hybrid: use the n-gram proposal when at least this many tokens match")
    device: str = option("auto", "torch device of the DFlash drafter (dflash, hybrid): auto (cuda when available), cpu, cuda, cuda:N; n-gram drafting runs on the host either way")
    dtype: str = option("auto", "dtype of the DFlash drafter and the target's embedding and LM head it borrows: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16")
    drafter_cuda_graphs: bool = option(True, "on CUDA, replay the DFlash drafter's forwards from CUDA graphs captured at load (a session whose context outgrows them goes on eagerly); off = eager forwards, warmed up by one eager round at load")
    torch_threads: int = option(1, "CPU threads for the drafter's torch work (0 = torch's default, all cores); on a CPU host keep the cores for the verifier")
    upstream_wait_s: float = option(120.0, "at start, how long to wait for the scheduler and verifier to be ready")
    metrics_port: int = option(9101, "Prometheus /metrics HTTP port (0 = any free port, -1 = off)")
    grace_s: float = option(5.0, "shutdown grace period for in-flight streams")
    auth_token: str = option("", "when set, Generate/Abort/ModelInfo need metadata 'authorization: Bearer <token>' (health and reflection stay open)", secret=True)
    tls_cert: str = option("", "PEM certificate chain: serve the public API over TLS (with --tls-key)")
    upstream_tls_ca: str = option("", "PEM CA that signed the scheduler's and verifier's certificates: call them over TLS")
    upstream_tls_cert: str = option("", "PEM client certificate for the scheduler and verifier (when they require mutual TLS)")
    upstream_tls_key: str = option("", "PEM private key of --upstream-tls-cert")

    def torch_device(self) -> str:
        """The device the DFlash drafter runs on (auto resolved)."""
        return resolve_device(self.device)

    def torch_dtype(self) -> str:
        """The DFlash drafter's dtype name (auto resolved for its device)."""
        return resolve_dtype(self.dtype, self.torch_device())

    def validate(self) -> None:
        self.validate_server()
        check_device(self.device)
        check_dtype(self.dtype)
        for name in ("model", "drafter"):
            v = getattr(self, name)
            if v and not (pathlib.Path(v) / "config.json").exists():
                raise ConfigError(f"--{name} {v!r}: no config.json there; point it at a checkpoint directory")
        if self.drafter:
            check_drafter_fits(self.drafter, self.model)
        if self.default_drafter and self.default_drafter not in KINDS:
            raise ConfigError(f"--default-drafter {self.default_drafter!r}: choose one of {', '.join(KINDS)}")
        if not 1 <= self.block_size <= self.max_block_size:
            raise ConfigError(f"--block-size {self.block_size}: must be in [1, --max-block-size={self.max_block_size}]")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ConfigError("--default-max-tokens must be in [1, --max-tokens-limit]")
        if self.torch_threads < 0:
            raise ConfigError(f"--torch-threads {self.torch_threads}: must be >= 0 (0 = torch's default)")
        if self.max_concurrent < 1:
            raise ConfigError("--max-concurrent must be >= 1")
        for name in ("scheduler", "verifier"):
            if ":" not in getattr(self, name):
                raise ConfigError(f"--{name} {getattr(self, name)!r}: expected host:port")
        check_client_options(self.upstream_tls_ca, self.upstream_tls_cert, self.upstream_tls_key, "upstream_tls")
        check_auth_token(self.auth_token)
