"""Where a model comes from -- a file or a factory -- and how a factory reaches a model process.

Model processes are spawned: a factory travels to them pickled *by name* (the child imports
``module.qualname``), which fails for a lambda or a nested function, and for one defined in a ``__main__``
that is no file a child can re-run (a notebook, ``python -c``, ``python - < x.py``). ``ship`` sends those *by
value* instead: ``ByValue`` carries ``cloudpickle.dumps(factory)`` (code, closure and what it uses from
``__main__``, classes included), and the model process calls ``pickle.loads(payload)()``. cloudpickle is the
optional ``simpledbi[notebook]`` extra (what Ray, Dask and joblib ship functions with); without it such a
factory is refused before anything starts, saying what to do."""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import multiprocessing.process
import os
import pickle
import re
import sys
import types
from typing import Any, Callable, Optional, Tuple

#: ``package.module:function`` (the function may be ``Class.method``)
_REF = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")

_NOTEBOOK_EXTRA = "pip install 'simpledbi[notebook]'"


# ---------------------------------------------------------------- factories by value
class ByValue:
    """A factory the model processes cannot import, pickled by value with cloudpickle (plain
    ``pickle.loads`` reads it where cloudpickle is importable, as in the same environment)."""

    def __init__(self, factory: Callable[[], Any], payload: bytes):
        self.payload = payload
        self.name = describe(factory)

    def __call__(self, *args, **kwargs):
        return pickle.loads(self.payload)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.name}, sent by value>"


class ByName:
    """A factory by import path, ``module:function``, imported where it is called: a model process,
    which reads the module as it is on disk now. A reload to a function added to a module after the
    runtime's process imported it was refused ("has no ..."): that process checked its own copy."""

    def __init__(self, ref: str):
        self.ref = ref

    def __call__(self, *args, **kwargs):
        module = self.ref.partition(":")[0]
        if module in sys.modules:   # imported before this process was forked from the runtime's
            importlib.reload(sys.modules[module])
        return import_factory(self.ref)(*args, **kwargs)

    def __repr__(self) -> str:
        return self.ref


def describe(factory) -> str:
    """A factory's name for messages: ``module.qualname``, or its repr."""
    if isinstance(factory, (ByValue, ByName)):
        return factory.name if isinstance(factory, ByValue) else factory.ref
    fn, qualname = _unwrap(factory)
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{qualname}" if module else qualname


def import_path(factory) -> str:
    """A factory as ``--model`` and ``reload --path`` take it, ``module:qualname`` (``describe``
    where it has no importable name)."""
    fn, qualname = _unwrap(factory)
    module = getattr(fn, "__module__", None)
    if module and not isinstance(factory, (ByValue, ByName)):
        return f"{module}:{qualname}"
    return describe(factory)


def _unwrap(factory) -> Tuple[Any, str]:
    """The function under any ``functools.partial``, and its qualified name."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return factory, getattr(factory, "__qualname__", None) or type(factory).__qualname__


def main_is_importable() -> bool:
    """Can a spawned child re-create ``__main__`` (``python -m pkg`` by name, a script by path)?"""
    main = sys.modules.get("__main__")
    return main is not None and (bool(getattr(getattr(main, "__spec__", None), "name", None))
                                 or _main_file(main) is not None)


def _main_file(main) -> Optional[str]:
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or not path:
        return None
    if not os.path.isabs(path) and multiprocessing.process.ORIGINAL_DIR is not None:
        path = os.path.join(multiprocessing.process.ORIGINAL_DIR, path)   # as spawn does
    return path if os.path.isfile(path) else None


def unguarded_start(start_method: str) -> Optional[Tuple[str, int]]:
    """(script, line) when the main script starts a runtime from a top-level statement that is
    no ``if`` (``if __name__ == "__main__":``): under spawn and forkserver every child re-imports
    the script and would run that line again -- multiprocessing then fails in each child with a
    long traceback. None when the line is guarded, or there is no script."""
    main = sys.modules.get("__main__")
    path = _main_file(main) if start_method != "fork" else None
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if path is None or name == "__main__" or name.endswith(".__main__"):
        return None   # (python -m package: multiprocessing leaves such a main alone)
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        with open(path, "rb") as f:
            body = ast.parse(f.read()).body
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            return None if isinstance(node, (ast.If, getattr(ast, "Match", ast.If))) else (path, line)
    return None


def _where_main_is() -> str:
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) == "<stdin>" or sys.argv[:1] == ["-"]:   # (the file may be
        return "standard input (python -)"                                     # forgotten by now)
    if "IPython" in sys.modules or "ipykernel" in sys.modules:
        return "a notebook or IPython session"
    return "python -c or an interactive session"


def why_not_importable(factory) -> Optional[str]:
    """Why a spawned model process could not unpickle ``factory`` -- pickled by name, as spawn
    does -- or None if it can: a lambda or nested function, or anything from a ``__main__`` the
    child cannot import (the factory itself, or what a ``functools.partial`` of it carries)."""
    qualname = _unwrap(factory)[1]
    if "<" in qualname:
        return f"{qualname} is a lambda or a nested function, which has no importable name"
    finder = _MainFinder()
    try:
        finder.dump(factory)
    except Exception as e:  # noqa: BLE001 - pickle raises many kinds
        return f"it cannot be pickled by name ({type(e).__name__}: {e})"
    if finder.found is not None and not main_is_importable():
        what = "it is" if finder.found == describe(factory) else f"it uses {finder.found}, which is"
        return f"{what} defined in __main__, which here is {_where_main_is()}: no file to import"
    return None


class _MainFinder(pickle.Pickler):
    """Pickles into nothing, noting the first class or function of ``__main__`` it meets."""

    def __init__(self):
        super().__init__(types.SimpleNamespace(write=len), protocol=pickle.HIGHEST_PROTOCOL)
        self.found: Optional[str] = None

    def reducer_override(self, obj):
        if self.found is None:
            named = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
            if getattr(named, "__module__", None) == "__main__":
                self.found = f"__main__.{named.__qualname__}"
        return NotImplemented


def ship(what: str, factory: Callable[..., Any], start_method: str,
         children: str = "model processes") -> Callable[..., Any]:
    """``factory`` (a model's factory, or ``Run``'s target: ``what`` names it in messages) as it
    can travel to ``children`` started with ``start_method``: itself when they can import it by
    name (or inherit it, under fork), else a ByValue."""
    if start_method == "fork" or isinstance(factory, ByValue):
        return factory
    why = why_not_importable(factory)
    if why is None:
        return factory
    try:
        import cloudpickle
    except ImportError:
        raise TypeError(
            f"{what} {describe(factory)} cannot reach the {children}: {why}, and they are started with "
            f"{start_method!r}, so they import it by name. Either {_NOTEBOOK_EXTRA} (cloudpickle: simpledbi "
            f"then sends it by value), or move it into a module they can import (a .py file beside your "
            f"notebook or script, then `from mymodels import build`)") from None
    try:
        payload = cloudpickle.dumps(factory)
    except Exception as e:  # noqa: BLE001 - pickling raises many kinds
        raise TypeError(f"{what} {describe(factory)} cannot be sent to the {children} by value "
                        f"either ({type(e).__name__}: {e}); move it into an importable module") from None
    return ByValue(factory, payload)


def forget_unreadable_main_file(start_method: str) -> None:
    """NOTE [a __main__ that is no file]: ``python - < script.py`` sets ``__main__.__file__`` to
    ``'<stdin>'``, and every spawned child (model processes, workers, the janitor) then tries to
    re-run that "file" before anything else: ``FileNotFoundError: '<stdin>'`` in each one. With no
    ``__file__`` at all (as under ``python -c``), children skip re-running ``__main__``; what they
    need from it comes by value (``ship``). So a ``__file__`` that names no file is removed."""
    main = sys.modules.get("__main__")
    if start_method == "fork" or main is None or getattr(getattr(main, "__spec__", None), "name", None):
        return
    if isinstance(getattr(main, "__file__", None), str) and _main_file(main) is None:
        del main.__file__


# ---------------------------------------------------------------- files and import paths
def import_factory(ref: str):
    """``"package.module:function"`` -> the function (spawned model processes import it again)."""
    module, _, attr = ref.partition(":")
    _cwd_on_path()
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        hint = _module_hint(module, attr)
        if not hint and isinstance(e, ModuleNotFoundError) and e.name and \
                (module + ".").startswith(e.name + "."):   # the module itself, not what it imports
            hint = (f" (modules are imported from the current directory, {os.getcwd()}, and "
                    f"$PYTHONPATH: run from the directory that holds it, or add it to PYTHONPATH)")
        raise ValueError(f"factory {ref!r}: cannot import {module!r}: {e}{hint}") from None
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"factory {ref!r}: {module!r} has no {attr!r}") from None
    return obj


def _cwd_on_path() -> None:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules next to the caller resolve


def is_import_path(where: str) -> bool:
    """Is ``where`` shaped like ``package.module:function``?"""
    return bool(_REF.match(where))


def resolve(where: str, by_name: bool = False) -> Tuple[str, Any]:
    """A model source given as text: ``("path", where)`` for a model file, ``("factory",
    function)`` for ``module:function`` (``by_name``: a ByName, once its module is found, for a
    reload: not imported here). Raises FileNotFoundError (nothing of either kind) or ValueError (a
    factory that does not import, or could be both), saying what was tried."""
    is_file = os.path.isfile(where)
    if not is_import_path(where):
        if is_file and where.endswith(".py"):   # torch.load would call it a corrupted checkpoint
            raise ValueError(f"{where!r} is Python source, not a model file (TorchScript or a saved "
                             f"module): name a factory in it as MODULE:FUNCTION, e.g. "
                             f"'{os.path.splitext(os.path.basename(where))[0]}:build'")
        if is_file:
            return "path", where
        module, sep, attr = where.rpartition(":")
        if sep and module and attr.isidentifier():   # ../mymodels:build
            raise FileNotFoundError(
                f"{where!r} is neither a model file (no file at {os.path.abspath(where)!r}) nor a "
                f"factory MODULE:FUNCTION ({module!r} is not a module name){_module_hint(module, attr)}")
        dotted = where.rpartition(".")   # mymodels.mlp: a factory meant as MODULE:FUNCTION?
        hint = (f" (for the factory {dotted[2]!r} of module {dotted[0]!r}, write "
                f"'{dotted[0]}:{dotted[2]}')" if dotted[0] and dotted[2].isidentifier()
                and os.path.splitext(where)[1] not in (".pt", ".pth", ".ts", ".jit") else "")
        raise FileNotFoundError(f"no model file at {where!r}{hint}")
    module, _, attr = where.partition(":")
    if is_file:
        if not _findable(module):
            return "path", where
        raise ValueError(f"{where!r} could be the model file {os.path.abspath(where)!r} or the "
                         f"factory {attr!r} of module {module!r}: write './{where}' for the file, "
                         f"or rename the file for the factory")
    if by_name and _findable(module):
        return "factory", ByName(where)
    try:
        return "factory", import_factory(where)
    except ValueError as e:
        raise ValueError(f"{e} (and there is no model file {where!r})") from None


def _findable(module: str) -> bool:
    """Can ``module`` be imported from here (found, not imported)?"""
    _cwd_on_path()
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _module_hint(module: str, attr: str) -> str:
    """For ``../mymodels:build`` or ``mymodels.py:build``: how to name ``build`` of that file by
    import path -- the model processes import a factory by module name."""
    stem = module[:-3] if module.endswith(".py") else module
    if not os.path.isfile(stem + ".py"):
        return ""
    directory, base = os.path.split(stem)
    return (f"; to use {attr}() of {stem}.py, put its directory on the import path and name "
            f"its module: PYTHONPATH={directory or '.'} ... {base}:{attr}")
