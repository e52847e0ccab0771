"""ScheduledPrune on the cases of a held-out sweep: mode="structured" on a hand-written GNN, whose inputs
(nodes, edges, node-to-graph vector) do not cut to two samples along the first tensor's rows, and the fit-end
warning of a run whose last event came a step before the schedule's end, at the target but for a float's
last digits."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.core import prune_setup
from lightning_pulse.core.prune_schedule import PruneSchedule
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

FEATURES, CLASSES = 6, 3


def _graphs() -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    generator = torch.Generator().manual_seed(0)
    graphs = []
    for _ in range(16):
        nodes = int(torch.randint(3, 7, (1,), generator=generator))
        source = torch.arange(nodes)
        edges = torch.stack([source, (source + 1) % nodes])
        graphs.append((torch.randn(nodes, FEATURES, generator=generator), edges, int(nodes % CLASSES)))
    return graphs


class _Graphs(Dataset):
    def __init__(self) -> None:
        self.graphs = _graphs()

    def __len__(self) -> int:
        return len(self.graphs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.graphs[index]


def _join(items: list[tuple[torch.Tensor, torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """PyTorch Geometric's layout: nodes joined, edges shifted by the nodes before them, a node-to-graph
    vector."""
    nodes, edges, owners, offset = [], [], [], 0
    for index, (x, edge_index, _) in enumerate(items):
        nodes.append(x)
        edges.append(edge_index + offset)
        owners.append(torch.full((len(x),), index))
        offset += len(x)
    labels = torch.tensor([label for _, _, label in items])
    return {"x": torch.cat(nodes), "edge_index": torch.cat(edges, 1), "batch": torch.cat(owners), "y": labels}


class _GraphNet(pl.LightningModule):
    """Message passing with ``index_add_`` over ``edge_index``, pooled per graph; ``forward`` takes the
    batch's entries by name. ``example``: how its ``example_input_array`` is given (``None``: not at all)."""

    def __init__(self, example: str | None = None) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Linear(FEATURES, 16), nn.Linear(16, 16), nn.Linear(16, CLASSES)
        first = _join(_graphs()[:4])
        entries = {key: first[key] for key in ("x", "edge_index", "batch")}
        if example == "tuple":
            self.example_input_array = tuple(entries.values())
        elif example == "dict":
            self.example_input_array = entries

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x).relu()
        passed = torch.zeros_like(hidden).index_add_(0, edge_index[1], hidden[edge_index[0]])
        hidden = self.mix(hidden + passed).relu()
        pooled = torch.zeros(int(batch.max()) + 1, hidden.shape[1]).index_add_(0, batch, hidden)
        return self.head(pooled / torch.bincount(batch).unsqueeze(1))

    def training_step(self, data: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        return F.cross_entropy(self(data["x"], data["edge_index"], data["batch"]), data["y"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(module: pl.LightningModule, prune: ScheduledPrune) -> None:
    data = DataLoader(_Graphs(), batch_size=4, collate_fn=_join)
    pl.Trainer(**trainer_kwargs(max_steps=8, callbacks=[prune])).fit(module, data)


def _structured() -> ScheduledPrune:
    return ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=6, every=2)


@pytest.mark.parametrize("given", ["tuple", "dict"])
def test_a_graph_example_input_array_is_traced_whole_where_two_of_its_rows_break_the_model(given):
    """Held-out sweep: the user's `example_input_array` was cut to its first two nodes, with the edges and the
    node-to-graph vector left whole: `IndexError` in the refusal, whose advice was to give an
    `example_input_array`. The model runs on it as given, so it is traced as given."""
    torch.manual_seed(0)
    module, prune = _GraphNet(given), _structured()
    _fit(module, prune)
    assert prune.sparsity == pytest.approx(0.5)
    assert module.mix.out_features < 16  # channels were cut, on the graph example the events traced whole
    traced = prune.pruner.example_inputs
    nodes = traced[0] if given == "tuple" else traced["x"]
    assert nodes.shape[0] == module.example_input_array[0 if given == "tuple" else "x"].shape[0]


def test_a_training_batch_that_runs_whole_and_not_cut_is_refused_as_such():
    """A batch from the loader the model runs on whole, and not on its first two rows with the edges left
    whole: said so (not "the model does not run"), with the `example_input_array` way out."""
    with pytest.raises(PulseRefusal) as refusal:
        _fit(_GraphNet(), _structured())
    message = str(refusal.value)
    assert "the training batch cannot be cut to the two samples the model is traced with" in message
    assert "IndexError" in message
    assert (
        "Give the LightningModule an `example_input_array` (what its `forward` takes): it is traced as given"
        in (message)
    )


class _BrokenExample(_GraphNet):
    """Its `example_input_array` misses an argument: the model runs on no cut of it, nor whole."""

    def __init__(self) -> None:
        super().__init__("tuple")
        self.example_input_array = self.example_input_array[:2]


def test_an_example_input_array_the_model_does_not_run_on_is_not_answered_with_giving_one():
    with pytest.raises(PulseRefusal) as refusal:
        _fit(_BrokenExample(), _structured())
    message = str(refusal.value)
    assert "the model does not run on its `example_input_array`" in message
    assert "Make `example_input_array` what `forward` takes" in message
    assert "give the LightningModule an `example_input_array`" not in message.lower()


# ------------------------------------------------------------------------- the fit-end warning
def _schedule_ended_by(last_step: int) -> PruneSchedule:
    """A schedule from step 20 to 170 whose last chance came at ``last_step`` (a maintain phase's start)."""
    schedule = PruneSchedule(final_sparsity=0.5, start=20, end=170, every=50)
    schedule.resolve(250.0)
    for step in (70, 120, last_step):
        schedule.advance(step)
    return schedule


def test_a_last_event_a_step_before_the_end_at_the_target_is_not_warned_as_unfinished():
    """Held-out sweep (PulseCycle, HardSampleReplay): the last event came at step 169 and reached 0.49999984
    of 0.5; the run was still warned "with no event at or after the schedule's end ... reached 0.500 of
    0.5"."""
    schedule = _schedule_ended_by(169)
    assert not schedule.finished and schedule.sparsity != 0.5
    events = [{"sparsity": schedule.sparsity}]
    assert prune_setup.unfinished_warning(schedule, 243, events) is None
    # a measured sparsity at the target (the masks' counts round to it) is not warned either
    early = _schedule_ended_by(150)
    assert prune_setup.unfinished_warning(early, 243, [{"sparsity": 0.5}]) is None


def test_a_last_event_short_of_the_target_is_still_warned():
    schedule = _schedule_ended_by(150)
    warning = prune_setup.unfinished_warning(schedule, 243, [{"sparsity": schedule.sparsity}])
    assert warning is not None
    assert "with no event at or after the schedule's end (step 170)" in warning
    assert f"reached {schedule.sparsity:.3f} of 0.5" in warning
