"""The public face of the package: ``__all__`` is exactly what it exposes, the whole
exception tree included (in the manner of httpx's tests/test_exported_members.py)."""

from __future__ import annotations

import inspect
import re
import types

import flask_solidloop
from flask_solidloop import errors

#: Dunder names that are part of the public API.
INCLUDED_PRIVATE_MEMBERS = {"__version__"}


def public_members(module: types.ModuleType) -> set[str]:
    """The names a module exposes: not private, and not a subpackage or submodule
    (importing ``.agent`` binds ``flask_solidloop.agent`` as a side effect)."""
    return {
        name for name, value in vars(module).items()
        if (not name.startswith("_") or name in INCLUDED_PRIVATE_MEMBERS)
        and not isinstance(value, types.ModuleType)
    }


def error_classes() -> dict[str, type[BaseException]]:
    return {
        name: value for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, BaseException)
        and value.__module__ == errors.__name__ and not name.startswith("_")
    }


def test_all_is_exactly_the_public_members():
    assert len(flask_solidloop.__all__) == len(set(flask_solidloop.__all__))
    assert set(flask_solidloop.__all__) == public_members(flask_solidloop)


def test_every_exception_is_exported():
    classes = error_classes()
    assert "SolidLoopError" in classes and "ProviderError" in classes
    missing = sorted(set(classes) - set(flask_solidloop.__all__))
    assert missing == []
    for name, cls in classes.items():
        assert getattr(flask_solidloop, name) is cls


def test_every_exported_name_is_importable():
    namespace: dict[str, object] = {}
    exec("from flask_solidloop import *", namespace)  # the star import is what is tested
    for name in flask_solidloop.__all__:
        assert name in namespace, name
        assert namespace[name] is getattr(flask_solidloop, name)


def test_every_exception_derives_from_the_package_base():
    for name, cls in error_classes().items():
        assert issubclass(cls, errors.SolidLoopError), name


def test_the_tree_in_the_errors_docstring_is_complete_and_true():
    """Each class is drawn once, under the class it derives from."""
    drawn: dict[str, str | None] = {}  # name -> the name drawn above it
    parents: list[tuple[int, str]] = []  # (column, name) of the open branches
    for line in (errors.__doc__ or "").splitlines():
        # The root opens an indented line; every other class follows a "├── " or "└── ".
        match = re.search(r"(?:^    |── )([A-Z]\w*Error)\b", line)
        if match is None:
            continue
        column, name = match.start(1), match.group(1)
        while parents and parents[-1][0] >= column:
            parents.pop()
        assert name not in drawn, f"{name} is drawn twice"
        drawn[name] = parents[-1][1] if parents else None
        parents.append((column, name))
    classes = error_classes()
    assert set(drawn) == set(classes)
    for name, parent in drawn.items():
        if parent is not None:
            assert issubclass(classes[name], classes[parent]), f"{name} is not a {parent}"
        assert classes[name].__doc__, f"{name} has no docstring"
