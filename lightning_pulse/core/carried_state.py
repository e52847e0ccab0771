"""Does a module carry state from one training batch to the next? (A check for callbacks that cut batches.)

A stateful RNN trained with truncated backpropagation keeps its hidden state on the module
(``self.state = tuple(s.detach() for s in state)``) and feeds it to the next batch. Row ``i`` of that state
belongs to row ``i`` of the previous batch, so a batch with fewer rows (or other samples in them) breaks it:
a shape error at best, silently mixed streams at worst.

:class:`CarriedStateCheck` finds such state over a fit's first two training batches, with no change to what
they train:

1. after the first batch, the *candidates*: plain tensors (or tuples/lists of tensors) stored as attributes of
   the module or a submodule, not parameters or buffers, with a dimension equal to the batch size
   (:func:`batch_shaped_attributes`);
2. during the second batch, which of the candidates' tensors any torch function reads (a
   ``TorchFunctionMode``, for that one batch only);
3. after it, which attributes were stored anew.

An attribute is *carried state* when its first-batch value was read by the second batch and the second batch
replaced it. That leaves out what ordinary modules keep: a cache built once (a positional table: read, never
replaced), outputs kept for logging or an epoch-end metric (replaced, never read by the next batch),
torchmetrics states (skipped: they accumulate over an epoch), state reset at every batch start (the old value
is never read). Hugging Face text models keep nothing on the module during training; Qwen2-VL keeps
``rope_deltas`` ``(B, 1)`` for generation, computed anew at every training forward (replaced, never read).

The test cannot tell which dimension of a tensor is the batch's: a state kept per feature (DINO's centre of
the teacher's outputs, ``(D,)``, replaced by an EMA of their batch mean at every batch) whose width ``D``
equals the batch size is read and replaced as a stateful RNN's ``(B, H)`` is, and is refused as one. Telling
them apart would take following the batch's rows through every op of the step (no read of the values does:
both are computed from the batch's rows), or a step on a batch of another size, which is what the cut would
be. So such a match is still refused, and when every dimension of the state is also the size of one of the
module's parameters (a layer's width), the refusal says that it may be a coincidence and names two ways out
that keep the check exact: a buffer updated in place (``self.center.lerp_(batch_mean, 0.1)``, as BatchNorm's
running statistics are: never replaced, so never carried state), or another batch size (a state per sample
follows it and is still refused).

A weight that torch's pruning, old-style ``weight_norm`` or ``spectral_norm`` keeps as a plain attribute is no
candidate: its forward pre-hook computes it anew from parameters before every forward, so it never carries
over. Counted as one, the weight of a layer as wide as the batch is large would refuse a cut batch before the
test could clear it.
"""

from __future__ import annotations

import copy
import operator
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torchmetrics import Metric, MetricCollection

_MAX_ITEMS = 16  # a longer list is a log of outputs, not a hidden state


#: what every ``nn.Module`` keeps in its ``__dict__`` (its parameters, buffers, submodules, hooks): not state
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def tensors_in(value: Any, depth: int = 0) -> tuple[Tensor, ...]:
    """The tensors of ``value`` if it is a tensor or a (nested, short) tuple, list or dict of tensors, else
    ``()``."""
    if isinstance(value, Tensor):
        return () if isinstance(value, nn.Parameter) else (value,)
    items = list(value.values()) if isinstance(value, dict) else value
    if depth < 2 and isinstance(value, (tuple, list, dict)) and 0 < len(items) <= _MAX_ITEMS:
        parts = [tensors_in(item, depth + 1) for item in items]
        if all(parts):
            return tuple(tensor for part in parts for tensor in part)
    return ()


def _plain_attributes(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """The attributes ``module`` holds itself, not through ``nn.Module``'s parameters, buffers or submodules."""
    return ((name, value) for name, value in vars(module).items() if name not in _MODULE_INTERNALS)


#: forward pre-hooks that compute a layer's weight from parameters before every forward and keep it as a plain
#: attribute: torch's pruning, old-style weight norm and spectral norm
WEIGHT_HOOKS = (BasePruningMethod, WeightNorm, SpectralNorm)


def hook_weight_name(hook: Any) -> str:
    """The attribute a :data:`WEIGHT_HOOKS` hook sets (``weight`` for ``weight_orig * weight_mask``)."""
    return hook._tensor_name if isinstance(hook, BasePruningMethod) else hook.name


def _recomputed_before_forward(module: nn.Module) -> set[str]:
    """The attributes of ``module`` that its :data:`WEIGHT_HOOKS` set from parameters before every forward."""
    return {hook_weight_name(h) for h in module._forward_pre_hooks.values() if isinstance(h, WEIGHT_HOOKS)}


def _skipped(module: nn.Module) -> bool:
    """Whether ``module`` is a torchmetrics metric (one of the user's own subclasses included) or collection
    of them: a metric's states accumulate over an epoch, are reset by Lightning and are never carried state.
    By type, not by the package of its class: a user's own ``Metric`` with a list state was refused as an
    RNN's state."""
    return isinstance(module, (Metric, MetricCollection))


def _outside_metrics(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``module.named_modules()`` without torchmetrics metrics and collections (:func:`_skipped`) and the
    modules inside them (a wrapper metric's inner metric, a metric's feature extractor)."""
    metrics: list[str] = []  # the dotted paths of the metrics met, each followed by a dot
    for prefix, submodule in module.named_modules():
        if any(f"{prefix}.".startswith(metric) for metric in metrics):
            continue
        if _skipped(submodule):
            metrics.append(f"{prefix}." if prefix else "")
            continue
        yield prefix, submodule


def batch_shaped_attributes(module: nn.Module, batch_size: int) -> dict[str, tuple[Tensor, ...]]:
    """Plain tensors (or tuples, lists or dicts of tensors) held as attributes of ``module`` or its submodules,
    and their buffers, keyed by their dotted path, of which a dimension is ``batch_size``. A buffer updated in
    place (BatchNorm's running statistics) is never *replaced*, so only one assigned anew at every batch (a
    hidden state kept as a buffer) can be carried state; torchmetrics metrics are skipped, and so are the
    weights a pruning or weight-norm pre-hook computes before every forward
    (:func:`_recomputed_before_forward`)."""
    found: dict[str, tuple[Tensor, ...]] = {}
    for prefix, submodule in _outside_metrics(module):
        recomputed = _recomputed_before_forward(submodule)
        for name, value in [*_plain_attributes(submodule), *submodule.named_buffers(recurse=False)]:
            if name in recomputed:
                continue
            tensors = tensors_in(value)
            if tensors and any(batch_size in tensor.shape for tensor in tensors):
                found[f"{prefix}.{name}" if prefix else name] = tensors
    return found


def _same_objects(before: tuple[Tensor, ...], now: tuple[Tensor, ...]) -> bool:
    """Whether ``now`` holds the very tensors ``before`` did (none assigned anew)."""
    return len(before) == len(now) > 0 and all(map(operator.is_, before, now))


def _is_buffer(module: nn.Module, path: str) -> bool:
    owner, _, name = path.rpartition(".")
    return name in (module.get_submodule(owner) if owner else module)._buffers


def _attribute(module: nn.Module, path: str) -> Any:
    owner, _, name = path.rpartition(".")
    try:
        holder = module.get_submodule(owner) if owner else module
    except AttributeError:
        return None
    if name in holder._buffers:
        return holder._buffers[name]
    return None if name in _MODULE_INTERNALS else vars(holder).get(name)


#: what a torch function mode sees for a look at a tensor's metadata, not its values
_METADATA = frozenset(
    (
        Tensor.shape.__get__,
        Tensor.dtype.__get__,
        Tensor.device.__get__,
        Tensor.ndim.__get__,
        Tensor.size,
        Tensor.dim,
        Tensor.numel,
        Tensor.is_floating_point,
    )
)


class _ReadWatch(TorchFunctionMode):
    """Notes which of the watched tensors any torch function (or tensor method) receives."""

    def __init__(self, watched: set[int]) -> None:
        super().__init__()
        self.watched = watched
        self.read: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _METADATA:  # a look at its shape or type carries none of its values
            return func(*args, **kwargs)
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, Tensor) and id(leaf) in self.watched:
                self.read.add(id(leaf))
        return func(*args, **kwargs)


class CarriedStateCheck:
    """Finds state a module carries from one training batch to the next (see the module docstring).

    Call :meth:`after_first_batch` when the first batch has trained, :meth:`watch` before the second trains
    and :meth:`after_second_batch` once it has; ``done`` then holds and ``found`` says what carries state.
    :meth:`note_lists` before the first batch lets a second batch that is cut (:meth:`before_batch`) through
    a list the first one only appended to.

    Example::

        check = CarriedStateCheck()
        train(batches[0]); check.after_first_batch(module, batch_size=len(batches[0]))
        check.watch(); train(batches[1]); check.after_second_batch(module)
        check.found        # {"state": ((2, 8, 64), (2, 8, 64))} for a stateful 2-layer LSTM, batch 8
    """

    def __init__(self) -> None:
        self.candidates: dict[str, tuple[Tensor, ...]] | None = None
        # the candidates on which a batch cut before the check ends is refused
        self._cut_blockers: set[str] = set()
        # the module's lists before its first batch (note_lists), by dotted path: the list and its items then
        self._lists_before: dict[str, tuple[list[Any], tuple[Any, ...]]] = {}
        # the tensors the module's plain attributes held before its first batch, by dotted path (note_lists)
        self._held_before: dict[str, tuple[Tensor, ...]] = {}
        self.found: dict[str, tuple[tuple[int, ...], ...]] = {}
        self.done = False
        self._watch: _ReadWatch | None = None
        # the sizes of the module's parameters' dimensions, and the batch size: a state whose every dimension
        # is one may be kept per feature, its batch-sized width a coincidence (the refusal says so)
        self._widths: set[int] = set()
        self._batch_size = 0

    @property
    def first_batch(self) -> bool:
        """Whether no batch has been checked yet."""
        return not self.done and self.candidates is None

    def before_batch(self, cut: bool, whole_batches: Callable[[], str] | None = None) -> str | None:
        """Before each batch trains: starts watching on the second one. ``cut``: the batch is smaller than
        offered; before the check is done that is refused (:func:`carried_state_refusal`'s reason) if anything
        batch-shaped is held, since a cut batch may break it. ``whole_batches``: how this fit could start with
        whole batches, for the refusal's way out (:data:`WHOLE_BATCHES` if not given)."""
        if self.done:
            return None
        if cut and self._cut_blockers:
            shapes = self.candidate_shapes()
            return carried_state_refusal(
                shapes,
                read_seen=False,
                coincidence=self._coincidence(shapes),
                whole_batches=WHOLE_BATCHES if whole_batches is None else whole_batches(),
            )
        self.watch()
        return None

    def after_batch(self, module: nn.Module, batch_size: int) -> str | None:
        """After each batch trained (``batch_size`` as offered): the refusal reason once carried state is found."""
        if self.done:
            return None
        if self.candidates is None:
            self.after_first_batch(module, batch_size)
            return None
        self.after_second_batch(module)
        return carried_state_refusal(self.found, coincidence=self._coincidence(self.found))

    def _coincidence(self, found: dict[str, tuple[tuple[int, ...], ...]]) -> int | None:
        """The batch size when every dimension (but those of size 1) of every tensor in ``found`` is also the
        size of a dimension of the module's parameters: then each may be a feature's width, not the batch's
        (DINO's centre ``(D,)`` with ``D == B``), and the refusal says so. ``None`` otherwise: an RNN's
        ``(layers, B, hidden)`` state or kept predictions ``(B,)`` whose ``B`` no layer has."""
        widths = self._widths
        if found and all(
            size in widths for shapes in found.values() for s in shapes for size in s if size > 1
        ):
            return self._batch_size
        return None

    def note_lists(self, module: nn.Module) -> None:
        """Before the first batch: note the lists ``module`` and its submodules hold, so that
        :meth:`after_first_batch` tells one the batch only appended to (per-step outputs kept for an epoch-end
        metric, ``self.training_step_outputs.append(...)``) from state carried to the next batch; and the
        tensors its plain attributes hold, so that one the first batch left in place (a fixed table kept as a
        plain attribute, HF VideoMAE's sinusoidal ``position_embeddings`` ``(1, P, D)``, whose ``D`` was the
        batch size) is no candidate: state carried from batch to batch is assigned anew at every batch."""
        attributes = [
            (f"{prefix}.{name}" if prefix else name, value)
            for prefix, submodule in _outside_metrics(module)
            for name, value in _plain_attributes(submodule)
        ]
        self._lists_before = {
            path: (value, tuple(value)) for path, value in attributes if isinstance(value, list)
        }
        self._held_before = {path: held for path, value in attributes if (held := tensors_in(value))}

    def _only_appended(self, path: str, value: Any, batch_size: int) -> bool:
        """Whether ``value`` is the list noted at ``path`` before the first batch, grown, old items kept, with
        no new tensor holding the batch size after a first dimension of another size: per-step outputs are
        ``(B, ...)`` (``(B, B)`` too: class probabilities with as many classes, an in-batch similarity), an
        RNN's hidden state ``(layers, B, hidden)``."""
        before, items = self._lists_before.get(path, (None, ()))
        return (
            value is before
            and len(value) > len(items)
            and all(now is then for now, then in zip(value, items))
            and not any(
                tensor.dim() > 1 and tensor.shape[0] != batch_size and batch_size in tensor.shape[1:]
                for item in value[len(items) :]
                for tensor in tensors_in(item)
            )
        )

    def after_first_batch(self, module: nn.Module, batch_size: int) -> None:
        held_before, self._held_before = self._held_before, {}
        self.candidates = {
            path: tensors
            for path, tensors in batch_shaped_attributes(module, batch_size).items()
            if not _same_objects(held_before.get(path, ()), tensors)
        }
        self._widths = {size for parameter in module.parameters() for size in parameter.shape}
        self._batch_size = batch_size
        self.done = not self.candidates  # nothing batch-shaped is kept: nothing can carry over
        # a batch cut before the check ends is refused only on a plain tensor, tuple or list attribute: buffers
        # (BatchNorm's statistics when its channels equal the batch size), dicts (outputs kept for logging, a
        # cache) and a list the batch only appended to (outputs kept for an epoch-end metric; not an RNN's
        # (layers, B, hidden) states, which hold B after the first dimension) are batch-shaped
        # far more often than they carry state, and wait for the read/replace test;
        # nor on a tensor still in the graph (a weight recomputed at every forward, WeightDrop's dropped
        # copy): a carried hidden state is detached, or the next batch's backward would fail through the freed
        # graph
        self._cut_blockers = {
            path
            for path, tensors in self.candidates.items()
            if not isinstance(value := _attribute(module, path), dict)
            and not _is_buffer(module, path)
            and not self._only_appended(path, value, batch_size)
            and all(tensor.grad_fn is None for tensor in tensors)
        }
        self._lists_before = {}

    def watch(self) -> None:
        """Start noting reads of the candidates (until :meth:`after_second_batch` or :meth:`stop`)."""
        if self.candidates and self._watch is None:
            self._watch = _ReadWatch({id(t) for tensors in self.candidates.values() for t in tensors})
            self._watch.__enter__()

    def stop(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.__exit__(None, None, None)

    def after_second_batch(self, module: nn.Module) -> None:
        read = set() if self._watch is None else self._watch.read
        self.stop()
        for path, tensors in (self.candidates or {}).items():
            now = tensors_in(_attribute(module, path))
            replaced = {id(t) for t in now} != {id(t) for t in tensors}
            if replaced and any(id(t) in read for t in tensors):
                self.found[path] = tuple(tuple(t.shape) for t in tensors)
        self.candidates, self.done = None, True

    @staticmethod
    def describe(found: dict[str, tuple[tuple[int, ...], ...]]) -> str:
        """``found`` as ``"`state` (tensors of shape (2, 8, 64), (2, 8, 64))"``."""
        return ", ".join(
            f"`{path}` (tensor{'s' if len(shapes) > 1 else ''} of shape "
            f"{', '.join(str(tuple(s)) for s in shapes)})"
            for path, shapes in found.items()
        )

    def candidate_shapes(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """The shapes of the candidates a batch cut before the check is done is refused on."""
        return {
            path: tuple(tuple(t.shape) for t in tensors)
            for path, tensors in (self.candidates or {}).items()
            if path in self._cut_blockers
        }


#: the ways a fit can start with whole batches, so that the read/replace test tells (the refusal before a cut
#: second batch names them; a caller that knows the batch cannot be cut in batch mode names the burst only)
BURST_FIRST = "a PulseCycle whose burst phase lasts two steps or more"
WHOLE_BATCHES = f"{BURST_FIRST}, or `mode='batch'`"


def carried_state_refusal(
    found: dict[str, tuple[tuple[int, ...], ...]],
    read_seen: bool = True,
    coincidence: int | None = None,
    whole_batches: str = WHOLE_BATCHES,
) -> str | None:
    """The reason and the way out, after the callback's name, for refusing to cut the batches of a module that
    carries ``found`` (see :meth:`CarriedStateCheck.describe`) from one batch to the next; ``None`` if
    nothing. ``read_seen=False``: a batch is cut before the read/replace test could tell (the message says
    so, and names ``whole_batches``, the ways to start the fit with whole batches). ``coincidence``: the batch
    size, when it may be a feature's width in ``found`` (the message says so and names the ways out for state
    kept per feature)."""
    if not found:
        return None
    if read_seen:
        held = "which holds the batch size and is read by the next batch (a stateful RNN)"
        way_out = "Remove HardSampleReplay for this model, or reset that state at the start of every batch."
        if coincidence is not None:
            held = (
                "which holds the batch size and is read by the next batch and replaced, as an RNN's state is"
            )
            way_out = (
                "If it is kept per sample, remove HardSampleReplay for this model, or reset that state at the "
                "start of every batch."
            )
    else:
        held = (
            "which holds the batch size and may be state carried to the next batch (as a stateful RNN's); "
            "the batch that would tell is cut"
        )
        # not learnt by letting the cut batch train and watching for a read: a read inside TorchScript or a
        # C++ extension never reaches the watch, and a stateful RNN read there would train on mixed streams
        # a library model's attribute (a Hugging Face VLM's `rope_deltas`, recomputed at every training
        # forward and kept for generation) is none of the user's code: clearing it after the step is the way
        # out that needs no change of the model, and it is exact (nothing left on the module carries over)
        cleared = " and ".join(f"`self.{path} = None`" for path in found)
        way_out = (
            "If the next batch reads it, remove HardSampleReplay for this model, or reset that state at the "
            "start of every batch. If not (outputs kept for a metric), return it from `training_step` "
            '(`{"loss": loss, "preds": preds}`, the `outputs` of `on_train_batch_end`) instead of keeping it '
            "on the module; if it is a table built once and never replaced, register it as a buffer "
            "(`register_buffer(..., persistent=False)`); if every forward computes it anew (a model's cache "
            f"for generation), clear it at the end of `training_step` ({cleared}); or start the fit with "
            f"whole batches ({whole_batches}) so that the check can tell."
        )
    if coincidence is not None:
        # what tells a state kept per feature from one kept per sample is where the batch's rows go, which the
        # check cannot follow; both ways out keep it exact: a buffer updated in place is never carried state,
        # and a state kept per sample follows another batch size and is refused again
        way_out += (
            f" The batch size, {coincidence}, is also the size of a dimension of the module's parameters, so "
            "the match may be a coincidence: a state kept per feature (a running mean over the batch, as "
            "DINO's centre) follows no sample, and a cut batch breaks nothing in it. For such a state, make it "
            "a buffer updated in place, as BatchNorm's running statistics are "
            "(`self.center.lerp_(batch_mean, 0.1)` for `self.center = self.center * 0.9 + batch_mean * 0.1`, "
            f"or `.copy_(new)`), which is not refused; or train with a batch size other than {coincidence} "
            "(a state kept per sample follows it and is refused again)."
        )
    return (
        f"cannot cut the batches of a module that carries state from one batch to the next: "
        f"{CarriedStateCheck.describe(found)}, {held}. A cut batch no longer matches it, and other samples "
        f"would break the streams it follows. {way_out}"
    )


def carried_tensors(module: nn.Module) -> dict[str, Any]:
    """The tensors modules hold as plain attributes, neither parameters nor buffers, by dotted name: e.g. an
    RNN's hidden state carried from one batch to the next (a tensor, or a short tuple, list or dict of tensors).
    Attributes that are ``None`` are listed too (a hidden state before the first batch). They are part of the
    model's state a rollback must return: a NaN carried there would outlive the restore of the parameters.

    torchmetrics metrics are left out (:func:`_outside_metrics`): their states count what ran over the epoch,
    which Lightning computes, logs and resets at its end, so a rollback to a snapshot of an earlier epoch
    brought that epoch's counts back into this one (an accuracy over 2629 samples in an epoch of 1797); and a
    NaN a metric recorded (a loss averaged without dropping NaN) is no state of the model's."""
    found: dict[str, Any] = {}
    for prefix, submodule in _outside_metrics(module):
        for name, value in _plain_attributes(submodule):
            if value is None or tensors_in(value):
                found[f"{prefix}.{name}" if prefix else name] = value
    return found


def restore_carried_tensors(module: nn.Module, saved: dict[str, Any]) -> None:
    """Put back copies of what :func:`carried_tensors` returned, on the module's device, at any nesting
    (an AWD-LSTM's ``[(h1, c1), (h2, c2)]``), in containers of the same types. A ``None`` is put back only
    over an attribute that holds tensors now (a hidden state created since)."""
    device = next((t.device for t in module.parameters()), None)
    for dotted, value in saved.items():
        owner_name, _, name = dotted.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if value is None:
            if tensors_in(getattr(owner, name, None)):
                setattr(owner, name, None)
        else:
            setattr(owner, name, _to(value, device))


def _to(value: Any, device: Any) -> Any:
    """A copy of ``value`` on ``device``, through the tuples, lists and dicts that hold its tensors (as
    :func:`tensors_in` reads them), each of its own type. Never a saved tensor itself (``.to`` on its own
    device returns it): a module that updates its state in place (``self.h.copy_(h)``) would write into the
    snapshot; and an inner tuple put back as it was held the snapshot's CPU copies, which a CUDA model's next
    forward got as its hidden state."""
    if isinstance(value, Tensor):
        return value.clone() if device is None else value.to(device, copy=True)
    if isinstance(value, dict):
        copied = copy.copy(value)  # its type, and a defaultdict's factory
        copied.update((key, _to(item, device)) for key, item in value.items())
        return copied
    if isinstance(value, (tuple, list)):
        items = [_to(item, device) for item in value]
        if hasattr(value, "_fields"):  # a namedtuple takes its items as arguments
            return type(value)(*items)
        return type(value)(items)
    return value


#: what :func:`_contents` keeps of a list or dict attribute, and of the lists and dicts directly inside it
Contents = list[tuple[Any, Any]]


def _contents(value: Any) -> Contents:
    """A shallow copy of ``value`` if it is a list or dict, and of each list or dict directly inside it (the
    Lightning docs' ``[[] for _ in dataloaders]``), paired with the object itself, so that
    :func:`_put_back` restores each in place: code holding a reference to one sees its old items again."""
    if not _container(value):
        return []
    if isinstance(value, list):
        kept, items = [(value, list(value))], value
    else:
        kept, items = [(value, dict(value))], value.values()
    kept += [
        (item, list(item) if isinstance(item, list) else dict(item)) for item in items if _container(item)
    ]
    return kept


def _container(value: Any) -> bool:
    # plain lists and dicts only: a subclass may refuse clear/update (Hugging Face's ModelOutput raises)
    return type(value) in (list, dict, OrderedDict, defaultdict)


def _put_back(contents: Contents) -> None:
    for container, items in contents:
        if isinstance(container, list):
            container[:] = items
        else:
            container.clear()
            container.update(items)


@contextmanager
def kept_carried_state(module: nn.Module) -> Iterator[None]:
    """Give back, on exit, the tensor state ``module`` carried on entry (:func:`carried_tensors`), and undo
    tensor state that appeared inside: an attribute created inside is dropped, one that held no tensors on
    entry gets its entry value back (a list or dict the same object, with its entry items).

    For an evaluation in the middle of training (PulseCycle's maintain probe): a stateful module's
    ``validation_step`` rebinds ``self.state`` to the validation stream's, and the next training batch must
    continue from the training stream's; the Lightning docs' ``self.validation_step_outputs.append(loss)``
    fills a list that was empty on entry, and the list must stay (the next ``validation_step`` appends to it).
    A tensor written in place inside (a running centre kept as ``self.center = torch.zeros(D)`` and updated
    with ``mul_``/``add_`` by every forward, eval mode included) gets its entry values back, as
    :func:`kept_buffers` does for buffers: before, only references were restored, and a probe's eval forwards
    moved such a centre, so a run with the probe trained otherwise than one without it. That costs a copy of
    the carried tensors, on their device, per use (not per training step).
    """
    saved = carried_tensors(module)
    # every plain attribute on entry, and the items of its lists and dicts: references and shallow copies only
    entry = {
        f"{prefix}.{name}" if prefix else name: (value, _contents(value))
        for prefix, submodule in module.named_modules()
        for name, value in _plain_attributes(submodule)
    }
    values = _entry_values(tensor for value in saved.values() for tensor in tensors_in(value))
    try:
        yield
    finally:
        for dotted, value in [*carried_tensors(module).items(), *saved.items()]:
            now = _attribute(module, dotted)
            if dotted in saved and saved[dotted] is None and not tensors_in(now):
                continue  # a None is put back only over tensors (a hidden state created since)
            if dotted not in saved and (value is None or not tensors_in(now)):
                continue  # holds no tensors now, nor did on entry: not ours (kept_python_state's)
            owner_name, _, name = dotted.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            if dotted not in entry:
                if name in vars(owner):
                    delattr(owner, name)
                continue
            old, contents = entry[dotted]
            _put_back(contents)
            if now is not old:
                setattr(owner, name, old)
        with torch.no_grad():
            for tensor, version, copied in values:
                _write_back(tensor, version, copied)


#: a tensor, its version counter and a copy of its values, as :func:`_entry_values` keeps them
EntryValue = tuple[Tensor, int, Tensor]


def _entry_values(tensors: Iterable[Tensor]) -> list[EntryValue]:
    """Each distinct tensor of ``tensors`` with its version counter and a copy of its values, for
    :func:`_write_back`; an inference tensor cannot be written outside inference mode (and keeps no version
    count), so it is left out, and so is a sparse one (a graph's adjacency, which ``torch.equal`` cannot read; a
    module rebinds rather than writes into it)."""
    distinct = {
        id(tensor): tensor
        for tensor in tensors
        if not is_lazy(tensor) and not tensor.is_inference() and tensor.layout is torch.strided
    }
    return [(tensor, tensor._version, tensor.detach().clone()) for tensor in distinct.values()]


def _write_back(tensor: Tensor, version: int, copied: Tensor) -> None:
    """Give ``tensor`` the values ``copied`` kept where something wrote into it since: its version counter
    moved, or its values differ (a write through ``.data`` or a custom kernel leaves the counter alone); one
    resized in place (an observer's first forward) gets its shape back. Call under ``no_grad``."""
    unchanged = tensor.shape == copied.shape and torch.equal(tensor, copied)
    if tensor._version != version or not unchanged:
        if tensor.shape != copied.shape:
            tensor.resize_(copied.shape)
        tensor.copy_(copied)


@contextmanager
def kept_python_state(module: nn.Module) -> Iterator[None]:
    """Give back, on exit, the public list, dict and number attributes of ``module`` and its submodules as they
    were on entry: lists and dicts the same objects with their entry items (and those of the lists and dicts
    directly inside them), numbers their values. Attributes created inside stay: a setup a ``validation_step``
    makes at its first call (behind its own flag) must survive (a review: dropping them raised
    ``AttributeError`` in the real validation), at the price that a list first created inside keeps the
    call's items.

    For a call of the module's own ``training_step`` or ``validation_step`` outside Lightning's loop
    (StabilityGuard's rollback test, the evaluation probe): the Lightning docs'
    ``self.validation_step_outputs.append(loss)`` and counters such as ``self.seen += len(x)`` would otherwise
    count that call, and the real epoch end would average the probe's outputs in. Private attributes
    (``_name``), booleans (``training``), other objects and torchmetrics metrics (whose states
    ``frozen_metric_states`` gives back) are left alone.
    """
    saved: list[tuple[Any, str, Any, Contents]] = []
    for _, owner in _outside_metrics(module):
        for name, value in vars(owner).items():
            if _python_state(name, value):
                saved.append((owner, name, value, _contents(value)))
    try:
        yield
    finally:
        for owner, name, value, contents in saved:
            _put_back(contents)
            if getattr(owner, name, None) is not value:
                setattr(owner, name, value)


def _python_state(name: str, value: Any) -> bool:
    """Whether :func:`kept_python_state` gives ``value``, held as attribute ``name``, back."""
    return (
        not name.startswith("_")
        and not isinstance(value, bool)
        and (isinstance(value, (int, float)) or _container(value))
    )


@contextmanager
def kept_buffers(module: nn.Module, written_only: bool = False) -> Iterator[None]:
    """Give back, on exit, every buffer of ``module`` as it was on entry: the same tensor object, with its
    entry values where something wrote into it (its version counter, or its values where a write through
    ``.data`` or a custom kernel left the counter alone); a buffer registered inside stays (a lazy setup at
    the first call must survive, as for :func:`kept_python_state`).

    For an evaluation in the middle of training: a forward in eval mode that updates a running statistic
    anyway (a test-time normaliser's ``self.mean.lerp_(...)``) or a ``validation_step`` that counts samples
    in a buffer (``self.seen += len(x)``) would otherwise carry the evaluation into training and into the
    real validation. A copy of every buffer, on its device, per evaluation: a model holding buffers of
    gigabytes (a retrieval datastore, a large queue) needs that much memory free during the probe.

    ``written_only``: give back only what was written in place, at its entry shape; a buffer replaced by
    another tensor or reshaped stays as it is now (structured pruning's trial cut: the cut replaces a cut
    layer's buffers, while the trace's forward writes a fake quantizer's observer in place)."""
    saved = [
        (owner, name, buffer, buffer._version, buffer.clone())
        for owner in module.modules()
        for name, buffer in owner._buffers.items()
        # an inference tensor cannot be written outside inference mode (and keeps no version count)
        if buffer is not None and not is_lazy(buffer) and not buffer.is_inference()
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, buffer, version, copied in saved:
                if written_only and (owner._buffers.get(name) is not buffer or buffer.shape != copied.shape):
                    continue
                _write_back(buffer, version, copied)
                if owner._buffers.get(name) is not buffer:
                    owner._buffers[name] = buffer
