"""Strict YAML -> dataclass config loading, with dotted command-line overrides.

Each component owns a dataclass next to its code; this module only knows how to build any
dataclass tree from plain data and to say precisely what is wrong:
`configs/tiny.yaml: optim.lr: expected float, got 'fast'`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from mmtrain.errors import ConfigError

T = TypeVar("T")
_MISSING = dataclasses.MISSING


def load_config(cls: type[T], path: str | Path, overrides: list[str] | None = None) -> T:
    """Read a YAML file (and the `base:` chain under it), apply `key.sub=value` overrides, and build
    `cls` strictly."""
    path = Path(path)
    raw = read_raw(path)
    for item in overrides or []:
        apply_override(raw, item, source=str(path))
    return from_dict(cls, raw, source=str(path))


def read_raw(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """A config file as plain data. `base: FILE` (relative to this file) names a config this one
    edits: its mappings are merged key by key, anything else (a list, a value) replaced whole, so
    `data.train` here replaces the base's list, `data.media.max_pixels` only that value."""
    if not path.is_file():
        of = f" (the base of {_chain[-1]})" if _chain else ""
        raise ConfigError(f"{path}: config file not found{of}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML: {_first_line(e)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected a config file path, got {_show(base)}")
    base_path = path.parent / base
    if base_path.resolve() in {p.resolve() for p in (*_chain, path)}:
        raise ConfigError(f"{path}: base: {base} leads back to itself")
    return _merge(read_raw(base_path, (*_chain, path)), raw)


def _merge(base: dict, edits: dict) -> dict:
    out = dict(base)
    for key, value in edits.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = _merge(base[key], value) if both else value
    return out


def apply_override(raw: dict, item: str, source: str = "--set") -> None:
    """`optim.lr=3e-4` -> raw["optim"]["lr"] = 3e-4 (value parsed as YAML); a number indexes a list:
    `data.train.0.weight=0.5`."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        parsed = value
    node = raw
    parts = key.strip().split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):  # `data.train.0.weight`: an index into a list
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{source}: --set {key}: {'.'.join(parts[:i])} has no item {part!r} "
                                  f"(a list of {len(node)})")
            part = int(part)
        elif not isinstance(node, dict):
            raise ConfigError(f"{source}: --set {key}: {'.'.join(parts[:i])} is not a section")
        if last:
            node[part] = parsed
        else:
            node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]


def from_dict(cls: type[T], raw: Any, source: str = "<config>", prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys, wrong types, bad values are errors."""
    where = f"{source}: {prefix}"
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, dict):
        key = prefix.rstrip(".") or "config"
        raise ConfigError(f"{source}: {key}: expected a mapping, got {_show(raw)}")
    if hasattr(cls, "legacy_keys"):  # a component that still reads keys it no longer writes
        raw = cls.legacy_keys(raw)
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{where}{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
    kwargs = {}
    for name, f in known.items():
        key = f"{prefix}{name}"
        if name in raw:
            kwargs[name] = _convert(hints[name], raw[name], source, key)
        elif f.default is _MISSING and f.default_factory is _MISSING:
            raise ConfigError(f"{source}: {key}: required key is missing")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        # Components phrase checks as "<field>: <problem>", so this names the dotted key.
        raise ConfigError(f"{source}: {prefix}{e}") from None


def to_dict(cfg: Any) -> Any:
    """Dataclass tree -> plain YAML-able data (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def _convert(tp: Any, value: Any, source: str, key: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for opt in options:
            try:
                return _convert(opt, value, source, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[-1]
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{source}: {key}: must be one of {list(args)}, got {_show(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, prefix=f"{key}.")
    if origin in (list, tuple):
        return _convert_sequence(tp, value, source, key)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping, got {_show(value)}")
        return {k: _convert(args[1], v, source, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    return _convert_scalar(tp, value, source, key)


def _convert_sequence(tp: Any, value: Any, source: str, key: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{source}: {key}: expected a list, got {_show(value)}")
    if origin is list:
        return [_convert(args[0], v, source, f"{key}[{i}]") for i, v in enumerate(value)]
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_convert(args[0], v, source, f"{key}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise ConfigError(f"{source}: {key}: expected {len(args)} items, got {len(value)}")
    return tuple(_convert(a, v, source, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))


def _convert_scalar(tp: Any, value: Any, source: str, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise ConfigError(f"{source}: {key}: unsupported field type {tp!r}")
    raise ConfigError(f"{source}: {key}: expected {tp.__name__}, got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 60 else text


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
