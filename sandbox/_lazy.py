"""Lazy package exports (PEP 562): a package's public names imported on first use, so importing
the package (or one of its leaf modules) runs none of the others. Used by `sandbox` and
`sandbox.tasks`."""

import importlib


def lazy_exports(package: str, exports: dict[str, str], namespace: dict):
    """(__getattr__, __dir__) for `package`, whose public names map to submodules in `exports`
    (name -> submodule); a name is imported on first access and cached in `namespace` (the
    package's globals())."""

    def __getattr__(name):
        mod = exports.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{mod}", package), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
