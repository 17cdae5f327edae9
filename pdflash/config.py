"""One way to configure every service: a dataclass of options, exposed as CLI flags, environment
variables and an optional YAML/JSON config file, all with the same names.

Precedence: flag > environment (PDFLASH_<NAME>) > config file (--config FILE, key <name>) > default.
Validation happens in each dataclass's `validate()`; errors name the option and its sources.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import typing
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    pass


def option(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field documented for --help. switch=True: a str option auto|on|off that also takes --NAME alone
    (on) and --no-NAME (off), and reads booleans as on/off (a YAML `off` is the boolean false)."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


SWITCH = ("auto", "on", "off")


def switch_value(value: Any) -> str:
    """A switch option's value as auto, on or off; anything else is returned as text for validate() to name."""
    if isinstance(value, bool):
        return "on" if value else "off"
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return "on"
    if s in ("0", "false", "no", "off"):
        return "off"
    return s or "auto"  # an empty variable (compose's unset ${X:-}) is no choice


LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclasses.dataclass
class ServerOptions:
    """What every pdflash server takes; each service's options extend it (and override port defaults)."""

    host: str = option("127.0.0.1", "address to bind (loopback by default; 0.0.0.0 serves other machines)")
    port: int = option(0, "port to bind (0 = pick a free one)")
    metrics_port: int = option(-1, "Prometheus /metrics HTTP port (0 = any free port, -1 = off)")
    grace_s: float = option(5.0, "shutdown grace period for in-flight RPCs")
    log_level: str = option("info", "debug, info, warning, error")
    tls_cert: str = option("", "PEM certificate chain: serve TLS (with --tls-key)")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_ca: str = option("", "PEM CA bundle: require client certificates signed by it (mutual TLS)")
    cpus: str = option("", "CPU cores this service runs on, as taskset writes them: 3, 0-1, 0,2 (empty = every core it may use)")

    def validate_server(self) -> None:
        from pdflash.tls import check_server_options  # pdflash.tls imports this module

        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: must be in [0, 65535]")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port {self.metrics_port}: must be -1 (off), 0 (any free port) or a port")
        if self.grace_s < 0:
            raise ConfigError(f"--grace-s {self.grace_s}: must be >= 0 seconds")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level!r}: choose one of {', '.join(LOG_LEVELS)}")
        check_server_options(self.tls_cert, self.tls_key, self.tls_ca)
        if self.cpus:
            parse_cpus(self.cpus)


def parse_cpus(text: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5}; ConfigError when malformed."""
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ConfigError(f"--cpus {text!r}: write cores as taskset does, e.g. 3, 0-1 or 0,2") from None
        if a < 0 or b < a:
            raise ConfigError(f"--cpus {text!r}: {part!r} is not a core or an increasing range of cores")
        out.update(range(a, b + 1))
    return out


def env_name(field_name: str) -> str:
    return "PDFLASH_" + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def _parse(value: Any, tp: Any, name: str) -> Any:
    tp = _base_type(tp)
    if value is None:
        return None
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if tp in (int, float, str):
            return tp(value)
        if typing.get_origin(tp) is list:
            (inner,) = typing.get_args(tp)
            if isinstance(value, str):
                value = [v for v in value.replace(",", " ").split() if v]
            return [inner(v) for v in value]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"option {name}: {e}") from None
    return value


def parse_option(cls: type, name: str, value: Any, source: str | None = None) -> Any:
    """One option of cls from text (a flag's, a variable's, a metadata value), as from_sources parses it."""
    return _parse(value, typing.get_type_hints(cls)[name], source or name)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    parser.add_argument("--config", type=pathlib.Path, default=None, help="YAML or JSON file of options (same names, snake_case)")
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        help_text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}; default {f.default!r}]"
        if tp is bool:
            # Not BooleanOptionalAction: it reads any flag starting with "--no-" as False, so an option
            # named no_x (flag --no-x) could never be turned on.
            if f.default is True:  # on by default: the --no- form is the flag that does something, so say it
                help_text = (f"{f.metadata.get('help', '')}; --no-{flag_name(f.name)[2:]} = off "
                             f"[env {env_name(f.name)}; default {f.default!r}]")
            parser.add_argument(flag_name(f.name), dest=f.name, default=None, action="store_const", const=True, help=help_text)
            parser.add_argument("--no-" + flag_name(f.name)[2:], dest=f.name, action="store_const", const=False,
                                help=argparse.SUPPRESS)
        elif f.metadata.get("switch"):
            no = "--no-" + flag_name(f.name)[2:]
            help_text = f"{f.metadata.get('help', '')}; {flag_name(f.name)} alone = on, {no} = off [env {env_name(f.name)}; default {f.default!r}]"
            parser.add_argument(flag_name(f.name), dest=f.name, default=None, nargs="?", const="on", metavar="|".join(SWITCH),
                                help=help_text)
            parser.add_argument(no, dest=f.name, action="store_const", const="off", help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag_name(f.name), dest=f.name, default=None, help=help_text, metavar=f.name.upper())


def from_sources(cls: type[T], args: argparse.Namespace | None = None, env: dict[str, str] | None = None) -> T:
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    file_values: dict[str, Any] = {}
    cfg_path = getattr(args, "config", None) if args is not None else None
    if cfg_path is None and env.get("PDFLASH_CONFIG"):
        cfg_path = pathlib.Path(env["PDFLASH_CONFIG"])
    if cfg_path is not None:
        try:
            text = pathlib.Path(cfg_path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {cfg_path}: {e}") from None
        loaded = json.loads(text) if str(cfg_path).endswith(".json") else yaml.safe_load(text)
        file_values = dict(loaded or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(file_values) - names)
    if unknown:
        raise ConfigError(f"config file {cfg_path}: unknown option(s) {unknown}; known: {sorted(names)}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None) if args is not None else None
        if value is None and env_name(f.name) in env:
            value = env[env_name(f.name)]
        if value is None and f.name in file_values:
            value = file_values[f.name]
        if value is not None:
            kwargs[f.name] = _parse(switch_value(value) if f.metadata.get("switch") else value, hints[f.name], f.name)
    cfg = cls(**kwargs)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def describe(cfg: Any) -> dict[str, Any]:
    """The effective configuration, for the start-up log line (secrets masked)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = "***" if f.metadata.get("secret") and v else v
    return out
