"""What is wrong with an entry of ``trainer.callbacks`` as the user wrote it in a YAML config.

jsonargparse refuses a malformed entry as a failed Union over ``list[Callback] | Callback | None`` and its
report names neither the entry nor the key: the CLI reads the entries of the config it was reading when the
parser refused and names the first entry that cannot be a callback (its index and class), the bad key or
value, what is allowed and the closest accepted name. Only what is certainly wrong is named (a path that does
not import, an option the class does not take, a key a callback entry does not have, ``init_args`` that is no
mapping); anything else (a wrong-typed value) is left to the parser's own sentence, with the entry named in
front of it by :func:`entry_named`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
import sys
import typing
from typing import Any

#: the keys jsonargparse reads in a mapping that names a class
ENTRY_KEYS = ("class_path", "init_args", "dict_kwargs")
#: an entry given as a file holding it (``callbacks: [early_stopping.yaml]``): a dotted name all the same
FILE_SUFFIXES = (".yaml", ".yml", ".json", ".jsonnet")


def callback_entries(config: Any) -> tuple[str, Any] | None:
    """``(field, value)`` of ``trainer.callbacks`` in a loaded config, or under one subcommand's section
    (``fit.trainer.callbacks`` in a config given before the subcommand); ``None`` where it holds none."""
    if not isinstance(config, dict):
        return None
    trainer = config.get("trainer")
    if isinstance(trainer, dict) and "callbacks" in trainer:
        return "trainer.callbacks", trainer["callbacks"]
    for name, section in config.items():
        found = callback_entries(section) if isinstance(section, dict) and "trainer" in section else None
        if found is not None:
            return f"{name}.{found[0]}", found[1]
    return None


def _callback_type() -> type:
    from lightning.pytorch.callbacks import Callback

    import lightning_pulse  # noqa: F401  (its callbacks are the ones a suggestion most likely names)

    return Callback


def _subclasses(cls: type) -> list[type]:
    found, todo = [], list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        if sub not in found:
            found.append(sub)
            todo.extend(sub.__subclasses__())
    return found


def _public_paths(cls: type) -> list[str]:
    """The paths a user writes for ``cls``: its module's, and its package's where the package exports it."""
    paths = [f"{cls.__module__}.{cls.__qualname__}"]
    package = cls.__module__.split(".")[0]
    for prefix in (package, cls.__module__.rpartition(".")[0]):
        module = sys.modules.get(prefix)
        if prefix and getattr(module, cls.__name__, None) is cls:
            paths.insert(0, f"{prefix}.{cls.__name__}")
    return list(dict.fromkeys(paths))


def _resolve(path: str) -> tuple[Any, str | None]:
    """The object ``path`` names (a dotted import path, or a Callback's bare class name as jsonargparse
    takes it) and ``None``, or ``None`` and why it does not import."""
    if "." not in path:
        named = [sub for sub in _subclasses(_callback_type()) if sub.__name__ == path]
        return (named[0], None) if named else (None, f"no Callback is named {path!r}")
    module_name, _, attribute = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:  # a typo in the module, or a module that fails on an import of its own
        return None, str(error)
    except Exception as error:  # the module's own code failed: not a typo, nothing to suggest
        return None, f"importing {module_name} raised {type(error).__name__}: {error}"
    if not hasattr(module, attribute):
        return None, f"module {module_name!r} has no attribute {attribute!r}"
    return getattr(module, attribute), None


def _did_you_mean(given: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(given, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _class_path_problem(path: Any) -> tuple[type | None, str | None]:
    """The callback class ``path`` names, or why it names none (with the closest callback's path)."""
    callback = _callback_type()
    if not isinstance(path, str) or not path:
        return None, f"class_path={path!r} is not accepted; expected the import path of a Callback class"
    cls, reason = _resolve(path)
    if reason is not None:
        choices = [
            p for sub in _subclasses(callback) if not sub.__name__.startswith("_") for p in _public_paths(sub)
        ]
        if "." not in path:
            choices += [sub.__name__ for sub in _subclasses(callback)]
        return None, (
            f"class_path {path} cannot be imported: {reason}{_did_you_mean(path, choices)}"
            "; expected the import path of a Callback class, such as lightning_pulse.PulseCycle"
        )
    if not (isinstance(cls, type) and issubclass(cls, callback)):
        return (
            None,
            f"class_path {path} is not a Callback class (it is {cls!r}); expected a Callback's class_path",
        )
    return cls, None


def _options(cls: type) -> list[str] | None:
    """The options ``cls`` takes by name, or ``None`` where its ``**kwargs`` may take any."""
    try:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in parameters):
        return None
    return [p.name for p in parameters if p.kind != p.POSITIONAL_ONLY]


def _field_class(cls: type, name: str) -> type | None:
    """The one class annotating ``cls``'s option ``name`` (``X`` of ``X | None``), or ``None``."""
    try:
        hint = typing.get_type_hints(cls.__init__).get(name)
    except Exception:  # an annotation that does not evaluate: nothing certain to say
        return None
    classes = [arg for arg in (typing.get_args(hint) or (hint,)) if arg is not type(None)]
    return classes[0] if len(classes) == 1 and isinstance(classes[0], type) else None


def _nested_options(cls: type, name: str, given: Any) -> tuple[str, list[str], dict] | None:
    """``(class name, its options, the keys given)`` of the nested config that the mapping ``given`` to
    ``cls``'s option ``name`` holds: a dataclass's fields (EnergyLogger's ``meters``), or the options of the
    class_path given to a class-typed option (HardSampleReplay's ``scorer``); ``None`` otherwise."""
    field_class = _field_class(cls, name) if isinstance(given, dict) else None
    if field_class is None:
        return None
    if dataclasses.is_dataclass(field_class):
        return field_class.__name__, [f.name for f in dataclasses.fields(field_class) if f.init], given
    path, init_args = given.get("class_path"), given.get("init_args")
    if not isinstance(path, str) or "." not in path or not isinstance(init_args, dict):
        return None
    sub, reason = _resolve(path)
    if reason is not None or not (isinstance(sub, type) and issubclass(sub, field_class)):
        return None
    options = _options(sub)
    return (sub.__name__, options, init_args) if options else None


def expected_class_path(cls: type) -> str:
    """What a class-typed option (HardSampleReplay's ``scorer``) takes: ``the class_path of a PerSampleScorer
    (...OutputKeyScorer, ...ForwardLossScorer or a subclass of your own)``, the library's own subclasses by
    path, those next to the type (a user's subclasses elsewhere are theirs to name)."""
    own = [
        f"{cls.__module__}.{sub.__qualname__}"
        for sub in cls.__subclasses__()
        if sub.__module__ == cls.__module__
    ]
    examples = f" ({', '.join(own)} or a subclass of your own)" if own else ""
    article = "an" if cls.__name__[:1] in "AEIOU" else "a"
    return f"the class_path of {article} {cls.__name__}{examples}"


def option_before_its_class(class_path: str, typed: str, class_paths: list[str]) -> str | None:
    """The sentence for ``--trainer.callbacks.<typed>=<value>`` where ``typed`` is an option of a class-typed
    option of the last callback given (of class ``class_path``) and no class was given to that option before
    (``scorer.los``, ``scorer.init_args.los``): jsonargparse tries the option's type itself (its implicit
    class_path, which takes no option by name) and reports its internal ``NestedArg(...)`` as the value. Named
    as typed, with the way out: the class first. ``None`` where ``class_paths`` (those the parser's report
    names) hold a class of the option's type (then :func:`option_entry` checks the option against it), or
    where ``typed`` is a key of the mapping itself (``scorer.class_pth``: checked as such)."""
    cls = _resolve(class_path)[0]
    name, _, rest = typed.removeprefix("init_args.").partition(".")
    field_class = _field_class(cls, name) if isinstance(cls, type) and rest else None
    if field_class is None or field_class.__module__ == "builtins" or dataclasses.is_dataclass(field_class):
        return None
    given = [
        path
        for path in class_paths
        if isinstance(sub := _resolve(path)[0], type)
        and issubclass(sub, field_class)
        and sub is not field_class
    ]
    key = rest.partition(".")[0]
    if given or (key not in ("init_args", "dict_kwargs") and _did_you_mean(key, list(ENTRY_KEYS))):
        return None
    return (
        f"`{typed}` was given before a class for `{name}`: give `--trainer.callbacks.{name}=<class_path>` first, "
        f"{expected_class_path(field_class)}, then its options"
    )


def _class_mapping_problem(cls: type, name: str, given: Any) -> str | None:
    """The sentence for a key of the mapping ``given`` to ``cls``'s class-typed option ``name``
    (HardSampleReplay's ``scorer``) that such a mapping does not have (``init_arg``), checked as a callback
    entry's keys are: its class_path first, then its keys against class_path, init_args and dict_kwargs."""
    field_class = _field_class(cls, name) if isinstance(given, dict) else None
    if field_class is None or field_class.__module__ == "builtins" or dataclasses.is_dataclass(field_class):
        return None
    unknown = [key for key in given if key not in ENTRY_KEYS]
    if not unknown or len(unknown) == len(given):
        return None  # options with no class_path at all: the parser's sentence asks for the class_path
    path = given.get("class_path")
    sub, reason = _resolve(path) if isinstance(path, str) and "." in path else (field_class, None)
    if reason is not None:
        subclasses = [c for c in _subclasses(field_class) if not c.__name__.startswith("_")]
        choices = [public for c in subclasses for public in _public_paths(c)]
        return (
            f"`{name}.class_path` {path} cannot be imported: {reason}{_did_you_mean(path, choices)}; "
            f"expected the import path of a {field_class.__name__}"
        )
    sub = sub if isinstance(sub, type) and issubclass(sub, field_class) else field_class
    key = unknown[0]
    if key in (_options(sub) or []):  # an option of the class written next to class_path
        hint = f" (did you mean `{name}.init_args.{key}`?)"
    else:
        hint = _did_you_mean(str(key), list(ENTRY_KEYS))
    options = "its options" if sub is field_class else f"{sub.__name__}'s options"
    return (
        f"`{name}.{key}` is not accepted{hint}; `{name}` takes class_path (the import path of a "
        f"{field_class.__name__}), init_args (a mapping of {options}) or dict_kwargs"
    )


def _nested_problem(cls: type, init_args: dict) -> str | None:
    """The sentence for the first key of a nested config in ``init_args`` that its class does not take, with
    the field path (``meters.sampling_perod``) and the closest option."""
    for name, given in init_args.items():
        mapping = _class_mapping_problem(cls, str(name), given)
        if mapping is not None:
            return mapping
        nested = _nested_options(cls, str(name), given)
        if nested is None:
            continue
        config, options, keys = nested
        for key in keys:
            if key not in options:
                return (
                    f"`{name}.{key}` is not accepted{_did_you_mean(str(key), options)}; `{name}` takes "
                    f"{config}'s options: {', '.join(options)}"
                )
    return None


def _entry_problem(entry: Any) -> tuple[str, str] | None:
    """``(class name or "", what is wrong)`` for one entry, or ``None`` where nothing is certainly wrong."""
    if isinstance(entry, str):
        if not re.fullmatch(r"[A-Za-z_][\w.]*", entry) or entry.lower().endswith(FILE_SUFFIXES):
            return None  # the path of a file holding the entry, or the entry inline: the parser reads it
        cls, problem = _class_path_problem(entry)
        return ("", problem) if problem else None
    if entry is None:
        return None  # left to the parser's own sentence
    if not isinstance(entry, dict):
        return "", (
            f"the entry {entry!r} is not accepted; expected a Callback's class_path, or a mapping with "
            "class_path and, optionally, init_args (a mapping of its options)"
        )
    unknown = [key for key in entry if key not in ENTRY_KEYS]
    if "class_path" not in entry:
        keys = ", ".join(map(str, entry)) or "none"
        return "", (
            f"the entry has no class_path (its keys: {keys}); an entry is a mapping with class_path (the "
            "Callback's import path, such as lightning_pulse.PulseCycle) and, optionally, init_args (a "
            "mapping of its options)"
        )
    cls, problem = _class_path_problem(entry["class_path"])
    if problem is not None:
        return "", problem
    assert cls is not None
    name = cls.__name__
    options = _options(cls)
    shown = f"; {name} accepts: {', '.join(options)}" if options else ""
    if unknown:
        key = unknown[0]
        if options and key in options:  # an option of the class written next to class_path
            hint = f" (did you mean init_args: {{{key}: ...}}?)"
        else:
            hint = _did_you_mean(str(key), list(ENTRY_KEYS))
        return name, (
            f"key {key!r} is not accepted in a callback entry{hint}; expected class_path, init_args (a "
            "mapping of the callback's options) or dict_kwargs"
        )
    init_args = entry.get("init_args")
    if "init_args" in entry and not isinstance(init_args, dict):  # an empty `init_args:` reads as None
        empty = "; leave init_args out for the defaults" if init_args is None else ""
        return (
            name,
            f"init_args={init_args!r} is not accepted; expected a mapping of {name}'s options{shown}{empty}",
        )
    if options is None or not init_args:
        return None
    for key in init_args:
        if key not in options:
            return name, f"Option {key!r} is not accepted{_did_you_mean(str(key), options)}{shown}"
    nested = _nested_problem(cls, init_args)
    return None if nested is None else (name, nested)


def _where(field: str, index: int | None, name: str) -> str:
    return f"`{field}{'' if index is None else f'[{index}]'}`{f' {name}' if name else ''}: "


def entries_problem(field: str, value: Any, only: int | None = None) -> str | None:
    """The sentence for the first entry of ``value`` (``trainer.callbacks`` as loaded) that is certainly no
    callback, naming the entry, its class, the key or value and what is allowed; ``None`` if none is.
    ``only``: look at that entry alone (the one the parser's own sentence is about)."""
    entries = value if isinstance(value, list) else [value]
    for index, entry in enumerate(entries):
        if only is not None and index != only:
            continue
        problem = _entry_problem(entry)
        if problem is not None:
            name, sentence = problem
            return f"{_where(field, index if isinstance(value, list) else None, name)}{sentence}."
    return None


def entry_about(value: Any, summary: str) -> int | None:
    """The index of the one entry of ``value`` that ``summary`` (the parser's sentence about one callback's
    option, ``"Owner: `key`=..."``) is about: the only ``Owner`` given ``key``; else ``None``."""
    about = re.match(r"(\w+): (?:`(\w+)`|Option '(\w+)')", summary)
    if about is None:
        return None
    owner, key = about.group(1), about.group(2) or about.group(3)
    entries = value if isinstance(value, list) else [value]
    found = [
        index
        for index, entry in enumerate(entries)
        if isinstance(entry, dict)
        and isinstance(entry.get("class_path"), str)
        and entry["class_path"].rpartition(".")[2] == owner
        and isinstance(entry.get("init_args"), dict)
        and key in entry["init_args"]
    ]
    return found[0] if len(found) == 1 else None


def entry_named(field: str, value: Any, summary: str) -> str:
    """``summary`` with the entry it is about (:func:`entry_about`) named in front, where there is one."""
    index = entry_about(value, summary)
    if index is None:
        return summary
    return f"`{field}{f'[{index}]' if isinstance(value, list) else ''}` {summary}"


def nested_named(field: str, value: Any, summary: str) -> str:
    """``summary``, the parser's sentence about a field of a nested config (``"MeterConfig: `gpu_devices`=0
    ..."``, ``"`loss`='x' ..."`` of a scorer's class), said of the one entry whose option holds that config:
    ``"`trainer.callbacks[i]` EnergyLogger: `meters.gpu_devices`=0 ..."``; else ``summary`` unchanged."""
    match = re.fullmatch(r"(?:(\w+): )?(?:(\w+): )?`(\w+)`(=.*)", summary, re.S)
    if match is None:
        return summary
    callback, config = (match.group(1), match.group(2)) if match.group(2) else (None, match.group(1))
    key, rest = match.group(3), match.group(4)
    entries = value if isinstance(value, list) else [value]
    found = []
    for index, entry in enumerate(entries):
        if not (isinstance(entry, dict) and isinstance(entry.get("init_args"), dict)):
            continue
        path = entry.get("class_path")
        cls = _resolve(path)[0] if isinstance(path, str) else None
        if not isinstance(cls, type) or callback not in (None, cls.__name__):
            continue
        for name, given in entry["init_args"].items():
            nested = _nested_options(cls, str(name), given)
            if nested is not None and key in nested[2] and config in (None, nested[0]):
                found.append((index, cls.__name__, name))
    if len(found) != 1:
        return summary
    index, owner, name = found[0]
    return f"`{field}{f'[{index}]' if isinstance(value, list) else ''}` {owner}: `{name}.{key}`{rest}"


def option_entry(class_path: str, path: str, value: Any, class_paths: list[str]) -> dict:
    """The callback entry that ``--trainer.callbacks.<path>=<value>`` makes of the last callback given (of
    class ``class_path``), as it would read in YAML: ``meters.sampling_perod=1`` is ``{class_path: ...,
    init_args: {meters: {sampling_perod: 1}}}``. A class-typed option's mapping (``scorer.los``) gets the
    class_path given to it before, the one of ``class_paths`` (those the parser's report names) that is its
    type's, with an option under init_args and a key of the mapping (``scorer.init_arg.loss``) beside it."""
    *fields, last = path.removeprefix("init_args.").split(".")
    nested: Any = {last: value}
    for field in reversed(fields):
        nested = {field: nested}
    cls = _resolve(class_path)[0]
    ((name, given),) = nested.items()
    field_class = _field_class(cls, name) if isinstance(cls, type) and isinstance(given, dict) else None
    if field_class is not None and not dataclasses.is_dataclass(field_class) and "class_path" not in given:
        typed = [
            p for p in class_paths if isinstance(sub := _resolve(p)[0], type) and issubclass(sub, field_class)
        ]
        if typed:
            options = _options(_resolve(typed[-1])[0]) or []
            beside = any(
                key in ENTRY_KEYS or (key not in options and _did_you_mean(str(key), list(ENTRY_KEYS)))
                for key in given
            )
            given = (
                {"class_path": typed[-1], **given}
                if beside
                else {"class_path": typed[-1], "init_args": given}
            )
            nested = {name: given}
    return {"class_path": class_path, "init_args": nested}
