"""Whether code runs inside a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ``vjp``, ``jvp``,
``functionalize``), and the plain tensor under a transform's wrapper. Plain torch.

A ``training_step`` may call the model inside a transform: a Jacobian penalty through ``vmap(jacrev(net))``,
per-sample gradients through ``vmap(grad(...))`` with ``functional_call``. A module hook then sees wrapped
tensors that have no storage of their own (``data_ptr()`` raises) and may not write a tensor the transform
captured (``zero_()`` raises), and a call inside ``vmap`` sees one sample at a time. torch has no public test
for either: the private ``torch._C`` functions (``_are_functorch_transforms_active``, and in
``torch._C._functorch`` the interpreter stack and the wrapper tests) are read here only, and where this torch
lacks them no transform is seen (the callers then behave as before).
"""

from __future__ import annotations

from typing import Any

import torch

_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)  # what autograd.Function.apply reads
_FUNCTORCH = getattr(torch._C, "_functorch", None)


def transform_active() -> bool:
    """Whether the caller runs inside a ``torch.func`` transform."""
    return bool(_ACTIVE()) if _ACTIVE is not None else False


def differentiating() -> bool:
    """Whether one of the active ``torch.func`` transforms differentiates (``grad``, ``vjp``, ``jacrev``,
    ``jacfwd``, ``jvp``, ``hessian``), not only batches (``vmap``) or functionalizes."""
    stack = getattr(_FUNCTORCH, "get_interpreter_stack", None)
    levels = stack() if stack is not None and transform_active() else None
    return any(str(level.key()).endswith(("Grad", "Jvp")) for level in levels or ())


def unwrapped(tensor: Any) -> Any:
    """``tensor`` without the wrappers a ``torch.func`` transform put around it (itself if none): the tensor
    at the level of ordinary autograd, which holds the storage and the graph node."""
    if _FUNCTORCH is None or not isinstance(tensor, torch.Tensor):
        return tensor
    while _FUNCTORCH.is_functorch_wrapped_tensor(tensor):
        tensor = _FUNCTORCH.get_unwrapped(tensor)
    return tensor
