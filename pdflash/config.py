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
    """A dataclass field documented for --help."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


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


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    parser.add_argument("--config", type=pathlib.Path, default=None, help="YAML or JSON file of options (same names, snake_case)")
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        help_text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}; default {f.default!r}]"
        if tp is bool:
            # Not BooleanOptionalAction: it reads any flag starting with "--no-" as False, so an option
            # named no_x (flag --no-x) could never be turned on.
            parser.add_argument(flag_name(f.name), dest=f.name, default=None, action="store_const", const=True, help=help_text)
            parser.add_argument("--no-" + flag_name(f.name)[2:], dest=f.name, action="store_const", const=False,
                                help=argparse.SUPPRESS)
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
            kwargs[f.name] = _parse(value, hints[f.name], f.name)
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
