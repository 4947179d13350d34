"""One field list for two dataclasses: a Hydra schema and the plain, frozen value that later stages use.

The trainer's arguments are declared once in :class:`~miles_sglang_plugin.config.trainer_inputs.TrainerInputs`
and copied into the root schema ``MilesTrainerArgs``; a router's settings are declared once in the schema's
``RouterConf`` and copied into ``RouterSettings`` (rendering). A field added to the source appears in both.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

ClassT = TypeVar("ClassT", bound=type)


def fields_of(source: type, *, retype: Callable[[Any], Any] | None = None) -> Callable[[ClassT], ClassT]:
    """Class decorator, written under ``@dataclass``: the class gets every dataclass field of ``source``, in
    ``source``'s order and before its own fields, with the same type (resolved), default or default factory,
    and field options. ``retype`` maps each copied type (e.g. ``Mapping`` to ``dict`` for OmegaConf). The class
    records ``source`` in ``__fields_copied_from__`` (where the copied fields' docstrings are)."""
    hints = typing.get_type_hints(source)

    def decorate(cls: ClassT) -> ClassT:
        own = dict(inspect.get_annotations(cls))
        copied: dict[str, Any] = {}
        for source_field in dataclasses.fields(source):
            if source_field.name in own:
                raise TypeError(f"{cls.__name__}.{source_field.name} is already a field of {source.__name__}")
            field_type = hints[source_field.name]
            copied[source_field.name] = retype(field_type) if retype is not None else field_type
            setattr(cls, source_field.name, _copy_field(source_field))
        cls.__annotations__ = {**copied, **own}
        cls.__fields_copied_from__ = source  # type: ignore[attr-defined]
        return cls

    return decorate


def _copy_field(source_field: dataclasses.Field) -> Any:
    return dataclasses.field(
        default=source_field.default,
        default_factory=source_field.default_factory,
        init=source_field.init,
        repr=source_field.repr,
        hash=source_field.hash,
        compare=source_field.compare,
        metadata=source_field.metadata,
        kw_only=source_field.kw_only,
    )


def mapping_as_dict(field_type: Any) -> Any:
    """``Mapping[K, V]`` as ``dict[K, V]`` (OmegaConf types a mapping node only as ``dict``); others as given."""
    if typing.get_origin(field_type) is Mapping:
        return dict[typing.get_args(field_type)]  # type: ignore[misc]
    return field_type


def dict_as_mapping(field_type: Any) -> Any:
    """``dict[K, V]`` as ``Mapping[K, V]`` (a frozen value holds a read-only mapping); others as given."""
    if typing.get_origin(field_type) is dict:
        return Mapping[typing.get_args(field_type)]  # type: ignore[misc]
    return field_type
