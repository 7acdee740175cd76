"""A griffe extension for the docs build: every public name of dsgd's API has a docstring.

The API reference is generated from the docstrings, so a public class,
function, method or property without one would leave a hole in it. This
extension logs a warning for each, and ``mkdocs build --strict`` (``make
docs``, CI) turns the warning into a failed build.

"Public" is what the reference renders: the names in ``dsgd.__all__``,
``dsgd.tune.trainable`` and ``dsgd.progress.Progress``, and the members of
those classes whose names do not start with an underscore (``__init__``
excepted: its arguments are documented in the class docstring). A method
that overrides a documented method of a base class counts as documented,
as ``inspect.getdoc`` has it.
"""

from __future__ import annotations

import ast
import logging

import griffe

logger = logging.getLogger("mkdocs.plugins.dsgd_docstrings")

# Beyond dsgd.__all__ (read from dsgd/__init__.py's _EXPORTS): the public names of the extras.
EXTRA_PUBLIC = ["dsgd.tune.trainable", "dsgd.progress.Progress"]


def _exported_names(package: griffe.Module) -> list[str]:
    """``dsgd.<name>`` for every key of ``_EXPORTS`` in dsgd/__init__.py: the names ``dsgd.__all__`` lists."""
    exports = package.members.get("_EXPORTS")
    if exports is None or exports.value is None:
        logger.warning("dsgd/__init__.py has no _EXPORTS dict: cannot tell which names are public")
        return []
    names = ast.literal_eval(str(exports.value))
    return [f"dsgd.{name}" for name in names]


class PublicDocstrings(griffe.Extension):
    """Warn about every public object of dsgd without a docstring."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        """Called once dsgd (or another package) is loaded: check dsgd's public names."""
        if pkg.name != "dsgd":
            return
        for path in _exported_names(pkg) + EXTRA_PUBLIC:
            obj = _find(pkg, path)
            if obj is None:
                logger.warning(f"public name {path} not found in the sources")
                continue
            obj = obj.final_target if obj.is_alias else obj
            self._require(obj, path)
            if obj.is_class:
                for name, member in obj.members.items():
                    if name.startswith("_"):
                        continue
                    member = member.final_target if member.is_alias else member
                    if member.is_attribute and "property" not in member.labels:
                        continue  # plain attributes are described in the class docstring
                    if not _documented(member) and _inherited_docstring(obj, name):
                        continue  # an override of a documented method (inspect.getdoc's rule)
                    self._require(member, f"{path}.{name}")

    @staticmethod
    def _require(obj: griffe.Object, path: str) -> None:
        if not _documented(obj):
            logger.warning(f"public name {path} has no docstring (the API reference is made from docstrings)")


def _documented(obj: griffe.Object) -> bool:
    return obj.docstring is not None and bool(obj.docstring.value.strip())


def _inherited_docstring(cls: griffe.Class, name: str) -> bool:
    """Whether a base class of ``cls`` documents a member ``name`` (a documented method overridden)."""
    for base in cls.resolved_bases:
        member = base.members.get(name)
        if member is not None and _documented(member.final_target if member.is_alias else member):
            return True
    return False


def _find(pkg: griffe.Module, path: str) -> griffe.Object | None:
    """The object at dotted ``path`` under ``pkg``, following dsgd's lazy exports through ``_EXPORTS``."""
    parts = path.split(".")[1:]
    if len(parts) == 1:
        exports = ast.literal_eval(str(pkg.members["_EXPORTS"].value))
        module_path = exports.get(parts[0])
        if module_path is None:
            return None
        module = pkg
        for part in module_path.split(".")[1:]:
            module = module.members.get(part)
            if module is None:
                return None
        return module.members.get(parts[0])
    obj: griffe.Object | None = pkg
    for part in parts:
        obj = obj.members.get(part) if obj is not None else None
    return obj
