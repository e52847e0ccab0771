"""HardSampleReplay's planned passes (mode="steps") leave a sampler's own generator where the plain run's
BatchSampler leaves it: torch's RandomSampler draws once more when its iterator is read to the end, which the
plain BatchSampler does before a short last batch and when a loader with workers asks past the last batch.
The planned pass read exactly its indices, so from the second epoch on (still in PulseCycle's pure-burst
warm-up, where training is documented untouched) every batch held other samples than the plain run's."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.core.sample_index import PlannedBatchSampler
from tests.conftest import trainer_kwargs


def _passes(batch_sampler, passes: int, past_end: bool) -> list[list[list[int]]]:
    """The batches of ``passes`` passes, each read as a loader without workers reads it (its length's worth)
    or, ``past_end``, as one with workers does (until the batch sampler stops)."""
    out = []
    for _ in range(passes):
        iterator = iter(batch_sampler)
        if past_end:
            out.append(list(iterator))
        else:
            out.append([next(iterator) for _ in range(len(batch_sampler))])
    return out


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("past_end", [False, True])
@pytest.mark.parametrize("samples", [250, 256])
def test_a_planned_pass_of_the_plain_sizes_draws_as_the_plain_batch_sampler(samples, past_end, drop_last):
    def make():
        sampler = RandomSampler(range(samples), generator=torch.Generator().manual_seed(7))
        return sampler, BatchSampler(sampler, 16, drop_last)

    plain_sampler, plain = make()
    expected = _passes(plain, 3, past_end)
    sampler, original = make()
    sizes = [len(batch) for batch in expected[0]]
    planned = PlannedBatchSampler(original, lambda: (0, sizes), len(plain))
    got = _passes(planned, 3, past_end)
    assert got == expected  # every pass the plain one: nothing trained twice or left out
    assert torch.equal(sampler.generator.get_state(), plain_sampler.generator.get_state())


def test_a_pass_the_plan_cuts_short_leaves_the_rest_of_the_data_unread():
    """At the run's end a pass is cut to its remaining steps: the plain run stopped there reads no further."""
    generator = torch.Generator().manual_seed(7)
    sampler = RandomSampler(range(256), generator=generator)
    planned = PlannedBatchSampler(BatchSampler(sampler, 16, False), lambda: (0, [16] * 5), 16)
    assert len(list(planned)) == 5
    plain_generator = torch.Generator().manual_seed(7)
    torch.randperm(256, generator=plain_generator)
    assert torch.equal(generator.get_state(), plain_generator.get_state())


class _Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.seen: list[list[int]] = []
        self.epochs: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.append(idx.tolist())
        self.epochs.append(self.current_epoch)
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(samples: int, workers: int, replay: bool) -> tuple[_Recorder, int | None]:
    pl.seed_everything(0, workers=True, verbose=False)
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(
        torch.randn(samples, 4, generator=data),
        torch.randint(0, 3, (samples,), generator=data),
        torch.arange(samples),
    )
    loader = DataLoader(
        dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(7), num_workers=workers
    )
    callbacks, replay_at = [], []
    if replay:
        cycle = PulseCycle(burst=6, replay=3, maintain=2, warmup=0.6, anneal=0, maintain_eval="none")
        cycle.added_listeners.append(
            lambda trainer, module, change: (
                replay_at.append(trainer.global_step) if "current=<Phase.REPLAY" in str(change) else None
            )
        )
        callbacks = [cycle, HardSampleReplay()]
    module = _Recorder()
    pl.Trainer(max_steps=40, callbacks=callbacks, **trainer_kwargs()).fit(module, loader)
    return module, min(replay_at, default=None)


@pytest.mark.parametrize(("samples", "workers"), [(250, 0), (256, 2)])
def test_the_warm_up_trains_the_plain_runs_batches_with_a_loader_generator(samples, workers):
    plain, _ = _fit(samples, workers, replay=False)
    replayed, replay_at = _fit(samples, workers, replay=True)
    assert replay_at == 28 and len(plain.seen) == 40  # two epochs and more of pure burst first
    # was: other samples from step 16 (the second epoch) on
    assert replayed.seen[:replay_at] == plain.seen[:replay_at]
    for epoch in set(replayed.epochs):  # no sample trained twice in an epoch, and a burst epoch trains all
        seen = [i for batch, at in zip(replayed.seen, replayed.epochs) if at == epoch for i in batch]
        assert len(set(seen)) == len(seen)
        assert epoch > 0 or sorted(seen) == list(range(samples))


def test_a_pass_ending_in_a_light_window_leaves_the_generator_where_the_plain_pass_does():
    # a review: the drain keyed on the plan's own last batch; the plain pass's last batch (250 % 16) decides
    def make():
        sampler = RandomSampler(range(250), generator=torch.Generator().manual_seed(7))
        return sampler, BatchSampler(sampler, 16, False)

    plain_sampler, plain = make()
    batches = iter(plain)
    for _ in range(len(plain)):  # a loader without workers reads len() batches
        next(batches)
    sampler, source = make()
    planned = PlannedBatchSampler(source, lambda: (0, [32] * 7 + [26]), len(plain))
    windows = iter(planned)
    for _ in range(8):
        next(windows)
    assert torch.equal(plain_sampler.generator.get_state(), sampler.generator.get_state())


def test_the_drain_reads_no_more_than_the_length_promises():
    # a review: a sampler with a length that never stops iterating hung the pass's end
    class Endless(torch.utils.data.Sampler):
        def __len__(self):
            return 20

        def __iter__(self):
            index = 0
            while True:
                yield index % 20
                index += 1

    planned = PlannedBatchSampler(BatchSampler(Endless(), 8, False), lambda: (0, [8, 8, 4]), 3)
    assert [len(batch) for batch in planned] == [8, 8, 4]
