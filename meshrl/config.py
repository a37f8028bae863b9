"""Typed configuration: msgspec Structs from defaults, a YAML file and dotted command-line overrides.

Every component owns a ``msgspec.Struct`` with its defaults and a one-line doc per field; the
root config only composes them. This module turns ``defaults ← YAML ← overrides`` into that
root Struct, and fails at start, in one line naming the key, on an unknown key, a wrong type or
a malformed override:

    cfg = load_config(PipelineConfig, "run.yaml", ["algo=grpo", "queue.max_staleness=2"])

Override values are parsed as YAML scalars/lists (``2`` is an int, ``1e-4`` a float, ``[1, 2]``
a list, ``null`` None). YAML 1.1's octal (``0400`` = 256) and base-60 (``1:30`` = 90) numbers are
refused, in files and overrides: nobody means them in a config. Assigning a string to a field
that holds a Struct selects one of that Struct's presets (``algo=grpo``): a Struct type opts in
with a ``presets()`` classmethod that returns ``{name: {field: value}}``. A preset sets every key
that any preset of the Struct sets (its own values, the defaults for the others), so presets
replace each other whole; keys no preset sets (``algo.kl_coef``) keep what the file or an
earlier override gave them.

Simplification: unions of Structs are not supported as config fields (one type per key).
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, Sequence, TypeVar

import msgspec
import yaml

T = TypeVar("T", bound=msgspec.Struct)

__all__ = ["ConfigError", "load_config", "apply_override", "to_yaml"]


class ConfigError(ValueError):
    """A configuration problem, stated in one line that names the key."""


def _struct_type(tp: Any) -> type[msgspec.Struct] | None:
    """The Struct type behind an annotation (``X``, ``X | None``), or None if it is not one."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1:
        return _struct_type(args[0])
    return None


def _field_types(cls: type[msgspec.Struct]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {name: hints[name] for name in cls.__struct_fields__}


def _presets(cls: type[msgspec.Struct]) -> dict[str, dict[str, Any]]:
    fn = getattr(cls, "presets", None)
    return fn() if callable(fn) else {}


def _merge(cls: type[msgspec.Struct], base: dict, update: dict, prefix: str, from_file: bool = False) -> dict:
    """Deep-merge ``update`` into ``base`` (builtins of a ``cls``), checking every key exists."""
    types = _field_types(cls)
    out = dict(base)
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if key not in types:
            raise ConfigError(f"unknown config key `{dotted}` (known: {', '.join(sorted(types))})")
        sub = _struct_type(types[key])
        if sub is not None and value is None and from_file and types[key] is sub:
            value = {}  # a section whose keys are all commented out: nothing to change, not "no section"
        if sub is not None and isinstance(value, str):
            value = _preset_value(sub, value, dotted)
        if sub is not None and isinstance(value, dict):
            current = out.get(key)
            if not isinstance(current, dict):
                current = msgspec.to_builtins(sub())
            out[key] = _merge(sub, current, value, dotted + ".", from_file)
        else:
            out[key] = value
    return out


def _preset_value(cls: type[msgspec.Struct], name: str, dotted: str) -> dict:
    presets = _presets(cls)
    if name not in presets:
        known = ", ".join(sorted(presets)) or "none"
        raise ConfigError(f"`{dotted}={name}`: no such preset for {cls.__name__} (presets: {known})")
    # Every key some preset sets is reset to its default first: `algo=grpo` after `algo=dr_grpo`
    # is GRPO, not a mix; keys outside the presets (kl_coef, entropy_coef, ...) are left alone.
    defaults = msgspec.to_builtins(cls())
    governed = {key for preset in presets.values() for key in preset}
    return {**{key: defaults[key] for key in governed}, **presets[name]}


def _nest(dotted: str, value: Any) -> dict:
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"malformed config key `{dotted}`")
    node: Any = value
    for key in reversed(keys):
        node = {key: node}
    return node


def apply_override(cls: type[T], data: dict, override: str) -> dict:
    """Apply one ``dotted.key=value`` override to builtins of ``cls``; return the new builtins."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override `{override}` is not of the form key=value")
    try:
        value = yaml.load(raw, Loader=_ScalarLoader) if raw.strip() else ""
    except yaml.YAMLError as exc:
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"`{key}`: cannot parse value {raw!r}: {what}") from None
    return _merge(cls, data, _nest(key, value), "")


def _convert(cls: type[T], data: dict) -> T:
    try:
        return msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as exc:
        # msgspec says "... - at `$.queue.max_staleness`"; lead with the key instead.
        msg = str(exc)
        where = ""
        if " - at `$." in msg:
            msg, _, where = msg.partition(" - at `$.")
            where = where.rstrip("`")
        raise ConfigError(f"`{where}`: {msg}" if where else msg) from None


_YAML11_INT = re.compile(r"[-+]?(0[0-7_]+|[0-9][0-9_]*(:[0-5]?[0-9])+)")
_YAML11_FLOAT = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+\.[0-9_]*")


class _ScalarLoader(yaml.SafeLoader):
    """``yaml.safe_load``, refusing YAML 1.1's octal and base-60 numbers (``0400`` would be 256 and
    ``1:30`` 90): quote the value for a string, or drop the leading zero."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        return self._refuse_yaml11(node, _YAML11_INT) or super().construct_yaml_int(node)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        return self._refuse_yaml11(node, _YAML11_FLOAT) or super().construct_yaml_float(node)

    def _refuse_yaml11(self, node: yaml.ScalarNode, form: re.Pattern) -> None:
        if form.fullmatch(node.value):
            if ":" in node.value:
                what = f"a YAML 1.1 base-60 number ({yaml.safe_load(node.value)}): quote it for a string"
            else:
                sign, digits = (node.value[0], node.value[1:]) if node.value[0] in "+-" else ("", node.value)
                decimal = sign + (digits.lstrip("0_") or "0")
                what = f"a YAML 1.1 octal number ({yaml.safe_load(node.value)}): write {decimal}, or quote it for a string"
            raise yaml.constructor.ConstructorError(None, None, f"{node.value} is {what}", node.start_mark)


_ScalarLoader.add_constructor("tag:yaml.org,2002:int", _ScalarLoader.construct_yaml_int)
_ScalarLoader.add_constructor("tag:yaml.org,2002:float", _ScalarLoader.construct_yaml_float)


class _UniqueKeyLoader(_ScalarLoader):
    """``yaml.safe_load``, except that a key repeated in one mapping is an error: YAML keeps the last,
    so a second ``rollout:`` section would silently reset the first's keys to their defaults."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        # only the mapping's own keys must be unique: keys merged in (<<: *anchor) may be overridden
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, f"unhashable key {key!r}", key_node.start_mark) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(
    cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()
) -> T:
    """Build a ``cls`` from its defaults, then the YAML file at ``path``, then ``overrides``."""
    data = msgspec.to_builtins(cls())
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"{where}: not valid YAML ({what})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of config keys")
        data = _merge(cls, data, loaded, "", from_file=True)
    for override in overrides:
        data = apply_override(cls, data, override)
    return _convert(cls, data)


def to_yaml(cfg: msgspec.Struct) -> str:
    """The resolved config as YAML, for the run directory and ``--print-config``."""
    return yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False)
