"""The stub's options: its script (how it answers a Generate) and the rest (address, TLS, token, the model
and limits it claims, record and replay). Flags of `pdflash stub`, PDFLASH_* variables, keys of --config,
and keyword arguments of `StubServer(...)`, all with the same names (pdflash.config).

The limits are the drafter's own options (same names, defaults and help: read from DrafterConfig), and
the model defaults mirror the embedded demo model that `pdflash up` serves (vocabulary 4096, context 2048,
all four drafter kinds), so a request the stub accepts by default is one `pdflash up` accepts.
"""

from __future__ import annotations

import dataclasses
import pathlib

import grpc

from drafter_svc.config import KINDS, DrafterConfig
from pdflash.config import LOG_LEVELS, ConfigError, option
from pdflash.tls import check_auth_token, check_client_options, check_server_options

# Per-request script overrides travel as metadata `pdflash-stub-<option>` (e.g. pdflash-stub-fault: UNAVAILABLE).
METADATA_PREFIX = "pdflash-stub-"


def _as_drafter(name: str):
    """The drafter's option of that name, declared once (DrafterConfig)."""
    f = DrafterConfig.__dataclass_fields__[name]
    return option(f.default, f.metadata["help"])


@dataclasses.dataclass
class Script:
    """How the stub answers a Generate. Every field can also be set for one request, as metadata
    `pdflash-stub-<option-with-dashes>` (e.g. `pdflash-stub-fault-after: 2`)."""

    text: str = option("", "the completion to stream, tokenized by --tokenizer (empty = echo the prompt); it repeats with ignore_eos")
    chunk_tokens: int = option(4, "tokens per chunk after the first (the first token streams alone, as the drafter's does); at most the request's block")
    delay_ms: float = option(0.0, "pause before each chunk after the first, in milliseconds")
    fault: str = option("", "end the stream with this status instead of `final` (a grpc.StatusCode name: UNAVAILABLE, RESOURCE_EXHAUSTED, INVALID_ARGUMENT, ...)")
    fault_after: int = option(0, "chunks streamed before the fault (0 = at once, before any)")
    fault_message: str = option("", "the fault's message (default: 'stub fault: <CODE>')")
    fault_field: str = option("", "INVALID_ARGUMENT: the field its BadRequest field violation names (default '(stub)')")
    retry_after_s: float = option(1.0, "RESOURCE_EXHAUSTED: the RetryInfo delay it carries")
    stall_after: int = option(-1, "after this many chunks send nothing and never finish: a client deadline, a cancel or Abort ends the stream (-1 = never)")

    def validate_script(self) -> None:
        if self.fault:
            code = getattr(grpc.StatusCode, self.fault.upper(), None)
            if not isinstance(code, grpc.StatusCode) or code == grpc.StatusCode.OK:
                names = ", ".join(c.name for c in grpc.StatusCode if c != grpc.StatusCode.OK)
                raise ConfigError(f"--fault {self.fault!r}: a status code name other than OK: {names}")
        if self.chunk_tokens < 1:
            raise ConfigError(f"--chunk-tokens {self.chunk_tokens}: must be >= 1")
        if self.delay_ms < 0:
            raise ConfigError(f"--delay-ms {self.delay_ms}: must be >= 0")
        if self.fault_after < 0:
            raise ConfigError(f"--fault-after {self.fault_after}: must be >= 0")
        if self.stall_after < -1:
            raise ConfigError(f"--stall-after {self.stall_after}: must be >= 0, or -1 (never)")
        if self.retry_after_s < 0:
            raise ConfigError(f"--retry-after-s {self.retry_after_s}: must be >= 0")

    def validate(self) -> None:
        self.validate_script()


@dataclasses.dataclass
class StubConfig(Script):
    """Everything `pdflash stub` takes: the script above, then the server, the model it claims, its limits,
    and record / replay."""

    host: str = option("127.0.0.1", "address to bind; 0.0.0.0 serves other machines (a container)")
    port: int = option(50051, "port to bind (0 = pick a free one; the address is printed on stdout)")
    grace_s: float = option(1.0, "shutdown grace period for open streams")
    log_level: str = option("info", "debug, info, warning, error")
    tls_cert: str = option("", "PEM certificate chain: serve TLS (with --tls-key), as the drafter does")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_ca: str = option("", "PEM CA bundle: require client certificates signed by it (mutual TLS)")
    auth_token: str = _as_drafter("auth_token")
    model: str = option("pdflash-stub", "the model name ModelInfo reports")
    architecture: str = option("stub", "the architecture ModelInfo reports")
    tokenizer: str = option("", "tokenizer.json (or a checkpoint directory holding one) to tokenize prompts and --text "
                                "as that model does; needs the `tokenizers` package (empty = one token per UTF-8 byte)")
    vocab_size: int = option(0, "token ids accepted in prompt_tokens and stop_token_ids: [0, vocab_size) (0 = the tokenizer's; "
                                "4096, the demo model's, with the byte tokenizer)")
    max_context: int = option(2048, "the model's context: a prompt must be shorter; generation stops there (finish CONTEXT)")
    drafters: str = option(",".join(KINDS), "drafter kinds served, comma-separated (none, ngram, dflash, hybrid)")
    default_drafter: str = _as_drafter("default_drafter")
    block_size: int = _as_drafter("block_size")
    max_block_size: int = _as_drafter("max_block_size")
    default_max_tokens: int = _as_drafter("default_max_tokens")
    max_tokens_limit: int = _as_drafter("max_tokens_limit")
    max_prompt_tokens: int = _as_drafter("max_prompt_tokens")
    max_concurrent: int = _as_drafter("max_concurrent")
    record: str = option("", "proxy every call to --upstream and append each Generate and its answer to this transcript (JSON lines)")
    replay: str = option("", "answer Generate from this transcript (made with --record); an unknown request gets NOT_FOUND")
    upstream: str = option("", "--record: the real drafter, host:port")
    upstream_wait_s: float = option(30.0, "--record: how long to wait at start for the upstream to answer ModelInfo")
    upstream_tls_ca: str = option("", "--record: PEM CA that signed the upstream's certificate: call it over TLS")
    upstream_tls_cert: str = option("", "--record: PEM client certificate for an upstream that requires mutual TLS")
    upstream_tls_key: str = option("", "--record: PEM private key of --upstream-tls-cert")

    def kinds(self) -> list[str]:
        return [k.strip().lower() for k in self.drafters.split(",") if k.strip()]

    def validate(self) -> None:
        self.validate_script()
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: must be in [0, 65535]")
        if self.grace_s < 0:
            raise ConfigError(f"--grace-s {self.grace_s}: must be >= 0 seconds")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level!r}: choose one of {', '.join(LOG_LEVELS)}")
        check_server_options(self.tls_cert, self.tls_key, self.tls_ca)
        check_auth_token(self.auth_token)
        kinds = self.kinds()
        unknown = [k for k in kinds if k not in KINDS]
        if not kinds or unknown:
            raise ConfigError(f"--drafters {self.drafters!r}: a comma-separated list of {', '.join(KINDS)}")
        if self.default_drafter and self.default_drafter not in kinds:
            raise ConfigError(f"--default-drafter {self.default_drafter!r}: must be one of --drafters ({', '.join(kinds)})")
        if not 1 <= self.block_size <= self.max_block_size:
            raise ConfigError(f"--block-size {self.block_size}: must be in [1, --max-block-size={self.max_block_size}]")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ConfigError("--default-max-tokens must be in [1, --max-tokens-limit]")
        if self.max_concurrent < 1:
            raise ConfigError("--max-concurrent must be >= 1")
        if self.vocab_size < 0 or self.max_context < 2 or self.max_prompt_tokens < 1:
            raise ConfigError("--vocab-size must be >= 0, --max-context >= 2 and --max-prompt-tokens >= 1")
        if self.tokenizer and not pathlib.Path(self.tokenizer).exists():
            raise ConfigError(f"--tokenizer {self.tokenizer!r}: no such file or directory")
        if self.record and self.replay:
            raise ConfigError("--record and --replay exclude each other")
        if self.record and ":" not in self.upstream:
            raise ConfigError("--record needs --upstream HOST:PORT (the real drafter to record)")
        if self.upstream and not self.record:
            raise ConfigError("--upstream is for --record")
        if self.replay and not pathlib.Path(self.replay).is_file():
            raise ConfigError(f"--replay {self.replay!r}: no such file")
        check_client_options(self.upstream_tls_ca, self.upstream_tls_cert, self.upstream_tls_key, "upstream_tls")


SCRIPT_FIELDS = tuple(f.name for f in dataclasses.fields(Script))


def script_of(cfg: Script) -> Script:
    """The Script part of a StubConfig."""
    return Script(**{name: getattr(cfg, name) for name in SCRIPT_FIELDS})
