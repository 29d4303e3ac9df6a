"""Typed, frozen settings: every field is a command-line flag with an env-var fallback.

Precedence: flag > environment variable > default. Each service declares one
frozen dataclass whose fields carry `setting(...)` metadata; `load_settings`
builds the argparse parser from it, so flags, env names and help never drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")


def setting(default: Any, env: str, help: str) -> Any:  # noqa: A002 - mirrors argparse
    """A dataclass field bound to env var `ENV_PREFIX + env` and flag `--field-name`."""
    return dataclasses.field(default=default, metadata={"env": env, "help": help})


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _converter(kind: Any):
    if kind is bool:
        return _parse_bool
    if kind in (int, float, str):
        return kind
    raise TypeError(f"unsupported settings type {kind!r}")


def env_vars(cls: type) -> dict[str, str]:
    """field name -> env var name, for every setting of `cls` (used by deploy checks).

    A class may set `ENV_PREFIX` (a ClassVar) so that subclasses share fields
    under another prefix (draft and target servers).
    """
    prefix = getattr(cls, "ENV_PREFIX", "")
    return {f.name: prefix + f.metadata["env"] for f in dataclasses.fields(cls)}


def flags(cls: type) -> dict[str, str]:
    """field name -> command-line flag."""
    return {f.name: "--" + f.name.replace("_", "-") for f in dataclasses.fields(cls)}


def load_settings(
    cls: type[T],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    prog: str | None = None,
    **overrides: Any,
) -> T:
    """Build `cls` from flags, then env vars, then defaults; `overrides` win over all (tests)."""
    environ = os.environ if environ is None else environ
    hints = get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip().splitlines()[0])
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        convert = _converter(hints[field.name])
        env = env_vars(cls)[field.name]
        default = field.default
        if env in environ:
            try:
                default = convert(environ[env])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{env}={environ[env]!r}: {exc}")
        parser.add_argument(
            flags(cls)[field.name],
            dest=field.name,
            type=convert,
            default=default,
            help=f"{field.metadata['help']} (env {env}; default {field.default!r})",
        )
    parsed = parser.parse_args(list(argv) if argv is not None else [])
    values.update(vars(parsed))
    values.update(overrides)
    instance = cls(**values)
    validate = getattr(instance, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as exc:
            parser.error(str(exc))
    return instance
