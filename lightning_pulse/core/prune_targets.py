"""What of a model can be pruned safely, and how to call it for a structured trace: checks run before the
first step, on any ``nn.Module``.

* Layers whose weight is read without calling the layer (``nn.MultiheadAttention`` reads ``out_proj.weight``
  inside ``F.multi_head_attention_forward``) never see a pruning forward pre-hook refresh their masked weight;
  they are left out.
* A parameter held by several modules (tied embeddings, ``b.weight = a.weight``) is pruned only when every
  owner is pruned with the same mask; otherwise all its owners are left out.
* Hugging Face builds GPT-2 style blocks from ``transformers.pytorch_utils.Conv1D`` (weight ``(in, out)``),
  matched by :class:`HFConv1D` without importing ``transformers``.

Nothing here imports Lightning or ``transformers``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from copy import copy as shallow_copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize
from torch.optim.swa_utils import AveragedModel

from lightning_pulse.core.func_transforms import unwrapped
from lightning_pulse.nn.hyper_connections import HyperConnection


def is_hf_conv1d(module: object) -> bool:
    """Whether ``module`` is (a subclass of) Hugging Face's ``transformers.pytorch_utils.Conv1D``."""
    return any(
        cls.__name__ == "Conv1D" and cls.__module__.split(".")[0] == "transformers"
        for cls in type(module).__mro__
    )


class _MatchesHFConv1D(type):
    def __instancecheck__(cls, instance: object) -> bool:
        return is_hf_conv1d(instance)


class HFConv1D(nn.Module, metaclass=_MatchesHFConv1D):
    """Stands for Hugging Face's ``Conv1D`` in ``layer_types`` (``"HFConv1D"``): ``isinstance(m, HFConv1D)``
    is true for a ``transformers.pytorch_utils.Conv1D``, matched by its class's module and name."""


def scales_channels(module: nn.Module) -> bool:
    """Whether ``module``'s own ``weight`` has fewer than two dimensions: a per-channel scale (a norm of any
    kind, ``torch``'s, Hugging Face's ``LlamaRMSNorm`` or a user's; a ``PReLU``), whose channels are its
    input's. Structured pruning cuts them with the layer that makes them; as a channel group's root
    (``layer_types=None`` chooses them) they would stand in that layer's place, which the report then calls
    uncut. An uninitialized lazy weight has no dimensions yet: ``False``."""
    weight = _own_parameter(module, "weight")
    return weight is not None and not is_lazy(weight) and weight.dim() < 2


def _own_parameter(module: nn.Module, name: str) -> Any:
    # a torch.jit.script'ed module's `_parameters` is an OrderedDictWrapper, which has no `.get`
    parameters = module._parameters
    return parameters[name] if name in parameters else None


def _has_weight(module: nn.Module) -> bool:
    return isinstance(_own_parameter(module, "weight"), nn.Parameter) or isinstance(
        _own_parameter(module, "weight_orig"), nn.Parameter
    )


#: why a layer inside a ``torch.jit.script``'ed part is never pruned
SCRIPTED = "inside a torch.jit.script'ed part, which runs TorchScript and takes no pruning hook"


def scripted_modules(model: nn.Module) -> set[str]:
    """Names of the modules of ``model`` that are ``torch.jit.script``'ed (and so are all their submodules):
    a ScriptModule refuses forward hooks, and its forward reads its weights inside TorchScript, so a mask
    could neither be added nor reach the weight it computes."""
    return {name for name, module in model.named_modules() if isinstance(module, torch.jit.ScriptModule)}


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors ``value`` is or holds, in lists, tuples and mappings at any depth (an HF ``ModelOutput``
    is a mapping)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


@contextmanager
def hooks_on(modules: Iterable[nn.Module], register: Callable[[nn.Module], Any]) -> Iterator[None]:
    """``register(module)`` (a ``register_*_hook`` call, giving its handle) for each of ``modules`` inside
    the block, the hooks removed after. A ``torch.jit.script``'ed module refuses hooks and is left out."""
    handles = [register(module) for module in modules if not isinstance(module, torch.jit.ScriptModule)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _old_style_norm(module: nn.Module) -> bool:
    """Whether a forward pre-hook computes the layer's ``weight`` from other tensors: the older
    ``torch.nn.utils.spectral_norm`` (whose ``weight_orig`` looks like a pruned layer's) or ``weight_norm``."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return any(isinstance(hook, (SpectralNorm, WeightNorm)) for hook in module._forward_pre_hooks.values())


def weight_computation_removal(module: nn.Module) -> str:
    """The call that makes ``module``'s computed ``weight`` a plain parameter again
    (:func:`computes_its_weight`): each kind has its own, and the others raise on it
    (``remove_parametrizations`` on an old-style ``weight_norm``: "does not have a parametrization on
    weight")."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    hooks = module._forward_pre_hooks.values()
    if not parametrize.is_parametrized(module, "weight"):
        if any(isinstance(hook, WeightNorm) for hook in hooks):
            return "torch.nn.utils.remove_weight_norm(layer)"
        if any(isinstance(hook, SpectralNorm) for hook in hooks):
            return "torch.nn.utils.remove_spectral_norm(layer)"
    return "torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight')"


def computes_its_weight(module: nn.Module) -> bool:
    """Whether ``module``'s ``weight`` is computed from other tensors at each forward: a parametrization, or
    the older ``weight_norm`` / ``spectral_norm`` hooks. Such a layer is never pruned, nor cut as a consumer."""
    return parametrize.is_parametrized(module, "weight") or _old_style_norm(module)


def _weight(module: nn.Module) -> nn.Parameter:
    weight = _own_parameter(module, "weight_orig")
    return weight if weight is not None else _own_parameter(module, "weight")


def hidden_weight_readers(model: nn.Module) -> dict[str, str]:
    """Layers whose weight is read without their forward (so without a pruning pre-hook), with the reason."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            for child_name, child in module.named_modules():
                if child_name and _has_weight(child):
                    found[f"{name}.{child_name}" if name else child_name] = (
                        "nn.MultiheadAttention reads its weight directly, past the pruning hook"
                    )
    return found


#: why a layer inside a ``torch.optim.swa_utils.AveragedModel`` is never pruned on its own
AVERAGED_COPY = (
    "inside an AveragedModel (EMA/SWA): a copy averaged from another module by position, not trained; masks "
    "of its own would not be the model's"
)


def averaged_copies(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: averaged module}`` of each ``torch.optim.swa_utils.AveragedModel`` in ``model`` (outermost
    ones): ``name`` is that of the copy it averages into (``<averaged model>.module``). Its parameters require
    grad, yet no optimizer trains them: ``update_parameters`` averages another module's tensors into them."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        inner = getattr(module, "module", None)
        if (
            isinstance(module, AveragedModel)
            and isinstance(inner, nn.Module)
            and not any(name.startswith(f"{outer}.") for outer in found)
        ):
            found[f"{name}.module" if name else "module"] = inner
    return found


def _inside(name: str, parts: Collection[str]) -> bool:
    return any(name == part or name.startswith(f"{part}.") for part in parts)


def averaged_parts(model: nn.Module) -> dict[str, str]:
    """``{averaged copy: part}``: each AveragedModel copy (:func:`averaged_copies`) and the part of ``model``
    outside every copy with its type and structure that it is averaged from, as ``AveragedModel(self.net)``
    makes it (``update_parameters(self.net)`` pairs their tensors by position). Of several such parts (two
    identical towers, an EMA of one ``Linear`` among many of its shape), the one whose values are nearest the
    copy's: an average follows its part (at the start of a fit, equal to it), not a twin."""
    copies = averaged_copies(model)
    found = {}
    for copy_name, copy in copies.items():
        shape = _structure(copy, plain=True)
        candidates = [
            name
            for name, part in model.named_modules()
            if name
            and type(part) is type(copy)
            and not _inside(name, copies)
            and _structure(part, plain=True) == shape
        ]
        if candidates:
            found[copy_name] = min(candidates, key=lambda name: _distance(copy, model.get_submodule(name)))
    return found


@torch.no_grad()
def _distance(copy: nn.Module, part: nn.Module) -> float:
    """The squared distance between the parameters of two modules of one structure, paired by position."""
    return sum(
        float((a.detach().float() - b.detach().float().to(a.device)).pow(2).sum())
        for a, b in zip(copy.parameters(), part.parameters())
    )


def averaged_sources(model: nn.Module, layers: Mapping[str, nn.Module]) -> dict[str, str]:
    """The entries of :func:`averaged_parts` whose part holds some of ``layers``."""
    splits = [name.split(".") for name in layers]
    holding = {".".join(parts[:end]) for parts in splits for end in range(1, len(parts) + 1)}
    return {copy: part for copy, part in averaged_parts(model).items() if part in holding}


def uncut_averaged_copies(before: nn.Module, after: nn.Module) -> list[tuple[str, str]]:
    """``(copy, part)`` of :func:`averaged_parts` in ``before`` where ``after`` (a copy of it a trial cut has
    pruned) changed a parameter shape of the part and none of the copy's: a part left out whose inputs
    another layer's cut narrows (an EMA of a head behind a cut body), whose average then fails on the
    shapes."""

    def shapes(model: nn.Module, name: str) -> list[tuple[int, ...]]:
        return [tuple(p.shape) for p in model.get_submodule(name).parameters()]

    return [
        (copy, part)
        for copy, part in averaged_parts(before).items()
        if shapes(before, part) != shapes(after, part) and shapes(before, copy) == shapes(after, copy)
    ]


def parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> [qualified names]``, one per module attribute holding it (found over every module
    name, ``remove_duplicate=False``), each under its module's name in ``named_modules()``; a pruned
    ``weight_orig`` is named ``weight``.

    A second name for the same module (a handle such as ``self.first = self.backbone[0]``, or
    ``self.features = self.backbone``) is no second owner: counted as one, its layer was left out as "shared
    with first.weight, which is not pruned" (a sweep: 93% of a model unpruned), and structured mode failed
    with ``KeyError: 'first'``, a name ``named_modules()`` does not give."""
    module_names = {id(module): name for name, module in model.named_modules()}
    owners: dict[int, list[str]] = {}
    seen: set[tuple[int, str]] = set()
    for _, module in model.named_modules(remove_duplicate=False):
        for key, parameter in module._parameters.items():
            if parameter is None or (id(module), key) in seen:
                continue
            seen.add((id(module), key))
            key = key[: -len("_orig")] if key == "weight_orig" else key
            prefix = module_names[id(module)]
            owners.setdefault(id(parameter), []).append(f"{prefix}.{key}" if prefix else key)
    return owners


def shared_parameters_of(model: nn.Module, names: Collection[str]) -> dict[str, list[str]]:
    """The parameters the modules ``names`` hold that another module (or attribute) holds too: the first
    qualified name of each -> every qualified name holding it."""
    names = set(names)
    return {
        owners[0]: owners
        for owners in parameter_owners(model).values()
        if len(owners) > 1 and any(owner.rpartition(".")[0] in names for owner in owners)
    }


def shared_parameter_modules(model: nn.Module) -> set[nn.Module]:
    """Modules holding a parameter that another module (or another attribute) holds too."""
    modules = dict(model.named_modules())
    shared = set()
    for names in parameter_owners(model).values():
        if len(names) > 1:
            shared.update(modules[name.rpartition(".")[0]] for name in names)
    return shared


@dataclass
class LayerSelection:
    """The layers to prune and why others were left out.

    Attributes:
        layers: qualified name -> layer, in model order.
        left_out: qualified name -> why a layer of the chosen types was not selected.
        aliases: name of a layer whose weight is another selected layer's -> that layer's name (they share
            one mask).
    """

    layers: dict[str, nn.Module] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def primaries(self) -> dict[str, nn.Module]:
        """The selected layers, one per distinct weight."""
        return {name: layer for name, layer in self.layers.items() if name not in self.aliases}

    def describe_left_out(self, limit: int = 6) -> str:
        """``"a (why), b (why)"``, at most ``limit`` entries and a count of the rest."""
        items = [f"{name} ({why})" for name, why in self.left_out.items()]
        more = len(items) - limit
        return ", ".join(items[:limit]) + (f" and {more} more" if more > 0 else "")


#: why a layer whose ``weight`` is computed at every read is never pruned (:func:`computes_its_weight`)
COMPUTED_WEIGHT = "its weight is computed by a parametrization (weight_norm, spectral_norm...)"

#: why structured pruning leaves out a layer holding a parameter another module holds too (a tie)
SHARED_PARAMETER = "holds a parameter that another module holds too; cutting it cuts one owner"

#: why a layer whose ``weight`` the user froze is never pruned (:func:`frozen_layers`)
FROZEN_BY_USER = "frozen by the user (`requires_grad=False`)"


def _of_types(module: nn.Module, layer_types: tuple[type, ...], scripted: bool) -> bool:
    # a scripted layer is a RecursiveScriptModule, which keeps the name of the class it was made from
    if scripted:
        return any(kind.__name__ == getattr(module, "original_name", None) for kind in layer_types)
    return isinstance(module, layer_types)


def select_targets(
    model: nn.Module,
    layer_types: tuple[type, ...] = (),
    exclude: str | None = None,
    structured: bool = False,
    frozen: Collection[str] = (),
    not_trained: Mapping[str, str] | None = None,
) -> LayerSelection:
    """The layers of ``model`` to prune: the one place that decides what is prunable.

    A candidate has a ``weight`` parameter, is one of ``layer_types`` (any type when empty; ``structured``:
    any type but the per-channel scales of :func:`scales_channels`, cut with the layer before them) and its
    name does not match ``exclude`` (``re.search``). Layers named in ``frozen`` (:func:`frozen_layers` at the
    fit's start) are left out: pruning them would change weights the user froze. So are layers whose weight a
    parametrization computes (``weight_norm``, ``spectral_norm``). Candidates read without their hook
    are left out; so are owners of a shared weight unless all owners are candidates (then they share one
    mask). ``structured``: any layer holding a shared parameter is left out (cutting it would cut one owner
    only). Layers inside a ``torch.jit.script``'ed part (:func:`scripted_modules`) and those in
    ``not_trained`` (name -> why: a forward seen reading another tensor than the layer's own weight,
    :class:`OwnWeightWatch`) are left out with their reason, and so are the layers of the copy a
    ``torch.optim.swa_utils.AveragedModel`` averages into (:func:`averaged_copies`; :data:`AVERAGED_COPY`).
    """
    not_trained = not_trained or {}
    selection = LayerSelection()
    hidden = hidden_weight_readers(model)
    scripted = scripted_modules(model)
    averaged = averaged_copies(model)
    for name, module in model.named_modules():
        parametrized = bool(name) and name not in scripted and computes_its_weight(module)
        if not name or not (parametrized or _has_weight(module)):
            continue
        if layer_types and not _of_types(module, layer_types, name in scripted):
            continue
        if structured and not layer_types and scales_channels(module):
            continue
        if exclude is not None and re.search(exclude, name) is not None:
            continue
        if name in scripted:
            selection.left_out[name] = SCRIPTED
        elif _inside(name, averaged):
            selection.left_out[name] = AVERAGED_COPY
        elif name in not_trained:
            selection.left_out[name] = not_trained[name]
        elif parametrized:
            # weight_norm, spectral_norm, orthogonal...: `weight` is computed from other tensors on every read, so
            # a mask on it would not hold, and zeros in those tensors need not be zeros of the weight
            selection.left_out[name] = COMPUTED_WEIGHT
        elif name in frozen:
            selection.left_out[name] = FROZEN_BY_USER
        elif name in hidden:
            selection.left_out[name] = hidden[name]
        else:
            selection.layers[name] = module
    if structured:
        shared = shared_parameter_modules(model)
        for name in [name for name, module in selection.layers.items() if module in shared]:
            selection.left_out[name] = SHARED_PARAMETER
            del selection.layers[name]
    groups: dict[int, list[str]] = {}
    for name, module in selection.layers.items():
        groups.setdefault(id(_weight(module)), []).append(name)
    owners = parameter_owners(model)
    for key, names in groups.items():
        others = [owner for owner in owners[key] if owner not in {f"{name}.weight" for name in names}]
        if others:
            for name in names:
                selection.left_out[name] = f"weight shared with {others[0]}, which is not pruned"
                del selection.layers[name]
        else:
            selection.aliases.update({name: names[0] for name in names[1:]})
    return selection


#: why a layer whose forward was seen reading another tensor than its own weight is never pruned
NOT_OWN_WEIGHT = (
    "its forward read a `weight` passed in for it, not its own parameter (torch.func.functional_call: a "
    "hypernetwork, fast weights); a mask would overwrite that weight with its own"
)


class OwnWeightWatch:
    """Whether the forward of each layer to mask reads the layer's own ``weight`` parameter, seen over the
    fit's first optimizer step (unstructured: a mask's forward pre-hook sets ``layer.weight`` to ``weight_orig
    * mask`` before every call).

    A hypernetwork's ``functional_call(target, generated, x)`` calls ``target``'s layers with the generated
    tensors swapped in as their ``weight``, and never reads their own: a mask hook overwrote the generated
    weights with the unused own ones at every call after the first event, so the model stopped using and
    training them (a held-out run's accuracy fell from 0.89 to 0.30) while the events reported the target's
    layers pruned. Such a layer is left out (:data:`NOT_OWN_WEIGHT`). The signal is the forward's own read,
    not a missing gradient: a layer a batch does not route to (a MoE expert) or one whose gradients the user
    zeroes has none after a step and is pruned as any other. A weight passed in that shares the parameter's
    storage (a detached alias for a stop-gradient target, per-sample gradients through ``vmap``) is the
    layer's own. One forward pre-hook per watched layer (an identity check; nothing counted, so a compiled
    model is not recompiled), until :meth:`stop`. Layers masked already (a resume) compute their weight and
    are not watched.
    """

    def __init__(self) -> None:
        self.substituted: dict[str, str] = {}
        #: the layers whose ``weight`` parameter was replaced by another one while watched (:meth:`stop`)
        self.replaced: list[str] = []
        self._handles: dict[str, Any] = {}
        self._owns: dict[str, tuple[nn.Module, nn.Parameter]] = {}

    def start(self, layers: Mapping[str, nn.Module]) -> None:
        """Watch the forwards of ``layers`` (name -> layer) from now on."""
        self.stop()
        for name, layer in layers.items():
            own = _own_parameter(layer, "weight")
            if isinstance(own, nn.Parameter) and "weight_orig" not in layer._parameters:
                self._handles[name] = layer.register_forward_pre_hook(self._hook(name, layer, own))
                self._owns[name] = (layer, own)

    def _hook(self, name: str, layer: nn.Module, own: nn.Parameter) -> Any:
        def check(module: nn.Module, args: Any) -> None:
            if module is not layer:  # a deep copy of the model (a user's teacher) carries the hook too
                return
            weight = getattr(module, "weight", None)
            if weight is own or _aliases(weight, own):
                return
            self.substituted[name] = NOT_OWN_WEIGHT
            if (handle := self._handles.pop(name, None)) is not None:
                handle.remove()

        return check

    def stop(self) -> dict[str, str]:
        """Stop watching; the layers seen reading another ``weight`` than their own, with why. The layers
        whose ``weight`` is no longer the parameter :meth:`start` found go to :attr:`replaced`: code that
        assigns a new one (``layer.weight = nn.Parameter(...)`` in a forward, as a VQ-VAE's EMA codebook
        does) would replace the masked weight that a mask's hook computes, and the first refresh after an
        event failed (``TypeError: cannot assign 'torch.FloatTensor' as parameter 'weight'``)."""
        for handle in self._handles.values():
            handle.remove()
        self.replaced = [
            name for name, (layer, own) in self._owns.items() if layer._parameters.get("weight") is not own
        ]
        self._handles, self._owns = {}, {}
        found, self.substituted = self.substituted, {}
        return found

    def __getstate__(self) -> dict[str, Any]:  # pickled for spawning strategies: without hooks or layers
        return {"substituted": {}, "replaced": [], "_handles": {}, "_owns": {}}


@torch._dynamo.disable  # a storage pointer is no graph op; reached only for a weight other than the own one
def _aliases(weight: Any, own: nn.Parameter) -> bool:
    """Whether ``weight`` shares ``own``'s storage (a detached alias, also inside ``vmap``/``grad``)."""
    if not isinstance(weight, torch.Tensor):
        return False
    try:
        weight = unwrapped(weight)
        return weight.untyped_storage().data_ptr() == own.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor without storage (a fake or meta tensor)
        return False


def frozen_layers(model: nn.Module) -> frozenset[str]:
    """Names of the layers whose ``weight`` does not require grad: read at setup, before any callback freezes
    a layer for its own reasons (GradientCache), so it holds what the user froze."""
    return frozenset(
        name
        for name, module in model.named_modules()
        if name and _has_weight(module) and not _weight(module).requires_grad
    )


def _structure(module: nn.Module, plain: bool = False) -> tuple:
    """What two modules must share to be copies of each other: their submodules' names and types, and their
    parameters' names, shapes and dtypes; ``plain``: a masked ``X.weight_orig`` named ``X.weight``."""

    def named(name: str) -> str:
        return name[: -len("_orig")] if plain and name.endswith("weight_orig") else name

    return (
        tuple((name, type(m).__name__) for name, m in module.named_modules()),
        tuple((named(name), tuple(p.shape), p.dtype) for name, p in module.named_parameters()),
    )


def _same_values(a: nn.Module, b: nn.Module) -> bool:
    # a few leading entries first: a frozen encoder's submodules are compared with every part of their shape,
    # and most differ there, without reading whole weights
    pairs = list(zip(a.parameters(), b.parameters()))
    return all(
        torch.equal(p.detach().reshape(-1)[:16], q.detach().reshape(-1)[:16]) for p, q in pairs
    ) and all(torch.equal(p.detach(), q.detach()) for p, q in pairs)


def _distinctive(module: nn.Module) -> bool:
    """Whether a parameter of ``module`` holds two different values: a zero-initialised layer (a DiT's final
    or modulation layer, a LoRA ``B``) equals any other of its shape without being copied from it."""
    return any(p.numel() > 1 and not bool((p == p.reshape(-1)[0]).all()) for p in module.parameters())


def _positional_siblings(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are entries of one ``nn.ModuleList`` or ``nn.Sequential`` (``blocks.0``, ``blocks.2``)."""
    (parent_a, _, last_a), (parent_b, _, last_b) = a.rpartition("."), b.rpartition(".")
    return parent_a == parent_b and last_a.isdigit() and last_b.isdigit()


def frozen_twins(
    model: nn.Module, layers: Mapping[str, nn.Module], same_values_only: bool = False
) -> dict[str, str]:
    """The frozen copies of parts holding ``layers``: ``{copy's name: part's name}`` (outermost copies only).

    A copy is a submodule with parameters, none of them trainable, with the structure of a trainable submodule
    that holds some of ``layers``, and either the same values now (a copy made before training: an EMA teacher,
    a target network, a reference model) or, with other values (a resumed run), two layers or more and not an
    entry of the same list as the part. Frozen lower blocks of a stack and a fixed layer that happens to be
    shaped like a trained one are not copies. Inside a frozen module that is no copy, each outermost submodule
    with a part's structure and values is one (``deepcopy(nn.Sequential(self.backbone, self.head))``: its
    ``0`` and ``1``), where one of them holds two different values."""
    modules = dict(model.named_modules())
    frozen = [
        name
        for name, m in modules.items()
        if name and any(True for _ in m.parameters()) and not any(p.requires_grad for p in m.parameters())
    ]
    frozen = [n for n in frozen if not any(n.startswith(o + ".") for o in frozen)]
    # the names of the modules that hold a layer (the layer and its ancestors): a set, not a scan per module
    splits = [name.split(".") for name in layers]
    holding = {".".join(parts[:end]) for parts in splits for end in range(1, len(parts) + 1)}
    # each part's structure once: a frozen module's submodules are each compared with them
    parts = [
        (name, modules[name], _structure(modules[name]))
        for name in modules
        if name and name in holding and all(p.requires_grad for p in modules[name].parameters())
    ]

    def part_copied(copy_name: str, copy: nn.Module, same_values: bool) -> str | None:
        shape = _structure(copy)
        layered = sum(1 for m in copy.modules() if any(True for _ in m.parameters(recurse=False))) >= 2
        return next(
            (
                name
                for name, part, structure in parts
                if type(part) is type(copy)
                and not name.startswith(copy_name + ".")
                and structure == shape
                and (
                    _same_values(part, copy)
                    or (layered and not same_values and not _positional_siblings(name, copy_name))
                )
            ),
            None,
        )

    twins: dict[str, str] = {}
    for copy_name in frozen:
        part = part_copied(copy_name, modules[copy_name], same_values_only)
        if part is not None:
            twins[copy_name] = part
            continue
        # a copy of several parts together is shaped like none of them: a sweep's EMA teacher of
        # `nn.Sequential(backbone, head)` went unrefused and crashed at the first event. Inside a module that
        # is no copy (a frozen encoder of the same block type), only values shared at fit start tell a copy
        inner: dict[str, str] = {}
        for name, module in modules[copy_name].named_modules(prefix=copy_name):
            if name == copy_name or any(name.startswith(found + ".") for found in inner):
                continue
            if any(True for _ in module.parameters()) and (part := part_copied(name, module, True)):
                inner[name] = part
        if any(_distinctive(modules[name]) for name in inner):
            twins.update(inner)
    return twins


def _copy_like(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` could hold a copy of a layer's weight: floating, created, of two dimensions or more
    (not a step count, an index table or a boolean attention mask). One dimension matches too easily: a frozen
    BatchNorm's running statistics, or a per-channel scale, were shaped like the bias of another cut layer."""
    return not is_lazy(buffer) and buffer.is_floating_point() and buffer.dim() > 1


def uncut_buffer_copies(before: nn.Module, after: nn.Module) -> list[tuple[str, str]]:
    """``(buffer, parameter)`` of ``before`` where ``after`` (a copy of it a trial cut has pruned) changed the
    parameter's shape and left the buffer, of that shape before the cut and holding a copy of its values
    (:func:`holds_a_copy`), as it was: a copy of the weights kept as a buffer (an EMA updated by parameter
    name) that the cut does not follow. A buffer the cut shrinks with its layer (a BatchNorm's running
    statistics) is not one; nor is one of a cut parameter's shape that holds other values (a positional
    table, a mask)."""
    cut_params = dict(after.named_parameters())
    cut_shapes: dict[tuple[int, ...], list[tuple[str, torch.Tensor]]] = {}
    for name, parameter in before.named_parameters():
        cut = cut_params.get(name)
        if cut is not None and not is_lazy(parameter) and cut.shape != parameter.shape:
            cut_shapes.setdefault(tuple(parameter.shape), []).append((name, parameter))
    if not cut_shapes:
        return []
    cut_buffers = dict(after.named_buffers())
    found = []
    for name, buffer in before.named_buffers():
        if not _copy_like(buffer) or name not in cut_buffers or cut_buffers[name].shape != buffer.shape:
            continue
        copied = next(
            (p_name for p_name, p in cut_shapes.get(tuple(buffer.shape), []) if holds_a_copy(buffer, p)), None
        )
        if copied is not None:
            found.append((name, copied))
    return found


def weight_shaped_buffers(model: nn.Module, layers: Mapping[str, nn.Module]) -> dict[str, str]:
    """``{buffer: layer}``: the floating buffers of ``model`` outside ``layers`` (a mask's own ``weight_mask``
    is in its layer) that hold a copy (:func:`holds_a_copy`) of the weight of one of them, ``layer``."""
    shapes: dict[tuple[int, ...], list[tuple[str, torch.Tensor]]] = {}
    for name, layer in layers.items():
        weight = _weight(layer)
        if weight is not None and not is_lazy(weight):
            shapes.setdefault(tuple(weight.shape), []).append((name, weight))
    found = {}
    for name, buffer in model.named_buffers():
        owner = name.rpartition(".")[0]
        if owner in layers or not _copy_like(buffer):
            continue
        copied = next(
            (layer for layer, w in shapes.get(tuple(buffer.shape), []) if holds_a_copy(buffer, w)), None
        )
        if copied is not None:
            found[name] = copied
    return found


def holds_a_copy(buffer: torch.Tensor, parameter: torch.Tensor) -> bool:
    """Whether ``buffer`` holds a copy of ``parameter``'s values, or values that follow them (an EMA, a frozen
    copy taken at some step): their cosine similarity is above 0.5. A table or a mask of the same shape (a
    sinusoidal positional table, a causal mask) is near 0 against trained or initial weights, and is not a
    copy. Not seen: a copy that starts from zeros and has not moved yet, or one that has drifted far from the
    weights (a frozen copy of the initial weights after long training: a review measured 0.25)."""
    if is_lazy(buffer) or is_lazy(parameter) or buffer.is_meta or parameter.is_meta:
        return False
    with torch.no_grad():
        a, b = buffer.detach().flatten().float(), parameter.detach().flatten().float().to(buffer.device)
        if a.numel() != b.numel() or a.numel() == 0:
            return False
        return float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.5


def weight_shares(model: nn.Module, layers: Mapping[str, nn.Module]) -> dict[str, float]:
    """Each of ``layers``' share of the model's distinct parameter elements (its weight's)."""
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return {name: _weight(layer).numel() / total if total else 0.0 for name, layer in layers.items()}


def weight_share(model: nn.Module, layers: Mapping[str, nn.Module]) -> float:
    """Share of the model's distinct parameter elements held by the weights of ``layers``."""
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    chosen = sum(w.numel() for w in {id(_weight(m)): _weight(m) for m in layers.values()}.values())
    return chosen / total if total else 0.0


# ---------------------------------------------------------------------------------------------- trace inputs
def has_own_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class, or a user class it derives from, defines ``forward``: the placeholders of
    ``nn.Module`` and ``LightningModule`` raise NotImplementedError."""
    owner = next(cls for cls in type(module).__mro__ if "forward" in vars(cls))
    lightning = owner.__name__ == "LightningModule" and owner.__module__.startswith(("lightning", "pytorch_"))
    return owner is not nn.Module and not lightning


def call_with(model: nn.Module, example: Any) -> Any:
    """``model(**example)`` for a mapping, ``model(*example)`` for a tuple or list, else ``model(example)``.

    Each call gets its own copy of every mapping among the arguments: the checks call the model on one example
    many times (trace, trial cuts, output comparisons, torch-pruning's graph build), and a ``forward(batch)``
    that takes entries out of its batch (``batch.pop("labels")``, as HF wrappers do) would otherwise leave the
    next call a batch without them. ``**example`` already unpacks a mapping example into a new dict."""
    if isinstance(example, Mapping):
        return model(**example)
    if isinstance(example, (tuple, list)):
        return model(*(_fresh_mapping(argument) for argument in example))
    return model(example)


def _fresh_mapping(argument: Any) -> Any:
    """A shallow copy of ``argument`` if it is a mapping (its own type where it copies), else ``argument``."""
    if not isinstance(argument, Mapping):
        return argument
    try:
        return shallow_copy(argument)
    except Exception:  # a mapping type that does not copy: a plain dict holds the same entries
        return dict(argument)


def example_from_batch(module: nn.Module, batch: Any) -> Any:
    """How to call ``module``'s ``forward`` on a training ``batch``: positional arguments (a tuple) or keyword
    arguments (a dict), taken from the batch by ``forward``'s signature.

    A tensor batch is the input; of a tuple or list batch, the first item is (a namedtuple whose fields name
    every required argument gives them by name); a mapping batch gives the entries named like ``forward``'s
    parameters (all its entries, by name, for a ``forward(**inputs)``; its ``x``/``input``/``inputs``/
    ``input_ids`` entry for a ``forward(*args, **kwargs)``; the whole batch for a ``forward(batch)`` whose one
    required argument the batch does not name).

    Raises:
        ValueError: the reason the call cannot be made from the batch; where the batch does not hold
            ``forward``'s arguments, it starts with :data:`BATCH_NOT_INPUT`.
    """
    if not has_own_forward(module):
        raise ValueError(f"{type(module).__name__} has no `forward` to trace the model with")
    signature = inspect.signature(module.forward)
    parameters = list(signature.parameters.values())
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p.name for p in positional if p.default is p.empty]
    if isinstance(batch, tuple) and hasattr(batch, "_asdict"):  # a namedtuple: its fields name the arguments
        named_fields = batch._asdict()
        if len(required) > 1 and all(name in named_fields for name in required):
            batch = named_fields
    if isinstance(batch, Mapping):
        named = {p.name: batch[p.name] for p in positional if p.name in batch}
        if named and all(name in named for name in required):
            return named
        kinds = {p.kind for p in parameters}
        if kinds == {inspect.Parameter.VAR_KEYWORD}:
            # `forward(self, **inputs)`, the usual wrapper of an HF model, takes every entry by name and
            # none by position
            return dict(batch)
        if not positional:
            for key in ("x", "input", "inputs", "input_ids"):
                if key in batch:
                    return (batch[key],)
        if not named and len(required) == 1:
            # `forward(self, batch)` handing the batch on (`self.model(**batch)`), as wrappers of an HF model
            # are often written: the batch is its one argument
            return (batch,)
        missing = [name for name in required if name not in batch]
        raise ValueError(
            f"{BATCH_NOT_INPUT}: `forward{signature}` of {type(module).__name__} cannot be called with the "
            f"batch's entries {sorted(map(str, batch))} by name{f' (missing {missing})' if missing else ''}"
        )
    first = batch if isinstance(batch, torch.Tensor) else None
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        first = batch[0]
    if first is None:
        raise ValueError(f"{BATCH_NOT_INPUT}: no model input found in a batch of type {type(batch).__name__}")
    if len(required) > 1:
        raise ValueError(
            f"{BATCH_NOT_INPUT}: `forward` of {type(module).__name__} takes {len(required)} arguments "
            f"({', '.join(required)}), and a {type(batch).__name__} batch gives one input (its first item)"
        )
    return (first,)


#: the start of the reason :func:`example_from_batch` gives for a batch that does not hold ``forward``'s
#: arguments: the input is read before any layer is chosen, so no `layer_types`/`exclude_pattern` changes it
BATCH_NOT_INPUT = "the training batch does not give `forward`'s arguments"


def output_shapes(output: Any) -> list[tuple[int, ...]]:
    """Shapes of every tensor in a model output (tensor, tuple/list, mapping or HF ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        return [tuple(output.shape)]
    if isinstance(output, Mapping):
        return [shape for value in output.values() for shape in output_shapes(value)]
    if isinstance(output, (tuple, list)):
        return [shape for value in output for shape in output_shapes(value)]
    return []


def untraceable_output(output: Any, path: str = "output") -> str | None:
    """Where ``output`` holds something torch-pruning's trace cannot follow, and what, or ``None``.

    The trace starts from every tensor of the output, looking into tuples, lists and dicts only (a Hugging
    Face ``ModelOutput`` is a dict); anything else there (a key/value cache object, ``None`` in a tuple, a
    number) makes it fail with an error that names neither the output nor a way out (``'tuple' object has no
    attribute 'grad_fn'`` for a ``DynamicCache``, which it iterates as tuples)."""
    if isinstance(output, torch.Tensor):
        return None
    if isinstance(output, dict):
        items = [(f"{path}.{key}", value) for key, value in output.items()]
    elif isinstance(output, (tuple, list)):
        items = [(f"{path}[{index}]", value) for index, value in enumerate(output)]
    elif output is None:
        return f"None at `{path}`"
    else:
        name = type(output).__name__
        return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name} at `{path}`"
    return next((found for item, value in items if (found := untraceable_output(value, item))), None)


# ---------------------------------------------------------------------------------------- out of reach
#: share of the trainable parameters (embedding tables aside) that, out of reach, is warned of at fit start
UNREACHED_SHARE = 1 / 3


def weightless_of_types(model: nn.Module, layer_types: tuple[type, ...]) -> dict[str, str]:
    """Modules of ``layer_types`` that have no ``weight`` parameter (a Hugging Face MoE's ``OlmoeExperts``
    keeps every expert in fused 3-D ``gate_up_proj`` / ``down_proj``), name -> why they cannot be pruned. A
    layer whose ``weight`` a parametrization computes has one (:data:`COMPUTED_WEIGHT` says why it is left
    out): called weightless, it was offered other ``layer_types``, which cannot help."""
    found = {}
    for name, module in model.named_modules():
        if not name or not layer_types or not isinstance(module, layer_types) or _has_weight(module):
            continue
        if computes_its_weight(module):
            continue
        own = [f"`{key}` ({value.dim()}-D)" for key, value in module._parameters.items() if value is not None]
        found[name] = (
            f"{type(module).__name__} has no `weight` parameter, the only parameter ScheduledPrune prunes; "
            + (f"its own are {', '.join(own)}" if own else "it holds no parameter of its own")
            + (", fused tensors holding every expert" if _expert_like(module) and own else "")
        )
    return found


def _expert_like(module: nn.Module) -> bool:
    return "expert" in type(module).__name__.lower()


def _names_a_table(leaf: str) -> bool:
    return "emb" in leaf or leaf.startswith("pos") or leaf == "pe"


def _embedding_parameters(model: nn.Module) -> set[int]:
    """``id``s of embedding tables: ``nn.Embedding``/``EmbeddingBag`` weights (and any module holding one: a
    tied ``lm_head``), and bare parameters named as embedding or position tables (a ViT's
    ``position_embeddings``, a minGPT ``pos_emb``, a ``pe``)."""
    found = {
        id(parameter)
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        for parameter in module.parameters(recurse=False)
    }
    # position tables too: a minGPT ``pos_emb``, a ``position`` or ``pe`` table read by a broadcast add
    found.update(
        id(p) for name, p in model.named_parameters() if _names_a_table(name.rpartition(".")[2].lower())
    )
    return found


def unreached_parameters(
    model: nn.Module, selection: LayerSelection, exclude: str | None, types_chosen: bool = False
) -> tuple[list[tuple[str, int, str]], int, int]:
    """The trainable parameters of ``model`` with two or more dimensions that ``selection`` does not prune,
    largest first, as ``(name, elements, why)``; the trainable elements the selected weights hold; and the
    trainable elements all these are measured against. Embedding tables are none of these (a lookup table is
    not pruned by magnitude with the layers, and a tiny config with a real vocabulary can hold most of its
    parameters there: counting it would warn on every small language model), nor are biases and norm scales
    (one dimension), parameters the user froze or masked with ``torch.nn.utils.prune`` (``<name>_orig``), or
    those of a layer ``exclude`` matches, nor, when the user named ``layer_types`` (``types_chosen``), the
    weights of layers of other types (choices already made), nor those of an AveragedModel's copy
    (:func:`averaged_copies`: averaged, not trained), nor the stream maps of this library's
    :class:`~lightning_pulse.nn.HyperConnection` layers (``phi_res``..., dense by design: a held-out sweep's
    mHC CNN was told to build them "from `nn.Linear` layers")."""
    embeddings = _embedding_parameters(model)
    reached_ids = {id(_weight(layer)) for layer in selection.layers.values()}
    modules = dict(model.named_modules())
    # an averaged copy (EMA/SWA) is not trained: neither out of reach nor counted in the total
    averaged = {id(p) for copy in averaged_copies(model).values() for p in copy.parameters()}
    unreached, reached, total, seen = [], 0, 0, embeddings | averaged
    for qualified, parameter in model.named_parameters():
        if id(parameter) in seen or not parameter.requires_grad or is_lazy(parameter):
            continue
        seen.add(id(parameter))
        total += parameter.numel()
        owner, _, key = qualified.rpartition(".")
        module = modules[owner]
        if id(parameter) in reached_ids:
            reached += parameter.numel()
            continue
        user_masked = key.endswith("_orig") and f"{key[: -len('_orig')]}_mask" in module._buffers
        if parameter.dim() < 2 or user_masked or (exclude is not None and re.search(exclude, owner)):
            continue
        if isinstance(module, HyperConnection):  # this library's stream maps: dense by design, like norms
            continue
        kind = type(module).__name__
        if key == "weight" and owner in selection.left_out:
            why = selection.left_out[owner]
        elif key == "weight" and types_chosen:
            continue
        elif key == "weight":
            why = f"`weight` of {kind}, not a layer type it prunes (`layer_types`)"
        elif parameter.dim() == 3 and _expert_like(module):
            why = f"fused 3-D expert tensors of {kind}, one slice per expert, not a layer's `weight`"
        else:
            why = f"`{key}` of {kind} is not a layer's `weight`, the only parameter it prunes"
        unreached.append((qualified, parameter.numel(), why))
    return sorted(unreached, key=lambda item: -item[1]), reached, total
