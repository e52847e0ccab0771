"""The ``lightning-pulse`` command: LightningCLI for training, plus ``report`` for energy reports.

``lightning-pulse fit --config examples/mnist1d/pulse.yaml`` trains any LightningModule/DataModule named by
``class_path`` in the YAML, with the pulse callbacks configured under ``trainer.callbacks``. Class paths
resolve from the current directory too, as with ``python -m``, so a project's own modules need no install.

``lightning-pulse report DIR`` re-renders ``energy_report.md`` and the PNG from the ``energy_report.json``
that ``DIR`` names, holds, or holds below it (found as ``compare`` finds a run).

``lightning-pulse compare RUN_A RUN_B [--out DIR]`` prints run B against run A (wall time, kWh, CO2, cost,
final metrics, ratios B/A) and writes it as ``energy_comparison.{json,md,png}`` next to RUN_B's report.

``lightning-pulse wait-for-window DIR [--print [--format iso|unix|slurm]]`` sleeps until the clean window a
run suspended by GreenWindow waits for (``DIR/green_window.json``, next to its checkpoint), or prints its
time, for cron or ``sbatch --begin``; then the ``resume_command`` it prints (``lightning-pulse fit ...
--ckpt_path`` the suspended run's checkpoint) resumes the run. Once the run has completed it says so and exits
3 (``WINDOW_FINISHED_EXIT``), so that ``while lightning-pulse wait-for-window DIR; do ...; done`` ends.
"""

from __future__ import annotations

import builtins
import inspect
import logging
import os
import re
import sys
import warnings
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pulse._callback_entries import (
    callback_entries,
    entries_problem,
    entry_about,
    entry_named,
    expected_class_path,
    nested_named,
    option_before_its_class,
    option_entry,
)
from lightning_pulse.errors import pulse_class

#: set to 1 for the full tracebacks and jsonargparse's whole report instead of one-line errors
TRACEBACK_ENV = "LIGHTNING_PULSE_TRACEBACK"
#: jsonargparse's own switch for its whole report; it takes only true or false
JSONARGPARSE_DEBUG = "JSONARGPARSE_DEBUG"

# jsonargparse's scaffolding around the sentence that matters: Union alternatives tried, the value dumped
_SCAFFOLDING = (
    "Does not validate against any of the Union subtypes",
    "Subtypes:",
    "Errors:",
    "Given value",
    "Not a valid subclass of",
    "Subclass types expect one of",
    "a class path (str)",
    "a dict with",
    "a dict without",
    "Expected a <class 'NoneType'>",
    "Problem with given class_path",
    'Parser key "',
)


def _verbose() -> bool:
    return (
        os.environ.get(TRACEBACK_ENV, "") not in ("", "0")
        or os.environ.get(JSONARGPARSE_DEBUG, "").lower() == "true"
    )


def _refused_jsonargparse_debug() -> str | None:
    """The error for a ``JSONARGPARSE_DEBUG`` that jsonargparse would crash on (it takes true or false)."""
    value = os.environ.get(JSONARGPARSE_DEBUG, "")
    if value.lower() in ("", "true", "false"):
        return None
    return (
        f"{JSONARGPARSE_DEBUG}={value} is not accepted; expected true or false "
        f"(or {TRACEBACK_ENV}=1 for the full report and tracebacks)."
    )


def _accepted_options(class_path: str) -> list[str]:
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(
            sys.modules.get(module_name) or __import__(module_name, fromlist=[class_name]), class_name
        )
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
        # `*args`, `**kwargs` (an abstract base's) are no option a user can write
        return [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except Exception:  # the summary must never fail where the full report would not
        return []


# the types of a failed value, as the user writes them in YAML
_TYPE_NAMES = {"Sequence": "a list", "MutableSequence": "a list", "list": "a list", "tuple": "a list"}


# Union alternatives that are not about the class the user named: the list branch of Lightning's
# `list[Callback] | Callback` refusing one callback mapping, the base Callback tried as a fallback, and a
# mapping or list given inline on the command line tried as the path of a file first
_OFF_TOPIC_ALTERNATIVE = re.compile(
    r"- (?:Expected a <class 'list'>$|Problem with given class_path 'lightning[\w.]*\.Callback'"
    r"|Not a valid subclass of Callback$|Expected a path but [{\[])"
)


def _without_off_topic_alternatives(message: str) -> str:
    """``message`` less the Union alternatives of :data:`_OFF_TOPIC_ALTERNATIVE` (with the lines nested under
    them) wherever a sibling alternative reports on the class the user named."""
    lines = message.splitlines()

    def indent(i: int) -> int:
        return len(lines[i]) - len(lines[i].lstrip())

    def block_end(i: int) -> int:
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or indent(end) > indent(i)):
            end += 1
        return end

    dropped: set[int] = set()
    seen: set[int] = set()
    for start, line in enumerate(lines):
        if start in seen or not line.lstrip().startswith("- "):
            continue
        alternatives = []  # the sibling items of one Union's `Errors:` list
        item = start
        while item < len(lines) and lines[item].lstrip().startswith("- ") and indent(item) == indent(start):
            alternatives.append((item, block_end(item)))
            seen.add(item)
            item = alternatives[-1][1]
        off_topic = [bool(_OFF_TOPIC_ALTERNATIVE.match(lines[i].strip())) for i, _ in alternatives]
        on_topic = [
            not off and not lines[i].strip().startswith("- Expected a <class 'NoneType'>")
            for (i, _), off in zip(alternatives, off_topic)
        ]
        if any(on_topic):
            for (first, end), off in zip(alternatives, off_topic):
                if off:
                    dropped.update(range(first, end))
    return "\n".join(line for i, line in enumerate(lines) if i not in dropped)


def _innermost_key(message: str) -> tuple[str | None, list[str]]:
    """The innermost ``Parser key "..."`` of a jsonargparse report (the field the value was given to, e.g.
    ``meters`` inside ``trainer.callbacks``) and the lines of its block, stripped; ``(None, [])`` if none."""
    raw = [line for line in message.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(raw) if line.strip().startswith('Parser key "')]
    if not starts:
        return None, []
    head = raw[starts[-1]]
    indent = len(head) - len(head.lstrip())
    block = []
    for line in raw[starts[-1] + 1 :]:
        if len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line.strip().removeprefix("- ").strip())
    return re.search(r'Parser key "([^"]+)"', head).group(1), block  # type: ignore[union-attr]


def _given_value(lines: list[str]) -> str | None:
    for line in lines:
        match = re.match(r"(?:.*\. )?(?:Given|Got) value: (.*)", line)
        if match and not line.startswith("Given value type"):
            return match.group(1)
    return None


def _nested_config(block: list[str]) -> tuple[str, bool] | None:
    """The class path of the nested config (a dataclass such as ``MeterConfig``) that a field's value was
    refused by for not being a mapping of its options, and whether null is allowed; ``None`` otherwise."""
    import dataclasses

    for line in block:
        if not line.startswith("Subtypes:"):
            continue
        for path in re.findall(r"<class '([\w.]+)'>", line):
            module_name, _, name = path.rpartition(".")
            cls = getattr(sys.modules.get(module_name), name, None)
            refused = any(
                text.startswith((f"Not a valid subclass of {name}", "Expected a dot import path string"))
                for text in block
            )
            if refused and dataclasses.is_dataclass(cls):
                return path, "NoneType" in line
    return None


# why jsonargparse could not import a class_path or a function's path: a typo in the class or the module
# name, or a module that fails on an import of its own
_IMPORT_FAILURE = re.compile(r"(?:module '[\w.]+' has no attribute '\w+'|No module named '[\w.]+')$")
# the line of a jsonargparse report that names the class path it then says went wrong
_GIVEN_CLASS_PATH = re.compile(r"Problem with given class_path '([\w.]+)':")


def _unimportable_class_paths(message: str) -> dict[str, str]:
    """The class paths of a jsonargparse report that did not import, each with the reason. They are the
    user's typos: neither the class the error is about nor a class that exists."""
    lines = [line.strip().removeprefix("- ").strip() for line in message.splitlines() if line.strip()]
    unimportable = {}
    for line, following in zip(lines, lines[1:]):
        given = _GIVEN_CLASS_PATH.fullmatch(line)
        if given and _IMPORT_FAILURE.fullmatch(following):
            unimportable[given.group(1)] = following
    return unimportable


def _import_failure(block: list[str], unimportable: dict[str, str]) -> str | None:
    """``"X cannot be imported (reason)"`` for the path a field's value named that did not import."""
    for line in block:
        given = _GIVEN_CLASS_PATH.fullmatch(line)
        if given and given.group(1) in unimportable:
            return f"{given.group(1)} cannot be imported ({unimportable[given.group(1)]})"
    reason = next((match for line in block if (match := _IMPORT_FAILURE.search(line))), None)
    path = _given_value(block)
    if reason is not None and path is not None and re.fullmatch(r"[\w.]+", path):  # a function's path
        return f"{path} cannot be imported ({reason.group(0)})"
    return None


def _expected_class(block: list[str], refused_anyway: bool = False) -> tuple[str, bool] | None:
    """What a class-typed field (HardSampleReplay's ``scorer``, ``trainer.callbacks``) takes when its value
    named no subclass of its type, or a class_path that does not import (or, ``refused_anyway``, was a mapping
    of options its type, which takes none by name, refused): the type, with the library's own subclasses by
    class path, and whether null is allowed; ``None`` for other fields."""
    refused = ("Import path", "Not a valid subclass of", "Expected a dot import path string")
    if not refused_anyway and not any(
        line.startswith(refused) or _IMPORT_FAILURE.fullmatch(line) for line in block
    ):
        return None
    subtypes = next((line for line in block if line.startswith("Subtypes:")), "")
    for path in re.findall(r"<class '([\w.]+)'>", subtypes):
        module_name, _, name = path.rpartition(".")
        cls = getattr(sys.modules.get(module_name), name, None)
        if not isinstance(cls, type):
            continue
        several = " or a list of them" if f"list[{path}]" in subtypes else ""
        return f"{expected_class_path(cls)}{several}", "NoneType" in subtypes
    return None


def _expected_callable(block: list[str], value: str) -> tuple[str, bool] | None:
    """What a function-typed field (AccountingConfig's ``token_counter``) takes when its value is no import
    path of one, and whether null is allowed; ``None`` for other fields."""
    subtypes = next((line for line in block if line.startswith("Subtypes:")), "")
    refused = any(
        line.startswith("Expected a dot import path") or "expects a function or a callable class: " in line
        for line in block
    )
    if "Callable" not in subtypes or not refused:
        return None
    builtin = f", here builtins.{value}" if hasattr(builtins, value) else ""
    return f"the dot import path of a function (package.module.function{builtin})", "NoneType" in subtypes


def _expected_class_names(block: list[str]) -> tuple[str, bool] | None:
    """What a list of classes given by name (ScheduledPrune's ``layer_types``, ``Sequence[str | type]``) takes
    when an entry is neither a word nor an import path, and whether null is allowed; ``None`` otherwise.
    jsonargparse's own sentence there is the first alternative it tried, "Expected a <class 'str'>"."""
    subtypes = next((line for line in block if line.startswith("Subtypes:")), "")
    if "[str | type]" not in subtypes or not any(
        line.startswith("Expected a dot import path") for line in block
    ):
        return None
    allowed = "a list of layer classes by name: a torch.nn name such as Linear, or a dotted import path"
    return f"{allowed} such as mypackage.layers.MyConv", "NoneType" in subtypes


def summarise_parser_error(message: str) -> str:
    """The sentence of a jsonargparse error that says what is wrong, prefixed with the class it is about.

    jsonargparse reports a bad callback value as a failed Union over ``list[Callback] | Callback | None``:
    the callback's own sentence sits among the alternatives it tried. This picks it out, so the first line a
    user reads names the class, the field, the value and what is allowed.
    """
    message = _without_off_topic_alternatives(message)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    specific = [
        line.removeprefix("- ").strip()
        for line in lines
        if not line.removeprefix("- ").startswith(_SCAFFOLDING)
    ]
    unimportable = _unimportable_class_paths(message)
    class_paths = [path for path in re.findall(r"class_path '([\w.]+)'", message) if path not in unimportable]
    # a value tried against the union's fallback, Lightning's base Callback, is not about the class the user named
    named = [
        path for path in class_paths if not (path.startswith("lightning") and path.endswith(".Callback"))
    ]
    class_paths = named or class_paths
    if not class_paths:
        # a constructor's ValueError names no class path; the value dump does, when one class was given
        given = set(re.findall(r"""class_path['"]?[=:] ?['"]([\w.]+)['"]""", message)) - set(unimportable)
        class_paths = sorted(given) if len(given) == 1 else []
    owner = f"{class_paths[-1].rpartition('.')[2]}: " if class_paths else ""
    key, block = _innermost_key(message)
    value = _given_value(block) or "this value"
    config = _nested_config(block)
    if key is not None and config is not None:
        # a nested config (`meters`, `accounting`, `config`, `options`) given a number, a list or a word
        path, nullable = config
        options = ", ".join(_accepted_options(path))
        # a word was tried as the path of a YAML file holding the mapping, which is allowed too
        as_file = any(line.startswith("Expected a path") for line in block)
        return (
            f"{owner}`{key}`={value} is not accepted; expected a mapping of {path.rpartition('.')[2]}'s options"
            f"{f' ({options})' if options else ''}{', the path of a YAML file holding one' if as_file else ''}"
            f"{', or null' if nullable else ''}."
        )
    names = _expected_class_names(block) if key is not None else None
    if names is not None:  # an entry of the list is no string: a number, a list, a mapping
        allowed, nullable = names
        whole = next((line for line in reversed(block) if line.startswith("Given value: ")), "")
        whole = whole.removeprefix("Given value: ") or value
        refusal = f"`{key}`={whole}: entry {value} is not accepted"
        return f"{owner}{refusal}; expected {allowed}{', or null' if nullable else ''}."
    typed = (_expected_class(block) or _expected_callable(block, value)) if key is not None else None
    if typed is not None:  # a function or a word where a class_path goes, or a word where a function goes
        allowed, nullable = typed
        failure = _import_failure(block, unimportable)
        refusal = f"`{key}`={value} is not accepted{f': {failure}' if failure else ''}"
        if failure is not None and value.startswith("["):
            # an entry of trainer.callbacks named it: no callback owns the list (the dump names the good ones)
            owner, refusal = "", f"`{key}`: {failure}"
        return f"{owner}{refusal}; expected {allowed}{', or null' if nullable else ''}."
    if not specific:
        if key is not None and block:  # the innermost field's value was refused by every type it allows
            return f"{owner}`{key}`={value} is not accepted."
        return lines[0] if lines else message
    if owner and specific[0].startswith(owner):
        owner = ""
    expected = [re.search(r"Expected a <class '([\w.]+)'>(?:\. Got value: (.*))?", line) for line in specific]
    if all(expected):
        given = [match.group(2) for match in expected if match.group(2)] or re.findall(
            r"Given value: (.*)", message
        )
        value = given[0] if given else "this value"
        names = [match.group(1).rpartition(".")[2] for match in expected]
        names = list(dict.fromkeys(_TYPE_NAMES.get(name, name) for name in names))
        types = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        if types == "a list" and re.fullmatch(r"[\w.-]+", value):  # one word where a list goes
            types += f" (in YAML, [{value}] for a single item)"
        return f"{owner}`{key if key else '?'}`={value} is not accepted; expected {types}."
    sentence = specific[0]
    unknown = re.match(r"Option '(\w+)' is not accepted", sentence)
    if unknown and class_paths:
        options = _accepted_options(class_paths[-1])
        if options:
            sentence += f"; {class_paths[-1].rpartition('.')[2]} accepts: {', '.join(options)}"
        elif key is not None and (typed := _expected_class(block, refused_anyway=True)) is not None:
            # a mapping of a subclass's options with no class_path: its base type (a PerSampleScorer, whose
            # `*args, **kwargs` name no option) was tried; the field's class is the one to name
            allowed, nullable = typed
            outer = f"{class_paths[-2].rpartition('.')[2]}: " if len(class_paths) > 1 else ""
            return (
                f"{outer}`{key}`={value} is not accepted; expected {allowed} with its options under init_args"
                f"{', or null' if nullable else ''}."
            )
    return f"{owner}{sentence}"


class PulseArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors open with the sentence that says what is wrong (one line, exit 2).

    Set ``LIGHTNING_PULSE_TRACEBACK=1`` (or ``JSONARGPARSE_DEBUG=true``: jsonargparse takes only true or
    false there) for jsonargparse's full report.
    """

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        # the command line, for :meth:`error` to read a `--trainer.callbacks` value given on it (an iterator
        # is read once: the parser gets the same list)
        args = None if args is None else list(args)
        token = _COMMAND_LINE.set(tuple(sys.argv[1:] if args is None else args))
        try:
            return super().parse_args(args, *rest, **kwargs)
        finally:
            _COMMAND_LINE.reset(token)

    def parse_string(self, *args: Any, **kwargs: Any) -> Any:
        # the config being read, for :meth:`error` to name the entry of trainer.callbacks it refused
        content = args[0] if args else kwargs.get("content", kwargs.get("cfg_str"))
        token = _CONFIG_BEING_READ.set(content if isinstance(content, str) else None)
        try:
            return super().parse_string(*args, **kwargs)
        finally:
            _CONFIG_BEING_READ.reset(token)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if _verbose() or not self.exit_on_error:
            super().error(message, ex)
        summary = summarise_parser_error(message)
        if "trainer.callbacks" in message:
            summary = _last_callback_named(message, summary) or self._naming_the_callback_entry(summary)
        elif (built := _CALLBACKS_BUILT.get()) is not None:  # a nested config's constructor refused a value
            summary = nested_named("trainer.callbacks", built, summary)
        if message.startswith("Problems parsing config"):  # YAML that does not parse: where, in which file
            summary = _where_yaml_breaks(summary, _COMMAND_LINE.get())
        sys.stderr.write(f"error: {summary}\n")
        sys.stderr.write(
            f"(`{self.prog.replace(' [options]', '')} --help` lists the options; "
            f"{TRACEBACK_ENV}=1 prints the parser's full report)\n"
        )
        self.exit(2)

    def _naming_the_callback_entry(self, summary: str) -> str:
        """For a refusal of ``trainer.callbacks`` in the config being read: the first entry that is certainly
        no callback, by index and class, with its bad key or value, what is allowed and the closest accepted
        name; else ``summary`` (the parser's own sentence, e.g. on a wrong-typed value) with the entry it is
        about named in front where one entry is that class given that option, or, for a field of a nested
        config (``meters``, a scorer's init_args), with the entry, its class and the field's path."""
        import yaml

        content = _CONFIG_BEING_READ.get()
        if content is None:  # not a config file's: a whole `--trainer.callbacks` on the command line
            content = _callbacks_on_the_command_line(_COMMAND_LINE.get())
        if content is None or self.parser_mode not in ("yaml", "omegaconf"):
            return summary
        try:
            found = callback_entries(yaml.safe_load(content))
        except yaml.YAMLError:
            return summary
        if found is None:
            return summary
        # the parser stopped at the entry its sentence is about: that entry's problem, or the sentence named;
        # else the first entry certainly wrong
        problem = entries_problem(*found, only=entry_about(found[1], summary))
        if problem is not None:
            return problem
        named = entry_named(*found, summary)
        return nested_named(*found, summary) if named == summary else named


def _where_yaml_breaks(summary: str, args: Sequence[str]) -> str:
    """``summary`` with the file, line and column of the first ``--config`` file in ``args`` that is no YAML
    (jsonargparse names only ``"<unicode string>"``, the file's text it read)."""
    import yaml

    paths = [
        value if option == "--config" else option.partition("=")[2]
        for option, value in zip(args, [*args[1:], ""])
        if option == "--config" or option.startswith("--config=")
    ]
    for path in paths:
        try:
            yaml.safe_load(Path(path).read_text())
        except (OSError, UnicodeDecodeError):
            continue
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = "" if mark is None else f", line {mark.line + 1}, column {mark.column + 1}"
            return f"{summary.rstrip('.')} ({path}{where})."
    return summary


def _callbacks_on_the_command_line(args: Sequence[str]) -> str | None:
    """A config holding the last list or mapping given whole as ``--trainer.callbacks`` in ``args``."""
    given = [
        value if option == "--trainer.callbacks" else option.partition("=")[2]
        for option, value in zip(args, [*args[1:], ""])
        if option == "--trainer.callbacks" or option.startswith("--trainer.callbacks=")
    ]
    if not given or not given[-1].lstrip().startswith(("[", "{")):
        return None  # a class path, or an appended one (`+=`): the parser's own sentence names it
    return f"trainer: {{callbacks: {given[-1]}}}"


# the value jsonargparse reports for `--trainer.callbacks.<path>=<value>`, set on the last callback given
_NESTED_ARGUMENT = re.compile(r"( *)Given value: NestedArg\(key='([\w.]+)', val=(.*)\)")


def _last_callback_named(message: str, summary: str) -> str | None:
    """For a refused key or value of a nested config given on the command line (``--trainer.callbacks.meters.
    sampling_perod=1``, ``--trainer.callbacks.config={...}``): ``summary`` said of the last callback given, which
    jsonargparse sets it on, as of an entry in YAML (the field's path, the closest option); ``None`` for other
    reports, and for a callback's own option (the parser's sentence names the callback)."""
    import ast

    found = [match for line in message.splitlines() if (match := _NESTED_ARGUMENT.fullmatch(line))]
    if not found:
        return None
    outer = min(found, key=lambda match: len(match.group(1)))
    path = outer.group(2).removeprefix("init_args.")
    try:
        value = ast.literal_eval(outer.group(3))
    except (ValueError, SyntaxError):
        value = outer.group(3)
    if "." not in path and not isinstance(value, dict):
        return None
    class_paths = [
        path for path in re.findall(r"class_path '([\w.]+)'", message) if not path.endswith(".Callback")
    ]
    if not class_paths:
        return None
    entry = option_entry(class_paths[0], path, value, class_paths)
    before_its_class = option_before_its_class(class_paths[0], outer.group(2), class_paths)
    if before_its_class is not None:
        named = f"`trainer.callbacks` {class_paths[0].rpartition('.')[2]}: {before_its_class}."
    else:
        named = entries_problem("trainer.callbacks", entry) or nested_named(
            "trainer.callbacks", entry, summary
        )
    if named == summary:
        return None
    # a class-typed option's field named as typed (`scorer.init_args.los`, said `scorer.los` of YAML's entry)
    *fields, last = path.split(".")
    if fields and path != f"{fields[0]}.{last}":
        named = named.replace(f"`{fields[0]}.{last}`", f"`{path}`", 1)
    return re.sub(r"^(`[\w.]+` \w+): ", r"\1 (the last callback given): ", named, count=1)


#: the command line the parser is reading, while it reads it
_COMMAND_LINE: ContextVar[tuple[str, ...]] = ContextVar("lightning_pulse_command_line", default=())
#: the text of the config file (or string) the parser is reading, while it reads it
_CONFIG_BEING_READ: ContextVar[str | None] = ContextVar("lightning_pulse_config_being_read", default=None)
#: ``trainer.callbacks`` as parsed (plain data), while a refusal raised building them is reported
_CALLBACKS_BUILT: ContextVar[Any] = ContextVar("lightning_pulse_callbacks_built", default=None)


def _raised_by(error: BaseException) -> str:
    """The class whose ``__init__`` raised ``error`` (the innermost one), for the message's prefix."""
    owner = ""
    traceback = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        instance = frame.f_locals.get("self")
        if frame.f_code.co_name == "__init__" and instance is not None:
            owner = type(instance).__name__
        traceback = traceback.tb_next
    return owner


#: what the top-level ``--help`` adds after LightningCLI's subcommands
OTHER_COMMANDS = (
    "Energy reports: `report DIR` re-renders a run's energy report; `compare RUN_A RUN_B [--out DIR]` "
    "compares two runs; `wait-for-window DIR [--print]` waits for the clean window a run suspended by "
    "GreenWindow waits for. Each takes --help."
)


class PulseCLI(LightningCLI):
    """LightningCLI in subclass mode whose construction errors read like argument errors.

    A callback's ``ValueError`` (e.g. ``PulseCycle(burst="-5min")``) is raised while the classes are
    instantiated, before any training; it is reported as ``error: PulseCycle: <message>`` with exit code 2
    instead of a traceback. So is Lightning's refusal of two callbacks that would share a checkpoint entry.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("parser_class", PulseArgumentParser)
        # the top-level --help also names the commands main() dispatches before LightningCLI sees them
        kwargs.setdefault("parser_kwargs", {}).setdefault("epilog", OTHER_COMMANDS)
        self._seed_lines = HeldSeedLines()
        with self._seed_lines:
            super().__init__(*args, **kwargs)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            owner = _raised_by(error)
            text = str(error)
            # a refusal inside a nested config (`distill`, a scorer's init_args): named by the entry holding it
            token = _CALLBACKS_BUILT.set(self._callbacks_as_given())
            try:
                self.parser.error(f"{owner}: {text}" if owner and not text.startswith(owner) else text)
            finally:
                _CALLBACKS_BUILT.reset(token)
        except RuntimeError as error:
            duplicated = re.search(r"more than one stateful callback of type `(\w+)`", str(error))
            if duplicated is None:
                raise
            self.parser.error(_duplicated_callback(duplicated.group(1), self._given_callbacks()))
        self._seed_lines.release()  # the classes are built: the seed lines follow, before training

    def _callbacks_as_given(self) -> Any:
        """``trainer.callbacks`` of the parsed config as plain data (mappings, lists), or ``None``."""
        key = f"{self.subcommand}.trainer.callbacks" if self.subcommand else "trainer.callbacks"
        try:
            given = self.config.get(key)
        except Exception:  # the naming must never fail where the sentence would not
            return None

        def plain(value: Any) -> Any:
            if hasattr(value, "as_dict"):
                return value.as_dict()
            return [plain(item) for item in value] if isinstance(value, list) else value

        return plain(given)

    def _given_callbacks(self) -> list[Any]:
        """The callbacks built from ``trainer.callbacks`` (one or a list)."""
        key = f"{self.subcommand}.trainer.callbacks" if self.subcommand else "trainer.callbacks"
        given = self.config_init.get(key)
        return given if isinstance(given, list) else [given]


def _duplicated_callback(name: str, callbacks: list[Any]) -> str:
    """The error for two callbacks of class ``name`` that Lightning refuses: a checkpoint keeps a callback's
    state under its ``state_key``, the class name unless the callback adds some of its options to it, as
    ``{'prefix': 'mhc'}`` (HyperConnectionMonitor) or ModelCheckpoint's ``monitor``; a user's subclass of a
    lightning-pulse callback keeps the lightning-pulse class's name."""
    same = [callback for callback in callbacks if type(callback).__name__ == name]
    key = same[0].state_key if same else name
    options = key.removeprefix(pulse_class(same[0]).__qualname__) if same else ""
    keyed = [(f"`{option}`", value) for option, value in re.findall(r"'(\w+)': ([^,}]+)", options)]
    # Lightning names the later of the two: a user's subclass beside its lightning-pulse class shares its key
    kinds = sorted(
        {type(callback).__name__ for callback in callbacks if getattr(callback, "state_key", 0) == key}
    )
    if len(kinds) > 1:
        return (
            f"`trainer.callbacks` holds {' and '.join(kinds)}, which a checkpoint keeps under one key "
            f"{key!r} (a subclass keeps its lightning-pulse class's key); a Trainer takes one of them: "
            "remove the others."
        )
    if not keyed:
        return (
            f"`trainer.callbacks` holds {name} more than once; a Trainer takes one (a checkpoint keeps its "
            "state under the class name): remove the others."
        )
    names = " and ".join(option for option, _ in keyed)
    return (
        f"`trainer.callbacks` holds {name} more than once with "
        f"{' and '.join(f'{option}={value}' for option, value in keyed)}; a checkpoint keeps its state under "
        f"{names}: give each {name} a distinct {names}, or remove the others."
    )


class HeldSeedLines:
    """Holds Lightning's seed lines ("Seed set to 0", the "No seed found" warning) back until the classes are
    built, so that when a value is refused its error is the first line the user reads. The seed itself is set
    as before; :meth:`release` puts the logging and warning hooks back and emits the held lines, and leaving
    the block puts them back and drops what was never released."""

    SEED_LOGGER = "lightning.fabric.utilities.seed"

    def __init__(self) -> None:
        self.records: list[logging.LogRecord] = []
        self.warnings: list[tuple[Any, ...]] = []
        self._logger = logging.getLogger(self.SEED_LOGGER)
        self._show: Any = None  # warnings.showwarning while holding, else None

    def __enter__(self) -> HeldSeedLines:
        self._logger.addFilter(self._hold_record)
        self._show, warnings.showwarning = warnings.showwarning, self._hold_warning
        return self

    def _hold_record(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def _hold_warning(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "seed" in str(message).lower():
            self.warnings.append((message, category, filename, lineno, *rest))
        else:
            self._show(message, category, filename, lineno, *rest)

    def _stop_holding(self) -> bool:
        """Put the hooks back; whether they were still in place."""
        if self._show is None:
            return False
        self._logger.removeFilter(self._hold_record)
        warnings.showwarning, self._show = self._show, None
        return True

    def release(self) -> None:
        if not self._stop_holding():
            return
        for args in self.warnings:
            warnings.showwarning(*args)
        for record in self.records:
            self._logger.handle(record)
        self.records, self.warnings = [], []

    def __exit__(self, *exc: object) -> None:
        self._stop_holding()


def run_report(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="lightning-pulse report", description="Re-render an energy report.")
    parser.add_argument(
        "directory",
        help="an energy_report.json, or a log directory holding one (searched below it, as compare)",
    )
    args = parser.parse_args(list(argv))
    from lightning_pulse.energy.report import render_report

    try:
        written = render_report(args.directory, field="DIR")
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    for path in written:
        print(path)
    return 0


def run_compare(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-pulse compare",
        description="Run B against run A (the baseline): wall time, kWh, CO2, cost, final metrics, ratios B/A.",
    )
    parser.add_argument("run_a", help="the baseline: an energy_report.json, or a log directory holding one")
    parser.add_argument("run_b", help="the run compared with it: the same")
    parser.add_argument(
        "--out", help="where to write energy_comparison.{json,md,png} (default: next to RUN_B)"
    )
    args = parser.parse_args(list(argv))
    from lightning_pulse.energy.compare import compare_runs, comparison_markdown, load_run, write_comparison

    try:
        runs = [load_run(path, field=field) for field, path in (("RUN_A", args.run_a), ("RUN_B", args.run_b))]
    except (OSError, ValueError) as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    comparison = compare_runs(*runs)
    print(comparison_markdown(comparison))
    out = args.out if args.out is not None else os.path.dirname(runs[1]["path"])
    try:
        written = write_comparison(comparison, out)
    except OSError as error:
        sys.stderr.write(f"error: could not write the comparison to {out} ({error})\n")
        return 2
    for path in written:
        print(path)
    return 0


WINDOW_FORMATS = ("iso", "unix", "slurm")
#: the exit status of a wait interrupted by Ctrl-C: 128 + SIGINT, as a shell reports a process it ended
INTERRUPTED_EXIT = 130


def run_wait_for_window(argv: Sequence[str], clock: object | None = None) -> int:
    import argparse
    from datetime import datetime, timezone

    from lightning_pulse.core.green_window import (
        WINDOW_FINISHED_EXIT,
        finished_line,
        read_resume_file,
        wait_for_window,
    )

    parser = argparse.ArgumentParser(
        prog="lightning-pulse wait-for-window",
        description="Sleep until the clean window a run suspended by GreenWindow waits for, or print it.",
        epilog=f"Exit status: 0 the window is open (or its time printed); {WINDOW_FINISHED_EXIT} the run has "
        "completed, nothing to resume; 2 an error; 130 interrupted (Ctrl-C).",
    )
    parser.add_argument("path", help="green_window.json, or the checkpoint folder holding it")
    parser.add_argument("--print", action="store_true", help="print the time instead of sleeping")
    parser.add_argument(
        "--format",
        choices=WINDOW_FORMATS,
        default="iso",
        help="iso: UTC, e.g. 2026-03-01T02:00:00Z; unix: seconds; slurm: local time for sbatch --begin",
    )
    args = parser.parse_args(list(argv))
    try:
        record = read_resume_file(args.path)
    except ValueError as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    if record["status"] == "finished":  # on stderr: nothing for `sbatch --begin=$(... --print)` to read
        sys.stderr.write(f"{finished_line(args.path, record)}\n")
        return WINDOW_FINISHED_EXIT
    at = float(record["resume_at_unix"])
    if args.print:
        if args.format == "unix":
            print(f"{at:.0f}")
        elif args.format == "slurm":
            print(datetime.fromtimestamp(at).strftime("%Y-%m-%dT%H:%M:%S"))
        else:
            print(datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        return 0
    try:
        slept = wait_for_window(args.path, clock)  # type: ignore[arg-type]
    except (
        KeyboardInterrupt
    ):  # Ctrl-C on a wait one started is ordinary: a line, and the shell's 128 + SIGINT
        sys.stderr.write(
            f"wait-for-window: interrupted before the window opens; the run is still suspended, resume it "
            f"with: {record.get('resume_command', '')}\n"
        )
        return INTERRUPTED_EXIT
    print(f"window open ({slept / 3600:.2f} h waited); resume with: {record.get('resume_command', '')}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-pulse`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "report":
        return run_report(args[1:])
    if args and args[0] == "compare":
        return run_compare(args[1:])
    if args and args[0] == "wait-for-window":
        return run_wait_for_window(args[1:])
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    refused = _refused_jsonargparse_debug()
    if refused is not None:  # jsonargparse would stop on it with a traceback when building the parser
        sys.stderr.write(f"error: {refused}\n")
        return 2
    try:
        PulseCLI(
            model_class=None,
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=None if argv is None else args,
            save_config_kwargs={"overwrite": True},
        )
    except MisconfigurationException as error:
        # a refusal at fit start (a callback that cannot handle this model, a bad Trainer setting): the
        # message says what to change, and a traceback into Lightning's loops would bury it
        if _verbose():
            raise
        sys.stderr.write(f"error: {error}\n({TRACEBACK_ENV}=1 prints the traceback)\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
