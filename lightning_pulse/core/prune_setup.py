"""What :class:`~lightning_pulse.ScheduledPrune` checks and says around a fit, without a Trainer.

Its rarely turned knobs (:class:`PruneOptions`), the setup-time checks that refuse a run before the first step
(an unsupported strategy, no layer to prune, a schedule that cannot be placed in the run, a maintain cadence
without a maintain phase, a model structured pruning cannot trace or cut safely, or one under torch.compile),
the event cadence, and the lines it logs at setup, after a distillation window and at fit end. The callback feeds
these with what it reads from the trainer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_pulse.core import prune_targets, pruning
from lightning_pulse.core.carried_state import kept_carried_state, kept_python_state
from lightning_pulse.core.prune_schedule import PRUNE_EVERY_DEFAULT, PruneSchedule, check_int, check_share
from lightning_pulse.core.prune_targets import LayerSelection
from lightning_pulse.core.pruning import exact_names_pattern
from lightning_pulse.core.snapshots import is_zero_redundancy, optimizers_within
from lightning_pulse.core.step_plan import epoch_steps
from lightning_pulse.errors import PulseRefusal, first_names, names_itself, refusing
from lightning_pulse.phase import STEPS_BOUND_ONLY, UNKNOWN_STEPS_PER_BATCH, Phase, PhaseClock

CADENCES = ("auto", "maintain", "steps")

#: why ScheduledPrune refuses a sharded strategy (:func:`~lightning_pulse.errors.refuse_sharded_strategy`)
SHARDED_REASON = "masks and channel choices made on a rank's shard are not the model's"

#: the warning for a distillation window whose term never reached the student
DISTILL_NO_EFFECT = (
    "ScheduledPrune: distillation had no effect: the module's forward never returned a logits tensor of the "
    "teacher's shape during training."
)


@dataclass
class PruneOptions:
    """Rarely turned knobs of :class:`~lightning_pulse.ScheduledPrune`.

    Attributes:
        initial_sparsity: sparsity at the schedule's start, in ``[0, final_sparsity]``.
        cadence: ``"maintain"`` (events at maintain-phase starts; needs a PulseCycle with a maintain phase),
            ``"steps"`` (every ``every`` steps), or ``"auto"`` (maintain when possible, else steps).
        ranking: ``"layer"`` (every layer reaches the target) or ``"global"`` (all chosen layers together).
        min_channels: structured mode: channels every layer keeps at least.
        make_permanent: at fit end, fold unstructured masks into the weights.
        fixed_copies: unstructured: the frozen copies of the parts to prune (a teacher, a reference model) are
            never updated from them, so prune anyway (:func:`refuse_frozen_twins`; an EMA cannot be told from
            a fixed copy at fit start).
    """

    initial_sparsity: float = 0.0
    cadence: str = "auto"
    ranking: str = "layer"
    min_channels: int = 1
    make_permanent: bool = True
    fixed_copies: bool = False

    @names_itself
    def __post_init__(self) -> None:
        check_share(self.initial_sparsity, "initial_sparsity", upper_open=True)
        if self.cadence not in CADENCES:
            raise ValueError(f"`cadence`={self.cadence!r} is not one of {list(CADENCES)}.")
        if self.ranking not in pruning.RANKINGS:
            raise ValueError(f"`ranking`={self.ranking!r} is not one of {list(pruning.RANKINGS)}.")
        check_int(self.min_channels, "min_channels", minimum=1)
        for name in ("make_permanent", "fixed_copies"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}`={getattr(self, name)!r} must be a bool.")


def check_options_apply(mode: str, every: int, options: PruneOptions) -> None:
    """Raise ``ValueError`` (naming the field) for an option set away from its default where the chosen ``mode``
    or cadence never reads it: ``min_channels`` (structured only), ``make_permanent=False`` (unstructured
    only: a structured cut has no masks to keep) and ``every`` with ``cadence='maintain'``."""
    if mode == "unstructured" and options.min_channels != PruneOptions.min_channels:
        raise ValueError(
            f"`min_channels`={options.min_channels!r} is read by mode='structured' only (channels a cut layer "
            "keeps); mode='unstructured' keeps every channel. Drop it, or use mode='structured'."
        )
    if mode == "structured" and options.make_permanent is not PruneOptions.make_permanent:
        raise ValueError(
            f"`make_permanent`={options.make_permanent!r} is read by mode='unstructured' only (whether masks are "
            "folded into the weights at fit end); mode='structured' removes channels and keeps no masks. Drop it."
        )
    if mode == "structured" and options.fixed_copies:
        raise ValueError(
            "`fixed_copies`=True is read by mode='unstructured' only; mode='structured' cuts a part's "
            "channels and not its copy's, so it refuses any frozen copy of a part to cut. Drop it, or use "
            "mode='unstructured'."
        )
    if options.cadence == "maintain" and every != PRUNE_EVERY_DEFAULT:
        raise ValueError(
            f"`every`={every!r} sets the step cadence, and `cadence`='maintain' prunes at maintain-phase starts "
            "instead, so it would do nothing; drop `every`, or use cadence='steps' (or 'auto' without a "
            "PulseCycle)."
        )


def check_strategy(name: str, supported: bool, spawns: bool, mode: str, options: PruneOptions) -> None:
    """Raise :class:`PulseRefusal` for a strategy other than single device and DDP (``supported``), or for
    structured mode or kept masks under a DDP strategy that ``spawns`` worker processes."""
    if not supported:
        raise PulseRefusal(
            f"ScheduledPrune: the {name} strategy is not supported (single device and DDP are); use "
            "strategy='ddp' or one device."
        )
    if spawns and (mode == "structured" or not options.make_permanent):
        raise PulseRefusal(
            "ScheduledPrune: mode='structured' or make_permanent=False cannot run under a spawning DDP "
            "strategy (ddp_spawn, ddp_fork, ddp_notebook): Lightning copies rank 0's final weights back into "
            "the main process's unpruned, unmasked module, which cannot take pruned shapes and would silently "
            "drop masked layers. Use strategy='ddp'."
        )


def check_optimizers(mode: str, optimizers: Iterable[Any]) -> None:
    """Raise :class:`PulseRefusal` for structured mode next to an optimizer that keeps the parameters' values
    in buffers of its own: a ``ZeroRedundancyOptimizer`` with ``parameters_as_bucket_view=True`` makes every
    parameter a view into a flat bucket it broadcasts after each step, and a cut parameter leaves its bucket,
    so the ranks would silently stop sharing its updates. Wrappers' inner optimizers are checked too
    (:func:`~lightning_pulse.core.snapshots.optimizers_within`)."""
    if mode != "structured":
        return
    for optimizer in optimizers_within(optimizers):
        if is_zero_redundancy(optimizer) and optimizer.parameters_as_bucket_view:
            raise PulseRefusal(
                "ScheduledPrune: mode='structured' cannot run next to ZeroRedundancyOptimizer with "
                "parameters_as_bucket_view=True: its parameters are views into flat buckets it broadcasts "
                "after each step, and a cut parameter leaves its bucket, so after the first cut the ranks "
                "would silently stop sharing its updates. Use parameters_as_bucket_view=False (the default; "
                "its cuts are followed), another optimizer, or mode='unstructured'."
            )


#: Lightning's callbacks that average the weights into a copy of the module taken at setup, by class name
#: (``WeightAveraging``, the base of ``EMAWeightAveraging``, came with Lightning 2.6)
AVERAGING_CALLBACKS = ("StochasticWeightAveraging", "WeightAveraging")


def check_weight_averaging(
    mode: str, callbacks: Iterable[Any], averages_buffers: Callable[[Any], bool]
) -> tuple[str, bool] | None:
    """Raise :class:`PulseRefusal` for structured mode next to one of ``callbacks`` that averages the weights
    into a copy of the module taken before training (:data:`AVERAGING_CALLBACKS`): the copy keeps the uncut
    shapes. Unstructured: returns the class name of a ``WeightAveraging`` (an ``EMAWeightAveraging``) and
    whether it averages buffers (``use_buffers``, read by ``averages_buffers``: the compat module's, private
    Lightning state), if there is one, for :func:`refuse_averaged_masks` at fit start;
    ``StochasticWeightAveraging`` pairs parameters only."""
    found = {
        kind: callback
        for callback in callbacks
        for kind in AVERAGING_CALLBACKS
        if any(
            base.__name__ == kind and base.__module__.startswith("lightning")
            for base in type(callback).__mro__
        )
    }
    if mode == "structured" and found:
        averaging = type(next(iter(found.values()))).__name__
        caveat = (
            " (next to a WeightAveraging it refuses a model with a buffer after a layer it masks, naming the "
            "layers to leave out)"
            if "WeightAveraging" in found
            else ""
        )
        raise PulseRefusal(
            f"ScheduledPrune: mode='structured' cannot run next to {averaging}: it averages the weights into a "
            "copy of the module taken before training, which keeps the uncut shapes, so its first average after "
            f"a cut would fail mid-run. Use mode='unstructured'{caveat}, or remove {averaging}."
        )
    averaging = found.get("WeightAveraging")
    if averaging is None:
        return None
    return type(averaging).__name__, averages_buffers(averaging)


#: Lightning's callback that puts ``torch.nn.utils.prune`` masks on the module at epoch ends, by class name
PRUNING_CALLBACKS = ("ModelPruning",)


def refuse_structured_next_to_pruning(mode: str, callbacks: Iterable[Any]) -> None:
    """Raise :class:`PulseRefusal` for structured mode next to Lightning's ``ModelPruning``. It masks layers
    at an epoch end, after the fit-start check of the masks a model carries, and a later cut that narrows a
    masked layer (its input, when the cut is upstream) puts a new parameter where the mask's hook sets a
    tensor: a held-out sweep's run crashed at the next event's forward (``cannot assign
    'torch.FloatTensor' as parameter 'weight'``), with ``make_pruning_permanent=False`` too. Unstructured
    masks sit next to ModelPruning's (:meth:`PruneEvents.end_fit
    <lightning_pulse.core.prune_events.PruneEvents.end_fit>` leaves its masks alone)."""
    if mode != "structured":
        return
    for callback in callbacks:
        found = next(
            (base for base in type(callback).__mro__ if _is_lightning(base, PRUNING_CALLBACKS)), None
        )
        if found is not None:
            raise PulseRefusal(
                f"ScheduledPrune: mode='structured' cannot run next to {type(callback).__name__}: it masks "
                "layers at epoch ends, and a later cut that narrows a masked layer or its input would fail "
                f"mid-run. Use mode='unstructured' (its masks and {found.__name__}'s live side by side), or "
                f"remove one of the two pruners."
            )


def _is_lightning(base: type, names: Sequence[str]) -> bool:
    return base.__name__ in names and base.__module__.split(".")[0] in ("lightning", "pytorch_lightning")


def folded_elsewhere_note(layers: Sequence[str], fold: bool) -> str:
    """The fit-end line for this callback's ``layers`` whose masks another callback folded before the fit's
    end (Lightning's ``ModelPruning`` with ``make_pruning_permanent=True`` folds every mask in the model at
    ``on_train_end``); ``fold``: this callback was to fold them too (``make_permanent``)."""
    kept = (
        "as make_permanent=True does"
        if fold
        else "so make_permanent=False could not keep their masks (ModelPruning(make_pruning_permanent=False) "
        "leaves them)"
    )
    return (
        f"ScheduledPrune: at fit end, the masks of {_some_names(list(layers))} had already been folded into "
        f"their weights by another callback (Lightning's ModelPruning does at train end); they are left as "
        f"they are, with their pruned zeros, {kept}."
    )


def refuse_averaged_masks(
    averaging: tuple[str, bool] | None,
    model: nn.Module,
    layers: Mapping[str, nn.Module],
    masked_at_setup: Collection[str],
) -> None:
    """Unstructured, next to a Lightning ``WeightAveraging`` (``averaging``: its class name, an
    ``EMAWeightAveraging``, and its ``use_buffers``): raise :class:`PulseRefusal` when the masks would break
    its pairing of the module's tensors with those of its copy taken at setup. With ``use_buffers=True`` it
    pairs parameters and buffers by position, so the ``weight_mask`` buffer an event adds to a layer shifts
    every buffer after it (a held-out model with BatchNorm crashed one step after the first event), and a mask
    a layer had at setup (``masked_at_setup``) is averaged in the copy and copied back over the events' masks;
    masks added after the last buffer are past the copy's end, left alone. With ``use_buffers=False`` it pairs
    the buffers strictly: any mask added fails its first update after the first event. The way out named
    leaves the layers that break it out (``exclude_pattern``), with ``use_buffers=True``."""
    if averaging is None:
        return
    name_of, use_buffers = averaging
    blocking, seen, buffer = [], [], None
    for name, module in model.named_modules():
        gains_mask = name in layers and name not in masked_at_setup  # not in the copy (a resume's is not)
        own = [b for b, _ in module.named_buffers(recurse=False) if not (gains_mask and b == "weight_mask")]
        if own and seen:  # a buffer after a layer that gains a mask: shifted
            blocking += seen
            buffer, seen = buffer or f"{name}.{own[0]}".lstrip("."), []
        if name in layers:
            (seen if gains_mask else blocking).append(name)
    gaining = [name for name in layers if name not in masked_at_setup]
    if not blocking and (use_buffers or not gaining):
        return
    names = sorted(set(blocking), key=list(layers).index)
    pattern = exact_names_pattern(names)
    if len(names) == len(layers):
        way_out = (
            f"Remove {name_of} (every layer to prune breaks its pairing), use StochasticWeightAveraging, or "
            f"register the buffer `{buffer}` before the layers to prune."
            if buffer
            else f"Remove {name_of} (every layer to prune breaks its pairing), or use StochasticWeightAveraging."
        )
    else:
        left_out = f" and leave {_some_names(names)} out with `exclude_pattern`={pattern!r}" if names else ""
        way_out = f"Use {name_of}(use_buffers=True){left_out}, or remove {name_of}."
    if not use_buffers:
        why = (
            "with use_buffers=False it keeps the copy's buffers in step with the module's by pairing them "
            f"strictly, and the mask buffer an event adds to `{gaining[0]}` makes the two lists differ in "
            "length"
        )
    elif buffer is not None:
        why = (
            "it pairs the module's parameters and buffers with its averaged copy's by position, and the mask "
            f"buffer an event adds to `{names[0]}` shifts `{buffer}` after it"
        )
    else:
        why = (
            f"the copy holds the mask `{names[0]}` carries now, which it averages and copies back over the "
            "events'"
        )
    raise PulseRefusal(
        f"ScheduledPrune: mode='unstructured' cannot run next to {name_of} on this model: {why}, so the run "
        f"would crash mid-run or end with wrong masks. {way_out}"
    )


def _and_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _some_names(names: Sequence[str]) -> str:
    shown = ", ".join(f"`{name}`" for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def checked_selection(pruner: pruning.Pruner, model: nn.Module) -> LayerSelection:
    """The layers ``pruner`` would prune in ``model``; :class:`PulseRefusal` when there is none, with the way
    out: other ``layer_types``, or, when no ``layer_types`` can help because the layers any of them would
    select are frozen by the user, the ways that do (:func:`_frozen_way_out`)."""
    selection = pruner.selection(model)
    if not selection.layers:
        chosen = (
            f"no layer of {model.__class__.__name__} can be pruned with `layer_types`="
            f"{[t.__name__ for t in pruner.layer_types] or None}, "
            f"`exclude_pattern`={pruner.exclude_pattern!r}"
        )
        weightless = _weightless_note(model, pruner.layer_types)
        if (frozen := _frozen_way_out(pruner, model)) is not None:
            raise PulseRefusal(f"ScheduledPrune: {chosen}, and {frozen[0]}{weightless} {frozen[1]}")
        embeddings = _embeddings_only_note(pruner, model)
        if (computed := _computed_way_out(pruner, model, selection)) is not None:
            raise PulseRefusal(
                f"ScheduledPrune: {chosen}.{left_out_note(selection)}{weightless}{embeddings} {computed}"
            )
        if (layerless := _layerless_way_out(pruner, model)) is not None:
            raise PulseRefusal(f"ScheduledPrune: {chosen}. {layerless}")
        raise PulseRefusal(
            f"ScheduledPrune: {chosen}.{left_out_note(selection)}{weightless}{embeddings} Choose other "
            "`layer_types` or remove ScheduledPrune."
        )
    return selection


def _layerless_way_out(pruner: pruning.Pruner, model: nn.Module) -> str | None:
    """Where no module of any type in ``model`` holds a weight either mode could prune, while parameters
    train: that no ``layer_types`` (nor the other mode) can help, the parameters that train, and what works.
    ``None`` otherwise. A torch.func ensemble (``stack_module_state``: the members' weights stacked as
    ``nn.Parameter`` on the module and read through ``vmap(functional_call(base, ...))``, the base module kept
    outside the module tree) was told to "choose other `layer_types`", which no value can satisfy."""
    trained = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    every = [
        prune_targets.select_targets(model, (), None, structured, (), pruner.not_trained)
        for structured in (False, True)
    ]
    if not trained or any(selection.layers or selection.left_out for selection in every):
        return None
    return (
        f"No other `layer_types` can help, nor the other `mode`: no module of any type holds the parameters "
        f"that train ({_some_names(trained)}), which are held outside any layer (stacked for torch.func's "
        "`vmap(functional_call(...))`, as `stack_module_state` gives them, or used by the module's own "
        "`forward`), and ScheduledPrune prunes a layer's own `weight` only, in either mode. Way out: hold "
        "the weights in layers that the forward calls (the members as `nn.Linear` layers in an "
        "`nn.ModuleList`, each called in turn) or remove ScheduledPrune."
    )


def _computed_way_out(pruner: pruning.Pruner, model: nn.Module, selection: LayerSelection) -> str | None:
    """Where layers of the chosen types are left out because their ``weight`` is computed (a parametrization,
    the older ``weight_norm`` / ``spectral_norm`` hooks): the call that removes each kind, the way to prune
    them; other ``layer_types`` only where they would select a layer. ``None`` where none is. A sweep's MLP
    with every ``Linear`` parametrized was told only to "choose other `layer_types`", which cannot help."""
    computed = [name for name, why in selection.left_out.items() if why == prune_targets.COMPUTED_WEIGHT]
    if not computed:
        return None
    removals: dict[str, list[str]] = {}
    for name in computed:
        call = prune_targets.weight_computation_removal(model.get_submodule(name))
        removals.setdefault(call, []).append(name)
    # each kind its own call: `remove_parametrizations` raises on an old-style `weight_norm` hook
    calls = "; ".join(f"`{call}` for {_some_names(names)}" for call, names in removals.items())
    any_type = prune_targets.select_targets(
        model, (), pruner.exclude_pattern, pruner.mode == "structured", pruner.user_frozen, pruner.not_trained
    )
    other_types = ", choose other `layer_types`" if any_type.layers else ""
    them, their = ("it", "its") if len(computed) == 1 else ("them", "their")
    return (
        f"Way out: remove what computes {their} weight before the fit ({calls}) to prune {them}{other_types} "
        "or remove ScheduledPrune."
    )


def _frozen_way_out(pruner: pruning.Pruner, model: nn.Module) -> tuple[str, str] | None:
    """Where no layer of any type can be pruned in ``model`` and some are left out as frozen by the user:
    why no ``layer_types`` can help, and the ways out that work (whether unfreezing helps, as the structured
    refusal says; holding bare trained parameters in ``nn.Linear`` layers; a narrower ``exclude_pattern``).
    ``None`` where other ``layer_types`` would select a layer, or nothing is frozen. A held-out sweep (prompt
    tuning on a frozen GPT-2, LoRA adapters held as bare ``nn.Parameter`` on a frozen Llama) was told to
    "choose other `layer_types`", and each it tried was refused again."""
    structured, exclude = pruner.mode == "structured", pruner.exclude_pattern

    def any_type(frozen: Collection[str], exclude: str | None) -> LayerSelection:
        return prune_targets.select_targets(model, (), exclude, structured, frozen, pruner.not_trained)

    selection = any_type(pruner.user_frozen, exclude)
    frozen = [name for name, why in selection.left_out.items() if why == prune_targets.FROZEN_BY_USER]
    if selection.layers or not frozen:
        return None
    others = {name: why for name, why in selection.left_out.items() if name not in frozen}
    # layers with a trained weight that the user's own pattern left out: that pattern, not the freezing, is
    # why nothing is left (a frozen backbone's trained `head` with exclude_pattern='head' was said to be
    # frozen, and its weight to be no layer's)
    excluded = list(any_type(pruner.user_frozen, None).layers) if exclude is not None else []
    every_layer = prune_targets.select_targets(model, (), None, structured, (), pruner.not_trained)
    layer_weights = {f"{name}.weight" for name in [*every_layer.layers, *every_layer.left_out]}
    # structured mode cuts a per-channel scale (a LayerNorm's) with the layer before it, never on its own
    scales = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if structured and name and prune_targets.scales_channels(module)
    }
    trained = {
        name: p for name, p in model.named_parameters() if p.requires_grad and name not in layer_weights
    }
    bare = [name for name in trained if name not in scales]
    scaled = [name for name in trained if name in scales]
    scales_aside = ", per-channel scales aside," if scaled else ""
    if excluded:
        which = (
            "the layer with a trained `weight` is"
            if len(excluded) == 1
            else "the layers with a trained `weight` are"
        )
        why = (
            f"no other `layer_types` can help: {which} left out by `exclude_pattern`={exclude!r} "
            f"(`layer_types`=None: {_some_names(excluded)}), and the rest{scales_aside} are frozen by the "
            f"user (`requires_grad=False`: {_some_names(frozen)}), whose weights ScheduledPrune never "
            "changes."
        )
    else:
        every = (
            "every layer with a `weight`" if not others else f"{len(frozen)} of the layers with a `weight`"
        )
        verb = "is" if not others or len(frozen) == 1 else "are"
        why = (
            f"no other `layer_types` can help: {every} (`layer_types`=None){scales_aside} {verb} frozen by "
            f"the user (`requires_grad=False`: {_some_names(frozen)}), and ScheduledPrune never changes "
            "frozen weights."
        )
    if others:
        why += f" Left out too: {LayerSelection(left_out=others).describe_left_out(3)}."
    if scaled:
        why += (
            f" {_some_names(scaled)} (per-channel scales) train too: mode='structured' cuts such a scale "
            "with the layer before it, never on its own."
        )
    if bare:
        besides = " besides" if excluded or scaled else ""
        why += (
            f" What trains{besides} is {_some_names(bare)}: parameters held outside a layer's `weight`, the "
            "only parameter it prunes."
        )
    ways = []
    if excluded:
        ways.append(f"narrow `exclude_pattern` so that it leaves {_some_names(excluded)} in")
    if any_type((), exclude).layers:
        ways.append("unfreeze the layers to prune")
    if any(trained[name].dim() >= 2 for name in bare):
        ways.append("hold trained adapter matrices in `nn.Linear` layers (as peft's LoRA holds them)")
    if exclude is not None and not excluded and any_type((), None).layers:
        ways.append("narrow `exclude_pattern`")
    if scaled and any_type((), exclude).layers:
        ways.append(
            "use mode='unstructured' with `layer_types`=None (it prunes a per-channel scale's `weight`)"
        )
    ways.append("remove ScheduledPrune")
    text = ", ".join(ways[:-1]) + f" or {ways[-1]}" if len(ways) > 1 else ways[0]
    return why, f"Way out: {text}."


def _embeddings_only_note(pruner: pruning.Pruner, model: nn.Module) -> str:
    """Where the layers any ``layer_types`` would select in a model the user froze are all ``nn.Embedding``:
    that they are, as peft's prompt tuning holds its soft prompt in one (``PromptEmbedding``), which
    ``layer_types=None`` would then prune itself; else ``""``."""
    if not pruner.user_frozen:
        return ""
    structured = pruner.mode == "structured"
    layers = prune_targets.select_targets(
        model, (), pruner.exclude_pattern, structured, pruner.user_frozen, pruner.not_trained
    ).layers
    if not layers or not all(isinstance(layer, nn.Embedding) for layer in layers.values()):
        return ""
    return (
        f" Other `layer_types` (None) would select only {_some_names(list(layers))}, an `nn.Embedding` in a "
        "model otherwise frozen: where it holds a soft prompt (peft's prompt tuning), that prunes the prompt "
        "itself."
    )


def _weightless_note(model: nn.Module, layer_types: tuple[type, ...]) -> str:
    found = prune_targets.weightless_of_types(model, layer_types)
    if not found:
        return ""
    name, why = next(iter(found.items()))
    more = f" (and {len(found) - 1} more like it)" if len(found) > 1 else ""
    return f" `{name}`{more} cannot be pruned: {why}."


def _type_path(layer_type: type) -> str:
    """How ``layer_types`` names ``layer_type``: its bare name for a ``torch.nn`` class, else its dotted
    path."""
    if getattr(nn, layer_type.__name__, None) is layer_type:
        return layer_type.__name__
    return f"{layer_type.__module__}.{layer_type.__qualname__}"


def unreached_warning(
    model: nn.Module,
    selection: LayerSelection,
    exclude: str | None,
    final_sparsity: float,
    types_chosen: bool = False,
    structured: bool = False,
) -> str | None:
    """The fit-start warning when trainable parameters out of reach of ``selection`` hold more than
    :data:`~lightning_pulse.core.prune_targets.UNREACHED_SHARE` of the model's (embedding tables, biases and
    norms aside: :func:`~lightning_pulse.core.prune_targets.unreached_parameters`), else ``None``. A
    held-out sweep: a transformers-5 OLMoE keeps its experts (59% of the model) in fused 3-D parameters, not
    layers; sparsity 0.5 was reported while 14.8% of the model was zero, with nothing said."""
    unreached, reached, total = prune_targets.unreached_parameters(model, selection, exclude, types_chosen)
    out_of_reach = sum(size for _, size, _ in unreached)
    if not total or out_of_reach <= prune_targets.UNREACHED_SHARE * total:
        return None
    by_reason: dict[str, list[str]] = {}
    for name, size, why in unreached[:3]:
        by_reason.setdefault(why, []).append(f"`{name}` ({size / total:.0%})")
    shown = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())
    more = f"; and {len(unreached) - 3} more" if len(unreached) > 3 else ""
    reasons = [why for _, _, why in unreached[:3]]  # the ways out fit the reasons shown
    ways = []
    kinds = [
        _type_path(type(model.get_submodule(name.rpartition(".")[0])))
        for name, _, why in unreached[:3]
        if why.endswith("(`layer_types`)")
    ]
    if kinds:
        # not `layer_types=None`: any layer with a `weight` also takes norm scales and embedding tables, whose
        # zeroed halves cost ten times the types named on a held-out MoE (HF JetMoE, validation loss +0.24
        # against +0.025)
        named = ", ".join(repr(kind) for kind in dict.fromkeys([*pruning.DEFAULT_LAYER_TYPES, *kinds]))
        ways.append(
            f"add the types named to `layer_types` (`layer_types=[{named}]`; not `None`, which takes every "
            "layer with a `weight`, norm scales and embedding tables too)"
        )
    if any("not a layer's `weight`" in why for why in reasons):
        experts = any("expert tensors" in why for why in reasons)
        ways.append(
            "ScheduledPrune prunes a layer's `weight` only and never these: build that part from `nn.Linear` "
            f"layers{' (one per expert)' if experts else ''}"
            + (
                ""
                if structured
                else ", or mask such tensors yourself with `torch.nn.utils.prune` (it keeps such masks, and "
                "this check counts them as pruned)"
            )
        )
    way_out = "; ".join(ways) or "lift the reasons named"
    return (
        f"ScheduledPrune: the layers it prunes hold {reached / total:.0%} of the trainable parameters "
        f"(embedding tables aside), while {out_of_reach / total:.0%} are out of its reach and will not be "
        f"pruned: {shown}{more}. The `sparsity` it reports counts only the pruned layers: "
        f"`final_sparsity`={final_sparsity:g} {'removes' if structured else 'zeroes'} about "
        f"{final_sparsity * reached / total:.0%} of these "
        f"parameters. Way out: {way_out}; or, to prune only these layers knowingly, name the rest in "
        "`exclude_pattern`, which this check then leaves out."
    )


def fit_start_selection(
    pruner: pruning.Pruner,
    model: nn.Module,
    schedule: PruneSchedule,
    frozen: frozenset[str] | None,
    compiled: Sequence[str],
    example: Any,
    fixed_copies: bool = False,
) -> tuple[LayerSelection, list[str], Any]:
    """At fit start, the layers ``pruner`` prunes in ``model``, leaving out those the user froze (``frozen``,
    as a restored checkpoint recorded them; ``None``: the layers frozen in ``model`` now). Raises
    :class:`PulseRefusal` when there is none (:func:`checked_selection`) and, in structured mode, for
    ``torch.nn.utils.prune`` masks on one (:func:`refuse_user_masks_structured`), a compiled part holding
    one (``compiled``: :func:`refuse_compiled_structured`), a model that cannot be traced or cut safely (:func:`refuse_structured`) or a frozen copy of a part to cut
    (:func:`refuse_frozen_twins`; unstructured too, unless ``fixed_copies``); in both modes, for a part an
    AveragedModel submodule averages (:func:`refuse_averaged_sources`).

    Returns the selection, the layers whose zeros folded into the weights were masked again
    (:func:`~lightning_pulse.core.pruning.mask_folded_zeros`, unstructured), and the structured trace input:
    from ``example_input_array`` (:func:`structured_example`), else ``example`` as it was."""
    pruner.user_frozen = prune_targets.frozen_layers(model) if frozen is None else frozen
    selection = checked_selection(pruner, model)
    refuse_averaged_sources(model, selection.layers, pruner.mode)
    masked = pruning.mask_folded_zeros(selection.layers, pruner.mode, schedule.sparsity)
    if pruner.mode == "unstructured" and not fixed_copies:
        refuse_frozen_twins(model, selection.layers, pruner.mode, pruner.exclude_pattern)
    if pruner.mode == "structured":
        refuse_user_masks_structured(selection.layers, pruner.exclude_pattern)
        refuse_compiled_structured(pruner.mode, compiled, selection.layers)
        blocker = pruning.structured_blocker(model, selection)
        if blocker is not None and blocker.startswith(pruning.HF_CONV1D):
            refuse_conv1d_alone(
                blocker, selection
            )  # else the trial cut without them decides, at the example:
            if pruner.example_inputs is not None:  # a checkpoint's (no later check would run)
                refuse_conv1d(blocker, model, pruner, schedule.sample_targets(), pruner.example_inputs)
        else:
            refuse_structured(blocker, model)
        refuse_frozen_twins(model, selection.layers, exclude=pruner.exclude_pattern)
        if getattr(model, "example_input_array", None) is not None:
            example = structured_example(model, pruner, schedule, None)
    return selection, masked, example


def renamed_weight_warning(mode: str, model: nn.Module, layers: Mapping[str, nn.Module]) -> str | None:
    """Unstructured: the fit-start warning for buffers of ``model`` shaped like the weight of one of ``layers``
    (:func:`~lightning_pulse.core.prune_targets.weight_shaped_buffers`), else ``None``. Such a buffer is most
    often a copy of the weights kept by parameter name (an EMA), and the first event renames each masked
    layer's parameter ``weight`` to ``weight_orig``: a held-out EMA kept as buffers, updated by name from
    ``named_parameters()``, failed at the first event (``AttributeError: ... 'ema_0_weight_orig'``). Whether
    code reads parameters by name shows only in training, so this is said, not refused."""
    if mode != "unstructured":
        return None
    found = prune_targets.weight_shaped_buffers(model, layers)
    if not found:
        return None
    buffer, layer = next(iter(found.items()))
    names = ", ".join(f"`{name}`" for name in list(found)[:3]) + (
        f" and {len(found) - 3} more" if len(found) > 3 else ""
    )
    return (
        f"ScheduledPrune: the module holds buffers shaped like the weights of layers it will mask ({names}; "
        f"`{buffer}` like `{layer}.weight`), as a copy of the weights kept by parameter name (an EMA) is. From "
        f"the first pruning event on, a masked layer's weight is no longer a parameter: `named_parameters()` "
        f"gives `{layer}.weight_orig`, and `{layer}.weight` is computed from `{layer}.weight_orig * "
        f"{layer}.weight_mask` before every forward. Code that reads or writes parameters by name must use "
        f"`weight_orig` (a write to `{layer}.weight` itself is kept, but not an in-place one through `.data`); "
        "or leave those layers out with `exclude_pattern`."
    )


def kept_masks_note(mode: str, layers: Mapping[str, nn.Module], pruned: bool) -> str | None:
    """Unstructured, before this run's first event (not ``pruned``): the line saying that ``layers`` already
    carry ``torch.nn.utils.prune`` masks with zeros (the user pruned the model, or :func:`load_pruned
    <lightning_pulse.core.pruning.load_pruned>` loaded a pruned run), kept: each event's mask is the
    intersection with the one a layer has (:func:`~lightning_pulse.core.pruning.unstructured_masks`), so the
    sparsity reported is the real one and may stay above the schedule's target. ``None`` when none has."""
    if mode != "unstructured" or pruned:
        return None
    masks = {name: pruning.current_mask(layer) for name, layer in layers.items()}
    masked = [name for name, mask in masks.items() if mask is not None and not bool(mask.all())]
    if not masked:
        return None
    return (
        f"ScheduledPrune: {len(masked)} layer(s) to prune already carry a pruning mask "
        f"({', '.join(masked[:3])}{' ...' if len(masked) > 3 else ''}; sparsity "
        f"{pruning.global_sparsity(layers):.3f} of the layers to prune): kept. Their zeros stay pruned: each "
        "event's mask keeps them, so the sparsity reached can stay above the schedule's target."
    )


def left_out_note(selection: LayerSelection) -> str:
    """``" Left out: a (why), ..."`` for the messages, or ``""`` when every candidate layer was selected."""
    return f" Left out: {selection.describe_left_out()}." if selection.left_out else ""


def uses_maintain(cadence: str, has_cycle: bool, has_maintain: bool) -> tuple[bool, str | None]:
    """Whether events happen at maintain-phase starts, and a warning to give (or ``None``).

    Raises :class:`PulseRefusal` for ``cadence="maintain"`` without a non-zero maintain phase.
    """
    if cadence == "maintain" and not has_maintain:
        raise PulseRefusal(
            "ScheduledPrune: `cadence`='maintain' needs a PulseCycle with a non-zero maintain phase; add one "
            "or use `cadence`='steps'."
        )
    warning = None
    if cadence == "auto" and has_cycle and not has_maintain:
        warning = "ScheduledPrune: the PulseCycle has no maintain phase; pruning on the step cadence."
    return has_maintain and cadence != "steps", warning


def event_cadence(
    cadence: str,
    clock: PhaseClock | None,
    schedule: PruneSchedule,
    step: int = 0,
    total_steps: float = math.inf,
    steps_per_epoch: float | None = None,
    *,
    decided: bool | None = None,
    pruned: bool = False,
    holder: str | None = None,
) -> tuple[bool, list[str]]:
    """Whether events happen at maintain-phase starts of ``clock`` (a PulseCycle's; ``None`` without one), and
    the warnings to give at fit start: :func:`uses_maintain`'s, then :func:`abrupt_schedule_warning`'s (on
    the maintain cadence at the maintain starts the clock plans, :func:`maintain_starts`; none for wall-clock
    phases, whose starts are not known before the run). Raises :class:`PulseRefusal` as :func:`uses_maintain`
    does. ``holder`` names a callback that can hold the PulseCycle in its light phases (a GreenWindow with
    ``when_dirty='light'``): its holds move the maintain starts, so that warning says the plan assumes none.

    On the maintain cadence the clock is played forward from ``step``: when no maintain phase starts between
    the schedule's start and the run's end (``total_steps``; a budget that lengthens the replay phases, or a
    short run, can leave none), ``cadence='auto'`` prunes on the step cadence instead, with a warning, and
    ``cadence='maintain'`` is refused: either way the run would end unpruned with nothing said.

    A resumed run keeps the look-ahead's answer its first part ``decided`` (saved in the checkpoint), so it
    prunes where the uninterrupted run would; the resumed fit's own ``cadence`` and PulseCycle still rule
    first (a resume with ``cadence='steps'``, or with no maintain phase, does not wait for maintain phases).
    One resumed from an older checkpoint that has ``pruned`` already is not played forward (its next maintain
    phase may lie past the run's end, as the uninterrupted run's did).
    """
    duration = clock.durations.get(Phase.MAINTAIN) if clock is not None else None
    has_maintain = duration is not None and not duration.is_zero
    on_maintain, warning = uses_maintain(cadence, clock is not None, has_maintain)
    if decided is not None and on_maintain:  # the first fit said its warnings
        return decided, []
    if on_maintain and clock is not None and not schedule.finished and not pruned:
        start = max(schedule.start_step, step)
        if clock.first_entry(Phase.MAINTAIN, start, steps_per_epoch, total_steps) is None:
            where = (
                f"no maintain phase starts between step {start} (the pruning schedule's start) and the run's end "
                f"(step {total_steps:g}) in the PulseCycle's plan"
            )
            if cadence == "maintain":
                raise PulseRefusal(
                    f"ScheduledPrune: `cadence`='maintain' prunes at maintain-phase starts, and {where}, so nothing "
                    "would be pruned. Use cadence='steps', start pruning earlier, or shorten the phases before "
                    "the maintain phase."
                )
            on_maintain, warning = False, f"ScheduledPrune: {where}; pruning on the step cadence instead."
    abrupt = None
    if not on_maintain:
        abrupt = abrupt_schedule_warning(schedule, run_end=total_steps)
    elif clock is not None and not schedule.finished and not pruned:
        starts = maintain_starts(clock, schedule.end_step, total_steps, steps_per_epoch)
        abrupt = None if starts is None else abrupt_schedule_warning(schedule, starts, holder, total_steps)
    return on_maintain, [text for text in (warning, abrupt) if text is not None]


def maintain_starts(
    clock: PhaseClock, until: int, total_steps: float, steps_per_epoch: float | None
) -> list[int] | None:
    """The optimizer steps at which maintain phases start in the run when a copy of ``clock`` (a
    PulseCycle's) is played forward from now: each one before step ``until``, and the first at or after it.
    ``None`` when the plan cannot tell: wall-clock phases end with the seconds the steps take, phases counted
    in epochs have no ``steps_per_epoch`` when the epoch's length changes (a GradientAccumulationScheduler),
    and warm-up or anneal need a run length (PulseCycle refuses that itself).

    The copy jumps from one possible phase change to the next, as :meth:`PhaseClock.first_entry` does: the
    end of a phase counted in steps, the warm-up's end, the anneal's start. A phase counted in epochs goes a
    step at a time, as the run's clock does, so it ends at the step the run's fractions of an epoch add up at.
    The cost is per phase for step-counted phases, per step for epoch-counted ones; measured once at fit start
    for a 1,000,000-step run planned to 70%: 0.08 s at PulseCycle's defaults (6,000 cycles; 0.84 s a step at
    a time), 0.78 s for phases of 2, 1 and 0.5 epochs of 1,000 steps."""
    if clock.uses_wall_clock:
        return None
    sim, starts = clock.copy(), []
    limit = min(until, total_steps)
    try:
        changes = [sim.start(total_steps)] if sim.stage == "pending" else []
        while True:
            starts += [c.step for c in changes if c is not None and c.current is Phase.MAINTAIN]
            if sim.step >= limit or sim.stage == "anneal":  # anneal is burst to the end
                break
            # the clock's own jumps (as first_entry makes them), none past the plan's end
            jump = min(sim.steps_to_boundary(total_steps), math.ceil(limit - sim.step))
            changes = sim.advance(jump, 0.0, steps_per_epoch, total_steps)
        if (not starts or starts[-1] < until) and sim.stage != "anneal":
            later = sim.first_entry(Phase.MAINTAIN, until, steps_per_epoch, total_steps)
            starts += [] if later is None else [later]
    except ValueError:
        return None
    return starts


def pulse_cycle_holder(callbacks: Iterable[Any], holder_type: type) -> str | None:
    """The class name of the first of ``callbacks`` that can hold the PulseCycle in its light phases
    (:meth:`PulseCycle.hold_light <lightning_pulse.PulseCycle.hold_light>`): a ``holder_type`` (the callback
    hands in GreenWindow: a core module imports no callback) with ``when_dirty='light'``; ``None`` for none
    (see :func:`event_cadence`)."""
    holders = (c for c in callbacks if isinstance(c, holder_type) and c.when_dirty == "light")
    return next((type(c).__name__ for c in holders), None)


def steps_per_epoch(
    batches: float, accumulation: int, epoch: int, scheduling: Mapping[int, int] | None
) -> int | None:
    """Optimizer steps in an epoch of ``batches`` batches, for phases counted in epochs, at ``accumulation``
    batches a step; ``None`` when a GradientAccumulationScheduler (``scheduling``: its factor by first epoch)
    changes them from one epoch to another from the current ``epoch`` on (no one figure plans such phases; a
    resumed run past the last change has one)."""
    if scheduling is None:
        factors = {accumulation}
    else:
        # the factor in force now (Lightning adds one for epoch 0 when none is given) and those set later
        in_force = max(start for start in scheduling if start <= epoch)
        factors = {factor for start, factor in scheduling.items() if start >= in_force}
    return epoch_steps(batches, factors.pop()) if len(factors) == 1 else None


#: A schedule whose largest single cut takes more than this share of ``final_sparsity`` is said at fit start
#: (the cubic schedule's first cut is 0.875 of it with 2 events, 0.70 with 3, 0.33 with 8): a held-out ResNet
#: on a 180-step run at the defaults (``every=100``) was cut from 0 to 50% in one event, its loss jumped from
#: 0.07 to 3.7, and it ended at 3.5x plain's; on the maintain cadence, PulseCycle's defaults on a 220-step run
#: had one maintain start in the span, and a BatchNorm CNN's probe accuracy fell from 0.975 to 0.284 there.
ABRUPT_CUT_SHARE = 0.75


def abrupt_schedule_warning(
    schedule: PruneSchedule,
    maintain_at: Sequence[int] | None = None,
    holder: str | None = None,
    run_end: float = math.inf,
) -> str | None:
    """A warning when the schedule cuts most of the way in one event, else ``None``: on the step cadence, or
    at ``maintain_at`` (the steps maintain phases start at, on the maintain cadence, in a plan that assumes
    no hold by ``holder``, a callback that can hold the PulseCycle in its light phases). Chances at or after
    ``run_end`` (the run's optimizer steps) make no cut (:meth:`PruneEvents.advance
    <lightning_pulse.core.prune_events.PruneEvents.advance>`) and are not counted."""
    cuts = schedule.planned_cuts(maintain_at, until=run_end)
    if not cuts or schedule.final_sparsity <= 0:
        return None
    step, before, after = max(cuts, key=lambda cut: cut[2] - cut[1])
    if after - before <= ABRUPT_CUT_SHARE * schedule.final_sparsity:
        return None
    span = schedule.end_step - schedule.start_step
    suggested = max(1, span // 8)
    span_text = f"the pruning span (steps {schedule.start_step} to {schedule.end_step})"
    cut_text = f"the one at step {step} takes sparsity from {before:.2f} to {after:.2f} at once"
    gradual = "gradual pruning needs several smaller cuts with training in between."
    if maintain_at is None:
        return (
            f"ScheduledPrune: with `every`={schedule.every} over {span_text}, the schedule makes {len(cuts)} "
            f"cut(s), and {cut_text}; {gradual} Set `every` to about {suggested} (8 events over the span), "
            "or widen `start`/`end`."
        )
    end, reached = schedule.end_step, cuts[-1][2]
    short = (
        f" (no maintain phase starts at or after step {end} with a step left to train after it: sparsity "
        f"stops at {reached:.2f})"
    )
    short = short if reached < schedule.final_sparsity else ""
    plan = (
        "the PulseCycle's plan"
        if holder is None
        else f"the PulseCycle's plan, if no {holder} hold moves its phases,"
    )
    # a cycle is at least a burst step and a maintain step: a span too short for 8 such cycles is offered
    # 3 (the cubic schedule's first cut is then 0.70 of the target, under ABRUPT_CUT_SHARE)
    phases = next(((count, span // count) for count in (8, 3) if span // count >= 2), None)
    cycle = (
        f"a cycle of about {phases[1]} steps has {phases[0]} in it: shorter `burst`/`replay`"
        if phases is not None
        else f"the span of {span} steps is too short for more: widen it"
    )
    return (
        f"ScheduledPrune: pruning at maintain-phase starts, {plan} makes {len(cuts)} cut(s) "
        f"over {span_text}, and {cut_text}{short}; {gradual} Give the span more maintain phases ({cycle}), "
        f"widen `start`/`end`, or prune on steps: options=PruneOptions(cadence='steps') with "
        f"`every`={suggested}."
    )


def refuse_schedule_past_the_run(schedule: PruneSchedule, total_steps: float, step: int) -> None:
    """Raise :class:`PulseRefusal` when the schedule's first event comes after the run's last step: nothing
    would be pruned, silently."""
    if (
        math.isfinite(total_steps)
        and not schedule.finished
        and schedule.start_step >= max(total_steps, step + 1)
    ):
        shares = isinstance(schedule.start, float)  # 1.0 is the run's end: a share can only be lowered
        way_out = (
            "below 1.0 (such as 0.2 and 0.8)" if shares else ", or give them as shares of the run (0.2, 0.8)"
        )
        raise PulseRefusal(
            f"ScheduledPrune: the schedule starts at step {schedule.start_step} (`start`={schedule.start!r}), but "
            f"the run ends at step {int(total_steps)}: nothing would be pruned. Lower `start` and `end`"
            f"{' ' if shares else ''}{way_out}."
        )


def resolve_schedule(
    schedule: PruneSchedule, total_steps: float, step: int, manual_optimizers: int = 0
) -> None:
    """At fit start, place ``schedule`` in a run of ``total_steps`` optimizer steps, now at ``step``
    (:meth:`PruneSchedule.resolve`). Raises :class:`PulseRefusal` when it cannot be placed (a share of a run of
    unknown length, ``start`` after ``end``) or when it would start after the run
    (:func:`refuse_schedule_past_the_run`). ``manual_optimizers``: the optimizers a module steps itself
    where a batch's steps are unknown (:func:`~lightning_pulse._lightning_compat.steps_per_batch_unknown`),
    else 0; a share of such a run of unknown length is refused with that reason. An ``end`` within the run's
    last batch (``end=1.0``, ``end=max_steps``) is placed a batch's steps before the run's end (one step; one
    per optimizer where a module steps ``manual_optimizers`` each batch): no event is made at the run's last
    step (:meth:`PruneEvents.advance <lightning_pulse.core.prune_events.PruneEvents.advance>`)."""
    spans = (("start", schedule.start), ("end", schedule.end))
    shares = [f"`{name}`={when!r}" for name, when in spans if isinstance(when, float)]
    if manual_optimizers and shares and not math.isfinite(total_steps):
        what = "are shares" if len(shares) > 1 else "is a share"
        raise PulseRefusal(
            f"ScheduledPrune: {' and '.join(shares)} {what} of the run's optimizer steps, and "
            f"{UNKNOWN_STEPS_PER_BATCH.format(count=manual_optimizers)}. Give `start` and `end` as int "
            f"optimizer steps, or {STEPS_BOUND_ONLY}."
        )
    with refusing("ScheduledPrune"):
        schedule.resolve(total_steps)
    refuse_schedule_past_the_run(schedule, total_steps, step)
    # `end` within the run's last batch (`end=1.0`): no event is made at the run's last step, after its last
    # batch (PruneEvents.advance), so the schedule ends a batch's steps before, where the cut to
    # `final_sparsity` still has a batch to train after it. A module stepping two optimizers a batch makes
    # global_step +2 a batch: a chance placed a step before the end came due only at the run's end, and
    # with every=100 the run ended at 0.07 of 0.5 while the fit-start plan promised the cut
    per_batch = max(1, manual_optimizers)
    if total_steps - per_batch < schedule.end_step <= total_steps:
        schedule.end_step = max(schedule.start_step, int(total_steps) - per_batch)


def refuse_structured(reason: str | None, model: nn.Module | None = None) -> None:
    """Raise :class:`PulseRefusal` with the way out when structured pruning cannot run for ``reason`` (on
    ``model``: one with a ``forward`` of its own is not told to add one)."""
    own_way_out = {
        pruning.NOT_RUN_ON_EXAMPLE: "Give the LightningModule an `example_input_array` (what its `forward` "
        "takes; it is traced as given), or a `forward` that takes the batch's input; or use "
        "mode='unstructured'.",
        NOT_RUN_ON_GIVEN_EXAMPLE: "Make `example_input_array` what `forward` takes (a tuple is passed as "
        "positional arguments, a dict as keyword arguments, anything else as the one argument), or use "
        "mode='unstructured'.",
        BATCH_NOT_CUT: "Give the LightningModule an `example_input_array` (what its `forward` takes): it is "
        "traced as given, uncut. Or use mode='unstructured'.",
        # read before any layer is chosen: narrowing `layer_types`/`exclude_pattern` gave the same refusal
        prune_targets.BATCH_NOT_INPUT: "Give the LightningModule an `example_input_array` that its `forward` "
        "takes (a tuple is passed as positional arguments, a dict as keyword arguments, anything else as the "
        "one argument): the model is traced with it instead of the batch. Or use mode='unstructured' (its "
        "masks need no trace).",
        pruning.REENTRANT_CHECKPOINT: "Pass use_reentrant=False to torch.utils.checkpoint / "
        "checkpoint_sequential (the non-reentrant form is traced whole), or use mode='unstructured'.",
        pruning.AUTOGRAD_OFF: "Leave these layers out with `exclude_pattern`, pass use_reentrant=False to a "
        "checkpoint around them, or use mode='unstructured'.",
        pruning.FROZEN_COUPLING: "Unfreeze those layers, or use mode='unstructured'.",
        pruning.FROZEN_LEFT_OUT: "Unfreeze the layers to cut, or use mode='unstructured'.",
        pruning.FROZEN_AND_UNCUTTABLE: "Use mode='unstructured'.",
        pruning.MIN_CHANNELS_FLOOR: "Lower `min_channels` (`PruneOptions(min_channels=...)`) into that range, "
        "or use mode='unstructured'.",
        pruning.CALLED_MORE_THAN_ONCE: "Use mode='unstructured' (one mask serves every call of a shared "
        "weight), or give each call its own module (weights not shared) to cut them with mode='structured'.",
        pruning.SHARED_LEFT_OUT: "Give each layer its own weight (`b.weight = nn.Parameter(a.weight.detach()"
        ".clone())`; untie a tied embedding and output layer) to cut them with mode='structured', or use "
        "mode='unstructured' (one mask serves every owner of a shared weight).",
        pruning.UNCUT_BUFFER: "Leave that layer out with `exclude_pattern`, use mode='unstructured' (it keeps "
        "every shape), or keep the copy outside the module, in a callback that follows each cut "
        "(`on_pulse_parameters_replaced` is given the cut parameters, their shapes before the cut and the "
        "channels kept).",
        pruning.UNCUT_AVERAGE: "Leave out the layers whose cut reaches that part (its inputs come from "
        "them) with `exclude_pattern`, or use mode='unstructured' (it keeps every shape).",
        pruning.GRAPH_BUILD_FAILED: "No `exclude_pattern` or `layer_types` changes that: the graph is built "
        "over the whole model, whatever layers are chosen. Use mode='unstructured' (its masks need no "
        "graph).",
        pruning.UNTRACEABLE_OUTPUT: "Have `forward` return tensors only (the logits or the loss); a Hugging "
        "Face model returns its key/value cache unless called with `use_cache=False` (or built with it in its "
        "config: setting `model.config.use_cache` afterwards does not reach T5's decoder). Or use "
        "mode='unstructured'.",
    }
    for cause, way_out in own_way_out.items():
        if reason is not None and reason.startswith(cause):
            raise PulseRefusal(
                f"ScheduledPrune: structured pruning cannot run on this model: {reason}. {way_out}"
            )
    if reason is not None and pruning.ON_HYPER_CONNECTION_STREAMS in reason:
        leave_out = "the `exclude_pattern` named, or " if pruning.TRIAL_CUT_PASSES in reason else ""
        raise PulseRefusal(
            f"ScheduledPrune: structured pruning cannot run on this model: {reason}. Use {leave_out}"
            "mode='unstructured' (its masks need no dependency search)."
        )
    if reason is not None and pruning.ON_USER_MASKS in reason:  # the reason names the layer and the fold
        leave_out = "the `exclude_pattern` named, or " if pruning.TRIAL_CUT_PASSES in reason else ""
        raise PulseRefusal(
            f"ScheduledPrune: structured pruning cannot run on this model: {reason}. Fold the masks as named, "
            f"or use {leave_out}mode='unstructured' (it keeps the masks)."
        )
    if reason is not None and pruning.IN_USER_HOOK in reason:  # the reason names the hook and the way out
        raise PulseRefusal(f"ScheduledPrune: structured pruning cannot run on this model: {reason}.")
    if reason is not None:
        forward = (
            "give the module a `forward` (and an `example_input_array` when a batch does not hold its "
            "arguments) that runs the model, or "
            if model is None or not prune_targets.has_own_forward(model)
            else ""
        )
        raise PulseRefusal(
            f"ScheduledPrune: structured pruning cannot run on this model: {reason}. Use mode='unstructured'; "
            f"or {forward}narrow `layer_types`/`exclude_pattern` to layers that can be cut."
        )


def _without_conv1d(selection: LayerSelection) -> dict[str, nn.Module]:
    """The selected layers other than Hugging Face ``Conv1D``, which torch-pruning cannot cut."""
    return {name: layer for name, layer in selection.layers.items() if not prune_targets.is_hf_conv1d(layer)}


def refuse_conv1d_alone(reason: str, selection: LayerSelection) -> None:
    """At fit start, :class:`PulseRefusal` for selected Hugging Face ``Conv1D`` layers (``reason``) when no
    other selected layer is left to cut: narrowing ``layer_types`` cannot help then (HF GPT-2, whose
    ``lm_head`` is tied to the embedding: a held-out run followed `layer_types`=['Linear'] into a second
    refusal). Where other layers are selected, the trial cut without the ``Conv1D`` layers decides the way out,
    once the example is known (:func:`refuse_conv1d`)."""
    if _without_conv1d(selection):
        return
    raise PulseRefusal(
        f"ScheduledPrune: structured pruning cannot run on this model: {reason}, and no layer of the chosen "
        "`layer_types` besides them is left to cut, so leaving them out (`layer_types`, `exclude_pattern`) "
        "cannot help."
        f"{left_out_note(selection)} Use mode='unstructured' (its masks cut Conv1D layers too)."
    )


def refuse_conv1d(
    reason: str, model: nn.Module, pruner: pruning.Pruner, targets: Sequence[float], example: Any
) -> None:
    """:class:`PulseRefusal` for selected Hugging Face ``Conv1D`` layers (``reason``), with `layer_types`
    narrowed to the other selected layers' types offered as a way out only where a trial cut with them passes
    (an output layer alone, as GPT-2's classifier head, is never cut)."""
    others = _without_conv1d(pruner.selection(model))
    types = list(dict.fromkeys(type(layer) for layer in others.values()))
    names = [
        cls.__name__ if getattr(nn, cls.__name__, None) is cls else f"{cls.__module__}.{cls.__qualname__}"
        for cls in types
    ]
    narrowed = pruner.for_trial(layer_types=types)
    with kept_python_state(model), kept_carried_state(model):  # the user's hooks run on the check's copies
        without = pruning.check_structured(model, narrowed, targets, example)
    if without is None:
        way_out = (
            f"Use mode='unstructured'; or `layer_types`={names} to leave them out (the trial cut passes)."
        )
    else:
        way_out = f"Use mode='unstructured' (with `layer_types`={names}, leaving them out: {without})."
    raise PulseRefusal(f"ScheduledPrune: structured pruning cannot run on this model: {reason}. {way_out}")


def refuse_user_masks_structured(layers: Mapping[str, nn.Module], exclude_pattern: str | None) -> None:
    """Structured, at fit start: :class:`PulseRefusal` for chosen ``layers`` behind a ``torch.nn.utils.prune``
    reparametrisation (:func:`~lightning_pulse.core.pruning.user_masked_tensors`: the user pruned the model, or
    ``load_pruned`` loaded an unstructured run). A cut sets the layer's weight to a smaller parameter while its
    pre-hook still writes ``weight_orig * weight_mask`` there: the trial cut failed with a ``TypeError`` ("cannot
    assign 'torch.FloatTensor' as parameter 'weight'") blamed on the model, with no word of the masks."""
    masked = {
        name: tensors for name, layer in layers.items() if (tensors := pruning.user_masked_tensors(layer))
    }
    if not masked:
        return
    names = list(masked)
    first, tensors = names[0], masked[names[0]]
    shown = first_names([f"{name} ({', '.join(masked[name])})" for name in names], 3)
    pattern = "|".join(p for p in (exclude_pattern, pruning.exact_names_pattern(names)) if p)
    raise PulseRefusal(
        f"ScheduledPrune: mode='structured' cannot cut layers that carry `torch.nn.utils.prune` masks "
        f"({len(names)} chosen: {shown}): a structured cut replaces a layer's weights with smaller ones and "
        f"cannot carry the masks along (`{first}.{tensors[0]}_orig`, `{first}.{tensors[0]}_mask` and the "
        "pre-hook that multiplies them before each forward). Way out: fold the masks into the weights before fit,"
        f' `torch.nn.utils.prune.remove(model.get_submodule("{first}"), "{tensors[0]}")` on the LightningModule '
        "for each layer and tensor named (their zeros become ordinary weights, trained and cut with the rest); "
        f"or leave these layers out with `exclude_pattern`={pattern!r} (a layer left out still follows the cut "
        "of a layer feeding it, which the trial cut then names); or use mode='unstructured', which keeps the "
        "masks (each event's mask keeps their zeros)."
    )


def refuse_compiled_structured(mode: str, compiled: Sequence[str], layers: Iterable[str]) -> None:
    """Raise :class:`PulseRefusal` for ``mode='structured'`` when a part of the module that runs under
    ``torch.compile`` (``compiled``: names from :func:`~lightning_pulse._lightning_compat.compiled_parts`, ``""``
    for the whole module) holds a layer to prune, or lies inside one (``layers``: their names). The structured
    check traces the forward of a copy of the model to find the channels it can cut, and an event swaps smaller
    layers in: through a compiled module the trace fails inside dynamo (a held-out compiled submodule refused with
    dynamo's internal assertion and an ``exclude_pattern`` hint that could not help), or sees no channel group
    (``trainer.fit(torch.compile(module))``, whose model uncompiled is cut without trouble). A compiled part that
    holds no layer to prune (a teacher left out with ``exclude_pattern``) is no reason to refuse."""
    if mode != "structured":
        return
    names = list(layers)

    def overlaps(part: str, layer: str) -> bool:
        return part == "" or layer == part or layer.startswith(part + ".") or part.startswith(layer + ".")

    hit = next((part for part in compiled if any(overlaps(part, layer) for layer in names)), None)
    if hit is None:
        return
    shown = "the LightningModule" if hit == "" else f"`{hit}`"
    raise PulseRefusal(
        f"ScheduledPrune: mode='structured' cannot run on a model compiled with torch.compile ({shown} is "
        "compiled and holds layers to prune): it traces the model's forward to find the channels it can cut and "
        "swaps smaller layers in, which a compiled module does not let it follow. Use mode='unstructured' (masks "
        "keep every shape and work under torch.compile); or prune an uncompiled model with mode='structured' and "
        "compile it after pruning (load the result with `ScheduledPrune.load_pruned`, then torch.compile)."
    )


def structured_example(model: nn.Module, pruner: pruning.Pruner, schedule: PruneSchedule, batch: Any) -> Any:
    """The trace input of ``model`` (from ``example_input_array``, else ``batch``), once a copy of the model
    has been pruned to the schedule's levels on it; :class:`PulseRefusal` when that is not safe. The pruner
    keeps it (:attr:`~lightning_pulse.core.pruning.Pruner.example_inputs`, unless a checkpoint gave one).

    Two samples of it (:func:`~lightning_pulse.core.pruning.small_example`) keep the trace fast, where the
    model runs on them. A batch whose samples are not rows of its first tensor (a graph batch's nodes next to
    its whole ``edge_index``) does not cut that way: a user's ``example_input_array`` is then traced as given
    (its size is the user's choice), and a training batch that runs whole is refused with that reason
    (:data:`BATCH_NOT_CUT`), not as a model that does not run."""
    given = getattr(model, "example_input_array", None) is not None
    try:
        whole = pruning.example_input(model, batch)
    except ValueError as error:
        refuse_structured(str(error), model)
    example, targets = pruning.small_example(whole), schedule.sample_targets()
    blocker = pruning.structured_blocker(model, pruner.selection(model))
    if blocker is not None and blocker.startswith(pruning.HF_CONV1D):
        refuse_conv1d(blocker, model, pruner, targets, example)
    # the user's hooks run on the check's copies; one closing over the model (``self.acts.append``) writes
    # into it
    with kept_python_state(model), kept_carried_state(model):
        reason = pruning.check_structured(model, pruner, targets, example)
        not_run = reason is not None and reason.startswith(pruning.NOT_RUN_ON_EXAMPLE)
        if not_run and pruning.small_example_cuts(whole):  # the cut, not the model, may be what breaks
            if given:
                example = pruning.as_traced(whole)
                reason = pruning.check_structured(model, pruner, targets, example)
            elif pruning.runs_on(model, whole, pruner.run_precision):
                error = reason[len(pruning.NOT_RUN_ON_EXAMPLE) :].strip()
                reason = f"{BATCH_NOT_CUT} {error}"
    if given and reason is not None and reason.startswith(pruning.NOT_RUN_ON_EXAMPLE):
        reason = NOT_RUN_ON_GIVEN_EXAMPLE + reason[len(pruning.NOT_RUN_ON_EXAMPLE) :]
    refuse_structured(reason, model)
    if pruner.example_inputs is None:  # the events trace it as it is, cut or whole
        pruner.example_inputs = example
    return example


#: the start of the reason for a model that does not run on the user's ``example_input_array``, as given
NOT_RUN_ON_GIVEN_EXAMPLE = "the model does not run on its `example_input_array`, before any cut"
#: the start of the reason for a training batch the model runs on whole and not on its first two samples
BATCH_NOT_CUT = (
    "the training batch cannot be cut to the two samples the model is traced with: the model runs on the "
    "whole batch, and not on the first two rows of its first tensor with the rest left as they are"
)


def setup_summary(
    mode: str, model: nn.Module, selection: LayerSelection, schedule: PruneSchedule, on_maintain: bool
) -> str:
    """The line logged when training starts: what is pruned, how far, between which steps and when."""
    where = "maintain-phase starts" if on_maintain else f"every {schedule.every} steps"
    if on_maintain and schedule.every != PRUNE_EVERY_DEFAULT:  # cadence 'auto' chose maintain at fit start
        where += f" (cadence 'auto' next to a maintain phase: `every`={schedule.every} is not read)"
    share = prune_targets.weight_share(model, selection.layers)
    # the events' `sparsity` is that of these layers, not the model's: said where they are named
    of_what = "output channels" if mode == "structured" else "weights"
    return (
        f"ScheduledPrune: {mode} pruning of {len(selection.layers)} layers ({share:.0%} of the model's "
        f"weights) to {schedule.final_sparsity:.0%} of their {of_what} (the logged `sparsity` counts these "
        f"layers only) between steps {schedule.start_step} and {schedule.end_step}, at {where}."
        f"{left_out_note(selection)}"
    )


def unfinished_warning(schedule: PruneSchedule, step: int, events: Sequence[Any]) -> str | None:
    """At fit end, the warning for a run that stopped at ``step`` before the schedule finished, or ``None``.

    A run whose last event reached the final target is not unfinished, though the schedule never saw its end
    step: next to a PulseCycle's maintain phases the last chance can come a step before it, where the cubic
    target is ``final_sparsity`` but for a float's last digits (0.49999984 of 0.5, which rounds to the same
    weight or channel count), or its measured sparsity (``events[-1]["sparsity"]``) is at the target."""
    if schedule.finished or (events and reached_final(schedule, events[-1].get("sparsity"))):
        return None
    if not events:  # the user asked for pruning and got none: said, not left to a look at the weights
        return (
            f"ScheduledPrune: the run ended at step {step} with no pruning event (the schedule runs from step "
            f"{schedule.start_step} to {schedule.end_step}); no weight was pruned."
        )
    # on the maintain cadence the schedule's end can pass between two maintain entries
    when = "before" if step < schedule.end_step else "with no event at or after"
    return (
        f"ScheduledPrune: the run ended at step {step} {when} the schedule's end (step {schedule.end_step}); "
        f"sparsity reached {schedule.sparsity:.3f} of {schedule.final_sparsity}."
    )


def reached_final(schedule: PruneSchedule, measured: float | None) -> bool:
    """Whether the last event's target (``schedule.sparsity``) is the final one within a float's precision, or
    what it ``measured`` is at least the final target."""
    final = schedule.final_sparsity
    close = math.isclose(schedule.sparsity, final, rel_tol=FINAL_TARGET_TOLERANCE)
    return close or (measured is not None and measured >= final)


#: how near the final target a last event's target counts as it: the cubic schedule a step before its end
#: differs from ``final_sparsity`` by ``final / span**3`` (3e-7 of it over 150 steps), one weight in millions
FINAL_TARGET_TOLERANCE = 1e-6


def refuse_frozen_twins(
    model: nn.Module, layers: dict[str, nn.Module], mode: str = "structured", exclude: str | None = None
) -> None:
    """Refuse pruning a part that has a frozen copy (:func:`prune_targets.frozen_twins`). Structured: the cut
    shrinks the part's channels and not the copy's. Code that pairs their parameters (an EMA teacher, a BYOL or
    DINO target network, a DQN target network loaded from the policy) or compares their features (a frozen
    reference for feature matching) then breaks at the first event, or at the first update after it: held-out
    runs crashed mid-run at all three. Unstructured: a mask renames the part's ``weight`` to ``weight_orig``
    and adds a ``weight_mask`` buffer: a held-out EMA teacher updated by name (``state_dict()``,
    ``named_parameters()``) crashed at the first event (``KeyError: '0.weight'``), and one updated by
    ``zip(parameters())`` averaged the unmasked ``weight_orig``, pruned entries included. Whether the copy is
    updated shows only in training, so any frozen copy is refused at fit start, with the ways out: a copy
    never updated (a fixed teacher) is said so with ``PruneOptions(fixed_copies=True)`` (unstructured), and
    an ``exclude_pattern`` (the user's ``exclude`` joined with one anchored on every part with a frozen copy)
    where it leaves a layer to prune."""
    # unstructured keeps every shape: only a copy made before training (same values now) is refused; a
    # frozen block of the same architecture with its own values (partial fine-tuning) trains as before
    same_values_only = mode == "unstructured"
    found = twins = prune_targets.frozen_twins(model, layers, same_values_only=same_values_only)
    if not twins:
        return
    copy, part = next(iter(twins.items()))
    # the pattern offered leaves out every part with a frozen copy, anchored (unanchored, 'student' also left
    # `student_head` out), and the layers it leaves are those it would select: a sweep followed the pattern
    # into "no layer can be pruned" where a second student had a frozen teacher, or `student_head` was all
    # there was besides; a part whose copy shows only once the others are left out is left out too
    parts: list[str] = []
    rest = dict(layers)
    while twins:
        parts += [name for name in dict.fromkeys(twins.values()) if name not in parts]
        pattern = f"^({'|'.join(re.escape(name) for name in parts)})(\\.|$)"
        rest = {name: layer for name, layer in layers.items() if re.search(pattern, name) is None}
        twins = prune_targets.frozen_twins(model, rest, same_values_only=same_values_only) if rest else {}
    offered = pattern if exclude is None else f"{exclude}|{pattern}"
    named = _and_list(parts)
    leave_out = (
        f"Leave {'the part' if len(parts) == 1 else named} out with `exclude_pattern`={offered!r}"
        if rest
        else f"Leaving {named} out (`exclude_pattern`) would leave no layer to prune"
    )
    also = [f"`{other}` of `{of}`" for other, of in list(found.items())[1:]]
    head = f"`{copy}` is a frozen copy of `{part}`" + (f" (and {_and_list(also)})" if also else "")
    ema = (
        f"an EMA of {part} kept with Lightning's EMAWeightAveraging callback (use_buffers=True) in place of "
        f"{copy} prunes with mode='unstructured' where no buffer (a BatchNorm's) follows a masked layer "
        "(docs: 'Works with', EMAWeightAveraging)"
    )
    if mode == "structured":
        raise PulseRefusal(
            f"ScheduledPrune: {head}. Structured pruning would cut {part}'s channels "
            f"and not {copy}'s, so code that pairs their parameters (an EMA teacher, a target network) or compares "
            f"their features breaks at the first pruning event. {leave_out}; {ema}; or, if {copy} is never "
            f"updated from {part} (a fixed teacher or reference model), use mode='unstructured' with "
            "options=PruneOptions(fixed_copies=True), which keeps every shape."
        )
    raise PulseRefusal(
        f"ScheduledPrune: {head}. From the first pruning event on, a "
        f"masked layer of {part} holds `weight_orig` and a `weight_mask` buffer instead of `weight`, so an "
        f"update of {copy} from {part} by name (an EMA teacher, a target network) fails, and one by position "
        f"averages the unmasked weights, pruned entries included. {leave_out}; for an EMA, {ema} (it copies "
        f"the averaged weights back under the model's masks); or, if {copy} is never updated from {part} (a "
        "fixed teacher or reference model: ScheduledPrune cannot tell one from an EMA at fit start), say so "
        "with options=PruneOptions(fixed_copies=True)."
    )


def refuse_averaged_sources(model: nn.Module, layers: Mapping[str, nn.Module], mode: str) -> None:
    """Raise :class:`PulseRefusal` when a ``torch.optim.swa_utils.AveragedModel`` submodule (an EMA or SWA
    of a part, ``AveragedModel(self.net)``) averages a part that holds ``layers``
    (:func:`~lightning_pulse.core.prune_targets.averaged_sources`). ``update_parameters`` pairs the copy's
    tensors with the part's by position. Unstructured: a held-out EMA averaged the part's unmasked
    ``weight_orig``, pruned entries included; its copy, pruned with masks of its own, averaged those masks
    too (``use_buffers=True``: 3% of them fractional) and ended at 0.486 sparsity while 0.500 was reported.
    Without its own masks, the copy would average the dense weights, none pruned. Structured: the cut part's
    shapes no longer match the copy's. The copy's own layers are never pruned (left out, ``AVERAGED_COPY``),
    so leaving the part out leaves both dense."""
    sources = prune_targets.averaged_sources(model, layers)
    if not sources:
        return
    copy, part = next(iter(sources.items()))
    pattern = f"^{re.escape(part)}(\\.|$)"
    if mode == "structured":
        harm = (
            f"from the first event on, {part}'s cut parameters no longer match the copy's shapes, so its "
            "first update after a cut fails"
        )
        way_out = (
            "use mode='unstructured' with Lightning's EMAWeightAveraging callback in place of the submodule"
        )
    else:
        harm = (
            f"from the first event on, it would average {part}'s unmasked `weight_orig`, pruned entries "
            "included, so the average keeps weights the model pruned and is not as sparse as reported"
        )
        way_out = (
            "keep the average with Lightning's EMAWeightAveraging callback (use_buffers=True) in place of "
            "the submodule: it copies the averaged weights back under the model's masks"
        )
    raise PulseRefusal(
        f"ScheduledPrune: `{copy}` is the copy an AveragedModel (EMA/SWA) averages from `{part}`, a part it "
        f"prunes, and `update_parameters` pairs their tensors by position: {harm}. To prune `{part}`, "
        f"{way_out}; or leave `{part}` out with `exclude_pattern`={pattern!r} (its averaged copy is never "
        "pruned)."
    )


def refuse_replaced_weights(replaced: Sequence[str]) -> None:
    """Unstructured, after the fit's first optimizer step, before any mask: raise :class:`PulseRefusal` for
    the layers whose ``weight`` parameter was replaced by a new one meanwhile (``replaced``:
    :attr:`~lightning_pulse.core.prune_targets.OwnWeightWatch.replaced`). A mask keeps the weight in
    ``weight_orig`` and sets ``weight`` from it before every call: a held-out VQ-VAE (the zalandoresearch
    ``VectorQuantizerEMA``) assigns ``_embedding.weight = nn.Parameter(...)`` in every forward, and its run
    crashed at the first event (``TypeError: cannot assign 'torch.FloatTensor' as parameter 'weight'``).
    Seen only once a forward ran, so said here, before the first event."""
    if not replaced:
        return
    names = _some_names(replaced)
    pattern = exact_names_pattern(replaced)
    raise PulseRefusal(
        f"ScheduledPrune: the `weight` parameter of {names} was replaced by a new one during the first "
        "training step (code that assigns `layer.weight = nn.Parameter(...)`, as the forward of an EMA "
        "codebook does): a mask keeps the weight in `weight_orig` and sets `weight` from it before every "
        "call, so an event would fail on the next such assignment, or the mask would be lost; and the new "
        "parameter is in no optimizer, so the layer no longer trains. "
        f"Leave these layers out with `exclude_pattern`={pattern!r}, or narrow `layer_types` to the layers "
        "to prune."
    )


def saved_mode(state: Mapping[str, Any]) -> str | None:
    """The ``mode`` of the run that saved ``state`` (a ScheduledPrune state dict): as recorded, else, for a
    checkpoint from before it was, ``"structured"`` when it holds a cut's history, ``"unstructured"`` when it
    holds none and an event that pruned, and ``None`` before any event that pruned (any mode may resume)."""
    if state.get("mode") is not None:
        return str(state["mode"]) if state.get("events") else None
    if state.get("history"):
        return "structured"
    # a structured event that cut no channel (an early one of a gradual schedule) leaves no history either
    pruned = any(float(event.get("sparsity") or 0.0) > 0.0 for event in state.get("events") or [])
    return "unstructured" if pruned else None


def refuse_mode_change(saved: str | None, mode: str) -> None:
    """At the fit start of a resume, raise :class:`PulseRefusal` when the run that saved the checkpoint pruned
    with another ``mode`` (``saved``: :func:`saved_mode`). A held-out resume of an unstructured run's
    checkpoint with ``mode='structured'`` was refused on its first batch with the trial cut's error
    (``cannot assign 'torch.FloatTensor' as parameter 'weight'``), blaming the model: the checkpoint's masks
    are no channels to cut. The other way, the cut model's sparsity counts channels, and the masks would take
    it as weights'."""
    if saved is None or saved == mode:
        return
    if saved == "unstructured":
        what = "its layers carry masks (`weight_orig` and `weight_mask`), not channels a cut can remove"
        fresh = "from the pruned weights with the masks folded in (`torch.nn.utils.prune.remove`)"
    else:
        what = "its layers are cut to smaller shapes, and its sparsity counts channels, not weights"
        fresh = "from the cut model (`ScheduledPrune.load_pruned` into a freshly built module)"
    raise PulseRefusal(
        f"ScheduledPrune: the checkpoint resumed was saved by a run with mode={saved!r}, and this run has "
        f"mode={mode!r}: a resume cannot change the mode ({what}). Resume with mode={saved!r}; or, to prune "
        f"with mode={mode!r}, start a new fit (without `ckpt_path`) {fresh}."
    )


def lowered_target_warning(schedule: PruneSchedule) -> str | None:
    """At fit start, the warning for a resumed run whose sparsity reached is above the ``final_sparsity`` of
    this run (lowered on resume), else ``None``: masks are never undone, so the model keeps the sparsity
    reached and no event prunes more (a held-out resume from 0.5 to 0.2 kept 0.48 with nothing said)."""
    if schedule.sparsity <= schedule.final_sparsity + 1e-9:
        return None
    return (
        f"ScheduledPrune: the resumed run reached sparsity {schedule.sparsity:.3f}, above this run's "
        f"`final_sparsity`={schedule.final_sparsity:g}: what is pruned stays pruned (masks and cuts are "
        f"never undone), so the model keeps {schedule.sparsity:.3f} and no event prunes more. To end at "
        f"{schedule.final_sparsity:g}, start a new fit (without `ckpt_path`) from unpruned weights."
    )


def kept_above_target(schedule: PruneSchedule) -> str:
    """The fit-end line's opening when the sparsity kept is above this run's ``final_sparsity``
    (:func:`lowered_target_warning`), else ``""``."""
    if schedule.sparsity <= schedule.final_sparsity + 1e-9:
        return ""
    return (
        f"sparsity {schedule.sparsity:.3f} kept from the resumed run, above this run's `final_sparsity`="
        f"{schedule.final_sparsity:g} (never undone); its last event: "
    )
