"""Reading a recipe, validated all at once: the schema, then what pydantic cannot check (the classes named, their
arguments, sections that must agree), every problem as ``key.path: problem (valid: ...)``; paths resolved."""

from __future__ import annotations

import dataclasses
import operator
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import ValidationError

from lightning_recompute.errors import DocumentError, clip
from lightning_recompute.safe_yaml import parse_document, read_text
from tuner.recipe._schema import (
    FILE_ADAPTER,
    REFERENCE_DATA,
    REFERENCE_MODEL,
    Component,
    Recipe,
    RecipeError,
    RecipeFile,
    StudySettings,
    TrackingSettings,
    accepts,
    init_signature,
    resolve_class,
    suggest,
)


def load(path: str | os.PathLike[str]) -> Recipe:
    p = Path(path).expanduser().resolve()
    try:
        # Bounded first (size, content, nesting, aliases), then parsed again refusing duplicate keys.
        text = read_text(p, what="recipe file")
        parse_document(text, source=str(p))
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except DocumentError as err:
        raise RecipeError([str(err).removeprefix(f"{p}: ")], p) from None
    except yaml.YAMLError as err:
        raise RecipeError([f"malformed YAML: {clip(str(err))}"], p) from None
    return from_dict({} if data is None else data, source=p)


class _UniqueKeyLoader(yaml.SafeLoader):
    """Refuses duplicate keys, where YAML would keep the last one unseen."""


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
    """Validate a recipe given as the file structure. ``source``, the file it came from, names it in errors and
    gives its default name and the folder relative paths resolve against; a class_path may name a module there."""
    from lightning_recompute.reference import SyntheticTokens

    src = None if source is None else Path(source).expanduser().resolve()
    if not isinstance(data, Mapping):
        raise RecipeError([f"a recipe must be a mapping of keys to values, got {type(data).__name__}"], src)
    folder = src.parent if src is not None else Path.cwd()
    for entry in (str(Path.cwd()), str(folder)):
        if entry not in sys.path:
            sys.path.append(entry)
    raw = dict(data)
    for key, default in (("model", REFERENCE_MODEL), ("data", REFERENCE_DATA)):
        if isinstance(raw.get(key), Mapping) and "class_path" not in raw[key]:  # left out: the reference's
            raw[key] = {"class_path": default, **raw[key]}

    errors: list[str] = []
    parsed: RecipeFile | None = None
    try:
        parsed = FILE_ADAPTER.validate_python(raw)
    except ValidationError as err:
        errors.extend(_describe(e) for e in err.errors(include_url=False))
    model_cls = _check_class("model", raw.get("model", {"class_path": REFERENCE_MODEL}), "LightningModule", errors)
    no_data = raw.get("data") is None
    data_cls = SyntheticTokens if no_data else _check_class("data", raw["data"], "LightningDataModule", errors)
    trainer = raw.get("trainer")
    strategy = trainer.get("strategy") if isinstance(trainer, Mapping) else None
    if isinstance(strategy, Mapping):
        _check_class("trainer.strategy", strategy, "pytorch.strategies.Strategy", errors)
    if parsed is not None:
        data_component = _cross_check(parsed, model_cls, data_cls, errors)
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


def _check_class(key: str, section: Any, base_name: str, errors: list[str]) -> type | None:
    """Import ``section``'s class and check its init_args against the signature; the class or ``None``."""
    if not isinstance(section, Mapping) or not isinstance(section.get("class_path"), str):
        return None  # the schema already reported the shape
    cls, problem = resolve_class(section["class_path"])
    if cls is None:
        errors.append(f"{key}.class_path: {problem}")
        return None
    import lightning as L

    if not issubclass(cls, operator.attrgetter(base_name)(L)):  # a dotted name: "pytorch.strategies.Strategy"
        errors.append(f"{key}.class_path: {section['class_path']} is not a lightning.{base_name} subclass")
    init_args = section.get("init_args", {})
    try:
        params = list(init_signature(cls).parameters.values())[1:]
    except (TypeError, ValueError):
        return cls  # no introspectable signature (a C extension): the trial will tell
    if not isinstance(init_args, Mapping):
        return cls
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        errors.extend(
            f"{key}.init_args.{arg}: {cls.__name__} takes no argument {arg!r}"
            f"{suggest(str(arg), named)} (valid: {', '.join(named) or 'none'})"
            for arg in init_args
            if arg not in named
        )
    for p in params:
        if p.name in named and p.default is p.empty and p.name not in init_args:
            errors.append(f"{key}.init_args.{p.name}: missing; {cls.__name__} requires it")
    return cls


def _cross_check(parsed: RecipeFile, model_cls: type | None, data_cls: type | None, errors: list[str]) -> Component:
    """Problems that only show between sections; the data component, whose synthetic tokens (by default) follow
    the reference model's vocabulary and context."""
    import lightning as L

    from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

    data = parsed.data or Component(REFERENCE_DATA)
    accel, strategy = parsed.trainer.accelerator, parsed.trainer.strategy
    model_args: dict[str, Any] = {}
    reference = model_cls is not None and issubclass(model_cls, ReferenceGPT)
    if reference and data_cls is not None and issubclass(data_cls, SyntheticTokens):
        sig = init_signature(ReferenceGPT).parameters.items()
        model_args = {**{n: p.default for n, p in sig if p.default is not p.empty}, **parsed.model.init_args}
        filled = {arg: model_args.get(arg) for arg in ("vocab_size", "seq_len") if arg not in data.init_args}
        data = Component(data.class_path, {**data.init_args, **filled})
    if parsed.budget.is_fraction and accel == "cpu":
        errors.append(
            f"budget.value: {parsed.budget.value:g} is a fraction of device memory, but trainer.accelerator is "
            f"cpu, which has no fixed memory size (valid on cpu: bytes such as '2GiB')"
        )
    if "offload" in parsed.search.modes and accel == "cpu":
        errors.append(
            "search.modes: 'offload' does nothing on cpu, where activations already live in host memory "
            "(valid on cpu: none, selective, full)"
        )
    storage = parsed.study.storage
    if storage is not None and "://" not in storage and not storage.endswith(".log"):
        errors.append(
            f"study.storage: {clip(repr(storage))} is neither a database URL nor a journal file "
            f"(valid: sqlite:///optuna.db, postgresql://..., mysql://..., or a path ending in .log)"
        )
    batch_size = data.init_args.get("batch_size", 1)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        # Every trial would fail building its data loader; say so now, not after the search.
        errors.append(
            f"data.init_args.batch_size: {clip(repr(batch_size))} is not a batch size (valid: a positive integer)"
        )
    if parsed.search.micro_batch_sizes and data_cls is not None and not accepts(data_cls, "batch_size"):
        errors.append(
            f"search.micro_batch_sizes: {data.class_path} takes no batch_size argument, so micro-batch sizes "
            f"cannot be tuned (valid: null, or a data module with a batch_size argument)"
        )
    for arg in ("vocab_size", "seq_len"):
        mine, theirs = data.init_args.get(arg), model_args.get(arg)
        if isinstance(mine, int) and isinstance(theirs, int) and mine > theirs:
            errors.append(f"data.init_args.{arg}: {mine} exceeds the model's {arg} {theirs} (valid: at most {theirs})")
    if strategy == "fsdp" and accel == "cpu":
        errors.append(
            "trainer.strategy: 'fsdp' is Lightning's FSDPStrategy (FSDP1), which needs CUDA, and "
            "trainer.accelerator is cpu (valid on cpu: ddp, or model_parallel for FSDP2's fully_shard over gloo)"
        )
    if (
        strategy == "model_parallel"
        and getattr(model_cls, "configure_model", None) is L.LightningModule.configure_model
    ):
        errors.append(
            f"trainer.strategy: 'model_parallel' shards the model in its configure_model hook (fully_shard on "
            f"self.device_mesh), and {parsed.model.class_path} does not override configure_model "
            f"(valid for it: auto, ddp, or fsdp on cuda)"
        )
    return data


def _describe(err: Mapping[str, Any]) -> str:
    """One pydantic error as ``key.path: problem (valid: ...)``."""
    loc = tuple(err["loc"])
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "(top level)"
    section: Any = RecipeFile  # or the section the key is in
    info = section.__pydantic_fields__.get(str(loc[0])) if len(loc) > 1 else None
    if info is not None:
        kinds = (info.annotation, *get_args(info.annotation))
        section = next((t for t in kinds if dataclasses.is_dataclass(t)), RecipeFile)
    kind, msg = err["type"], str(err["msg"])
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        valid = [f.name for f in dataclasses.fields(section)]
        return f"{path}: unknown key{suggest(str(loc[-1]), valid)} (valid: {', '.join(valid)})"
    if kind in ("missing", "missing_argument"):
        info = section.__pydantic_fields__.get(str(loc[-1]))
        return f"{path}: missing (required{f'; {info.description}' if info and info.description else ''})"
    if kind == "literal_error":
        names = [a or b for a, b in re.findall(r"'([^']*)'|(\d+)", err.get("ctx", {}).get("expected", ""))]
        suggestion = suggest(str(err["input"])[:200], names)
        return f"{path}: {clip(repr(err['input']))} is not valid{suggestion} (valid: {', '.join(names)})"
    if msg.startswith("Value error, "):
        return f"{path}: {msg.removeprefix('Value error, ')}"
    return f"{path}: {msg[0].lower() + msg[1:]} (got {clip(repr(err['input']))})"


_VARIABLE = re.compile(r"\$(?:\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


def _places(
    parsed: RecipeFile, name: str, folder: Path, src: Path | None
) -> tuple[TrackingSettings, StudySettings, Path]:
    """Where the recipe tracks, keeps its study and writes its policy: ``$VAR`` and ``${VAR}`` expanded (an
    unset one is an error), relative paths against ``folder``, and the policy file none of the stores' files."""
    errors: list[str] = []
    paths = {
        "tracking.uri": parsed.tracking.uri,
        "study.storage": parsed.study.storage or f"sqlite:///{folder / 'optuna.db'}",
        "output": parsed.output or "policy.yaml",
    }
    for key, value in paths.items():
        missing = ", ".join(f"${{{a or b}}}" for a, b in _VARIABLE.findall(value) if (a or b) not in os.environ)
        if missing:
            errors.append(
                f"{key}: {clip(value)} names environment variable(s) not set here: {missing} (valid: set them, or "
                f"give the path itself)"
            )
        paths[key] = _VARIABLE.sub(lambda m: os.environ.get(m["braced"] or m["plain"] or "", m[0]), value)
    if errors:
        raise RecipeError(errors, src)
    tracking = TrackingSettings(_resolve_uri(paths["tracking.uri"], folder), parsed.tracking.experiment or name)
    study = StudySettings(storage=_resolve_uri(paths["study.storage"], folder), name=parsed.study.name)
    output = _resolve_path(paths["output"], folder)
    target = os.path.realpath(output)
    for key, url in {"tracking.uri": tracking.uri, "study.storage": str(study.storage)}.items():
        files = []  # the store's local files: a SQLite database or an Optuna journal, with their companions
        rest = url.removeprefix("sqlite:///")
        if url.startswith("sqlite:///") and rest not in ("", ":memory:"):
            files = [f"{rest}{suffix}" for suffix in ("", "-journal", "-wal", "-shm", ".lock")]  # `sqlite_setup_lock`
        elif "://" not in url and url.endswith(".log"):
            files = [url, f"{url}.lock"]
        if any(os.path.realpath(f) == target for f in files):
            instead = clip(str(output.parent / "policy.yaml"))
            raise RecipeError(
                [
                    f"output: {clip(str(output))} is a file of the store in {key} ({clip(url)}); writing the policy "
                    f"there would destroy it (valid: a file of its own, e.g. {instead})"
                ],
                src,
            )
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


def _resolve_uri(uri: str, folder: Path) -> str:
    """Make a relative sqlite URL or plain path absolute against ``folder``; leave other URLs alone."""
    rest = uri.removeprefix("sqlite:///")
    if uri.startswith("sqlite:///"):
        return f"sqlite:///{(folder / rest).resolve()}" if rest and rest[0] != "/" and rest != ":memory:" else uri
    if "://" in uri or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", uri):
        return uri  # a server, a cloud store, file:/..., databricks: untouched
    return str(_resolve_path(uri, folder))
