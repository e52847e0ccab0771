"""HardSampleReplay on losses over a batch's packed rows (a graph batch's nodes, packed sequences' tokens:
``(N, .)`` with ``N != B``), which a held-out sweep found scored wrong or refused by chance: a packed-row term
next to a per-sample one was left out as a weight penalty whenever ``N % B != 0``, and a node-level loss on a
batch with no tensor of ``B`` rows was blamed on a collate_fn that drops samples, never refused."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_pulse import HardSampleReplay
from lightning_pulse.core.per_sample_loss import LossCapture, OutputKeyScorer
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

B = 4


# ---------------------------------------------------------------- a packed-row term next to a per-sample one
def _packed_batch(lengths: list[int], seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(sum(lengths), 6, generator=generator)
    seq_id = torch.cat([torch.full((n,), k) for k, n in enumerate(lengths)])
    return {
        "tokens": tokens,
        "seq_id": seq_id,
        "y": torch.randint(0, 2, (len(lengths),), generator=generator),
    }


class _PackedSequences(nn.Module):
    """A per-sequence CE ``(B,)`` plus a per-token reconstruction MSE over the ``N`` packed rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.dec, self.head = nn.Linear(6, 16), nn.Linear(16, 6), nn.Linear(16, 2)

    def forward(self, batch: dict) -> torch.Tensor:
        h = torch.relu(self.enc(batch["tokens"]))
        count = len(batch["y"])
        sums = torch.zeros(count, 16).index_add_(0, batch["seq_id"], h)
        pooled = sums / torch.bincount(batch["seq_id"], minlength=count)[:, None]
        return F.cross_entropy(self.head(pooled), batch["y"]) + F.mse_loss(self.dec(h), batch["tokens"])


@pytest.mark.parametrize("lengths", [[9, 8, 9, 7], [7, 7, 7, 7]], ids=["N%B=1", "N%B=0"])
def test_a_term_on_packed_rows_makes_the_step_unsplittable_whatever_its_row_count(lengths):
    # held-out sweep: with 33 packed tokens for 4 sequences the MSE over them was left out as a weight penalty
    # (the score was the CE alone); with 28 the same module was refused
    batch = _packed_batch(lengths)
    with LossCapture(batch_size=B, batch=batch) as capture:
        _PackedSequences()(batch)
    assert not capture.maps_onto_batch
    with pytest.raises(PulseRefusal, match=r"found no per-sample loss.*mse_loss.*set `scorer=`"):
        capture.require()


class _PackedModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _PackedSequences()

    def training_step(self, batch, batch_idx):
        return self.model(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Items(Dataset):
    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def _sequences() -> list:
    generator = torch.Generator().manual_seed(1)
    lengths = [9, 8, 9, 7] + [int(torch.randint(3, 12, (1,), generator=generator)) for _ in range(28)]
    return [(torch.randn(n, 6, generator=generator), int(k % 2)) for k, n in enumerate(lengths)]


def _pack(items: list) -> dict:
    return {
        "tokens": torch.cat([tokens for tokens, _ in items]),
        "seq_id": torch.cat([torch.full((len(tokens),), k) for k, (tokens, _) in enumerate(items)]),
        "y": torch.tensor([label for _, label in items]),
    }


def test_a_fit_whose_first_batch_packs_rows_not_a_multiple_of_b_is_refused_at_its_first_step():
    # the first batch holds 33 tokens for 4 sequences: it trained, scored by the CE term alone, with no word
    trainer = pl.Trainer(max_epochs=2, callbacks=[HardSampleReplay()], **trainer_kwargs())
    loader = DataLoader(_Items(_sequences()), batch_size=B, shuffle=False, collate_fn=_pack)
    with pytest.raises(
        PulseRefusal, match=r"mse_loss.*its 33 rows are computed from a batch tensor of 33 rows"
    ):
        trainer.fit(_PackedModule(), loader)
    assert trainer.global_step == 0  # before any update


class _DeepDistilled(pl.LightningModule):
    """A per-sequence CE ``(B,)`` plus a per-token distillation MSE over the ``N`` packed rows, after
    ``depth`` layers; its target is a teacher's output, not a batch tensor, so only a walk down to the first
    layer's input finds that its rows are the batch's."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.dec, self.head = nn.Linear(6, 8), nn.Linear(8, 6), nn.Linear(8, 2)
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(depth)))
        self.teacher = nn.Linear(6, 6).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        h = self.body(self.enc(batch["tokens"]))
        count = len(batch["y"])
        sums = torch.zeros(count, 8).index_add_(0, batch["seq_id"], h)
        pooled = sums / torch.bincount(batch["seq_id"], minlength=count)[:, None]
        with torch.no_grad():
            teacher = torch.tanh(self.teacher(batch["tokens"]))
        return F.cross_entropy(self.head(pooled), batch["y"]) + F.mse_loss(self.dec(h), teacher)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("depth", [2, 500])
def test_a_packed_row_term_is_refused_at_the_first_step_however_deep_the_model(depth):
    # sweep: the walk for a batch tensor stopped at 2000 autograd nodes (some 25 Llama layers) and took the
    # distillation term for a weight penalty: 500 layers trained, scored by the CE alone, with no word
    trainer = pl.Trainer(max_epochs=1, callbacks=[HardSampleReplay()], **trainer_kwargs())
    loader = DataLoader(_Items(_sequences()), batch_size=B, shuffle=False, collate_fn=_pack)
    with pytest.raises(
        PulseRefusal, match=r"mse_loss.*its 33 rows are computed from a batch tensor of 33 rows"
    ):
        trainer.fit(_DeepDistilled(depth), loader)
    assert trainer.global_step == 0  # before any update


class _Penalized(nn.Module):
    """A CE on ``(B, D)`` features next to a penalty that is not on the batch's rows."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.router = nn.Linear(6, 16), nn.Linear(16, 2), nn.Linear(16, 6)
        self.register_buffer("prior", torch.randn(7, 6))
        self.kind = kind

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(batch["x"]))
        logits = self.head(h)
        if self.kind == "load balancing":
            # a mixture of experts' router load over E=6 experts, computed from the batch's rows
            load = self.router(h).softmax(-1).mean(0)
            penalty = F.mse_loss(load, torch.full_like(load, 1 / 6))
        elif self.kind == "weight":
            # a penalty on 7 rows of a weight, as many as a batch tensor's
            penalty = F.mse_loss(self.body.weight[:7] * 2, torch.zeros(7, 6))
        else:
            # a term on a constant table of the module's own, of 7 rows: not the batch's
            penalty = F.mse_loss(self.body(self.prior), torch.zeros(7, 16))
        return F.cross_entropy(logits, batch["y"]) + penalty, logits


@pytest.mark.parametrize("kind", ["load balancing", "weight", "constant table"])
def test_terms_not_computed_on_the_batchs_rows_are_still_left_out_as_penalties(kind):
    generator = torch.Generator().manual_seed(0)
    # a packed tensor of 7 rows beside the samples: the penalties' row counts match a batch tensor's
    batch = {
        "x": torch.randn(B, 6, generator=generator),
        "y": torch.randint(0, 2, (B,), generator=generator),
        "extra": torch.randn(7, 3, generator=generator),
    }
    with LossCapture(batch_size=B, batch=batch) as capture:
        _, logits = _Penalized(kind)(batch)
    assert capture.maps_onto_batch
    assert torch.allclose(
        capture.per_sample(), F.cross_entropy(logits, batch["y"], reduction="none").detach()
    )


# ---------------------------------------------------------------- graphs with a node-level loss only
def _graphs(count: int = 32) -> list:
    generator = torch.Generator().manual_seed(1)
    graphs = []
    for _ in range(count):
        nodes = int(torch.randint(2, 10, (1,), generator=generator))
        x = torch.randn(nodes, 8, generator=generator)
        graphs.append((x, torch.randint(0, nodes, (2, 2 * nodes), generator=generator), (x[:, 0] > 0).long()))
    return graphs


def _join(items: list) -> dict:
    """Nodes concatenated, edges offset, node labels and a node-to-graph vector: no tensor of ``B`` rows."""
    offset, edges = 0, []
    for x, edge_index, _ in items:
        edges.append(edge_index + offset)
        offset += len(x)
    return {
        "x": torch.cat([x for x, _, _ in items]),
        "edge_index": torch.cat(edges, 1),
        "y": torch.cat([y for _, _, y in items]),
        "batch": torch.cat([torch.full((len(x),), k) for k, (x, _, _) in enumerate(items)]),
    }


class _NodeClassifier(pl.LightningModule):
    def __init__(self, per_graph: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.message, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 2)
        self.per_graph = per_graph
        self.true: list[tuple[torch.Tensor, torch.Tensor]] = []  # (node-to-graph vector, per-graph loss)

    def training_step(self, batch, batch_idx):
        h = torch.relu(self.lin(batch["x"]))
        source, target = batch["edge_index"]
        logits = self.out(torch.relu(h + torch.zeros_like(h).index_add_(0, target, self.message(h)[source])))
        loss = F.cross_entropy(logits, batch["y"])
        if not self.per_graph:
            return loss
        # the way out the refusal names: each graph's mean node loss, read by OutputKeyScorer
        per_node = F.cross_entropy(logits, batch["y"], reduction="none").detach()
        graphs = int(batch["batch"].max()) + 1
        counts = torch.bincount(batch["batch"], minlength=graphs)
        per_graph = torch.zeros(graphs).index_add_(0, batch["batch"], per_node) / counts
        return {"loss": loss, "per_sample_loss": per_graph}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # frozen: the true per-graph losses stay put


def _fit_nodes(module: _NodeClassifier, replay: HardSampleReplay) -> pl.Trainer:
    trainer = pl.Trainer(max_epochs=2, callbacks=[replay], **trainer_kwargs())
    loader = DataLoader(_Items(_graphs()), batch_size=B, shuffle=False, collate_fn=_join)
    trainer.fit(module, loader)
    return trainer


def test_a_node_level_loss_on_a_graph_batch_is_refused_at_the_first_step_naming_a_per_graph_scorer():
    # held-out sweep: the warning blamed "a collate_fn that drops samples" (the batch holds more rows than
    # indices), advised stand-in samples, and every step trained unscored on an unchosen half of the data
    trainer = None
    with pytest.raises(PulseRefusal) as refused:
        trainer = _fit_nodes(_NodeClassifier(), HardSampleReplay())
    message = str(refused.value)
    assert trainer is None
    assert "found no per-sample loss" in message and "more rows than samples (packed rows" in message
    assert "set `scorer=`" in message and "OutputKeyScorer" in message and "index_add_" in message
    assert "drops samples" not in message and "stand-in" not in message


def test_the_per_graph_scorer_the_refusal_names_scores_each_graphs_mean_node_loss():
    module = _NodeClassifier(per_graph=True)
    replay = HardSampleReplay(scorer=OutputKeyScorer("per_sample_loss"))
    trainer = _fit_nodes(module, replay)
    assert trainer.global_step > 0
    # the frozen model's per-graph losses, computed here in dataset order
    with torch.no_grad():
        expected = torch.cat(
            [module.training_step(_join(_graphs()[k : k + B]), 0)["per_sample_loss"] for k in range(0, 32, B)]
        )
    scores = torch.as_tensor(replay.table.scores, dtype=torch.float32)
    scored = ~torch.isnan(scores)
    assert scored.sum() >= 16
    assert torch.allclose(scores[scored], expected[scored], atol=1e-5)


def test_batch_mode_refuses_a_graph_batch_with_no_tensor_of_b_rows_before_any_cut():
    # it was taken for a batch a collate_fn dropped samples from, never checked for a cut, and trained
    trainer = None
    with pytest.raises(PulseRefusal, match=r"cannot cut a batch of 4 samples in mode='batch'.*mode='steps'"):
        trainer = _fit_nodes(
            _NodeClassifier(per_graph=True),
            HardSampleReplay(mode="batch", scorer=OutputKeyScorer("per_sample_loss")),
        )
    assert trainer is None


# ---------------------------------------------------------------- sequences packed as HF packs them
V = 11


def _token_sequences(count: int = 32) -> list:
    generator = torch.Generator().manual_seed(2)
    lengths = [9, 8, 9, 7] + [int(torch.randint(3, 12, (1,), generator=generator)) for _ in range(count - 4)]
    return [(torch.randint(0, V, (n,), generator=generator), k % 2) for k, n in enumerate(lengths)]


def _flatten(items: list) -> dict:
    """HF's ``DataCollatorWithFlattening``: the sequences joined into one row, each ``(1, T)``."""
    ids = torch.cat([tokens for tokens, _ in items])[None]
    positions = torch.cat([torch.arange(len(tokens)) for tokens, _ in items])[None]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def _flatten_with_lengths(items: list) -> dict:
    """The same with flash-attention's ``cu_seq_lens`` and ``max_length`` (``return_flash_attn_kwargs``)."""
    batch = _flatten(items)
    lengths = torch.tensor([len(tokens) for tokens, _ in items])
    batch["cu_seq_lens"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    batch["max_length"] = int(lengths.max())
    return batch


def _flat_1d(items: list) -> dict:
    """1-D tokens next to ``cu_seqlens`` (flash-attention's varlen layout); the model reads ``ids[None]``."""
    batch = _flatten_with_lengths(items)
    return {
        "input_ids": batch["input_ids"][0],
        "labels": batch["labels"][0],
        "cu_seqlens": batch["cu_seq_lens"],
    }


class _PackedLM(pl.LightningModule):
    """A next-token CE over packed tokens, computed as HF's causal-LM loss is (``(1, T, V)`` logits viewed as
    ``(T, V)``, the labels shifted into a new tensor by a pad and a slice); with ``per_sequence``, plus a CE
    of each sequence's mean hidden state; with ``score``, each sequence's mean token
    loss for an OutputKeyScorer."""

    def __init__(self, per_sequence: bool = False, score: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lm, self.head = nn.Embedding(V, 16), nn.Linear(16, V), nn.Linear(16, 2)
        self.per_sequence, self.score = per_sequence, score

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"] if batch["input_ids"].dim() == 2 else batch["input_ids"][None]
        labels = batch["labels"].reshape(1, -1)
        if "position_ids" in batch:
            sequence = (batch["position_ids"][0] == 0).cumsum(0) - 1
        else:
            bounds = batch["cu_seqlens"]
            sequence = torch.repeat_interleave(torch.arange(len(bounds) - 1), bounds.diff())
        h = self.emb(ids)
        logits = self.lm(h)
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        per_token = F.cross_entropy(logits.view(-1, V), shifted.reshape(-1), reduction="none")
        loss = per_token.sum() / (shifted != -100).sum()
        if self.per_sequence:
            count = int(sequence.max()) + 1
            pooled = torch.zeros(count, 16).index_add_(0, sequence, h[0])
            pooled = pooled / torch.bincount(sequence, minlength=count)[:, None]
            loss = loss + F.cross_entropy(self.head(pooled), batch["y"])
        if not self.score:
            return loss
        kept = (shifted.reshape(-1) != -100).float()
        count = int(sequence.max()) + 1
        sums = torch.zeros(count).index_add_(0, sequence, per_token.detach() * kept)
        return {"loss": loss, "per_sample_loss": sums / torch.zeros(count).index_add_(0, sequence, kept)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _with_labels(collate):
    def joined(items: list) -> dict:
        return {**collate(items), "y": torch.tensor([label for _, label in items])}

    return joined


@pytest.mark.parametrize(
    "collate", [_with_labels(_flatten), _with_labels(_flat_1d)], ids=["(1, T)", "1-D, read as ids[None]"]
)
def test_a_token_term_on_sequences_packed_as_hf_packs_them_makes_the_step_unsplittable(collate):
    # held-out review: HF's layouts kept the token term a penalty (the (1, T) leaves were counted as 1 row;
    # the 1-D ids were read through a (1, T) view, and the labels shifted into new storage), so the first step
    # (33 tokens for 4 sequences) was scored by the per-sequence CE alone
    batch = collate(_token_sequences()[:B])
    with LossCapture(batch_size=B, batch=batch) as capture:
        _PackedLM(per_sequence=True).training_step(batch, 0)
    assert [record.shape for record in capture.records] == [(33,), (B,)]
    assert not capture.maps_onto_batch
    assert "computed from a batch tensor of 33 rows" in capture.records[0].why_not


def test_a_fit_on_hf_packed_rows_with_a_per_sequence_term_is_refused_at_its_first_step():
    trainer = pl.Trainer(max_epochs=2, callbacks=[HardSampleReplay()], **trainer_kwargs())
    loader = DataLoader(_Items(_token_sequences()), batch_size=B, collate_fn=_with_labels(_flatten))
    with pytest.raises(PulseRefusal, match=r"cross_entropy.*its 33 rows are computed from a batch tensor"):
        trainer.fit(_PackedLM(per_sequence=True), loader)
    assert trainer.global_step == 0


def test_a_next_token_term_shifted_across_packed_rows_is_unsplittable():
    # `logits[:-1]` against `ids[1:]` over 34 packed tokens: 33 rows, which no batch tensor holds
    generator = torch.Generator().manual_seed(0)
    seq_id = torch.cat([torch.full((n,), k) for k, n in enumerate([9, 8, 9, 8])])
    batch = {
        "ids": torch.randint(0, V, (34,), generator=generator),
        "seq_id": seq_id,
        "y": torch.arange(B) % 2,
    }
    torch.manual_seed(0)
    emb, lm, head = nn.Embedding(V, 16), nn.Linear(16, V), nn.Linear(16, 2)
    for target in ("slice of the batch", "copy"):
        with LossCapture(batch_size=B, batch=batch) as capture:
            h = emb(batch["ids"])
            pooled = torch.zeros(B, 16).index_add_(0, seq_id, h) / torch.bincount(seq_id)[:, None]
            shifted = batch["ids"][1:] if target == "slice of the batch" else batch["ids"][1:].clone()
            (F.cross_entropy(head(pooled), batch["y"]) + F.cross_entropy(lm(h)[:-1], shifted)).backward()
        assert not capture.maps_onto_batch, target
        assert capture.records[1].shape == (33,)


def test_a_walk_that_finds_no_batch_tensor_runs_once_per_call_site_over_a_fit(monkeypatch):
    # a term whose row count matches a batch tensor's but that reads a copy of it: the walk finds nothing and
    # walks the whole graph (ms per call); its verdict is kept for the call site, not walked again each step
    from lightning_pulse.core import per_sample_loss
    from lightning_pulse.core.per_sample_loss import StepLossCaptures

    walks = []
    reads = per_sample_loss._reads
    monkeypatch.setattr(
        per_sample_loss, "_reads", lambda *args, **kwargs: walks.append(1) or reads(*args, **kwargs)
    )
    model = _PackedSequences()
    captures = StepLossCaptures()
    captures.start()
    try:
        for step, lengths in enumerate([[9, 8, 9, 7], [9, 8, 9, 7], [7, 8, 9, 9], [5, 8, 9, 7]]):
            batch = _packed_batch(lengths, seed=step)
            x = (batch["tokens"] - batch["tokens"].mean(0)) / batch["tokens"].std(0)  # standardized: a copy
            captures.open(B, batch=batch)
            h = torch.relu(model.enc(x))
            sums = torch.zeros(B, 16).index_add_(0, batch["seq_id"], h)
            pooled = sums / torch.bincount(batch["seq_id"], minlength=B)[:, None]
            F.cross_entropy(model.head(pooled), batch["y"]) + F.mse_loss(model.dec(h), x)
            captures.close()
            assert captures.closed is not None and captures.closed.maps_onto_batch  # not detected: documented
    finally:
        captures.release()
    assert len(walks) == 1


# ---------------------------------------------------------------- HF-packed batches with a token loss only
@pytest.mark.parametrize(
    "collate", [_flatten, _flatten_with_lengths], ids=["all (1, T)", "position_ids restart"]
)
def test_sequences_packed_into_one_row_are_refused_at_the_first_step_naming_a_per_sequence_scorer(collate):
    # held-out review: HF's DataCollatorWithFlattening batches (one row for 4 indices) were blamed on "a
    # collate_fn that drops samples", with stand-in samples as the way out, and every step trained unscored
    trainer = pl.Trainer(max_epochs=2, callbacks=[HardSampleReplay()], **trainer_kwargs())
    loader = DataLoader(_Items(_token_sequences()), batch_size=B, collate_fn=collate)
    with pytest.raises(PulseRefusal) as refused:
        trainer.fit(_PackedLM(), loader)
    message = str(refused.value)
    assert trainer.global_step == 0
    assert "holds 33 rows for the 4 dataset indices" in message and "more rows than samples" in message
    assert "set `scorer=`" in message and "position_ids" in message
    assert "drops samples" not in message and "stand-in" not in message


@pytest.mark.parametrize("collate", [_flatten, _flat_1d], ids=["(1, T)", "1-D"])
def test_the_per_sequence_scorer_trains_and_scores_packed_sequences(collate):
    replay = HardSampleReplay(scorer=OutputKeyScorer("per_sample_loss"))
    trainer = pl.Trainer(max_epochs=2, callbacks=[replay], **trainer_kwargs())
    loader = DataLoader(_Items(_token_sequences()), batch_size=B, collate_fn=collate)
    trainer.fit(_PackedLM(score=True), loader)
    assert trainer.global_step > 0 and replay.batches.unscored_steps == 0
    assert replay.metrics()["table_seen"] >= 32


@pytest.mark.parametrize("collate", [_flatten, _flat_1d], ids=["(1, T)", "1-D"])
def test_batch_mode_refuses_packed_sequences_naming_steps_mode_and_a_scorer(collate):
    # batch mode named mode='steps' alone (1-D), where a second refusal then named `scorer=`; the (1, T)
    # layout trained with every step unscored
    trainer = pl.Trainer(max_epochs=2, callbacks=[HardSampleReplay(mode="batch")], **trainer_kwargs())
    loader = DataLoader(_Items(_token_sequences()), batch_size=B, collate_fn=collate)
    with pytest.raises(PulseRefusal) as refused:
        trainer.fit(_PackedLM(), loader)
    message = str(refused.value)
    assert trainer.global_step == 0
    assert "mode='steps'" in message and "33 packed rows" in message and "set `scorer=`" in message
