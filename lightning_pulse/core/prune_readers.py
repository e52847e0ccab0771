"""Untraced readers: the modules that structured pruning's trace of ``forward`` never sees, and what they
read.

:class:`~lightning_pulse.ScheduledPrune` plans its structured cuts on a trace of ``forward``, and a cut
narrows the inputs of every module in that trace that reads the removed channels. A module with parameters
that ``forward`` never calls (an auxiliary head whose loss ``training_step`` adds, a projection head, a
linear probe) is not in the trace, and no cut narrows its inputs: a held-out sweep's auxiliary head, fed the
backbone's output in ``training_step``, failed with a bare torch shape error at its first call after the
first cut (``mat1 and mat2 shapes cannot be multiplied (32x57 and 64x3)``, at step 12; at step 32 when its
loss joined at epoch 2), while the event line had named it "left uncut".

:class:`UntracedReaders` finds those modules at fit start, and at each of their calls in training finds,
through the autograd graph of their inputs, the layers whose outputs they read. One that reads a layer whose
output channels the cut plan removes is refused at that call, before it runs: before any cut when the first
step calls it; after the cuts when it first runs later, which a warning after the first step foretells for
a module as wide as a cut output.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pulse.core import pruning
from lightning_pulse.core.carried_state import kept_carried_state, kept_python_state
from lightning_pulse.core.prune_targets import call_with, hidden_weight_readers, scripted_modules
from lightning_pulse.errors import PulseRefusal, first_names

#: how many autograd nodes the search for the layers a call reads visits at most
NODES_SEARCHED = 512


def untraced_modules(
    model: nn.Module, example: Any, precision: pruning.RunPrecision | None = None, skip: Collection[str] = ()
) -> tuple[list[str], nn.Module | None]:
    """The names of the modules of ``model`` holding parameters of their own that ``forward`` does not call on
    ``example`` (in eval mode, nor in training mode, as the trial cut calls it), leaving aside those inside
    ``skip`` (compiled parts) or a scripted module and those whose weight ``forward`` reads without calling
    them; and the copy of ``model`` it called, for :func:`narrowed_by_plan` (``None`` when there is no such
    module, or the forward fails: the trial cut has refused such a model)."""
    duplicate = pruning.copy_without_hooks(model, keep_user_hooks=True)
    names = {module: name for name, module in duplicate.named_modules()}
    inputs = pruning.inputs_for(duplicate, pruning.as_traced(example), precision)
    called: set[nn.Module] = set()

    def record(module: nn.Module, args: Any) -> None:
        called.add(module)

    # a scripted module refuses hooks (its submodules are left aside below)
    hooked = [m for m in duplicate.modules() if not isinstance(m, torch.jit.ScriptModule)]
    handles = [module.register_forward_pre_hook(record) for module in hooked]
    devices = sorted({p.device.index or 0 for p in duplicate.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for training in (False, True):
                duplicate.train(training)
                try:
                    call_with(duplicate, inputs)
                except Exception:  # the trial cut refused a model that fails in eval mode (and checks
                    if not training:  # eval mode only where training mode fails on the example)
                        return [], None
    finally:
        for handle in handles:
            handle.remove()
        duplicate.eval()
    outside = [*skip, *scripted_modules(duplicate)]
    read_directly = hidden_weight_readers(duplicate)  # `out_proj`: its weight is read in forward, not called
    found = [
        name
        for module, name in names.items()
        if module not in called
        and name not in read_directly
        and any(p is not None and p.is_floating_point() for p in module._parameters.values())
        and not any(name == part or name.startswith(part + ".") or part == "" for part in outside)
    ]
    return found, (duplicate if found else None)


def narrowed_by_plan(duplicate: nn.Module, pruner: pruning.Pruner, example: Any) -> dict[str, set[str]]:
    """The modules of ``duplicate`` (a copy of the model ``pruner`` cuts) whose output channels a channel
    group it may cut removes, each with the roots of those groups (the layers to leave out to keep it
    whole)."""
    graph = pruning.build_dependency_graph(duplicate, pruning.as_traced(example), pruner.run_precision)
    named = dict(duplicate.named_modules())
    names = {module: name for name, module in named.items()}
    roots = {name: named[name] for name in pruner.selection(duplicate).layers if name in named}
    narrowed: dict[str, set[str]] = {}
    for group in pruning.channel_groups(graph, duplicate, roots, pruner.user_frozen):
        for dependency, _ in group.group:
            module = dependency.target.module
            if module in names and graph.is_out_channel_pruning_fn(dependency.handler):
                narrowed.setdefault(names[module], set()).add(group.root)
    return narrowed


def layers_read(tensors: Sequence[torch.Tensor], owners: Mapping[int, str]) -> set[str]:
    """The modules whose outputs ``tensors`` were computed from: on each path of their autograd graph, the
    first operation that takes a parameter of a module named in ``owners`` (``id(parameter) -> module
    name``). Empty for tensors without autograd history (computed under ``torch.no_grad()``, detached)."""
    found: set[str] = set()
    stack = [tensor.grad_fn for tensor in tensors if tensor.grad_fn is not None]
    seen: set[Any] = set()
    while stack and len(seen) < NODES_SEARCHED:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        taken = {owners[id(p)] for p in _parameters_taken(node) if id(p) in owners}
        if taken:
            found |= taken
            continue
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return found


def _parameters_taken(node: Any) -> Iterator[torch.Tensor]:
    # an operation's parameter inputs: leaves reached directly or through a transpose, cast or view
    for child, _ in node.next_functions:
        for _ in range(3):
            if child is None or hasattr(child, "variable") or len(child.next_functions) != 1:
                break
            child = child.next_functions[0][0]
        if child is not None and isinstance(getattr(child, "variable", None), nn.Parameter):
            yield child.variable


def input_width(module: nn.Module) -> int | None:
    """The width of the inputs ``module`` takes: its input features or channels (a linear, convolution or norm
    layer), else ``None``."""
    if isinstance(module, nn.Linear):
        return module.in_features
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return module.in_channels
    if isinstance(module, nn.LayerNorm):
        return module.normalized_shape[-1]
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return module.num_features
    if isinstance(module, nn.GroupNorm):
        return module.num_channels
    return None


def width_mismatch(module: nn.Module, tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """``(its width, the width the layer takes)`` when the first of ``tensors`` no longer fits ``module``
    (:func:`input_width`), else ``None``."""
    wanted = input_width(module)
    if wanted is None or not tensors or tensors[0].dim() < 2:
        return None
    shape = tensors[0].shape
    if isinstance(module, (nn.Linear, nn.LayerNorm)):
        got = shape[-1]
    elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        got = shape[1 if len(shape) == len(module.kernel_size) + 2 else 0]  # batched, or one sample
    else:
        got = shape[1]
    return (int(got), int(wanted)) if got != wanted else None


def _output_width(module: nn.Module) -> int | None:
    for attribute in ("out_features", "out_channels", "num_features", "num_channels"):
        if isinstance(value := getattr(module, attribute, None), int):
            return value
    return module.normalized_shape[-1] if isinstance(module, nn.LayerNorm) else None


def as_wide_as_cut(
    model: nn.Module, untraced: Sequence[str], narrowed: Mapping[str, Collection[str]]
) -> dict[str, list[str]]:
    """Of the ``untraced`` modules of ``model`` with trainable parameters, those whose inputs are as wide as
    the output of a module the cuts narrow (``narrowed``, :func:`narrowed_by_plan`), with those modules: a
    reader of theirs that the first step did not show reading something else, which
    :meth:`UntracedReaders.after_first_step` warns of."""
    named = dict(model.named_modules())
    widths = {name: _output_width(named[name]) for name in sorted(narrowed) if name in named}
    found = {}
    for name in untraced:
        module = named[name]
        if not any(p.requires_grad for p in module._parameters.values() if p is not None):
            continue
        same = [
            layer for layer, width in widths.items() if width is not None and width == input_width(module)
        ]
        if same:
            found[name] = same
    return found


class UntracedReaders:
    """Structured: watches the calls in training of the modules ``forward`` does not call (an auxiliary head
    called from ``training_step``), and refuses the run at the call of one that reads channels the cuts remove
    (:func:`layers_read` against :func:`narrowed_by_plan`), or, after a cut, whose input no longer fits it
    (:func:`width_mismatch`): the cut plan, made on the trace of ``forward``, cannot narrow such a module's
    inputs. Its hooks exist only on those modules, which most models do not have."""

    def __init__(self) -> None:
        self.started = False
        self.read: dict[str, set[str]] = {}  # module -> the layers its first call with autograd history read
        self._narrowed: dict[str, set[str]] = {}
        self._owners: dict[int, str] = {}
        self._handles: list[Any] = []
        self._pruner: pruning.Pruner | None = None
        self._wide: dict[str, list[str]] = {}  # as_wide_as_cut, until after_first_step

    def start(
        self, model: nn.Module, pruner: pruning.Pruner, example: Any, skip: Collection[str] = ()
    ) -> None:
        """At fit start, once the trace input ``example`` is known: find the modules
        (:func:`untraced_modules`; ``skip``: the compiled parts) and hook their calls."""
        self.started, self._pruner, self.read, self._narrowed = True, pruner, {}, {}
        # the user's hooks run on the copy; one closing over the model (``self.acts.append``) writes into it
        with kept_python_state(model), kept_carried_state(model):
            untraced, duplicate = untraced_modules(model, example, pruner.run_precision, skip)
            if duplicate is None:
                return
            try:
                self._narrowed = narrowed_by_plan(duplicate, pruner, example)
            except Exception:  # the trial cut built this graph: no reason to stop a run it passed; the
                self._narrowed = {}  # width check after a cut still names a reader its cut breaks
        del duplicate
        named = dict(model.named_modules())
        self._owners = {
            id(parameter): name
            for name, module in named.items()
            if name
            for parameter in module._parameters.values()
            if parameter is not None
        }
        for name in untraced:
            self._handles.append(named[name].register_forward_pre_hook(self._before(name), with_kwargs=True))
        self._wide = as_wide_as_cut(model, untraced, self._narrowed)

    def after_first_step(self) -> str | None:
        """Once, after the fit's first optimizer step: the warning for the modules as wide as a cut output
        (:func:`as_wide_as_cut`) whose calls did not show what they read (none came, or none with autograd
        history): a later call may find one reading it, with the model already cut. Else ``None``."""
        wide = {name: layers for name, layers in self._wide.items() if name not in self.read}
        self._wide = {}
        if not wide:
            return None
        name, layers = next(iter(wide.items()))
        more = f" (and {first_names(list(wide)[1:], 3)} likewise)" if len(wide) > 1 else ""
        return (
            f"ScheduledPrune: `{name}`{more} holds trainable parameters that `forward` does not call, and "
            f"takes inputs as wide as the output of {first_names([f'`{n}`' for n in layers], 3)}, whose "
            "channels the structured cuts remove. The cuts follow the trace of `forward` only and cannot "
            "narrow its inputs: if a step calls it on that output, the run stops at that call, with the "
            "model already cut if the call first comes after a cut (an auxiliary loss switched on after a "
            "warm-up). Call it inside `forward` and return its output with the model's; or leave out the "
            "layers whose output it reads with `exclude_pattern`; or use mode='unstructured'."
        )

    def stop(self) -> None:
        """Remove the hooks (the fit's end, teardown, an exception): the module leaves the fit as it came."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._owners, self._wide, self.started = [], {}, {}, False

    def _before(self, name: str) -> Any:
        def before_call(module: nn.Module, args: Any, kwargs: Any) -> None:
            tensors = list(_floating_tensors((args, kwargs)))
            if name not in self.read and (read := layers_read(tensors, self._owners)):
                self.read[name] = read
            narrowed = sorted(self.read.get(name, set()) & self._narrowed.keys())
            cut = self._pruner is not None and bool(self._pruner.history)
            mismatch = width_mismatch(module, tensors) if cut and not narrowed else None
            if narrowed:
                layers = first_names([f"`{layer}`" for layer in narrowed], 3)
                what = f"reads the output of {layers}, whose channels the cuts remove"
            elif mismatch is not None:
                what = f"is called on inputs {mismatch[0]} wide where it takes {mismatch[1]}: a cut removed "
                what += "channels of what it reads"
            else:
                return
            self.stop()  # the run stops here: the module leaves it as it came
            raise PulseRefusal(self._refusal(name, what, narrowed))

        return before_call

    def _refusal(self, name: str, what: str, narrowed: Sequence[str]) -> str:
        pruner = self._pruner
        cut = pruner is not None and bool(pruner.history)
        roots = sorted({root for layer in narrowed for root in self._narrowed[layer]})
        if roots:
            pattern = "|".join(p for p in (pruner.exclude_pattern, pruning.exact_names_pattern(roots)) if p)
            leave_out = f"leave out the layers whose cut reaches it with `exclude_pattern`={pattern!r}"
        else:
            leave_out = "leave out the layer whose output it reads with `exclude_pattern`"
        then = (
            "The model is already cut (the run stops here, at this call): start again, from a checkpoint "
            "saved before the first pruning event or from scratch, with one of these ways out."
            if cut
            else "Refused at this call, before any cut."
        )
        return (
            f"ScheduledPrune: structured pruning cannot run on this model: `{name}` is called outside "
            "`forward` (in a step), so the trace of `forward` that plans the cuts never sees it, and it "
            f"{what}. No cut narrows its inputs to match: it fails with a shape error at its first call "
            f"after a cut (or computes without those channels). {then} Call `{name}` inside `forward` and "
            "return its output with the model's (the trace then narrows its inputs with the rest); or "
            f"{leave_out}; or use mode='unstructured'."
        )


def _floating_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _floating_tensors(item, depth + 1)
    elif depth < 4 and isinstance(value, Mapping):
        for item in value.values():
            yield from _floating_tensors(item, depth + 1)
