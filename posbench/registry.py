"""Registries of named classes (schemes, tasks): a name or a user's module:Class, and their options.

A registry maps names to "module:Class" paths and imports a class on first use, so listing or
ordering the names (as a report does) imports neither torch nor the classes.

Importing a user's module runs its code. A module:Class the user gives (a flag, a config file)
is theirs to run; one that only a run folder's records name (its config.yaml or model.pt, perhaps
from someone else) is said in one line before it is imported (`named_by`, `notice`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar

from posbench import progress
from posbench.errors import PosbenchError, did_you_mean, first_line

# the module of each plugin loaded in this process, with the first spec that named it: an error
# raised in its code is said as the plugin's (`unexpected`); workers are given the parent's
PLUGIN_MODULES: dict[str, str] = {}


def plugin_at_fault(e: BaseException) -> str | None:
    """ "scheme 'badplug:Bias' (badplug.py, line 12, in bias)": the innermost frame of a loaded
    plugin's code that `e` (or the error it was raised from) passed through; None if none did."""
    found = None
    while e is not None and found is None:
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_globals.get("__name__") in PLUGIN_MODULES:
                found = tb
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    if found is None:
        return None
    code = found.tb_frame.f_code
    where = f"{os.path.basename(code.co_filename)}, line {found.tb_lineno}, in {code.co_name}"
    return f"{PLUGIN_MODULES[found.tb_frame.f_globals['__name__']]} ({where})"


def unexpected(e: BaseException) -> str:
    """What an error no one expected says: its type and first line, and the plugin whose code
    raised it where one did (its bug, not posbench's); where none did but plugins are loaded, that
    one of their hooks may have returned what posbench's code cannot take (None, a str)."""
    what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {first_line(e, 300)}"
    at = plugin_at_fault(e)
    if at is None:
        if not PLUGIN_MODULES or isinstance(e, SystemExit):
            return f"unexpected {what}"
        return (
            f"unexpected {what}; a plugin's code is loaded here (module {', '.join(sorted(PLUGIN_MODULES))}): a "
            "hook that returns the wrong thing (None, a str) fails in posbench's code"
        )
    return f"{at} {what if isinstance(e, SystemExit) else 'raised ' + what}: a bug in that plugin"


class Registry(Mapping):
    """name -> class, in registration order. `lookup` also takes `module:Class` for a user's
    subclass of `base`; `check` looks further at such a class, `explain` words an unknown name.
    `aliases` (another name -> the registered one) are never looked up, only suggested: a run's
    folder and records keep one name per class."""

    def __init__(
        self,
        kind: str,
        entries: dict[str, str],
        base: str,
        example: str,
        also: tuple[str, ...] = (),
        check: Callable[[str, type], None] | None = None,
        explain: Callable[[str], None] | None = None,
        derive: Callable[[str, Registry], type | None] | None = None,
        aliases: dict[str, str] | None = None,
        forms: tuple[tuple[str, ...], str] = ((), ""),
    ):
        self.kind, self.entries, self.base, self.example = kind, entries, base, example
        self.aliases = aliases or {}
        self.also, self.check, self.explain = also, check, explain  # also: names valid outside the registry
        self.derive = derive  # names made from registered ones (noisy_rope), or None
        self.forms = forms  # what `derive` takes: names it knows (suggested) and words for the rest
        self.loaded: dict[str, type] = {}

    def __getitem__(self, name: str) -> type:
        if name not in self.loaded:
            cls = _import(self.entries[name])  # KeyError for a name not registered
            if "registry" in vars(cls) and cls.registry is None:  # a class that builds others by name
                cls.registry = self
            self.loaded[name] = cls
        return self.loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, name: str) -> type:
        """A registered name, or `module:Class` naming a user's subclass of the base class."""
        if name in self.entries:
            return self[name]
        derived = self.derive(name, self) if self.derive is not None else None
        if derived is not None:
            return derived
        if ":" in name:
            cls = load_plugin(name, self.kind, _import(self.base), self.base.replace(":", "."), self.example)
            if getattr(cls, "registry", False) is None:  # a subclass of a class that builds others by name
                cls.registry = self
            if self.check is not None:
                self.check(name, cls)
            return cls
        if self.explain is not None:
            self.explain(name)
        names = [*self.also, *self.entries]
        known, words = self.forms
        raise PosbenchError(
            f"unknown {self.kind} '{name}'{did_you_mean(name, [*names, *known], self.aliases)}; valid {self.kind}s: "
            f"{', '.join(names)}, {words + ', ' if words else ''}"
            f"or module:Class"
        )

    def build(self, name: str, *args, hint: str = ""):
        """lookup(name)(*args); a user's class that fails to build is one line naming it (and `hint`)."""
        cls = self.lookup(name)
        try:
            return cls(*args)
        except PosbenchError:
            raise
        except Exception as e:
            if name in self.entries:  # ours: a bug, which the CLI reports as one
                raise
            raise PosbenchError(
                f"{self.kind} '{name}' failed to build ({type(e).__name__}: {first_line(e)}){hint}"
            ) from None


# where the names being looked up come from, when that is a run folder rather than the user
_named_by: ContextVar[str | None] = ContextVar("named_by", default=None)


@contextlib.contextmanager
def named_by(record: str | os.PathLike):
    """Within the block, the names looked up are read from `record` (a run folder), not given by
    the user: a module:Class whose module is not yet imported is said (progress.say) first."""
    token = _named_by.set(str(record))
    try:
        yield
    finally:
        _named_by.reset(token)


def _say_import(spec: str, kind: str, module_name: str) -> None:
    """One line before a run folder's records make posbench import a user's module. Nothing is
    said for a module already imported (its code has run) or one that cannot be found (its
    import fails in one line of its own)."""
    record = _named_by.get()
    if record is None or progress.notice is None or module_name in sys.modules:
        return
    try:  # a top-level module is found without running it; its file is what would run
        found = importlib.util.find_spec(module_name.partition(".")[0])
    except (ImportError, ValueError):
        found = None
    if found is None:
        return
    folders = list(found.submodule_search_locations or []) if "." in module_name else []  # a package's
    path = folders[0] if folders else found.origin if found.has_location else None
    where = f" ({path})" if path else ""
    progress.say(f"{record} names {kind} '{spec}', not one of posbench's: importing module '{module_name}'{where}")


def _import(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def load_plugin(spec: str, kind: str, base: type, public: str, example: str) -> type:
    """The class `spec` (module:Class) names, checked to subclass `base` (importable as
    `public`); every way it can fail is one line naming the `kind` and the spec."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise PosbenchError(f"{kind} '{spec}': expected module:Class, e.g. {example}")
    _say_import(spec, kind, module_name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        # the module itself (or its package) is not found, not a module it imports: say where
        # posbench looks (the CLI puts the working directory last on sys.path)
        where = (
            f"; posbench imports it from the working directory ({os.getcwd()}) or PYTHONPATH: run "
            f"posbench from the folder that holds {module_name.replace('.', '/')}.py"
            if isinstance(e, ModuleNotFoundError) and missing and (module_name + ".").startswith(missing + ".")
            else ""
        )
        raise PosbenchError(f"{kind} '{spec}': cannot import module '{module_name}' ({e}){where}") from None
    except Exception as e:  # the user's module itself is broken: name the error, not a traceback
        raise PosbenchError(
            f"{kind} '{spec}': importing module '{module_name}' failed ({type(e).__name__}: {first_line(e, 10**6)})"
        ) from None
    except SystemExit as e:  # a script's sys.exit() at import: not posbench's exit status
        raise PosbenchError(
            f"{kind} '{spec}': importing module '{module_name}' called sys.exit({e.code!r}); "
            f"a plugin module defines its class and exits nothing at import"
        ) from None
    PLUGIN_MODULES.setdefault(module_name, f"{kind} '{spec}'")
    cls = module
    for part in class_name.split("."):  # module:Outer.Inner works too
        cls = getattr(cls, part, None)
    if cls is None:
        raise PosbenchError(f"{kind} '{spec}': module '{module_name}' has no '{class_name}'")
    if not (inspect.isclass(cls) and issubclass(cls, base)):
        raise PosbenchError(f"{kind} '{spec}': {class_name} is not a subclass of {public}")
    return cls


def check_options(defaults: dict, given: dict, where: str, owner: str = "") -> None:
    """A class's options as given (scheme_options.<name>, task_options) against their defaults:
    unknown keys (with a did-you-mean), wrong types, and non-positive values of options whose
    default is positive, one line each. A default of None takes any value; the class checks it.
    A float option written 1e6, which YAML 1.1 reads as a string, becomes the number in `given`."""
    for key, value in list(given.items()):
        if key not in defaults:
            valid = ", ".join(defaults) or "none"
            raise PosbenchError(
                f"{where}.{key}: unknown option{owner}{did_you_mean(key, defaults)}; valid options: {valid}",
                f"{where}.{key}",
            )
        default = defaults[key]
        if default is None:
            continue
        want = float if isinstance(default, float) else type(default)
        if want is float and isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)
                given[key] = value = number if math.isfinite(number) else value
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        fits = isinstance(value, bool) if want is bool else (numeric if want is float else isinstance(value, want))
        if not fits or (want is int and isinstance(value, bool)):
            raise PosbenchError(f"{where}.{key}: expected {want.__name__}, got {value!r}", f"{where}.{key}")
        # sizes, distances, bases and scales: every numeric option with a positive default is a
        # positive quantity (a class may check more when it is built)
        if numeric and isinstance(default, (int, float)) and default > 0 and not value > 0:
            raise PosbenchError(f"{where}.{key}={value} must be positive", f"{where}.{key}")
