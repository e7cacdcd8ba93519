"""Test processes only: torch without the import of torch._dynamo that no test needs.

Every Python process the tests start has this directory first on PYTHONPATH (tests/conftest.py
puts it there), so Python runs this module as it starts. Nearly every torch process the suite
starts (a few hundred training workers) builds a ``torch.optim`` optimizer, and in torch 2.x
that imports ``torch._dynamo`` on the optimizer's first method call: the methods are wrapped so
that torch.compile leaves them alone (``torch._compile._disable_dynamo``) and each step marks
a graph break (``_use_grad_for_differentiable``). That import costs about as much CPU as
``import torch`` itself, and on a 2-core machine the suite's time is its CPU time.

While ``torch._dynamo`` has not been imported, nothing is being compiled (torch.compile imports
it), so "don't compile this" and "break the graph here" have nothing to act on. The two
wrappers are therefore replaced, as their modules load, by ones that call the plain function
while ``torch._dynamo`` is not loaded, and do exactly what torch's do once it is. Nothing else
of torch changes: the same kernels, optimizers and autograd run as in a user's process.

Where torch does not have these two names (another version), nothing is replaced and the
processes only start slower. ``BPSCTL_TESTS_FULL_TORCH=1`` turns this off. The interpreter's
own ``sitecustomize``, which this module hides, runs after it.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any


def _lazy_disable_dynamo(original: Any) -> Any:
    """torch._compile._disable_dynamo, acting only once torch._dynamo is loaded."""

    def disable_dynamo(fn: Any = None, recursive: bool = True) -> Any:
        if fn is None:                  # used as @_disable_dynamo(recursive=False)
            return functools.partial(disable_dynamo, recursive=recursive)
        torchs = original(fn, recursive)

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            return torchs(*args, **kwargs)
        return inner

    return disable_dynamo


def _lazy_use_grad(original: Any) -> Any:
    """torch.optim.optimizer._use_grad_for_differentiable, its graph breaks only once
    torch._dynamo is loaded."""

    def use_grad_for_differentiable(func: Any) -> Any:
        torchs = original(func)

        def use_grad(*args: Any, **kwargs: Any) -> Any:
            if "torch._dynamo" in sys.modules:
                return torchs(*args, **kwargs)
            import torch
            previous = torch.is_grad_enabled()
            try:
                torch.set_grad_enabled(args[0].defaults["differentiable"])
                return func(*args, **kwargs)
            finally:
                torch.set_grad_enabled(previous)

        functools.update_wrapper(use_grad, func)
        return use_grad

    return use_grad_for_differentiable


#: module -> (its attribute, what replaces it) once the module has run
_PATCHES = {"torch._compile": ("_disable_dynamo", _lazy_disable_dynamo),
            "torch.optim.optimizer": ("_use_grad_for_differentiable", _lazy_use_grad)}


class _PatchAfterLoading(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`_PATCHES` as the other finders do, and replaces their
    attribute as soon as each has run (before any other module can import it)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        attribute, replace = _PATCHES[name]
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            original = getattr(module, attribute, None)
            if callable(original):
                setattr(module, attribute, replace(original))

        spec.loader.exec_module = exec_module       # type: ignore[method-assign]
        return spec


def _run_the_interpreters_own() -> None:
    """Run the ``sitecustomize`` this module hides (Debian's installs an error hook)."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def install() -> bool:
    """Replace the two wrappers in this process as torch loads (not once it has loaded, nor
    twice); whether they will be."""
    if os.environ.get("BPSCTL_TESTS_FULL_TORCH") == "1" or "torch" in sys.modules:
        return False
    if not any(isinstance(finder, _PatchAfterLoading) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterLoading())
    return True


if __name__ == "sitecustomize":         # as Python starts (tests/conftest.py imports it too)
    install()
    try:
        _run_the_interpreters_own()
    except Exception:   # noqa: BLE001 - as site.py does: a broken hook must not stop Python
        pass
