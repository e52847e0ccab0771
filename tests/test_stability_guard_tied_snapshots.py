"""StabilityGuard's snapshots of a model with tied weights (GPT-2's ``wte`` / ``lm_head``): the tied matrix is
listed under two ``state_dict`` names, and each snapshot copied it once per name (2x the model in host memory,
times ``max_snapshots``)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard
from lightning_pulse.core.snapshots import (
    CopyMemo,
    SnapshotRing,
    copy_to_cpu,
    restore_snapshot,
    take_snapshot,
    tensor_bytes,
)
from tests.conftest import trainer_kwargs

V, D = 512, 16


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # weight tying, as GPT-2 / T5 / BERT's MLM head do

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, V, (4, 8), generator=generator), torch.randint(0, V, (4, 8), generator=generator)
    optimizer.zero_grad()
    F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1)).backward()
    optimizer.step()


def _held_bytes(obj) -> int:
    """Bytes of the distinct storages the tensors in ``obj`` use (what the snapshot really holds)."""
    storages = {}
    for tensor in _tensors(obj):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def test_a_tied_weight_is_copied_once_and_counted_once():
    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer, 0)
    snapshot = take_snapshot(1, model, [optimizer])
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied one once
    assert {"emb.weight", "head.weight"} <= snapshot.model.keys()
    assert snapshot.model["emb.weight"] is snapshot.model["head.weight"]
    assert _held_bytes(snapshot.model) == param_bytes  # was 1.94x: the 512x16 matrix twice
    # AdamW keeps its state per parameter: the tied one has one exp_avg and one exp_avg_sq
    optimizer_bytes = 2 * param_bytes + 3 * 4  # + a float32 `step` per parameter
    assert _held_bytes(snapshot.optimizers) == optimizer_bytes
    assert snapshot.nbytes == param_bytes + optimizer_bytes == tensor_bytes(snapshot.model) + optimizer_bytes
    ring = SnapshotRing(2)
    ring.add(snapshot)
    assert ring.nbytes == snapshot.nbytes


def test_a_rollback_from_a_tied_snapshot_restores_both_names_and_the_model_keeps_its_tie():
    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer, 0)
    snapshot = take_snapshot(1, model, [optimizer])
    saved_weight = snapshot.model["emb.weight"].clone()
    saved_moment = optimizer.state[model.emb.weight]["exp_avg"].clone()
    tied = model.emb.weight
    for seed in (1, 2):
        _step(model, optimizer, seed)
    assert not torch.equal(model.emb.weight, saved_weight)
    restore_snapshot(snapshot, model, [optimizer])
    assert model.head.weight is model.emb.weight is tied  # loaded in place: the tie is the model's own
    assert torch.equal(model.emb.weight, saved_weight) and torch.equal(model.head.weight, saved_weight)
    assert torch.equal(optimizer.state[tied]["exp_avg"], saved_moment)
    assert torch.equal(snapshot.model["head.weight"], saved_weight)  # the snapshot itself is left as it was


def test_a_recycled_tied_snapshot_is_refilled_for_one_name_when_the_tie_was_undone_since():
    torch.manual_seed(0)
    model = TiedLM()
    old = take_snapshot(0, model)
    shared = old.model["emb.weight"]
    with torch.no_grad():
        model.head.weight = nn.Parameter(model.emb.weight + 1.0)  # untied, other values
    snapshot = take_snapshot(1, model, reuse=old)
    assert torch.equal(snapshot.model["emb.weight"], model.emb.weight)
    assert torch.equal(snapshot.model["head.weight"], model.head.weight)
    assert (snapshot.model["emb.weight"] is shared) != (snapshot.model["head.weight"] is shared)
    # and back: separate copies recycled for a tied model are shared again
    model.head.weight = model.emb.weight
    again = take_snapshot(2, model, reuse=snapshot)
    assert again.model["head.weight"] is again.model["emb.weight"]
    assert torch.equal(again.model["head.weight"], model.emb.weight)


def test_a_recycled_snapshot_whose_names_are_two_objects_over_one_memory_is_refilled_for_one_of_them():
    # a review: the refills were known by object, so two objects over one copy's memory (a loader that does
    # not keep a tie one object) were both refilled in place, the first name ending with the second's values
    torch.manual_seed(0)
    model = TiedLM()
    old = take_snapshot(0, TiedLM())
    held = old.model["emb.weight"]
    old.model["head.weight"] = held.view(held.shape)  # another object, the same memory
    with torch.no_grad():
        model.head.weight = nn.Parameter(model.emb.weight + 1.0)  # untied, other values
    snapshot = take_snapshot(1, model, reuse=old)
    assert torch.equal(snapshot.model["emb.weight"], model.emb.weight)
    assert torch.equal(snapshot.model["head.weight"], model.head.weight)


def test_only_views_of_the_same_memory_share_a_copy():
    weight = torch.arange(12.0).reshape(3, 4)
    state = {
        "a": weight,
        "b": weight.detach(),  # the same view: shared
        "row": weight[1],  # overlaps, but another view: its own copy
        "t": weight.t(),  # same storage and offset, other strides: its own copy
        "twin": weight.clone(),  # equal values, other memory: its own copy
    }
    copied = copy_to_cpu(state)
    assert copied["a"] is copied["b"]
    assert len({id(copied[name]) for name in ("a", "row", "t", "twin")}) == 4
    for name, value in state.items():
        assert torch.equal(copied[name], value)
    assert tensor_bytes(copied) == tensor_bytes(state) == 4 * (12 + 4 + 12 + 12)


class _Temporaries:
    """A rollback-aware callback whose state is made afresh at each call (clones), like GradientCache's."""

    def __init__(self, fill: float) -> None:
        self.fill = fill

    def state_dict(self):
        return {"window": torch.full((256,), self.fill)}

    def load_state_dict(self, state):
        self.fill = float(state["window"][0])


class _Anchored:
    """A callback whose state holds the model's live weight itself."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self):
        return {"anchor": self.model.mid.weight.detach()}

    def load_state_dict(self, state):
        pass


def test_a_memo_never_takes_a_freed_tensors_memory_for_the_same_tensor():
    memo = CopyMemo()
    first = copy_to_cpu({"window": torch.full((1024,), 1.0)}, memo=memo)  # a temporary, freed after the call
    second = copy_to_cpu({"window": torch.full((1024,), 2.0)}, memo=memo)  # may be allocated where it was
    assert first["window"][0] == 1.0 and second["window"][0] == 2.0


def test_callback_states_share_the_models_copies_and_keep_their_own_values():
    model = TiedLM()
    states = {f"cb{i}": _Temporaries(float(i)) for i in range(4)} | {"anchored": _Anchored(model)}
    snapshot = take_snapshot(0, model, callbacks=states)
    for i in range(4):  # a freed temporary's memory reused by the next state never aliases its copy
        assert torch.equal(snapshot.callbacks[f"cb{i}"]["window"], torch.full((256,), float(i)))
    assert snapshot.callbacks["anchored"]["anchor"] is snapshot.model["mid.weight"]


class TiedLightningLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = TiedLM()

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.net(x).reshape(-1, V), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _NaNIntoTheTiedWeightAt12(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 12 and not getattr(self, "done", False):
            self.done = True
            with torch.no_grad():
                pl_module.net.emb.weight[0].fill_(float("nan"))


def test_a_guard_rollback_on_a_tied_model_keeps_the_tie_and_its_snapshots_hold_the_model_once():
    pl.seed_everything(0)
    data = TensorDataset(torch.randint(0, V, (64, 8)), torch.randint(0, V, (64, 8)))
    model = TiedLightningLM()
    tied = model.net.emb.weight
    guard = StabilityGuard(warmup=5, snapshot_every=5, rollback_margin=5)
    trainer = pl.Trainer(max_steps=16, callbacks=[_NaNIntoTheTiedWeightAt12(), guard], **trainer_kwargs())
    with pytest.warns(UserWarning, match="rollback 1 at step 12 to the snapshot of step 5"):
        trainer.fit(model, DataLoader(data, batch_size=8))
    assert guard.rollbacks == 1
    assert model.net.head.weight is model.net.emb.weight is tied and torch.isfinite(tied).all()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert (
        len(guard.snapshots) >= 1 and guard.snapshots.nbytes == len(guard.snapshots) * param_bytes
    )  # SGD: no state
    for snapshot in guard.snapshots:
        assert snapshot.model["net.emb.weight"] is snapshot.model["net.head.weight"]
        assert _held_bytes(snapshot.model) == param_bytes
