"""Loading the router's configuration (``router.config`` is its schema): a YAML file,
then ``KVROUTER_*`` environment variables, then command-line flags, merged in that order
and built into the schema's dataclasses with every name and type checked (``build``, also
what discovery and the admin API build a worker's config with); and the policy and its
knobs checked against the policies that exist, which the schema does not know of.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from policies.base import PolicyConfigError
from policies.registry import build_policy
from router.config import RouterConfig
from router.errors import ConfigError
from router.wire.sessions import DEFAULT_SESSION_KEYS


def _convert(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, options[0], where)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
        return build(hint, value, where)
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list")
        return tuple(_each(lambda i, v: _convert(v, item, f"{where}[{i}]"), enumerate(value)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
        return dict(value)
    if hint is bool:
        if isinstance(value, str) and value.lower() in (
            "1",
            "true",
            "yes",
            "on",
            "0",
            "false",
            "no",
            "off",
        ):
            return value.lower() in ("1", "true", "yes", "on")
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false")
        return value
    if hint in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number")
        try:
            converted = hint(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"{where}: expected {'an integer' if hint is int else 'a number'}"
            ) from None
        if hint is int and isinstance(value, float) and value != converted:
            raise ConfigError(f"{where}: expected an integer")
        return converted
    if hint is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string")
        return str(value)
    return value


def _each(convert: Callable[[Any, Any], Any], pairs: Iterable[tuple[Any, Any]]) -> list[Any]:
    """``convert(key, value)`` for every pair, raising one ``ConfigError`` with every
    pair's problems."""
    converted: list[Any] = []
    problems: list[str] = []
    for key, value in pairs:
        try:
            converted.append(convert(key, value))
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(*problems)
    return converted


def build(cls: type[Any], values: Mapping[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, checking names and types; every wrong
    setting is named at once."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    prefix = f"{where}." if where else ""
    unknown = [
        f"{prefix}{name}: unknown setting; known: {', '.join(sorted(names))}"
        for name in sorted(set(values) - names)
    ]
    known = [(k, v) for k, v in values.items() if k in names]
    try:
        converted = _each(lambda k, v: _convert(v, hints[k], f"{prefix}{k}"), known)
    except ConfigError as exc:
        raise ConfigError(*unknown, *exc.problems) from None
    if unknown:
        raise ConfigError(*unknown)
    kwargs = {k: value for (k, _), value in zip(known, converted, strict=True)}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(
            *(m if m.startswith(prefix) else f"{prefix}{m}" for m in exc.problems)
        ) from None
    except TypeError as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def _worker_entry(value: Any) -> Any:
    return {"url": value} if isinstance(value, str) else value


def merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``overrides`` into a copy of ``base`` (lists are replaced)."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


ENV_PREFIX = "KVROUTER_"
# Variables of the same prefix that are not router settings: where the config file is,
# and which router the command-line clients (top, admin) talk to.
NOT_SETTINGS = frozenset({"KVROUTER_CONFIG", "KVROUTER_URL"})


def _knob_value(text: str) -> Any:
    """Knobs are untyped here (each policy types its own): read them as YAML, as the
    --policy-knob flag does, so "0.5" is a number; the policy names a bad one."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``KVROUTER_PORT=9000`` -> ``{"port": "9000"}``; ``KVROUTER_UPSTREAM__MAX_ATTEMPTS``
    -> ``{"upstream": {"max_attempts": ...}}``; ``KVROUTER_WORKERS`` is comma-separated."""
    environ = os.environ if environ is None else environ
    result: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key in NOT_SETTINGS:
            continue
        path = key[len(ENV_PREFIX) :].lower().split("__")
        node = result
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _knob_value(value) if path[0] == "policy_knobs" else value
    return result


def load_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def load_config(
    path: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> RouterConfig:
    values: dict[str, Any] = load_file(path) if path else {}
    values = merge(values, env_overrides(environ))
    values = merge(values, flags or {})
    if "workers" in values:
        workers = values["workers"]
        if isinstance(workers, str):
            workers = [w for w in workers.split(",") if w]
        if not isinstance(workers, list | tuple):
            raise ConfigError("workers: expected a list")
        values["workers"] = [_worker_entry(w) for w in workers]
    values = _session_headers_first(_legacy_session_keys(values))
    policy_problems = _policy_problems(values)
    try:
        config: RouterConfig = build(RouterConfig, values)
    except ConfigError as exc:
        raise ConfigError(*exc.problems, *policy_problems) from None
    if policy_problems:
        raise ConfigError(*policy_problems)
    return config


def _names(value: Any, setting: str) -> list[str] | None:
    """A list of names from a file's list or a variable's comma-separated string."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [v for v in value.split(",") if v]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{setting}: expected a list of strings")
    return list(value)


def _legacy_session_keys(values: dict[str, Any]) -> dict[str, Any]:
    """``session_header`` and ``session_body_fields``, the settings ``session_keys``
    replaced, still read: the header takes the first place of the default order (an
    empty one: no header there) and the fields the body's places, the order they had."""
    header = values.pop("session_header", None)
    fields = _names(values.pop("session_body_fields", None), "session_body_fields")
    if header is None and fields is None:
        return values
    if "session_keys" in values:
        raise ConfigError(
            "session_header, session_body_fields: replaced by session_keys; set it alone"
        )
    if header is not None and not isinstance(header, str):
        raise ConfigError("session_header: expected a string")
    body = [f"body:{f}" for f in fields] if fields is not None else None
    keys: list[str] = []
    for source in DEFAULT_SESSION_KEYS:
        if source == DEFAULT_SESSION_KEYS[0] and header is not None:
            keys.extend([f"header:{header}".lower()] if header else [])
        elif source.startswith("body:") and body is not None:
            keys.extend(body)  # all of them in the first body place, none in the others
            body = []
        else:
            keys.append(source)
    keys = list(dict.fromkeys(keys))  # a legacy header that is also a default one
    return {**values, "session_keys": keys}


def _session_headers_first(values: dict[str, Any]) -> dict[str, Any]:
    """``session_headers`` (``serve --session-header``): more headers a session key is
    read from, before every source in ``session_keys``."""
    headers = _names(values.pop("session_headers", None), "session_headers")
    if headers is None:
        return values
    first = [f"header:{h}".lower() for h in headers]
    keys = _names(values.get("session_keys", DEFAULT_SESSION_KEYS), "session_keys") or []
    return values | {"session_keys": list(dict.fromkeys([*first, *keys]))}


def _policy_problems(values: Mapping[str, Any]) -> tuple[str, ...]:
    """What is wrong with the configured policy and knobs (checked apart from the schema,
    so that a file's other problems are named with it)."""
    defaults = RouterConfig()
    policy = values.get("policy", defaults.policy)
    knobs = values.get("policy_knobs", defaults.policy_knobs)
    if not isinstance(policy, str) or not isinstance(knobs, Mapping):
        return ()  # the schema names these
    try:
        build_policy(policy, dict(knobs))
    except PolicyConfigError as exc:
        return (f"policy: {exc}",)
    return ()
