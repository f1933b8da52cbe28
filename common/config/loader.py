"""Load a `Config` from a YAML file plus dotted `key=value` command-line overrides.

Design: the file is read into a plain tree, each override sets one dotted key in that tree (its
value parsed as YAML, so lists, null and numbers work), and pydantic validates the result once.
Every problem found is reported together, each blamed on the override that set the key or else on
the file. The YAML loader is PyYAML's safe loader with two fixes: duplicate keys are errors (PyYAML
silently keeps the last one) and `1e-6` is a float (YAML 1.1 wants `1.0e-6`).
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import AliasChoices, BaseModel, ValidationError

from common.config import aliases
from common.config.errors import ConfigError, Issue, issues_from_validation_error
from common.config.root import Config


class _Loader(yaml.SafeLoader):
    """Safe loader that refuses duplicate keys and reads `1e-6` as a float."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text; syntax errors become a ConfigError naming `source` and the line."""
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader subclasses SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        raise ConfigError([Issue("", f"invalid YAML: {problem}", source=where)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Issue("", f"invalid YAML: {exc}", source=source)]) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw tree of a YAML config file (an empty file is an empty mapping)."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            [Issue("", f"cannot read config file: {exc.strerror}", source=source)]
        ) from None
    tree = parse_yaml(text, source)
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(
            [
                Issue(
                    "",
                    f"must be a mapping of sections (got a {type(tree).__name__})",
                    source=source,
                )
            ]
        )
    return tree


def override_label(text: str) -> str:
    """How error messages name a command-line override."""
    return f"command line override {text!r}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (['a', 'b', 'c'], parsed value).

    hydra's prefixes, as verl's recipe scripts write them: `+a.b=v` (add a key) and `++a.b=v` (add
    or override) set the key like `a.b=v`, since every key of the typed config exists with its
    default; `~a.b` (delete) is refused with why, since a key left out keeps its default."""
    label = override_label(text)
    key, sep, raw = text.partition("=")
    key = key.strip()
    if key.startswith("~"):
        raise ConfigError(
            [
                Issue(
                    key[1:],
                    "hydra's ~ (delete a key) has no meaning here: every key has a default, so "
                    "leave the override out to keep it",
                    source=label,
                )
            ]
        )
    key = key.removeprefix("++") if key.startswith("++") else key.removeprefix("+")
    parts = key.split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError([Issue("", "expected dotted.key=value", source=label)])
    parts = [p.strip() for p in parts]
    value = parse_yaml(raw, label)
    # `trainer.experiment_name=0042` means the string, not the integer 42.
    if isinstance(value, bool | int | float) and _accepts_str(_annotation_at(parts)):
        value = raw.strip()
    return parts, value


def set_key(tree: dict[str, Any], parts: Sequence[str], value: Any) -> None:
    """Set a dotted key in a raw tree, creating mappings on the way; list items by index."""
    node: Any = tree
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                where = ".".join(parts[:depth])
                raise ConfigError(
                    [Issue(where, f"has no item {part!r} (the list has {len(node)} item(s))")]
                )
            index = int(part)
            if last:
                node[index] = value
            else:
                node = node[index]
            continue
        if not isinstance(node, dict):
            where = ".".join(parts[:depth])
            raise ConfigError(
                [Issue(where, f"is a value, not a section (cannot set {part!r} in it)")]
            )
        if last:
            node[part] = value
        else:
            child = node.get(part)
            if child is None:  # absent, or an empty section (`trainer:` with nothing under it)
                is_list = get_origin(_strip_optional(_annotation_at(parts[: depth + 1]))) is list
                child = node[part] = [] if is_list else {}
            node = child


def load_config(
    path: str | Path | None,
    overrides: Iterable[str] = (),
    *,
    check_paths: bool = True,
) -> Config:
    """Load, override and validate a configuration.

    `path` None starts from the built-in defaults. `check_paths` also checks the filesystem (the
    model directory exists); a real run and `--check` use it, tools that only read configs do not.
    Raises ConfigError listing every problem.
    """
    source = str(path) if path is not None else None
    tree: dict[str, Any] = read_config_file(path) if path is not None else {}
    overridden: dict[str, str] = {}
    problems: list[Issue] = []
    applied: list[aliases.Applied] = []
    # Foreign keys (AgentFly's agent.*, verl keys named differently here) become ours first.
    for parts, value in aliases.foreign_keys_in_tree(tree):
        aliases.remove_key(tree, parts)
        try:
            done = aliases.translate(parts, value)
            if done.target is not None:
                set_key(tree, done.target.split("."), done.converted)
            applied.append(done)
        except aliases.AliasError as exc:
            problems.append(Issue(exc.key, str(exc), source=source))
        except ConfigError as exc:
            problems += exc.issues
    if aliases.AGENT_SECTION in tree and not tree[aliases.AGENT_SECTION]:
        del tree[aliases.AGENT_SECTION]  # `agent:` with nothing left under it
    # Key -> (override label, value, the key as spelled): two spellings of one key (an alias and
    # ours) set to different values are refused rather than one silently winning; the same
    # spelling twice is an ordinary override (the last wins).
    set_by: dict[str, tuple[str, Any, str]] = {}
    for text in overrides:
        label = override_label(text)
        try:
            parts, value = parse_override(text)
            spelled = aliases.canonical(parts)
            if aliases.is_foreign(parts):
                done = aliases.translate(parts, value)
                applied.append(done)
                if done.target is None:
                    continue
                parts, value = done.target.split("."), done.converted
                if isinstance(value, bool | int | float) and _accepts_str(_annotation_at(parts)):
                    value = text.partition("=")[2].strip()  # a path or name of digits: the text
            key = ".".join(parts)
            earlier = set_by.get(key)
            if earlier and earlier[2] != spelled and earlier[1] != value:
                _conflict(key, earlier[0])
            set_by[key] = (label, value, spelled)
            set_key(tree, parts, value)
        except aliases.AliasError as exc:
            problems.append(Issue(exc.key, str(exc), source=label))
            continue
        except ConfigError as exc:
            problems += exc.with_sources(lambda _i, label=label: label).issues
            continue
        overridden[".".join(parts)] = label

    def blame(issue: Issue) -> str | None:
        keys = (issue.key, *issue.related)
        hits = [label for key, label in overridden.items() if any(_overlaps(key, k) for k in keys)]
        return hits[-1] if hits else source

    _add_required_sections(tree, Config)
    # Validate even after a bad override, so one run reports every problem.
    config: Config | None = None
    try:
        config = Config.model_validate(tree, context={"check_paths": check_paths})
    except ValidationError as exc:
        problems += issues_from_validation_error(exc, suggest=valid_keys)
    except ConfigError as exc:
        problems += exc.issues
    if problems or config is None:
        raise ConfigError(problems).with_sources(blame)
    config.applied_aliases = applied
    return config


def _conflict(key: str, other: str) -> None:
    """An alias and our own key both set ``key``, differently: say so rather than pick one."""
    raise ConfigError([Issue(key, f"is set both here and by {other}, differently; keep one")])


def dump_config(config: Config) -> str:
    """The config as YAML text that `load_config` reads back to an equal Config."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def valid_keys(loc: Sequence[str | int]) -> list[str]:
    """Keys allowed in the section at `loc` (names and aliases); [] when it is not a section."""
    model = _strip_optional(_annotation_at(loc))
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    keys: list[str] = []
    for name, field in model.model_fields.items():
        keys.append(name)
        if isinstance(field.validation_alias, AliasChoices):
            keys += [c for c in field.validation_alias.choices if isinstance(c, str)]
    return keys


def _add_required_sections(tree: dict[str, Any], model: type[BaseModel]) -> None:
    # A missing required section would be reported as `actor_rollout_ref: required key is
    # missing`; an empty one makes pydantic name the missing leaf (`...model.path`) instead.
    for name, field in model.model_fields.items():
        section = field.annotation
        if not (
            field.is_required() and isinstance(section, type) and issubclass(section, BaseModel)
        ):
            continue
        if tree.get(name) is None:
            tree[name] = {}
        if isinstance(tree[name], dict):
            _add_required_sections(tree[name], section)


def _overlaps(a: str, b: str) -> bool:
    # `data.datasets` and `data.datasets.0.ratio` concern the same value; `data.seed` and
    # `data.seed_x` do not.
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _annotation_at(loc: Sequence[str | int]) -> Any:
    """The type annotation of the field at `loc` under Config, or None if there is no such field."""
    annotation: Any = Config
    for part in loc:
        annotation = _strip_optional(annotation)
        if get_origin(annotation) is list:
            if not str(part).isdigit():
                return None
            annotation = get_args(annotation)[0]
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                field = next(
                    (
                        f
                        for f in annotation.model_fields.values()
                        if isinstance(f.validation_alias, AliasChoices)
                        and part in f.validation_alias.choices
                    ),
                    None,
                )
            if field is None:
                return None
            annotation = field.annotation
        else:
            return None
    return annotation


def _strip_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _accepts_str(annotation: Any) -> bool:
    annotation = _strip_optional(annotation)
    if get_origin(annotation) is list:  # `data.train_files=2024.jsonl`-like single items
        return _accepts_str(get_args(annotation)[0])
    return annotation is str
