"""Finding the watched tensors in a module's inputs and outputs (pytree walks and rebuilds)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import (
    GetAttrKey,
    MappingKey,
    SequenceKey,
    tree_flatten_with_path,
    tree_map_only,
)

__all__ = ["floats", "has_leaf", "map_watched", "version_of", "walk", "watched"]


def watched(t: torch.Tensor) -> bool:
    """Floating and complex tensors are watched (a complex one through its real view);
    integer and bool tensors are not."""
    return t.is_floating_point() or t.is_complex()


def floats(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """``list(walk(obj, prefix))``, with the common cases (one tensor, a tuple of
    tensors) taken without the generator."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)] if watched(obj) else []
    if type(obj) is tuple and all(isinstance(o, torch.Tensor) for o in obj):
        return [(f"{prefix}[{i}]", o) for i, o in enumerate(obj) if watched(o)]
    return list(walk(obj, prefix))


def has_leaf(outs: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether an output is a leaf that requires grad (no autograd node of its own)."""
    for _, t in outs:
        if t.grad_fn is None and t.requires_grad:
            return True
    return False


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter, or None for an inference tensor (which has none: it can
    be neither aliased by version nor proved)."""
    try:
        return t._version
    except RuntimeError:
        return None


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def role_of(prefix: str, path: tuple[Any, ...]) -> str:
    """A pytree key path as a role: ``output[0]``, ``output.logits``, ``input[1]``."""
    parts = [prefix]
    for key in path:
        if isinstance(key, SequenceKey):
            parts.append(f"[{key.idx}]")
        elif isinstance(key, MappingKey):
            parts.append(f".{key.key}" if isinstance(key.key, str) else f"[{key.key!r}]")
        elif isinstance(key, GetAttrKey):
            parts.append(f".{key.name}")
        else:
            parts.append(str(key))
    return "".join(parts)


def walk(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(role, tensor) for every floating tensor in ``obj``: whatever torch's pytree
    walks (tuples, lists, dicts, namedtuples, registered types such as Hugging Face's
    ModelOutput), and the fields of plain dataclasses, which pytree leaves alone."""
    leaves, _ = tree_flatten_with_path(obj, is_leaf=is_dataclass_instance)
    for path, leaf in leaves:
        role = role_of(prefix, path)
        if isinstance(leaf, torch.Tensor):
            if watched(leaf):
                yield role, leaf
        elif is_dataclass_instance(leaf):
            for f in dataclasses.fields(leaf):
                yield from walk(getattr(leaf, f.name), f"{role}.{f.name}")


def map_watched(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` rebuilt by torch's pytree with ``fn`` applied to its floating tensors
    (a plain dataclass is left as it is: its tensors are read, not replaced)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if watched(obj) else obj
    if type(obj) is tuple and all(isinstance(o, torch.Tensor) for o in obj):
        return tuple(fn(o) if watched(o) else o for o in obj)  # the common case
    return tree_map_only(
        torch.Tensor, lambda t: fn(t) if watched(t) else t, obj, is_leaf=is_dataclass_instance
    )
