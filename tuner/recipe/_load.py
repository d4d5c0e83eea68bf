"""Reading a recipe: the YAML file (duplicate keys refused) or a mapping, validated all at once,
relative paths resolved against the recipe's folder; the JSON Schema for editors."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lightning_recompute.errors import DocumentError, clip
from lightning_recompute.safe_yaml import parse_document, read_text
from tuner.recipe._checks import check_component, check_strategy, cross_check, default_data, describe_error, importable
from tuner.recipe._schema import (
    FILE_ADAPTER,
    REFERENCE_DATA,
    REFERENCE_MODEL,
    Recipe,
    RecipeError,
    RecipeFile,
    StudySettings,
    TrackingSettings,
)


def load(path: str | os.PathLike[str]) -> Recipe:
    """Read and validate a recipe file; a `RecipeError` lists every problem (missing, not YAML, invalid)."""
    p = Path(path).expanduser().resolve()
    try:
        # Bounded first (size, content, nesting, aliases), then parsed again refusing duplicate keys.
        text = read_text(p, what="recipe file")
        parse_document(text, source=str(p))
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except DocumentError as err:
        raise RecipeError([_without_path(str(err), p)], p) from None
    except yaml.YAMLError as err:
        raise RecipeError([f"malformed YAML: {clip(str(err))}"], p) from None
    if data is None:
        data = {}
    return from_dict(data, source=p)


def _without_path(message: str, path: Path) -> str:
    prefix = f"{path}: "
    return message[len(prefix) :] if message.startswith(prefix) else message


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: YAML would silently keep the last one."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def from_dict(data: Mapping[str, Any], source: str | os.PathLike[str] | None = None) -> Recipe:
    """Validate a recipe given as the file structure; a `RecipeError` lists every problem at once.

    ``source`` (the file it came from) names the recipe in errors, gives the default name, and is the folder
    relative paths resolve against (else the working directory). Both folders go on ``sys.path``, so a
    ``class_path`` can name a module beside the recipe.
    """
    src = None if source is None else Path(source).expanduser().resolve()
    if not isinstance(data, Mapping):
        raise RecipeError([f"a recipe must be a mapping of keys to values, got {type(data).__name__}"], src)
    folder = src.parent if src is not None else Path.cwd()
    importable(folder)

    raw = dict(data)
    # class_path may be left out, meaning the reference model / synthetic data.
    for key, default in (("model", REFERENCE_MODEL), ("data", REFERENCE_DATA)):
        section = raw.get(key)
        if isinstance(section, Mapping) and "class_path" not in section:
            raw[key] = {"class_path": default, **section}

    errors: list[str] = []
    parsed, classes = _parse(raw, errors)
    if parsed is not None:
        data_component = default_data(parsed, classes)
        cross_check(parsed, data_component, classes, errors)
        check_strategy(parsed, classes, errors)
    if errors or parsed is None:
        raise RecipeError(errors, src)

    name = parsed.name or (src.stem if src is not None else "recipe")
    tracking, study, output = _places(parsed, name, folder, src)
    as_parsed = ("model", "trainer", "layers", "budget", "search", "trial", "race")
    return Recipe(
        source=src,
        name=name,
        data=data_component,
        tracking=tracking,
        study=study,
        output=output,
        **{key: getattr(parsed, key) for key in as_parsed},
    )


def _parse(raw: dict[str, Any], errors: list[str]) -> tuple[RecipeFile | None, dict[str, type | None]]:
    """The file validated (``None`` when it fails) and its components' classes checked; problems go to ``errors``."""
    parsed: RecipeFile | None = None
    try:
        parsed = FILE_ADAPTER.validate_python(raw)
    except ValidationError as err:
        errors.extend(describe_error(e) for e in err.errors(include_url=False))

    classes: dict[str, type | None] = {}
    for key, base_name in (("model", "LightningModule"), ("data", "LightningDataModule")):
        section = raw.get(key, {"class_path": REFERENCE_MODEL} if key == "model" else None)
        if section is None:
            continue
        classes[key] = check_component(key, section, base_name, errors)
    trainer = raw.get("trainer")
    strategy = trainer.get("strategy") if isinstance(trainer, Mapping) else None
    if isinstance(strategy, Mapping):
        classes["strategy"] = check_component("trainer.strategy", strategy, "pytorch.strategies.Strategy", errors)

    return parsed, classes


def _places(
    parsed: RecipeFile, name: str, folder: Path, src: Path | None
) -> tuple[TrackingSettings, StudySettings, Path]:
    """Where the recipe tracks, keeps its study and writes its policy: ``$VARS`` expanded, relative paths against
    ``folder``, and the policy file none of the stores' files."""
    errors: list[str] = []
    raw_paths = {
        "tracking.uri": parsed.tracking.uri,
        "study.storage": parsed.study.storage or f"sqlite:///{folder / 'optuna.db'}",
        "output": parsed.output or "policy.yaml",
    }
    expanded = {key: _expand_vars(key, value, errors) for key, value in raw_paths.items()}
    if errors:
        raise RecipeError(errors, src)
    tracking = TrackingSettings(
        uri=_resolve_uri(expanded["tracking.uri"], folder), experiment=parsed.tracking.experiment or name
    )
    study = StudySettings(storage=_resolve_uri(expanded["study.storage"], folder), name=parsed.study.name)
    output = _resolve_path(expanded["output"], folder)
    clash = _output_clash(output, {"tracking.uri": tracking.uri, "study.storage": str(study.storage)})
    if clash is not None:
        raise RecipeError([clash], src)
    return tracking, study, output


def json_schema() -> dict[str, Any]:
    """The recipe file's JSON Schema (draft 2020-12), for editors and ``recompute-tune schema``."""
    schema = FILE_ADAPTER.json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "lightning-recompute tuning recipe"
    return schema


def _resolve_path(value: str | os.PathLike[str], folder: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (folder / p).resolve()


_VARIABLE = re.compile(r"\$(?:\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


def _expand_vars(key: str, value: str, errors: list[str]) -> str:
    """``value`` with ``$VAR`` and ``${VAR}`` replaced from the environment; an unset one is an error."""
    missing = []

    def lookup(match: re.Match[str]) -> str:
        var = match.group("braced") if match.group("braced") is not None else match.group("plain")
        if var in os.environ:
            return os.environ[var]
        missing.append(var)
        return match.group(0)

    out = _VARIABLE.sub(lookup, value)
    if missing:
        names = ", ".join(f"${{{name}}}" if name else "${}" for name in missing)
        errors.append(
            f"{key}: {clip(value)} names environment variable(s) not set here: {names} (valid: set them, or give "
            f"the path itself)"
        )
    return out


_SQLITE_COMPANIONS = ("", "-journal", "-wal", "-shm", ".lock")  # .lock: `tuner._stores.sqlite_setup_lock`


def _store_files(url: str) -> list[Path]:
    """The local files of a store at ``url`` (a SQLite database or an Optuna journal, with their companions)."""
    if url.startswith("sqlite:///"):
        rest = url[len("sqlite:///") :]
        if not rest or rest == ":memory:":
            return []
        return [Path(f"{rest}{suffix}") for suffix in _SQLITE_COMPANIONS]
    if "://" not in url and url.endswith(".log"):
        return [Path(url), Path(f"{url}.lock")]  # Optuna's journal and its lock file
    return []


def _output_clash(output: Path, stores: Mapping[str, str]) -> str | None:
    """Why ``output`` cannot be the policy file (a promotion would write over one of the stores' own files);
    ``None`` when it can. Paths are compared after following symbolic links."""
    target = os.path.realpath(output)
    for key, url in stores.items():
        for path in _store_files(url):
            if os.path.realpath(path) == target:
                instead = clip(str(output.parent / "policy.yaml"))
                return (
                    f"output: {clip(str(output))} is a file of the store in {key} ({clip(url)}); writing the policy "
                    f"there would destroy it (valid: a file of its own, e.g. {instead})"
                )
    return None


def _resolve_uri(uri: str, folder: Path) -> str:
    """Make a relative sqlite URL or plain path absolute against ``folder``; leave other URLs alone."""
    if uri.startswith("sqlite:///"):
        rest = uri[len("sqlite:///") :]
        if rest and not rest.startswith("/") and rest != ":memory:":
            return f"sqlite:///{(folder / rest).resolve()}"
        return uri
    if "://" in uri or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", uri):
        return uri  # a server, a cloud store, file:/..., databricks: untouched
    return str(_resolve_path(uri, folder))
