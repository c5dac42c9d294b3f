"""A user's own class, loaded by `module:Class` wherever a scheme or task name goes."""

from __future__ import annotations

import importlib
import inspect

from posbench.errors import PosbenchError


def load_plugin(spec: str, kind: str, base: type, public: str, example: str) -> type:
    """The class `spec` names, checked to subclass `base` (importable as `public`); every way it
    can fail is one line naming the `kind` ('scheme', 'task') and the spec."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise PosbenchError(f"{kind} '{spec}': expected module:Class, e.g. {example}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PosbenchError(f"{kind} '{spec}': cannot import module '{module_name}' ({e})") from None
    except Exception as e:  # the user's module itself is broken: name the error, not a traceback
        first = (str(e).strip().splitlines() or [""])[0]
        raise PosbenchError(
            f"{kind} '{spec}': importing module '{module_name}' failed ({type(e).__name__}: {first})"
        ) from None
    cls = module
    for part in class_name.split("."):  # module:Outer.Inner works too
        cls = getattr(cls, part, None)
    if cls is None:
        raise PosbenchError(f"{kind} '{spec}': module '{module_name}' has no '{class_name}'")
    if not (inspect.isclass(cls) and issubclass(cls, base)):
        raise PosbenchError(f"{kind} '{spec}': {class_name} is not a subclass of {public}")
    return cls
