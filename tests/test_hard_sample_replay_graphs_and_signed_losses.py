"""HardSampleReplay on two cases a held-out sweep found: graphs joined with a bare node-to-graph ``batch``
vector (batch mode crashed at its first cut), and a loss whose per-sample terms enter with coefficients of
both signs (a REINFORCE loss scored by its unweighted cross-entropy, with no word)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import HardSampleReplay
from lightning_pulse.core.per_sample_loss import LossCapture, OutputKeyScorer
from lightning_pulse.core.selection import concatenated_parts
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

B = 8


# ---------------------------------------------------------------- graphs joined by a node-to-graph vector
def _graphs(count: int = 32) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    graphs = []
    for _ in range(count):
        nodes = int(torch.randint(3, 9, (1,), generator=generator))
        x = torch.randn(nodes, 4, generator=generator)
        edges = torch.randint(0, nodes, (2, 2 * nodes), generator=generator)
        graphs.append({"x": x, "edge_index": edges, "y": int(x[:, 0].mean() > 0)})
    return graphs


def _join_graphs(samples: list[dict]) -> dict:
    """PyTorch Geometric's layout, written by hand: nodes concatenated, edges offset, and each node's graph id
    in a bare ``batch`` vector (no ``ptr``, no ``num_nodes``)."""
    offset, edges = 0, []
    for sample in samples:
        edges.append(sample["edge_index"] + offset)
        offset += len(sample["x"])
    return {
        "x": torch.cat([s["x"] for s in samples]),
        "edge_index": torch.cat(edges, 1),
        "batch": torch.cat([torch.full((len(s["x"]),), i) for i, s in enumerate(samples)]),
        "y": torch.tensor([s["y"] for s in samples]),
    }


class _GraphClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.message, self.head = nn.Linear(4, 16), nn.Linear(16, 16), nn.Linear(16, 2)

    def training_step(self, batch, batch_idx):
        h = torch.relu(self.embed(batch["x"]))
        source, target = batch["edge_index"]
        h = torch.relu(h + torch.zeros_like(h).index_add_(0, target, self.message(h)[source]))
        graphs = batch["y"].shape[0]
        pooled = torch.zeros(graphs, 16).index_add_(0, batch["batch"], h)  # a sum over each graph's nodes
        return F.cross_entropy(self.head(pooled), batch["y"])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _fit_graphs(replay: HardSampleReplay) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=3, callbacks=[replay], **trainer_kwargs())
    loader = DataLoader(_graphs(), batch_size=B, shuffle=True, collate_fn=_join_graphs)
    trainer.fit(_GraphClassifier(), loader)
    return trainer


@pytest.mark.parametrize("replay", [dict(mode="batch"), dict(rule="infobatch")], ids=["batch", "infobatch"])
def test_graphs_joined_by_a_bare_node_to_graph_vector_are_refused_in_batch_mode_before_any_cut(replay):
    # held-out sweep: the first cut kept y of 4 graphs and every node of 8, and the fit died inside
    # training_step at epoch 2 (torch's "index ... is out of bounds for dimension 0"); with `ptr` or
    # `num_nodes` beside it the same batch was already refused at the second batch
    trainer = None
    with pytest.raises(
        PulseRefusal,
        match=r"HardSampleReplay cannot cut a batch of 8 samples in mode='batch': "
        r"it holds batch\['batch'\] \(\d+ items, its values the sample ids 0 to 7.*mode='steps'",
    ):
        trainer = _fit_graphs(HardSampleReplay(**replay))
    assert trainer is None


def test_steps_mode_trains_graphs_joined_by_a_node_to_graph_vector():
    replay = HardSampleReplay()  # steps mode: the cut is at the sampler, before the graphs are joined
    trainer = _fit_graphs(replay)
    assert trainer.global_step > 0 and trainer.current_epoch == 3
    assert replay.metrics()["replay_fraction"] < 1.0  # it selected


def test_only_a_sorted_vector_of_each_sample_id_in_turn_is_read_as_splitting_itself():
    graphs = _join_graphs(_graphs(B))
    found = concatenated_parts(graphs, B)
    assert [where for where, _ in found] == ["batch['batch']"]
    assert found[next(iter(found))] == len(graphs["x"])
    healthy = {
        "tokens": torch.randint(0, 100, (3 * B,)),  # token ids longer than B
        "labels": torch.tensor([3, 1, 0, 2, 1, 3, 0, 3]),  # (B,), summing to no length here
        "gap": torch.tensor([0, 0, 1, 1, 2, 2, 4, 4, 5, 6, 7, 7]),  # sorted, 3 missing
        "from_one": torch.tensor([1, 1, 2, 3, 4, 5, 6, 7, 8, 8]),  # sorted, not from 0
        "past_b": torch.arange(2 * B),  # sorted ids 0 .. 2B - 1
        "sequences": torch.arange(B * 5).view(B, 5),  # (B, T)
        "float_ids": torch.arange(B).repeat_interleave(2).float(),  # not integers
    }
    assert concatenated_parts(healthy, B) == {}


# ---------------------------------------------------------------- per-sample coefficients of both signs
def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    y = torch.randint(0, 4, (64,), generator=generator)
    tokens = torch.randint(0, 4, (64, 6), generator=generator)
    tokens[:, 4:] = -100  # padding
    return TensorDataset(x, y, tokens, torch.arange(64))


class _Losses(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = nn.Linear(8, 4)
        self.tokens = nn.Linear(8, 6 * 4)
        self.log_vars = nn.Parameter(torch.zeros(2))

    def training_step(self, batch, batch_idx):
        x, y, tokens, _ = batch
        logits = self.net(x)
        kind = self.kind
        if kind == "plain":
            return F.cross_entropy(logits, y)
        if kind == "weighted_smoothed":
            return F.cross_entropy(logits, y, weight=torch.tensor([0.5, 1.0, 2.0, 1.5]), label_smoothing=0.1)
        if kind == "mixup":
            lam, perm = 0.3, torch.randperm(len(y))
            mixed = self.net(lam * x + (1 - lam) * x[perm])
            return lam * F.cross_entropy(mixed, y) + (1 - lam) * F.cross_entropy(mixed, y[perm])
        if kind == "weighted_huber":
            weights = torch.rand(len(y)) + 0.1
            return (F.huber_loss(logits[:, 0], y.float(), reduction="none") * weights).mean()
        if kind == "multitask":
            s = self.log_vars
            ce, mse = F.cross_entropy(logits, y), F.mse_loss(logits[:, 1], y.float())
            return torch.exp(-s[0]) * ce + s[0] + torch.exp(-s[1]) * mse + s[1]
        if kind == "infonce":
            z1, z2 = F.normalize(logits, dim=1), F.normalize(self.net(x + 0.1), dim=1)
            return F.cross_entropy(z1 @ z2.T / 0.1, torch.arange(len(y)))
        if kind == "tokens":
            token_logits = self.tokens(x).view(-1, 6, 4)
            mean = F.cross_entropy(token_logits.reshape(-1, 4), tokens.reshape(-1), ignore_index=-100)
            per_token = F.cross_entropy(token_logits.transpose(1, 2), tokens, reduction="none")
            mask = (tokens != -100).float()
            return mean + (per_token * mask).sum() / mask.sum()
        if kind == "sum":
            return F.cross_entropy(logits, y, reduction="sum")
        if kind == "focal":
            ce = F.cross_entropy(logits, y, reduction="none")
            return ((1 - torch.exp(-ce)) ** 2 * ce).mean()
        # the same losses reduced by hand: the check reads only calls with reduction="none"
        if kind == "weighted_smoothed_none":
            weight = torch.tensor([0.5, 1.0, 2.0, 1.5])
            return F.cross_entropy(logits, y, weight=weight, label_smoothing=0.1, reduction="none").mean()
        if kind == "mixup_none":
            lam, perm = 0.3, torch.randperm(len(y))
            mixed = self.net(lam * x + (1 - lam) * x[perm])
            ce_y, ce_perm = (F.cross_entropy(mixed, t, reduction="none") for t in (y, y[perm]))
            return (lam * ce_y + (1 - lam) * ce_perm).mean()
        if kind == "sum_none":
            return F.cross_entropy(logits, y, reduction="none").sum()
        ce = F.cross_entropy(logits, y, reduction="none")
        # both signs, in the losses' order: only the easiest samples are pushed up
        if kind == "mean_std":
            return ce.mean() + ce.std()
        if kind == "flooding":  # per-sample flooding; its first losses lie on both sides of 1.4
            return (ce - 1.4).abs().mean()
        if kind == "softmax_weighted":
            return (F.softmax(ce / 0.5, dim=0) * ce).sum()
        # both signs across the losses' order
        if kind == "vrex":  # V-REx: the variance of two environments' (the batch's halves') mean losses
            risks = torch.stack([ce[: len(y) // 2].mean(), ce[len(y) // 2 :].mean()])
            return risks.mean() + 10 * risks.var()
        if kind == "nnpu":  # a PU loss: the negative-class loss of the positives (first half) subtracted
            negative = F.binary_cross_entropy_with_logits(logits[:, 0], torch.zeros(len(y)), reduction="none")
            return negative[len(y) // 2 :].mean() - 0.3 * negative[: len(y) // 2].mean()
        # REINFORCE with batch-normalised advantages: each sample's term is ce_i * advantage_i
        actions = torch.distributions.Categorical(logits=logits.detach()).sample()
        reward = (actions == y).float()
        advantage = (reward - reward.mean()) / (reward.std() + 1e-8)
        terms = F.cross_entropy(logits, actions, reduction="none") * advantage
        return {"loss": terms.mean(), "per_sample_loss": terms.detach()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit_losses(kind: str, **replay) -> tuple[pl.Trainer, HardSampleReplay]:
    pl.seed_everything(0, verbose=False)
    callback = HardSampleReplay(**{"mode": "batch", **replay})  # every epoch trains all 64 samples' steps
    trainer = pl.Trainer(max_epochs=2, callbacks=[callback], **trainer_kwargs())
    trainer.fit(_Losses(kind), DataLoader(_data(), batch_size=16, shuffle=True))
    return trainer, callback


@pytest.mark.parametrize(
    "kind, call",
    [
        ("reinforce", "cross_entropy"),
        ("vrex", "cross_entropy"),
        ("nnpu", "binary_cross_entropy_with_logits"),
    ],
)
def test_a_reinforce_loss_is_refused_at_the_first_step_naming_the_signed_coefficients_and_the_ways_out(
    kind, call
):
    # held-out sweep: `(F.cross_entropy(logits, a, reduction="none") * adv).mean()` was scored by the
    # unweighted cross-entropy (rank correlation -0.4 with each sample's own term), with no word; a variance
    # penalty across groups and a PU loss push some samples up that are harder than some pushed down too
    with pytest.raises(PulseRefusal) as refusal:
        _fit_losses(kind)
    message = str(refusal.value)
    assert message.startswith("HardSampleReplay cannot score the samples of step 0's loss")
    for named in (
        f"{call}(reduction='none')",
        "an element it pushes up has a loss of",
        "both signs that do not follow the samples' losses",
        "policy-gradient advantages",
        "a variance penalty across groups",
        "a PU loss",
        "does not rank how hard a sample is",
        "scorer=",
        "OutputKeyScorer",
        "rule='random'",
    ):
        assert named in message


@pytest.mark.parametrize(
    "replay", [dict(rule="random"), dict(scorer=OutputKeyScorer())], ids=["random", "scorer"]
)
def test_the_ways_out_the_signed_coefficients_refusal_names_train(replay):
    trainer, callback = _fit_losses("reinforce", **replay)
    assert trainer.current_epoch == 2 and callback.metrics()["replay_fraction"] < 1.0


@pytest.mark.parametrize(
    "kind",
    [
        "plain",
        "weighted_smoothed",
        "mixup",
        "weighted_huber",
        "multitask",
        "infonce",
        "tokens",
        "sum",
        "focal",
        "weighted_smoothed_none",
        "mixup_none",
        "sum_none",
    ],
)
def test_losses_whose_samples_enter_with_positive_coefficients_are_not_refused(kind):
    trainer, callback = _fit_losses(kind)
    assert trainer.current_epoch == 2 and callback.table.seen == 64


@pytest.mark.parametrize("kind", ["mean_std", "flooding", "softmax_weighted"])
def test_losses_that_push_up_only_their_easiest_samples_are_not_refused(kind):
    # a review: these were refused for their coefficients of both signs, though ranking by the unweighted
    # loss agrees with the loss that trains (each coefficient grows with the sample's loss)
    trainer, callback = _fit_losses(kind)
    assert trainer.current_epoch == 2 and callback.table.seen == 64


def test_signed_coefficients_reads_the_gradient_each_call_already_added_up():
    # sample i's margin for its class is 3 - i: losses grow with i
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    logits = torch.zeros(6, 3)
    logits[torch.arange(6), y] = 3.0 - torch.arange(6.0)
    logits.requires_grad_(True)
    for coefficients, signed in [
        (torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]), True),  # the hardest pushed up
        (torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0, 2.0]), False),  # only the easiest pushed up, in order
        (torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 3.0]), False),  # weights, some zero
        (torch.zeros(6), False),  # equal rewards: nothing to tell
    ]:
        capture = LossCapture(batch_size=6)
        with capture:
            loss = (F.cross_entropy(logits, y, reduction="none") * coefficients).mean()
        assert capture.signed_coefficients() is None  # no backward yet: nothing read
        loss.backward()
        found = capture.signed_coefficients()
        assert (found is not None) is signed, coefficients
        if signed:
            assert found.startswith("cross_entropy(reduction='none')")
            # sample 5's loss (pushed up) against sample 0's (pushed down)
            losses = F.cross_entropy(logits.detach(), y, reduction="none")
            assert f"pushes up has a loss of {losses[5]:.3g}, one it pushes down {losses[0]:.3g}" in found
