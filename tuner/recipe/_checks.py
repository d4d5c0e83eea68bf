"""Checks pydantic cannot make: the named classes import, take the given arguments, and agree with
the rest of the recipe; validation errors rewritten as ``key.path: problem (valid: ...)``."""

from __future__ import annotations

import dataclasses
import inspect
import operator
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from lightning_recompute.errors import clip
from tuner.recipe._schema import REFERENCE_DATA, SECTIONS, Component, RecipeFile, resolve_class, suggest


def importable(*folders: Path) -> None:
    """Put the working directory and ``folders`` (the recipe's own) on ``sys.path``, so class paths import."""
    for folder in (Path.cwd(), *folders):
        entry = str(folder)
        if entry not in sys.path:
            sys.path.append(entry)


def check_component(key: str, section: Any, base_name: str, errors: list[str]) -> type | None:
    """Import ``section``'s class and check its init_args against the signature; the class or ``None``."""
    if not isinstance(section, Mapping) or not isinstance(section.get("class_path"), str):
        return None  # the schema already reported the shape
    cls, problem = resolve_class(section["class_path"])
    if cls is None:
        errors.append(f"{key}.class_path: {problem}")
        return None
    import lightning as L

    base = operator.attrgetter(base_name)(L)  # a dotted name: "pytorch.strategies.Strategy"
    if not issubclass(cls, base):
        errors.append(f"{key}.class_path: {section['class_path']} is not a lightning.{base_name} subclass")
    init_args = section.get("init_args", {})
    if isinstance(init_args, Mapping):
        errors.extend(_check_init_args(key, cls, init_args))
    return cls


def init_signature(cls: type) -> inspect.Signature:
    """The signature of ``cls.__init__`` (``self`` included), as the recipe's ``init_args`` fill it."""
    # Not inspect.signature(cls): it would fold in a metaclass __call__ or __new__ the recipe does not fill.
    init = cast(Any, cls).__init__
    return inspect.signature(init)


def _check_init_args(key: str, cls: type, init_args: Mapping[str, Any]) -> list[str]:
    try:
        sig = init_signature(cls)
    except (TypeError, ValueError):
        return []  # no introspectable signature (a C extension): the trial will tell
    params = [p for p in list(sig.parameters.values())[1:] if p.kind not in (p.VAR_POSITIONAL,)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems = []
    if not takes_any:
        for arg in init_args:
            if arg not in named:
                problems.append(
                    f"{key}.init_args.{arg}: {cls.__name__} takes no argument {arg!r}"
                    f"{suggest(str(arg), named)} (valid: {', '.join(named) or 'none'})"
                )
    for p in params:
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in init_args:
            problems.append(f"{key}.init_args.{p.name}: missing; {cls.__name__} requires it")
    return problems


def accepts(cls: type, name: str) -> bool:
    """Whether ``cls.__init__`` takes a keyword ``name`` (or ``**kwargs``); ``True`` when it cannot be read."""
    try:
        params = init_signature(cls).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def default_data(parsed: RecipeFile, classes: Mapping[str, type | None]) -> Component:
    """The data component, with synthetic tokens matched to the reference model's vocabulary and context."""
    data = parsed.data or Component(REFERENCE_DATA)
    model_args = _reference_model_args(parsed, classes)
    if model_args is None:
        return data
    filled = dict(data.init_args)
    for arg in ("vocab_size", "seq_len"):
        filled.setdefault(arg, model_args.get(arg))
    return Component(data.class_path, filled)


def _data_class(parsed: RecipeFile, classes: Mapping[str, type | None]) -> type | None:
    from lightning_recompute.reference import SyntheticTokens

    return classes.get("data") if parsed.data is not None else SyntheticTokens


def _reference_model_args(parsed: RecipeFile, classes: Mapping[str, type | None]) -> dict[str, Any] | None:
    """The reference model's arguments, defaults included, when it reads synthetic tokens; else ``None``."""
    from lightning_recompute.reference import ReferenceGPT, SyntheticTokens

    model_cls, data_cls = classes.get("model"), _data_class(parsed, classes)
    if not (isinstance(model_cls, type) and issubclass(model_cls, ReferenceGPT)):
        return None
    if not (isinstance(data_cls, type) and issubclass(data_cls, SyntheticTokens)):
        return None
    sig = init_signature(ReferenceGPT).parameters.items()
    return {**{n: p.default for n, p in sig if p.default is not p.empty}, **parsed.model.init_args}


def cross_check(parsed: RecipeFile, data: Component, classes: Mapping[str, type | None], errors: list[str]) -> None:
    """Problems that only show between sections."""
    accel = parsed.trainer.accelerator
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
    batch_size = data.init_args.get("batch_size")
    if "batch_size" in data.init_args and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        # Every trial would fail building its data loader; say so now, not after the search.
        errors.append(
            f"data.init_args.batch_size: {clip(repr(batch_size))} is not a batch size (valid: a positive integer)"
        )
    data_cls = _data_class(parsed, classes)
    if parsed.search.micro_batch_sizes and data_cls is not None and not accepts(data_cls, "batch_size"):
        errors.append(
            f"search.micro_batch_sizes: {data.class_path} takes no batch_size argument, so micro-batch sizes "
            f"cannot be tuned (valid: null, or a data module with a batch_size argument)"
        )
    model_args = _reference_model_args(parsed, classes)
    if model_args is not None:
        for arg in ("vocab_size", "seq_len"):
            mine, theirs = data.init_args.get(arg), model_args.get(arg)
            if isinstance(mine, int) and isinstance(theirs, int) and mine > theirs:
                errors.append(
                    f"data.init_args.{arg}: {mine} exceeds the model's {arg} {theirs} (valid: at most {theirs})"
                )


def check_strategy(parsed: RecipeFile, classes: Mapping[str, type | None], errors: list[str]) -> None:
    """Strategy, accelerator and device combinations that cannot run, each with what would."""
    trainer = parsed.trainer
    accel = trainer.accelerator
    if trainer.strategy == "fsdp" and accel == "cpu":
        errors.append(
            "trainer.strategy: 'fsdp' is Lightning's FSDPStrategy (FSDP1), which needs CUDA, and "
            "trainer.accelerator is cpu (valid on cpu: ddp, or model_parallel for FSDP2's fully_shard over gloo)"
        )
    model_cls = classes.get("model")
    if trainer.strategy == "model_parallel" and model_cls is not None:
        import lightning as L

        if issubclass(model_cls, L.LightningModule) and model_cls.configure_model is L.LightningModule.configure_model:
            errors.append(
                f"trainer.strategy: 'model_parallel' shards the model in its configure_model hook (fully_shard on "
                f"self.device_mesh), and {parsed.model.class_path} does not override configure_model "
                f"(valid for it: auto, ddp, or fsdp on cuda)"
            )


def describe_error(err: Mapping[str, Any]) -> str:
    """One pydantic error as ``key.path: problem (valid: ...)``."""
    loc = tuple(err["loc"])
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "(top level)"
    kind = err["type"]
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        valid = _keys_at(loc[:-1])
        return f"{path}: unknown key{suggest(str(loc[-1]), valid)} (valid: {', '.join(valid)})"
    if kind in ("missing", "missing_argument"):
        info = _field_info(loc)
        hint = f"; {info.description}" if info is not None and info.description else ""
        return f"{path}: missing (required{hint})"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        choices = re.findall(r"'([^']*)'|(\d+)", expected)
        names = [a or b for a, b in choices]
        suggestion = suggest(str(err["input"])[:200], names)
        return f"{path}: {clip(repr(err['input']))} is not valid{suggestion} (valid: {', '.join(names)})"
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        return f"{path}: {msg[len('Value error, ') :]}"
    return f"{path}: {msg[0].lower() + msg[1:]} (got {clip(repr(err['input']))})"


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    cls: type = RecipeFile
    if loc:
        cls = SECTIONS.get(str(loc[0]), RecipeFile)
    return [f.name for f in dataclasses.fields(cls)]


def _field_info(loc: tuple[Any, ...]) -> Any:
    cls: type = SECTIONS.get(str(loc[0]), RecipeFile) if len(loc) > 1 else RecipeFile
    return getattr(cls, "__pydantic_fields__", {}).get(str(loc[-1]))
