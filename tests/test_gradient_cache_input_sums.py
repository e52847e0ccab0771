"""The activation cache's check of each replay's input (per-row sums noted when recording): optional
arguments, shared tensors, time-major keyword inputs, the dtype of the sums and what they cost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pulse.core.activation_cache import PrefixActivationCache, print_dtype, print_tolerance


def _drive(
    cache: PrefixActivationCache, batches: list[torch.Tensor], forward, epochs: int
) -> list[torch.Tensor]:
    """Run ``forward(indices)`` for each batch of sample ``indices`` in order, ``epochs`` times, keyed by
    the cache; the outputs, in order."""
    outputs = []
    for _ in range(epochs):
        for indices in batches:
            cache.begin_batch(indices)
            outputs.append(forward(indices))
            cache.end_batch()
    return outputs


def _gpt2(padded_share: float):
    """A 3-layer GPT-2 from config (sdpa, no dropout), frozen; 48 samples of 16 tokens, the first
    ``padded_share`` of them padded at the end; 6 batches of 8 with padded and unpadded samples mixed
    differently each epoch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=3,
        n_head=4,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).train().requires_grad_(False)
    samples, length = 48, 16
    ids = torch.randint(0, 64, (samples, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(samples, length, dtype=torch.long)
    for sample in range(int(samples * padded_share)):
        mask[sample, length - 1 - sample % 5 :] = 0
    return model, ids, mask


def test_an_attention_mask_passed_only_for_batches_with_padding_keeps_the_gpt2_cache_replaying():
    # review of the input check: Hugging Face models pass a block the attention mask as None for a batch
    # without padding and as a tensor for one with padding; the check fixed at the first recording which
    # arguments held rows, so the next batch of the other kind switched the cache off (GPT-2: 0 of 24
    # batches replayed, 17 before the check). Sums are now kept per argument, compared where both exist.
    model, ids, mask = _gpt2(padded_share=0.25)
    units = ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1"]
    orders = [torch.randperm(48, generator=torch.Generator().manual_seed(epoch)) for epoch in range(4)]
    batches = [order[k : k + 8] for order in orders for k in range(0, 48, 8)]

    positions = torch.arange(16).expand(48, 16)  # broadcast (stride 0): wpe then gives a row per sample

    def forward(indices, attention_mask=mask):
        return model(
            input_ids=ids[indices], attention_mask=attention_mask[indices], position_ids=positions[indices]
        ).logits

    plain = [forward(indices) for indices in batches]
    with_mask = [(mask[indices] == 0).any() for indices in batches]
    # both kinds of batch, so the mask comes and goes: the first batch is recorded without one, and its
    # samples are replayed in batches with one later
    assert not with_mask[0] and any(with_mask[6:])
    cache = PrefixActivationCache(capacity=48, dataset_size=48, budget_bytes=2**26)
    cache.plan([(name, model.get_submodule(name)) for name in units])
    cached = _drive(cache, batches, forward, epochs=1)
    assert cache.disabled_reason is None and [e.name for e in cache.entries] == units
    assert cache.hits >= 12  # every batch after the first epoch (and its one verifying batch)
    for got, expected in zip(cached, plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    # the mask is still compared where a sample was recorded with one: masking more of a sample is seen
    changed = mask.clone()
    changed[0, 10:] = 0
    padded_batch = next(indices for indices in batches if (indices == 0).any())
    before = cache.hits
    assert cache.begin_batch(padded_batch) == "hit"
    got = forward(padded_batch, changed)
    cache.end_batch()
    assert cache.hits == before and "the input of transformer.h.0 differs" in cache.disabled_reason
    torch.testing.assert_close(got, forward(padded_batch, changed), rtol=0, atol=0)


class PositionBlock(nn.Module):
    """A frozen block that adds a position embedding of a tensor of positions shared by the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.positions = nn.Embedding(32, 16)

    def forward(self, x, pos):
        return self.lin(x + self.positions(pos))


@pytest.mark.parametrize(
    ("samples", "positions"),
    [
        (33, torch.arange(8)[None]),  # (1, T): the last batch of every epoch has 1 row
        (32, torch.arange(8)),  # (T,) with T equal to the batch size
    ],
    ids=["(1, T) with a batch of one row", "(T,) with T equal to the batch size"],
)
def test_a_tensor_shared_by_the_batch_whose_size_matches_the_rows_keeps_the_cache_replaying(
    samples, positions
):
    # review of the input check: a shared position tensor was taken as one row per sample where its size
    # matched the batch's rows, and the cache switched off within an epoch (0 of 20 batches replayed)
    torch.manual_seed(0)
    block, head = PositionBlock().requires_grad_(False), nn.Linear(16, 2)
    data = torch.randn(samples, 8, 16)
    orders = [torch.randperm(samples, generator=torch.Generator().manual_seed(epoch)) for epoch in range(4)]
    batches = [order[k : k + 8] for order in orders for k in range(0, samples, 8)]

    def forward(indices):
        return head(block(data[indices], pos=positions))

    plain = [forward(indices) for indices in batches]
    cache = PrefixActivationCache(capacity=samples, dataset_size=samples, budget_bytes=2**24)
    cache.plan([("block", block)])
    cached = _drive(cache, batches, forward, epochs=1)
    assert cache.disabled_reason is None and cache.hits >= 10
    for got, expected in zip(cached, plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


class TimeMajorLSTM(nn.Module):
    """An LSTM over a time-major ``(T, B, F)`` input that returns its output batch-first."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16)

    def forward(self, x):
        return self.rnn(x)[0].transpose(0, 1)


def test_a_time_major_input_passed_by_keyword_that_changes_after_the_check_switches_the_cache_off():
    # review of the input check: the axis of the samples came from positional tensors only, so a time-major
    # input passed as x= was compared on its time axis (not the batch's): a transform started after the
    # cache's check was replayed stale (17 of 24 batches)
    torch.manual_seed(0)
    lstm = TimeMajorLSTM().requires_grad_(False)
    data = torch.randn(10, 24, 8)
    batches = [torch.arange(k, k + 8) for k in range(0, 24, 8)]
    cache = PrefixActivationCache(capacity=24, dataset_size=24, budget_bytes=2**24)
    cache.plan([("lstm", lstm)])
    _drive(cache, batches, lambda indices: lstm(x=data[:, indices]), epochs=2)  # record, verify, replay
    assert cache.hits == 2 and cache.disabled_reason is None
    scaled = data[:, batches[0]] * 1.5
    assert cache.begin_batch(batches[0]) == "hit"
    got = lstm(x=scaled)
    cache.end_batch()
    assert cache.hits == 2 and "the input of lstm differs" in cache.disabled_reason
    torch.testing.assert_close(got, lstm(x=scaled), rtol=0, atol=0)


def test_the_input_sums_are_float64_but_float32_on_mps_which_has_no_float64():
    # review of the input check: the sums were float64 on every device, and MPS has none (a crash at the
    # first recording on Apple silicon); float32 there, with a tolerance that grows with the values summed
    assert print_dtype(torch.device("cpu")) == torch.float64
    assert print_dtype(torch.device("cuda", 0)) == torch.float64
    assert print_dtype(torch.device("mps")) == torch.float32
    assert print_tolerance(torch.float64, 4096) == (1e-6, 1e-6)
    rtol, atol = print_tolerance(torch.float32, 4096)
    assert rtol == 1e-4 and atol == pytest.approx(4096e-6)
    # float32 sums of one input in two accumulation orders stay within it; noise of 1% of the values does not
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4096, generator=generator)
    forward_sum, reverse_sum = values.sum(), values.flip(0).cumsum(0)[-1]
    assert not torch.equal(forward_sum, reverse_sum)  # the order moved the float32 rounding
    assert torch.allclose(forward_sum, reverse_sum, rtol=rtol, atol=atol)
    noisy_sum = (values + 0.01 * torch.randn(4096, generator=generator)).sum()
    assert not torch.allclose(forward_sum, noisy_sum, rtol=rtol, atol=atol)


def test_the_input_sums_count_in_the_budget_and_their_weights_belong_to_the_cache():
    # review of the input check: the per-sample sums took memory outside activation_cache_mb, and their
    # pseudo-random weights lived in a module-level dict shared by every cache of the process
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    data = torch.randn(6, 4)
    cache = PrefixActivationCache(capacity=6, dataset_size=6, budget_bytes=2**20)
    cache.plan([("0", model[0])])
    _drive(cache, [torch.tensor([4, 1, 3])], lambda indices: model(data[indices]), epochs=3)
    assert cache.hits == 1
    assert cache.bytes_used == 6 * 8 * 4 + 6 * 2 * 8  # the outputs (float32) and two float64 sums per sample
    assert list(cache._print_weights) == [(4, torch.device("cpu"), torch.float64)]
    # a budget that holds the outputs but not their sums too leaves the module out, saying so
    small = PrefixActivationCache(capacity=6, dataset_size=6, budget_bytes=6 * 8 * 4 + 8)
    small.plan([("0", model[0])])
    _drive(small, [torch.tensor([4, 1, 3])], lambda indices: model(data[indices]), epochs=1)
    assert small.entries == [] and "its outputs (and input sums) for 6 samples" in small.uncached["0"]
