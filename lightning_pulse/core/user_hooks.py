"""Which forward hooks on a model are the user's own, and where a failure went through one.

A model's forward can depend on hooks its author registered (a pre-hook gating a layer's inputs, a hook
rescaling a layer's output): a copy that is meant to compute what the model computes must keep them. Hooks
that machinery registered (this library's callbacks, Lightning's, a profiler's, torch's own) are not part of
the model's function, and a bound method of theirs would drag its owner, often the whole Trainer, into a
copy. Plain torch; nothing here imports Lightning.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from functools import partial
from typing import Any

from torch import nn

#: packages whose hooks on a model are machinery, not part of the model's function
MACHINERY_PACKAGES = (
    "lightning_pulse",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "torch",
    "torch_pruning",
)

#: the forward hook dicts of a module, with the dicts that hold flags for the same handle ids
FORWARD_HOOK_DICTS = {
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
}

#: how a message names each kind of hook
HOOK_KINDS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook"}


def _from_machinery(module_name: str | None) -> bool:
    name = module_name or ""
    return any(name == package or name.startswith(package + ".") for package in MACHINERY_PACKAGES)


def _unwrapped(hook: Any) -> Any:
    while isinstance(hook, partial):
        hook = hook.func
    return hook


def _closes_over_a_callback(function: Any) -> bool:
    # a function a callback defined inside its own method (``def hook(...): self.seen += 1``) is the callback's
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if any(cls.__name__ == "Callback" and _from_machinery(cls.__module__) for cls in type(value).__mro__):
            return True
    return False


def is_user_hook(hook: Any) -> bool:
    """Whether ``hook`` is the model author's own: a function defined outside :data:`MACHINERY_PACKAGES`, a
    bound method of a module (the model's own), or a callable object (or a method of an object) none of whose
    classes comes from those packages (a Lightning callback's method is machinery, whoever wrote it)."""
    target = _unwrapped(hook)
    owner = getattr(target, "__self__", None)
    if isinstance(target, (types.FunctionType, types.MethodType)):
        function = getattr(target, "__func__", target)
        if _from_machinery(getattr(function, "__module__", None)) or _closes_over_a_callback(function):
            return False
    else:
        owner = target  # a callable object
    if owner is None or isinstance(owner, types.ModuleType):
        return True
    if isinstance(owner, nn.Module):
        return not _from_machinery(type(owner).__module__)
    return not any(_from_machinery(cls.__module__) for cls in type(owner).__mro__ if cls is not object)


def user_hooks(model: nn.Module) -> Iterator[tuple[str, str, Any]]:
    """The user's forward hooks on ``model``'s modules: (module name, hook dict attribute, hook)."""
    for name, module in model.named_modules():
        for attribute in FORWARD_HOOK_DICTS:
            for hook in getattr(module, attribute, {}).values():
                if is_user_hook(hook):
                    yield name, attribute, hook


def hook_code(hook: Any) -> types.CodeType | None:
    """The code object a call of ``hook`` runs (its ``__call__`` for a callable object), or ``None``."""
    target = _unwrapped(hook)
    function = getattr(target, "__func__", target)
    code = getattr(function, "__code__", None)
    if code is None:
        # a callable object: the code of its class's call method
        call = type(target).__dict__.get("__call__") or next(
            (cls.__dict__["__call__"] for cls in type(target).__mro__ if "__call__" in cls.__dict__), None
        )
        code = getattr(call, "__code__", None)
    return code


def describe_hook(hook: Any) -> str:
    """``hook`` as a message names it: its qualified name and where it is defined."""
    target = _unwrapped(hook)
    function = getattr(target, "__func__", target)
    name = getattr(function, "__qualname__", None) or type(target).__qualname__
    code = hook_code(hook)
    if code is None:
        return f"`{name}`"
    return f"`{name}` ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"


def failing_user_hook(model: nn.Module, error: BaseException) -> tuple[str, str, Any] | None:
    """The user's hook on ``model`` that ``error`` was raised in (the innermost): (module name, hook dict
    attribute, hook), or ``None`` when the error came through none. The module is the one whose call ran the
    hook (one function may be registered on several)."""
    hooks = list(user_hooks(model))
    codes = {hook_code(hook) for _, _, hook in hooks} - {None}
    names = {id(module): name for name, module in model.named_modules()}
    found, caller, frame = None, None, error.__traceback__
    while frame is not None:
        owner = frame.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            caller = names[id(owner)]
        code = frame.tb_frame.f_code
        if code in codes:
            matches = [entry for entry in hooks if hook_code(entry[2]) is code]
            found = next((entry for entry in matches if entry[0] == caller), matches[0])
        frame = frame.tb_next
    return found
