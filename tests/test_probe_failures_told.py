"""A ``validation_step`` that raises in the evaluation probe: the probe is off for the fit, every rank learns it
after the batch that failed (so none waits in a collective another never reaches), and the warning names the
error and the rank it came from."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from lightning_pulse import PulseCycle
from lightning_pulse.core.validation_streams import ProbeFailed
from tests.conftest import trainer_kwargs
from tests.ddp_workers import run_python_in_its_own_session

MARK = "ZZ_rank_one_probe_error"
#: (global_step, batch_idx) of each `validation_step` the probe called in this process
_PROBE_CALLS: list[tuple[int, int]] = []


def _cycle() -> PulseCycle:
    """Maintain phases (a probe each) at steps 2, 5 and 8."""
    return PulseCycle(
        burst=2, replay=0, maintain=1, order=["burst", "maintain"], warmup=0, anneal=0, probe_batches=2
    )


class _FailsOnRankOneAtTheSecondProbe(pl.LightningModule):
    """Logs a torchmetrics mean (its ``compute`` syncs: torchmetrics' all_gather). Rank 0 validates on two
    batches, rank 1 on one (an uneven validation shard). At the second probe every rank gathers each batch's
    loss (a collective in ``validation_step``), then rank 1 raises a ``KeyError`` at the first batch: before,
    rank 0 went on to the second batch's gather while rank 1 waited in the probe's failure vote, and both
    waited for good (without the gather, in ``compute``'s sync)."""

    def __init__(self, directory: str, fails_in: str = "step") -> None:
        super().__init__()
        self.directory, self.fails_in = directory, fails_in
        self.net = torch.nn.Linear(4, 2)
        self.mean = _FailsOnRankOneAtTheSecondProbeCompute() if fails_in == "compute" else MeanMetric()
        self.second = MeanMetric()  # its `compute` syncs too: after the first one's, which may fail

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        if self.trainer.state.stage == "train":  # in the probe
            _PROBE_CALLS.append((self.trainer.global_step, batch_idx))
            if self.trainer.global_step >= 5 and self.fails_in == "step":
                self.all_gather(loss)
                if self.global_rank == 1:
                    raise KeyError(MARK)
        if self.fails_in == "compute":
            in_the_second_probe = self.trainer.state.stage == "train" and self.trainer.global_step >= 5
            self.mean.fails = in_the_second_probe and self.global_rank == 1
        self.mean.update(loss)
        self.second.update(loss)
        self.log("val_mean", self.mean)
        self.log("val_second", self.second)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)

    def val_dataloader(self):
        x = torch.randn(8 if self.global_rank == 0 else 4, 4, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)

    def on_train_end(self):
        cycle = next(c for c in self.trainer.callbacks if isinstance(c, PulseCycle))
        outcome = {"step": self.trainer.global_step, "calls": _PROBE_CALLS, "last_probe": cycle.last_probe}
        Path(self.directory, f"rank{self.global_rank}.json").write_text(json.dumps(outcome))


class _FailsOnRankOneAtTheSecondProbeCompute(MeanMetric):
    """A mean whose ``compute`` raises where the module set ``fails`` (rank 1, at the second probe), after
    torchmetrics' sync: before a vote per metric, rank 0 went on to the next metric's sync while rank 1 waited
    in the vote (a review)."""

    fails = False

    def compute(self):
        value = super().compute()
        if self.fails:
            raise KeyError(MARK)
        return value


def fit_failing_on_rank_one(directory: str, fails_in: str = "step") -> None:
    """Two gloo ranks, 9 steps (no epoch ends, so Lightning's own validation never runs); run in a subprocess
    by the test below, which ends it if it hangs."""
    from tests.ddp_workers import TwoGlooProcesses

    kwargs = trainer_kwargs(devices=2, strategy=TwoGlooProcesses(), use_distributed_sampler=False)
    trainer = pl.Trainer(callbacks=[_cycle()], max_steps=9, limit_val_batches=2, **kwargs)
    trainer.fit(_FailsOnRankOneAtTheSecondProbe(directory, fails_in))


@pytest.mark.ddp
@pytest.mark.parametrize("fails_in", ["step", "compute"])
def test_a_probe_failure_on_one_rank_after_a_collective_turns_the_probe_off_on_both_and_names_the_error(
    tmp_path, fails_in
):
    call = (
        "from tests import test_probe_failures_told as t; "
        f"t.fit_failing_on_rank_one({str(tmp_path)!r}, {fails_in!r})"
    )
    returncode, stderr = run_python_in_its_own_session(
        call, "the two ranks hung after rank 1's probe failure"
    )
    assert returncode == 0, stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert rank0["step"] == rank1["step"] == 9
    # the first probe ran on both ranks' uneven shards (rank 1 voted while rank 0 had its second batch); at the
    # second, rank 0 stopped after the batch rank 1 failed (or ran both, where the metric's compute failed);
    # the third ran on neither: the probe is off
    assert rank0["calls"] == (
        [[2, 0], [2, 1], [5, 0]] if fails_in == "step" else [[2, 0], [2, 1], [5, 0], [5, 1]]
    )
    assert rank1["calls"] == [[2, 0], [5, 0]]
    assert rank0["last_probe"] == rank1["last_probe"] and set(rank0["last_probe"]) == {
        "val_mean",
        "val_second",
    }
    said = [line for line in stderr.splitlines() if "raised in the evaluation probe" in line]
    assert len(said) == 1, stderr[-3000:]  # one warning, from rank 0, with rank 1's error in it
    assert f": `KeyError: '{MARK}'` on rank 1)" in said[0]
    assert 'maintain_eval="none"' in said[0]


def test_the_warning_names_each_error_with_its_ranks_and_asserts_no_one_cause():
    failed = ProbeFailed(None, [(1, "KeyError: 'image'"), (2, "KeyError: 'image'"), (3, "ValueError: bad")])
    message = failed.message("PulseCycle", 'maintain_eval="none"')
    assert message.startswith(
        "PulseCycle: the module's code raised in the evaluation probe (`validation_step`, a batch hook or a "
        "metric's `compute`: `KeyError: 'image'` on ranks 1 and 2; `ValueError: bad` on rank 3), so the probe "
        "is off for this fit"
    )
    # three distinct errors at most (an out-of-memory line names its device: one per rank of a large job)
    many = ProbeFailed(None, [(rank, f"RuntimeError: out of memory on cuda:{rank}") for rank in range(8)])
    assert "cuda:2` on rank 2; and 5 more errors), so" in many.message("PulseCycle", "off")

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    assert ProbeFailed.said(Unprintable()) == "Unprintable"  # not an error outside the vote
    assert "Usual causes:" in message and "running out of memory" in message
    assert "Give validation batches" not in message  # the old advice blamed a batch size for every error
    assert message.endswith('turn the probe off with `maintain_eval="none"`.')
    # the type and the first line of the text only, cut where long
    out_of_memory = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nSee documentation")
    assert ProbeFailed.said(out_of_memory) == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert ProbeFailed.said(ValueError()) == "ValueError"
    assert len(ProbeFailed.said(ValueError("x" * 500))) == ProbeFailed.longest


class _FailsAtTheSecondProbeBatch(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.mean = MeanMetric()

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        if self.trainer.state.stage == "train" and batch_idx == 1:
            raise KeyError("label")
        self.mean.update(F.cross_entropy(self.net(batch[0]), batch[1]))
        self.log("val_mean", self.mean)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_one_process_names_the_error_without_a_rank_and_the_fit_goes_on():
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)
    cycle = _cycle()
    trainer = pl.Trainer(callbacks=[cycle], max_steps=9, limit_val_batches=2, **trainer_kwargs())
    with pytest.warns(
        UserWarning, match=r"raised in the evaluation probe \(.*: `KeyError: 'label'`\), so"
    ) as said:
        trainer.fit(_FailsAtTheSecondProbeBatch(), loader, loader)
    assert trainer.global_step == 9 and cycle.last_probe == {}
    assert sum("evaluation probe" in str(w.message) for w in said) == 1  # off after the first: said once
