"""Freeze units: the groups of parameters that are frozen or trained together, in forward order. Plain torch.

:func:`discover_units` splits a model into units (embedding, blocks, head, ...); it is the one place that
decides which parameters are frozen together. :class:`ForwardOrderTrace` puts them into forward order from the
order in which one real backward finished their gradients (the unit finished last is the one nearest the input).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_pulse.errors import PulseRefusal

DEFAULT_MIN_UNITS = 8


@dataclass
class FreezeUnit:
    """A group of parameters that is frozen or trained as one.

    Attributes:
        name: the module (or parameter) name the unit stands for, e.g. ``"blocks.0"`` or ``"position"``.
        param_names: qualified names (as in ``model.named_parameters()``) of the trainable parameters it owns.
        params: the parameters themselves, bound with :meth:`bind`.
        used: whether the parameters received a gradient in the traced backward; unused units never freeze.
        shared_with: names outside the unit under which the model also holds one of its parameters (a tied
            weight, e.g. ``lm_head.weight`` for the token embedding), set by :func:`mark_shared`. Such a unit is
            *pinned*: the frozen prefix stops before it, so a shared parameter is never frozen on one side only.
        inputs_from: names of the other units whose parameters the tensors its own parameters are applied to
            depend on, set by :func:`mark_inputs`. A unit applied again after later units (a weight-shared
            layer, a looped block) reads from units after it: it freezes only together with them
            (:func:`farthest_reads`).
        frozen_with: names of later units it freezes only together with, because a custom autograd Function
            needs them frozen or trained together (:mod:`~lightning_pulse.core.custom_functions`); found anew
            at each fit's first backward, like a pin.
        differentiated: how ``training_step`` differentiated one of its layers before the fit's backward (a
            ``torch.func`` transform, ``torch.autograd.grad(..., create_graph=True)``; ``""``: not seen), whose
            backward applies its weight again after later units; found anew at each fit's first backward
            (:attr:`~lightning_pulse.core.forward_calls.ForwardCalls.differentiated`), for the notes only.
    """

    name: str
    param_names: list[str]
    params: list[nn.Parameter] = field(default_factory=list)
    used: bool = True
    shared_with: list[str] = field(default_factory=list)
    inputs_from: list[str] = field(default_factory=list)
    frozen_with: list[str] = field(default_factory=list)
    differentiated: str = ""

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def pinned(self) -> bool:
        """Whether the unit shares a parameter with the rest of the model, so it never freezes."""
        return bool(self.shared_with)

    def bind(self, named: Mapping[str, nn.Parameter]) -> None:
        """Bind the parameters by name; a name saved before (or after) torch's pruning reparametrisation
        (``weight`` <-> ``weight_orig``) finds the parameter under its current name."""
        resolved = [resolve_parameter_name(name, named) for name in self.param_names]
        missing = [name for name, found in zip(self.param_names, resolved) if found is None]
        if missing:
            raise ValueError(f"Unit {self.name!r}: the model has no parameter {missing[0]!r}.")
        self.param_names = [name for name in resolved if name is not None]
        self.params = [named[name] for name in self.param_names]

    def covers(self, name: str) -> bool:
        """Whether the qualified parameter name ``name`` lies inside this unit."""
        if name in self.param_names:
            return True
        return self.name != REST and (name == self.name or name.startswith(self.name + "."))


REST = "<rest>"
_ORIG = "_orig"  # torch.nn.utils.prune keeps the dense tensor as `<name>_orig` and recomputes `<name>`


def resolve_parameter_name(name: str, named: Mapping[str, Any]) -> str | None:
    """``name`` as the model calls it now: itself, or across torch's pruning reparametrisation
    (``w`` -> ``w_orig`` once a mask was added, ``w_orig`` -> ``w`` once it was made permanent)."""
    if name in named:
        return name
    if name + _ORIG in named:
        return name + _ORIG
    if name.endswith(_ORIG) and name[: -len(_ORIG)] in named:
        return name[: -len(_ORIG)]
    return None


def mark_shared(units: Sequence[FreezeUnit], root: nn.Module) -> list[FreezeUnit]:
    """Set :attr:`FreezeUnit.shared_with` from every name under which ``root`` holds each unit's parameters.

    Found with ``named_parameters(remove_duplicate=False)`` and tensor identity: a tied weight (GPT-2's
    ``lm_head.weight is wte.weight``, ``mix_b.weight = mix_a.weight``) has a name outside the unit that owns
    it. Freezing that unit would also freeze the other side, which keeps training around it (the output layer
    stops learning), so the unit is pinned and the frozen prefix stops before it. A module applied twice holds
    its parameters under one name, so it is one unit and every application freezes or trains together. A
    second name for the same module (a handle such as ``self.stem = self.net[0]`` or ``self.encoder =
    self.model.encoder``) is no tie: the parameter has one holder, which the unit freezes with it.
    Returns ``units``.
    """
    # parameter -> (its name, the module attribute holding it) under every name the model has for it
    aliases: dict[int, list[tuple[str, tuple[int, str]]]] = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        for attribute, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{attribute}" if prefix else attribute
            aliases.setdefault(id(param), []).append((name, (id(module), attribute)))
    for unit in units:
        named = [alias for param in unit.params for alias in aliases.get(id(param), [])]
        own = {holder for name, holder in named if unit.covers(name)}
        unit.shared_with = sorted({name for name, holder in named if holder not in own})
    return list(units)


def check_unit_names(units: Sequence[str] | None) -> list[str] | None:
    """``units`` as a list of module or parameter names (``None``: the automatic split).

    Raises:
        ValueError: naming ``units``, for a string, an empty list or a non-string name.
    """
    if units is None:
        return None
    # the type before any iteration: an int or a float gave Python's bare "'int' object is not iterable"
    names = list(units) if isinstance(units, Iterable) and not isinstance(units, (str, bytes)) else []
    if not names or not all(isinstance(u, str) for u in names):
        raise ValueError(f"`units`={units!r} must be None or a non-empty list of module or parameter names.")
    return names


def order_note(units: Sequence[FreezeUnit]) -> str:
    """One line listing ``units`` in forward order with their sizes, the unused ones marked."""
    return "units in forward order: " + ", ".join(
        f"{u.name}({u.numel})" + ("" if u.used else "[unused]") for u in units
    )


#: the most parameter names a way out lists in full; a longer list is given as an expression
LISTED_NAMES = 8


def finer_units_way_out(root: nn.Module, unit: FreezeUnit) -> str | None:
    """The ``units`` that split ``unit``, ``root``'s single trainable unit, so that its parameters freeze one by
    one, where its module holds them itself and has no children: an ``nn.ParameterDict`` or
    ``nn.ParameterList`` the model reads directly, or a layer of the user's written with raw parameters. The
    automatic split divides modules into their children only, so it keeps such a module whole. ``None`` for a
    unit of one parameter, and for a torch layer (a Linear's weight and bias belong together)."""
    module = dict(root.named_modules()).get(unit.name)
    if module is None or len(unit.param_names) < 2 or any(True for _ in module.children()):
        return None
    container = isinstance(module, (nn.ParameterDict, nn.ParameterList))
    if not container and type(module).__module__.startswith("torch."):
        return None
    what = f"an nn.{type(module).__name__}" if container else f"a {type(module).__name__} without children"
    names, listed, every = unit.param_names, repr(unit.param_names), ""
    if len(names) > LISTED_NAMES:
        listed = f"[{', '.join(map(repr, names[:3]))}, ...]"
        every = (
            f"all {len(names)}: `[name for name, _ in pl_module.named_parameters() if "
            f"name.startswith({unit.name + '.'!r})]`; "
        )
    # `units` takes names only (no nested lists), so each parameter is its own unit; the first backward puts
    # them in forward order, whatever order they are named in
    return (
        f"`{unit.name}` holds every parameter, in {what}, which the automatic split keeps whole; to freeze its "
        f"parameters one by one, name each in `units`: units={listed} ({every}each name is its own unit; any "
        "order)"
    )


def pinned_note(units: Sequence[FreezeUnit]) -> str | None:
    """One line naming the pinned units and the other names of their parameters (``None``: none pinned)."""
    pinned = [f"{u.name} (also {', '.join(u.shared_with)})" for u in units if u.pinned]
    if not pinned:
        return None
    return (
        "units holding a tied or shared parameter never freeze, so the frozen prefix stops before them: "
        + "; ".join(pinned)
    )


def reread_note(units: Sequence[FreezeUnit]) -> str | None:
    """One line naming the units (in forward order) that read from a later unit, and the farthest one each
    reads from (``None``: none does), with the cause where it is known: a derivative ``training_step`` took
    through them (:attr:`FreezeUnit.differentiated`), else a weight-shared layer or a looped block. Pinned
    units are left out: :func:`pinned_note` names them."""
    position = {unit.name: index for index, unit in enumerate(units)}
    reread: dict[str, list[str]] = {}  # how they were differentiated ("": not seen) -> the units
    for index, unit in enumerate(units):
        later = [name for name in unit.inputs_from if position.get(name, -1) > index]
        if later and not unit.pinned:
            named = f"{unit.name} (after {max(later, key=position.__getitem__)})"
            reread.setdefault(unit.differentiated, []).append(named)
    if not reread:
        return None
    notes = [
        f"the backward of a derivative taken through the model ({how}) applies these units' weights again "
        "after later units, so each freezes only together with everything up to the last of those (that "
        "backward runs through all of them, frozen or not): " + "; ".join(names)
        for how, names in reread.items()
        if how
    ]
    if "" in reread:
        notes.append(
            "units applied again after later units (a weight-shared layer, a looped block) freeze only "
            "together with everything up to the last of those, so a frozen prefix never ends between them: "
            + "; ".join(reread[""])
        )
    return ". ".join(notes)


def head_positions(units: Sequence[FreezeUnit]) -> set[int]:
    """Positions of the *heads*: units that got a gradient and that no other unit reads from
    (:attr:`FreezeUnit.inputs_from`), so their output reaches the loss without passing through a trainable
    unit (a classifier, a second head of a multi-task or DANN model, an auxiliary loss's head). A frozen
    prefix stops before the first: freezing a head stops its loss's learning. A unit that reads no other unit
    is not one (its freezing stops no trunk's learning). The last unit of a chain is the only one;
    empty when no unit reads another (the reads were never traced: nothing to tell heads by)."""
    read = {name for unit in units for name in unit.inputs_from if name != unit.name}
    if not read:
        return set()
    # a unit that reads no other unit (Wide & Deep's wide part, a linear term on the raw input) cuts no trunk
    # off its loss's learning when frozen: it freezes like any other unit (a review found Wide & Deep never
    # freezing at all once it counted as a head at position 0)
    return {
        index for index, unit in enumerate(units) if unit.used and unit.inputs_from and unit.name not in read
    }


def heads_note(units: Sequence[FreezeUnit]) -> str | None:
    """One line naming the heads (:func:`head_positions`) before the last of them (``None``: one head)."""
    heads = sorted(head_positions(units))
    if len(heads) < 2:
        return None
    return (
        "units whose output reaches the loss without passing through another unit are heads and never freeze, "
        "so the frozen prefix stops before the first: " + ", ".join(units[index].name for index in heads)
    )


def farthest_reads(units: Sequence[FreezeUnit]) -> list[int]:
    """For each unit in forward order, the farthest position that it or a unit before it reads from
    (:attr:`FreezeUnit.inputs_from`) or must freeze with (:attr:`FreezeUnit.frozen_with`), itself at least:
    the first ``k`` units may be frozen together only if ``farthest_reads(units)[k - 1] == k - 1``, since a
    frozen unit whose input a training unit computes would stand still under changing inputs, and backward
    would still run through it."""
    position = {unit.name: index for index, unit in enumerate(units)}
    farthest, result = -1, []
    for index, unit in enumerate(units):
        reads = (position[name] for name in (*unit.inputs_from, *unit.frozen_with) if name in position)
        farthest = max([farthest, index, *reads])
        result.append(farthest)
    return result


#: autograd ops that, given only parameters and constants, compute a parameter-like value (views, casts,
#: concatenation, elementwise arithmetic): ``weight.t()`` inside ``F.linear``, autocast's cast, a pruning
#: mask's ``weight_orig * weight_mask``, mHC's ``cat(phi...) * scale``, weight norm's ``g * v / |v|``,
#: spectral norm's ``W / (u . (W v))`` (its ``u``, ``v`` are buffers), weight standardisation's
#: ``(w - mean(w)) / std(w)``. Ops with an index (an embedding lookup) are left out: what they compute depends
#: on the data.
_PARAMETER_OPS = frozenset(
    (
        "Alias AsStrided Clone Expand Permute ReshapeAlias Select Slice Split SplitWithSizes Squeeze T "
        "ToCopy Transpose Unbind Unsqueeze UnsafeView View Cat Stack Add Sub Mul Div Neg Reciprocal Pow "
        "Sqrt Rsqrt Exp Log Abs Clamp ClampMin Tanh Sigmoid Softplus Softmax LogSoftmax Sum Mean Norm "
        "LinalgVectorNorm WeightNormInterface Mv Dot Vdot Std Var StdMean VarMean"
    ).split()
)


def _op_name(node: Any) -> str:
    """``"T"`` for a ``TBackward0`` node."""
    return type(node).__name__.rstrip("0123456789").removesuffix("Backward")


def mark_inputs(units: Sequence[FreezeUnit], loss: torch.Tensor) -> None:
    """Add to each unit's :attr:`FreezeUnit.inputs_from` the units its parameters' inputs depend on, read from
    ``loss``'s autograd graph before its backward.

    One walk gives every node the units whose parameters it reaches, and whether it computes from parameters
    and constants alone (:data:`_PARAMETER_OPS`; every input that needs a gradient is a parameter or such a
    node). The first node on from a parameter that is not of that kind applies it, and its unit reads the
    units that node's activation inputs were computed from (not the parameters applied with it: mHC's
    ``phi`` projections, weight norm's ``g`` and ``v``). An added parameter (learned queries added at every
    layer) reads nothing: its gradient does not depend on what it is added to. A layer applied once reads
    only earlier units; ALBERT's shared layer, applied at every depth, reads its own later sub-layers, and a
    looped block A, B, A, B has A read B. A Siamese encoder's second application reads the raw input, so it
    reads nothing more than its first.
    """
    if loss.grad_fn is None:
        return
    index_of = {id(param): index for index, unit in enumerate(units) for param in unit.params}
    reach: dict[Any, int] = {}  # node -> bit set of the units whose parameters it reaches
    parameter_only: set[Any] = set()  # nodes computing from parameters alone
    parents: dict[Any, list[Any]] = {}
    leaves: list[tuple[Any, int]] = []  # (AccumulateGrad node, index of the unit holding its parameter)
    stack, entered = [(loss.grad_fn, False)], set()
    while stack:  # depth first, children before their node, without recursion (graphs are deep)
        node, children_done = stack.pop()
        children = [child for child, _ in node.next_functions]
        if children_done:
            bits = 0
            for child in children:
                bits |= reach.get(child, 0) if child is not None else 0
            variable = getattr(node, "variable", None)  # an AccumulateGrad: the parameter itself
            if variable is not None:
                parameter_only.add(node)
                if id(variable) in index_of:
                    leaves.append((node, index_of[id(variable)]))
                    bits |= 1 << index_of[id(variable)]
            elif _op_name(node) in _PARAMETER_OPS and all(
                c in parameter_only for c in children if c is not None
            ):
                # a None child needs no gradient: a constant (``* scale``), a buffer (a pruning mask) or,
                # rarely, the raw input; taken as a constant, which only ties a unit to the next one it feeds
                parameter_only.add(node)
            reach[node] = bits
            continue
        if node in entered:
            continue
        entered.add(node)
        stack.append((node, True))
        for child in children:
            if child is not None:
                parents.setdefault(child, []).append(node)
                if child not in entered:
                    stack.append((child, False))
    read = [0] * len(units)
    for leaf, index in leaves:
        waiting, seen = list(parents.get(leaf, [])), set()
        while waiting:
            node = waiting.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in parameter_only:
                waiting.extend(parents.get(node, []))  # still a parameter: the node applying it is further on
            elif _op_name(node) not in ("Add", "Sub"):  # an added parameter depends on nothing it is added to
                for child, _ in node.next_functions:
                    if child is not None and child not in parameter_only:
                        read[index] |= reach.get(child, 0)
    for index, unit in enumerate(units):
        found, bits = set(unit.inputs_from), read[index] & ~(1 << index)
        while bits:
            lowest = bits & -bits
            found.add(units[lowest.bit_length() - 1].name)
            bits ^= lowest
        unit.inputs_from = sorted(found)


def agree_inputs(units: Sequence[FreezeUnit], broadcast: Callable[[list[Any]], list[Any]]) -> None:
    """Give every process rank 0's :attr:`FreezeUnit.inputs_from` (DDP, one ``broadcast``): each process marks
    them from its own graph, and a loop whose count depends on the batch reads differently on each, which
    would let each propose its own prefix while the parameters must stay the same everywhere."""
    reads = dict(broadcast([(unit.name, list(unit.inputs_from)) for unit in units]))
    for unit in units:
        unit.inputs_from = list(reads.get(unit.name, []))


def replace_unit_parameters(
    units: Sequence[FreezeUnit], replacements: Iterable[tuple[nn.Parameter, nn.Parameter, Any]]
) -> dict[int, tuple[nn.Parameter, torch.Tensor]]:
    """Point ``units`` at new parameter tensors (structured pruning replaced them), in place.

    ``replacements`` yields ``(old, new, kept)`` with ``new.flatten() == old.flatten()[kept]`` (a
    :class:`~lightning_pulse.core.pruning.ParameterRemap`). Returns ``id(old) -> (new, kept)`` for the
    parameters that a unit held, so per-parameter state can follow (see :func:`cut_like`).
    """
    table = {id(old): (new, kept) for old, new, kept in replacements}
    moved: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
    for unit in units:
        for index, param in enumerate(unit.params):
            entry = table.get(id(param))
            if entry is not None:
                moved[id(param)] = entry
                unit.params[index] = entry[0]
    return moved


def cut_like(tensor: torch.Tensor, new: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``tensor`` (shaped like the replaced parameter) cut to the elements ``kept`` in ``new``'s shape."""
    return tensor.reshape(-1).index_select(0, kept.to(tensor.device)).reshape(new.shape).clone()


@contextmanager
def trainable_while(model: nn.Module, names: Iterable[str]) -> Iterator[list[str]]:
    """Turn on ``requires_grad`` of the parameters of ``model`` named in ``names`` that are off, for the
    duration of the block (yields their names), then turn them off again. A name ``model`` does not have is
    skipped: a structural change may have removed it."""
    wanted = set(names)
    opened = [
        (name, param)
        for name, param in model.named_parameters(remove_duplicate=False)
        if name in wanted and not param.requires_grad
    ]
    for _, param in opened:
        param.requires_grad_(True)
    try:
        yield [name for name, _ in opened]
    finally:
        for _, param in opened:
            param.requires_grad_(False)


def _under(prefix: str, names: Sequence[str]) -> list[str]:
    return [name for name in names if name == prefix or name.startswith(prefix + ".")]


def discover_units(
    root: nn.Module, module_names: Sequence[str] | None = None, min_units: int = DEFAULT_MIN_UNITS
) -> list[FreezeUnit]:
    """Split ``root``'s trainable parameters into bound freeze units (registration order; see :func:`order_units`).

    The one function that decides which parameters are frozen together: checks on the model belong here.
    ``named_parameters()`` yields a shared parameter once, under its first name, which gives it one owner; a
    unit whose parameter the model also holds under a name outside it (a tied weight) is pinned by
    :func:`mark_shared`: the frozen prefix stops before it.

    Automatic split: start from the whole model and keep expanding the largest unit that has sub-modules with
    parameters into those sub-modules (its own direct parameters become one unit each) until there are at
    least ``min_units`` units or nothing can be expanded. A transformer ends up as embedding, positional
    parameter, blocks, final norm and head; a small CNN as its layers. Parameters the user froze are left out.

    Args:
        root: the model.
        module_names: explicit units instead: qualified module or parameter names. Trainable parameters not
            covered by any of them form one extra unit ``"<rest>"``.
        min_units: the automatic split stops once there are this many units.

    Raises:
        PulseRefusal: for a name that is neither a module nor a parameter of ``root``, or names that overlap.
    """
    named = {name: p for name, p in root.named_parameters() if p.requires_grad}
    all_names = list(named)
    if module_names is not None:
        units = _explicit_units(root, module_names, all_names)
    else:
        units = [FreezeUnit(name, _under(name, all_names)) for name in _split(root, named, min_units)]
        units = [unit for unit in units if unit.param_names]
    for unit in units:
        unit.bind(named)
    return mark_shared(units, root)


def units_changed_since(
    saved_units: Sequence[str],
    saved_argument: Sequence[str] | None,
    argument: Sequence[str] | None,
    root: nn.Module,
    argument_saved: bool = True,
) -> list[FreezeUnit] | None:
    """The units this fit's ``units`` ``argument`` gives ``root`` (:func:`discover_units`), when they are not
    the ``saved_units`` that a checkpoint's run froze with ``saved_argument``; ``None`` when they are the same.

    Only a changed argument is looked at: with the same one, the saved units stand, also where ``root``'s
    trainable set would now give others (the saved run took in a backbone it saw start training). A
    checkpoint written before the argument was saved (``argument_saved`` false) is compared when either side
    names units explicitly: its units hold a ``"<rest>"`` unit, or ``argument`` is given.

    Raises:
        PulseRefusal: from :func:`discover_units`, for a name ``root`` does not have.
    """
    if argument_saved:
        if saved_argument == argument:
            return None
    elif argument is None and REST not in saved_units:
        return None  # the automatic split in both runs, as far as such a checkpoint tells
    if argument is not None and set(saved_units) - {REST} == set(argument):
        return None  # each entry one unit, as saved (their order is traced either way)
    units = discover_units(root, argument)
    return None if {unit.name for unit in units} == set(saved_units) else units


def untrained_entries(root: nn.Module, module_names: Sequence[str]) -> list[str]:
    """The explicit ``units`` entries of ``root`` holding no parameter that trains (all frozen by the user):
    :func:`discover_units` leaves them out, as it leaves out every frozen parameter."""
    trained = [name for name, param in root.named_parameters() if param.requires_grad]
    return [name for name in module_names if not _under(name, trained)]


def parameters_outside(root: nn.Module, units: Sequence[FreezeUnit]) -> list[nn.Parameter]:
    """``root``'s parameters that no unit holds: those frozen when the units were discovered (a backbone the
    user froze). One of them requiring grad later means the units no longer cover what trains."""
    held = {id(param) for unit in units for param in unit.params}
    return [param for param in root.parameters() if id(param) not in held]


def _explicit_units(root: nn.Module, module_names: Sequence[str], all_names: list[str]) -> list[FreezeUnit]:
    modules = dict(root.named_modules())
    parameters = dict(root.named_parameters())
    units: list[FreezeUnit] = []
    claimed: set[str] = set()
    for name in module_names:
        if name not in modules and name not in parameters:
            top = [child for child, module in root.named_children() if any(True for _ in module.parameters())]
            raise PulseRefusal(
                f"GradientCache: `units` entry {name!r} is neither a module nor a parameter of the model; "
                f"name modules as `model.named_modules()` lists them (its top level: {top[:8]}), or leave "
                "`units` unset to split the model automatically."
            )
        owned = _under(name, all_names)
        overlap = claimed.intersection(owned)
        if overlap:
            raise PulseRefusal(
                f"GradientCache: `units` entry {name!r} overlaps another entry on {sorted(overlap)[0]!r}; "
                "give each module or parameter once, in one entry."
            )
        claimed.update(owned)
        if owned:
            units.append(FreezeUnit(name, owned))
    rest = [name for name in all_names if name not in claimed]
    if rest:
        units.append(FreezeUnit(REST, rest))
    return units


def whole_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a torch layer holding trainable parameters of its own next to children that hold
    some: its forward reads theirs with its own, so the automatic split keeps it one unit. Torch's fused
    Conv-BN QAT modules (``fuse_modules_qat`` + ``prepare_qat``: ``ConvBnReLU1d`` folds ``bn.weight`` into its
    weight before calling ``bn``), ``nn.MultiheadAttention`` (``out_proj.weight``), a QAT layer with a
    learnable fake quantizer (``weight_fake_quant.scale``). Split, its child became a unit whose weight the
    parent's forward reads again: pinned as a tie, and, first in forward order, nothing froze; or the frozen
    prefix ended inside the layer. A learnable fake quantizer (``_LearnableFakeQuantize``: ``scale`` and
    ``zero_point`` of its own, next to an observer holding none) is kept whole too: its two parameters make one
    quantization grid. Split, a QuantStub's quantizer became two one-element units, the first its
    ``zero_point``, whose gradient is exactly 0 on an input the observer's range covers."""
    if not type(module).__module__.startswith("torch."):
        return False
    own = any(param.requires_grad for param in module.parameters(recurse=False))
    if own and isinstance(module, torch.ao.quantization.FakeQuantizeBase):
        return True
    return own and any(param.requires_grad for child in module.children() for param in child.parameters())


def _split(root: nn.Module, named: Mapping[str, nn.Parameter], min_units: int) -> list[str]:
    all_names = list(named)

    def expand(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module | None]]:
        parts: list[tuple[str, nn.Module | None]] = []
        for pname, param in module.named_parameters(recurse=False):
            qualified = f"{prefix}.{pname}" if prefix else pname
            if qualified in named and named[qualified] is param:
                parts.append((qualified, None))
        for cname, child in module.named_children():
            qualified = f"{prefix}.{cname}" if prefix else cname
            if _under(qualified, all_names):
                parts.append((qualified, child))
        return parts

    def size(name: str) -> int:
        return sum(named[n].numel() for n in _under(name, all_names))

    pieces = expand("", root)
    while True:
        # a single wrapper (LightningModule -> net) is see-through: always expand it
        candidates = [
            (size(name), index)
            for index, (name, module) in enumerate(pieces)
            if module is not None and any(True for _ in module.children()) and not whole_layer(module)
        ]
        if not candidates or (len(pieces) >= min_units and len(pieces) > 1):
            break
        _, index = max(candidates, key=lambda item: (item[0], -item[1]))
        name, module = pieces[index]
        replacement = expand(name, module)  # type: ignore[arg-type]
        if not replacement:
            break
        pieces[index : index + 1] = replacement
    return [name for name, _ in pieces]


@contextmanager
def record_gradient_order(params: Mapping[str, nn.Parameter]) -> Iterator[list[str]]:
    """Record the names of ``params`` in the order backward finishes accumulating their gradients. One that
    requires no gradient gets none, so it is not recorded (torch refuses a hook on it)."""
    order: list[str] = []
    handles = []
    for name, param in params.items():
        if not param.requires_grad:
            continue

        def hook(_: torch.Tensor, name: str = name) -> None:
            order.append(name)

        handles.append(param.register_post_accumulate_grad_hook(hook))
    try:
        yield order
    finally:
        for handle in handles:
            handle.remove()


def order_units(
    units: Sequence[FreezeUnit], gradient_order: Sequence[str], previous: Sequence[str] = ()
) -> list[FreezeUnit]:
    """Sort units into forward order from a backward's gradient-completion order.

    A unit's position is the *last* time one of its parameters got its gradient, read backwards: a tied
    embedding/head weight completes last, so its unit counts as the first one. Units none of whose parameters
    got a gradient are marked ``used=False`` and go last, unless ``previous`` (unit names in the forward order
    an earlier backward found) places them: then each goes right after the unit it followed there (a block
    LayerDrop skipped in this backward keeps its place), and this backward decides between units it saw.
    """
    last_seen = {name: index for index, name in enumerate(gradient_order)}
    keyed = []
    for position, unit in enumerate(units):
        seen = [last_seen[name] for name in unit.param_names if name in last_seen]
        unit.used = bool(seen)
        keyed.append((0 if seen else 1, -max(seen) if seen else position, position, unit))
    ordered = [unit for *_, unit in sorted(keyed, key=lambda item: item[:3])]
    return _merge_order(ordered, previous) if previous else ordered


def _merge_order(ordered: list[FreezeUnit], previous: Sequence[str]) -> list[FreezeUnit]:
    by_name = {unit.name: unit for unit in ordered}
    placed = [unit for unit in ordered if unit.used]
    names = {unit.name for unit in placed}
    after: str | None = None  # the unit of `previous` last seen among the placed ones
    for name in previous:
        unit = by_name.get(name)
        if unit is None:
            continue
        if name not in names:
            index = 0 if after is None else [u.name for u in placed].index(after) + 1
            placed.insert(index, unit)
            names.add(name)
            unit.used = True
        after = name
    return placed + [unit for unit in ordered if unit.name not in names]


_TRACE_ON = "\x00trace on"  # appended to rank 0's order when a wanted unit is still unplaced


class ForwardOrderTrace:
    """Puts discovered units into forward order from one real backward, merged with the order ``previous``
    backwards found (unit names; see :func:`order_units`).

    Call :meth:`begin` before a backward and :meth:`finish` after it. ``broadcast`` (DDP) makes every process
    use rank 0's order. ``wanted`` names units an earlier order missed and that have trained since: a backward
    that misses them too (an adapter used on odd batches) cannot place them, so the trace goes on, merging
    what each backward shows, until one sees them all, for at most :attr:`MAX_BACKWARDS` backwards.
    """

    MAX_BACKWARDS = 32

    def __init__(
        self, units: Sequence[FreezeUnit], previous: Sequence[str] = (), wanted: Sequence[str] = ()
    ) -> None:
        self.units = list(units)
        self.previous = list(previous)  # the forward order known so far (see :func:`order_units`)
        self.wanted = set(wanted)
        self.backwards = 0
        self.given_up: list[str] = []  # wanted units still unplaced after MAX_BACKWARDS: trained too rarely
        self._context: Any = None
        self._order: list[str] | None = None

    @property
    def running(self) -> bool:
        return self._context is not None

    def begin(self) -> None:
        params = {name: p for unit in self.units for name, p in zip(unit.param_names, unit.params)}
        self._context = record_gradient_order(params)
        self._order = self._context.__enter__()

    def finish(self, broadcast: Callable[[list[str]], list[str]] | None = None) -> list[FreezeUnit] | None:
        """The units in forward order, or ``None`` while a ``wanted`` unit is still unplaced (trace again)."""
        self.close()
        order = list(self._order or [])
        self._order = None
        self.backwards += 1
        trace_on = self._misses_wanted(order)
        if broadcast is not None:  # rank 0's order and rank 0's answer: every process traces as long
            order = broadcast(order + [_TRACE_ON] if trace_on else order)
            trace_on = bool(order) and order[-1] == _TRACE_ON
            order = order[:-1] if trace_on else order
        ordered = order_units(self.units, order, self.previous)
        if trace_on:
            self.previous = [unit.name for unit in ordered if unit.used]  # what this backward showed, kept
            return None
        self.given_up = [unit.name for unit in ordered if unit.name in self.wanted and not unit.used]
        return ordered

    def _misses_wanted(self, order: Sequence[str]) -> bool:
        if not self.wanted or self.backwards >= self.MAX_BACKWARDS:
            return False
        seen = set(order)
        known = set(self.previous)
        return any(
            unit.name in self.wanted and unit.name not in known and not seen.intersection(unit.param_names)
            for unit in self.units
        )

    def close(self) -> None:
        """Remove the hooks (also when the backward never came)."""
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)
