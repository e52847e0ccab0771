"""Per-sample loss capture: exact values and gradients for the caller, correct per-sample figures."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pulse.core import per_sample_loss
from lightning_pulse.core.per_sample_loss import (
    ForwardLossScorer,
    LossCapture,
    OutputKeyScorer,
    PerSampleScorer,
    concat_per_sample,
    loss_capture_scope,
    per_sample_from_unreduced,
)
from lightning_pulse.core.selection import infobatch_prune
from lightning_pulse.errors import PulseRefusal


def _logits_and_targets(batch=8, classes=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, classes, generator=generator, requires_grad=True)
    targets = torch.randint(0, classes, (batch,), generator=generator)
    return logits, targets


@pytest.mark.parametrize("ignored", [False, True], ids=["all-targets", "ignored-targets"])
@pytest.mark.parametrize("shape", [(8, 5), (96, 40)], ids=["classes", "tokens"])
def test_caller_gets_the_same_loss_value_and_gradient_bit_for_bit(shape, ignored):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(*shape, generator=generator, requires_grad=True)
    targets = torch.randint(0, shape[1], (shape[0],), generator=generator)
    if ignored:
        targets[::5] = -100
    plain = F.cross_entropy(logits, targets)
    (plain_grad,) = torch.autograd.grad(plain, logits)
    capture = LossCapture(batch_size=8)
    with capture:
        captured = F.cross_entropy(logits, targets)
    (captured_grad,) = torch.autograd.grad(captured, logits)
    assert torch.equal(plain, captured)
    assert torch.equal(plain_grad, captured_grad)
    expected = F.cross_entropy(logits, targets, reduction="none").detach().reshape(8, -1)
    valid = (targets != -100).reshape(8, -1)
    expected = torch.where(valid.any(1), (expected * valid).sum(1) / valid.sum(1), 0.0)  # nothing counted: 0
    assert torch.allclose(capture.per_sample(), expected)
    assert capture.per_sample().requires_grad is False


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("cross_entropy", {"label_smoothing": 0.1, "weight": torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])}),
        ("nll_loss", {"ignore_index": 2}),
        ("mse_loss", {}),
        ("kl_div", {"reduction": "batchmean"}),
        ("binary_cross_entropy_with_logits", {"reduction": "sum"}),
    ],
)
def test_sample_weights_of_one_give_torchs_own_reduction(name, kwargs):
    logits, targets = _logits_and_targets()
    if name in ("mse_loss", "kl_div", "binary_cross_entropy_with_logits"):
        targets = torch.softmax(torch.randn(8, 5), dim=1)

    def inputs():
        return torch.log_softmax(logits, dim=1) if name in ("nll_loss", "kl_div") else logits

    plain = getattr(F, name)(inputs(), targets, **kwargs)
    with LossCapture(batch_size=8, sample_weights=torch.ones(8)):
        captured = getattr(F, name)(inputs(), targets, **kwargs)
    assert captured.item() == pytest.approx(plain.item(), rel=1e-6)
    (plain_grad,) = torch.autograd.grad(plain, logits)
    (captured_grad,) = torch.autograd.grad(captured, logits)
    assert torch.allclose(plain_grad, captured_grad, rtol=1e-5, atol=1e-8)


def _every_loss_call(batch=6, classes=5):
    """One call of each captured loss with the options that change its reduction (class weights, ignored
    targets, label smoothing, pos_weight, a broadcast variance, ...): ``(name, kwargs, names of the inputs)``."""
    g = torch.Generator().manual_seed(0)
    x, p = torch.randn(batch, classes, generator=g), torch.rand(batch, classes, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    y[1] = -100
    w, sign = torch.rand(classes, generator=g) + 0.5, torch.ones(batch, classes)
    sign[::2] = -1
    soft = torch.softmax(torch.randn(batch, classes, generator=g), -1)
    return [
        ("cross_entropy", dict(input=x, target=y, weight=w, label_smoothing=0.1), ("input",)),
        ("cross_entropy", dict(input=x, target=y, label_smoothing=0.2), ("input",)),
        ("cross_entropy", dict(input=x, target=soft, label_smoothing=0.1), ("input",)),
        (
            "cross_entropy",
            dict(
                input=torch.randn(batch, classes, 7), target=torch.randint(0, classes, (batch, 7)), weight=w
            ),
            ("input",),
        ),
        ("nll_loss", dict(input=torch.log_softmax(x, -1), target=y, weight=w), ("input",)),
        ("binary_cross_entropy", dict(input=torch.sigmoid(x), target=p, weight=p + 0.1), ("input",)),
        ("binary_cross_entropy_with_logits", dict(input=x, target=p, pos_weight=w), ("input",)),
        ("mse_loss", dict(input=x, target=p), ("input",)),
        ("l1_loss", dict(input=x, target=p), ("input",)),
        ("smooth_l1_loss", dict(input=x, target=p, beta=0.5), ("input",)),
        ("huber_loss", dict(input=x, target=p, delta=0.5), ("input",)),
        ("kl_div", dict(input=torch.log_softmax(x, -1), target=soft), ("input",)),
        ("poisson_nll_loss", dict(input=x, target=p), ("input",)),
        ("gaussian_nll_loss", dict(input=x, target=p, var=p[:, :1] + 0.1), ("input",)),
        ("soft_margin_loss", dict(input=x, target=sign), ("input",)),
        ("multilabel_soft_margin_loss", dict(input=x, target=(p > 0.5).float(), weight=w), ("input",)),
        (
            "multilabel_margin_loss",
            dict(input=x, target=torch.tensor([[1, 2, -1, 0, 0]] * batch)),
            ("input",),
        ),
        ("multi_margin_loss", dict(input=x, target=y.clamp(min=0), weight=w), ("input",)),
        ("hinge_embedding_loss", dict(input=x, target=sign), ("input",)),
        (
            "margin_ranking_loss",
            dict(input1=x[:, 0], input2=x[:, 1], target=sign[:, 0]),
            ("input1", "input2"),
        ),
        ("cosine_embedding_loss", dict(input1=x, input2=p, target=sign[:, 0]), ("input1", "input2")),
        ("triplet_margin_loss", dict(anchor=x, positive=p, negative=soft), ("anchor", "positive")),
        ("triplet_margin_with_distance_loss", dict(anchor=x, positive=p, negative=soft), ("anchor",)),
    ]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_large_inputs_are_evaluated_once_and_reduced_as_torch_reduces_them(monkeypatch, reduction):
    # every loss takes the one-evaluation path here, as a language model's logits would
    monkeypatch.setattr(per_sample_loss, "SINGLE_PASS_ELEMENTS", 0)
    for name, kwargs, inputs in _every_loss_call():

        def call(name=name, kwargs=kwargs, inputs=inputs):
            loss = getattr(F, name)  # looked up at the call, as a module does: patched while capturing
            leaves = {
                k: v.clone().requires_grad_(k in inputs) if torch.is_tensor(v) else v
                for k, v in kwargs.items()
            }
            return loss(**leaves, reduction=reduction), [leaves[k] for k in inputs]

        plain, plain_inputs = call()
        with LossCapture(batch_size=6) as capture:
            captured, captured_inputs = call()
        torch.testing.assert_close(captured, plain, rtol=1e-6, atol=1e-7, msg=name)
        plain_grads = torch.autograd.grad(plain, plain_inputs)
        for got, want in zip(torch.autograd.grad(captured, captured_inputs), plain_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
        # the per-sample losses are those of the second-evaluation path, bit for bit
        monkeypatch.setattr(per_sample_loss, "SINGLE_PASS_ELEMENTS", 1 << 60)
        with LossCapture(batch_size=6) as reference:
            call()
        monkeypatch.setattr(per_sample_loss, "SINGLE_PASS_ELEMENTS", 0)
        got, want = capture.per_sample(), reference.per_sample()
        assert got is not None and torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)), name


def test_a_language_models_loss_is_one_pass_over_its_logits():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountLogSoftmax(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._log_softmax.default:
                CountLogSoftmax.calls += 1
            return func(*args, **(kwargs or {}))

    tokens, vocab = 4 * 64, 4100  # (B*T, V) logits of just over SINGLE_PASS_ELEMENTS
    assert tokens * vocab >= per_sample_loss.SINGLE_PASS_ELEMENTS
    logits = torch.randn(tokens, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    targets[::7] = -100
    plain = F.cross_entropy(logits, targets)
    with LossCapture(batch_size=4) as capture, CountLogSoftmax():
        captured = F.cross_entropy(logits, targets)
    assert CountLogSoftmax.calls == 1  # it was two: the caller's call and the capture's unreduced one
    torch.testing.assert_close(captured, plain, rtol=1e-6, atol=1e-7)
    per_token = F.cross_entropy(logits.detach(), targets, reduction="none").reshape(4, 64)
    valid = (targets != -100).reshape(4, 64)
    torch.testing.assert_close(capture.per_sample(), (per_token * valid).sum(1) / valid.sum(1))


def test_patch_exists_only_while_a_capture_is_active():
    original = F.cross_entropy
    with LossCapture(batch_size=2):
        assert F.cross_entropy is not original
    assert F.cross_entropy is original
    with loss_capture_scope():
        patched = F.cross_entropy
        assert patched is not original
        # outside a capture the patched function passes straight through
        logits, targets = _logits_and_targets()
        assert torch.equal(patched(logits, targets), original(logits, targets))
    assert F.cross_entropy is original


def test_nn_loss_modules_are_captured():
    logits, targets = _logits_and_targets()
    regression_input, regression_target = torch.randn(8, 3), torch.randn(8, 3)
    capture = LossCapture(batch_size=8)
    with capture:
        nn.CrossEntropyLoss()(logits, targets)
        nn.MSELoss()(regression_input, regression_target)
    names = [record.name for record in capture.records]
    assert names == ["cross_entropy", "mse_loss"]
    expected = F.cross_entropy(logits, targets, reduction="none").detach() + (
        (regression_input - regression_target) ** 2
    ).mean(dim=1)
    assert torch.allclose(capture.per_sample(), expected)


@pytest.mark.parametrize(
    ("name", "make", "expected"),
    [
        ("mse_loss", lambda a, b: F.mse_loss(a, b), lambda a, b: ((a - b) ** 2).mean(1)),
        ("l1_loss", lambda a, b: F.l1_loss(a, b, reduction="sum"), lambda a, b: (a - b).abs().mean(1)),
        (
            "smooth_l1_loss",
            lambda a, b: F.smooth_l1_loss(a, b),
            lambda a, b: F.smooth_l1_loss(a, b, reduction="none").mean(1),
        ),
        (
            "binary_cross_entropy_with_logits",
            lambda a, b: F.binary_cross_entropy_with_logits(a, b.sigmoid()),
            lambda a, b: F.binary_cross_entropy_with_logits(a, b.sigmoid(), reduction="none").mean(1),
        ),
        (
            "kl_div",
            lambda a, b: F.kl_div(a.log_softmax(1), b.softmax(1), reduction="batchmean"),
            lambda a, b: F.kl_div(a.log_softmax(1), b.softmax(1), reduction="none").sum(1),
        ),
    ],
)
def test_per_sample_loss_is_the_mean_of_each_samples_elements(name, make, expected):
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    capture = LossCapture(batch_size=6)
    with capture:
        make(a, b)
    assert capture.records[0].name == name
    assert torch.allclose(capture.per_sample(), expected(a, b), atol=1e-6)


def test_a_batchmean_kl_scores_each_samples_share_on_flattened_and_batch_first_inputs_alike():
    # batchmean divides the sum by the input's first dimension: B*T on flattened (B*T, V) token logits, where
    # each sample's share is its sum over T (it was its whole sum: the KL counted T times beside another term)
    batch, time, vocab = 3, 4, 5
    generator = torch.Generator().manual_seed(4)

    def capture(flat: bool) -> tuple[LossCapture, torch.Tensor]:
        student = torch.randn(batch, time, vocab, generator=generator).log_softmax(-1)
        teacher = torch.randn(batch, time, vocab, generator=generator).softmax(-1)
        sums = F.kl_div(student, teacher, reduction="none").sum((1, 2))
        taken = LossCapture(batch_size=batch)
        with taken:
            if flat:
                F.kl_div(student.reshape(-1, vocab), teacher.reshape(-1, vocab), reduction="batchmean")
            else:
                F.kl_div(student, teacher, reduction="batchmean")
        return taken, sums / time if flat else sums

    captures, expected = zip(*(capture(flat) for flat in (True, False, True)))
    for taken, share in zip(captures, expected):
        assert torch.allclose(taken.per_sample(), share, rtol=1e-6)
    # steps joined into one pass only where their input rows per sample agree (same elements per sample here)
    captures, expected = zip(*(capture(flat) for flat in (True, False, True, True)))
    joined = concat_per_sample(list(captures))
    assert np.allclose(joined, torch.cat(expected).numpy(), rtol=1e-6)
    captures, expected = zip(*(capture(True) for _ in range(2)))
    assert np.allclose(concat_per_sample(list(captures)), torch.cat(expected).numpy(), rtol=1e-6)


def test_token_losses_average_each_samples_own_tokens_and_skip_ignored_ones():
    batch, time, vocab = 3, 5, 7
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, time, vocab, generator=generator)
    targets = torch.randint(0, vocab, (batch, time), generator=generator)
    targets[0, :2] = -100  # two ignored tokens in sample 0
    targets[2, :] = -100  # sample 2 has no counted token at all
    class_weight = torch.rand(vocab, generator=generator) + 0.5
    capture = LossCapture(batch_size=batch)
    with capture:
        reduced = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), weight=class_weight)
    per_token = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="none").reshape(
        batch, time
    )
    valid = targets != -100
    weights = class_weight[targets.clamp_min(0)] * valid
    expected_0 = (per_token[0] * weights[0]).sum() / weights[0].sum()
    expected_1 = (per_token[1] * weights[1]).sum() / weights[1].sum()
    per_sample = capture.per_sample()
    assert torch.allclose(per_sample[:2], torch.stack([expected_0, expected_1]), atol=1e-6)
    assert per_sample[2] == 0  # no counted token: it adds nothing to the loss, the easiest sample
    assert torch.isfinite(reduced)


def test_sample_weights_reweight_the_loss_exactly_as_the_caller_reduces_it():
    batch, time, vocab = 4, 3, 6
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(batch * time, vocab, generator=generator, requires_grad=True)
    targets = torch.randint(0, vocab, (batch * time,), generator=generator)
    targets[1] = -100
    class_weight = torch.rand(vocab, generator=generator) + 0.5
    kwargs = dict(weight=class_weight, label_smoothing=0.05)
    with LossCapture(batch_size=batch, sample_weights=torch.ones(batch)):
        ones = F.cross_entropy(logits, targets, **kwargs)
    assert torch.allclose(ones, F.cross_entropy(logits, targets, **kwargs), rtol=1e-6)

    sample_weights = torch.tensor([2.0, 0.5, 1.0, 3.0])
    with LossCapture(batch_size=batch, sample_weights=sample_weights):
        weighted = F.cross_entropy(logits, targets, **kwargs)
    unreduced = F.cross_entropy(logits, targets, reduction="none", **kwargs).reshape(batch, time)
    counted = (class_weight[targets.clamp_min(0)] * (targets != -100)).sum()
    expected = (unreduced * sample_weights[:, None]).sum() / counted
    assert torch.allclose(weighted, expected, rtol=1e-6)
    (grad,) = torch.autograd.grad(weighted, logits)
    assert grad.abs().sum() > 0


_INFOBATCH_LOSSES = {
    "mean": lambda logits, targets: F.cross_entropy(logits, targets),
    "sum": lambda logits, targets: F.cross_entropy(logits, targets, reduction="sum"),
    "sum of elements": lambda logits, targets: F.mse_loss(
        logits, F.one_hot(targets, 5).float(), reduction="sum"
    ),
    "batchmean": lambda logits, targets: F.kl_div(
        torch.log_softmax(logits, dim=1), F.one_hot(targets, 5).float() * 0.8 + 0.04, reduction="batchmean"
    ),
    # the module reduces it: the weights assume a mean over the samples it got (a sum cannot be told apart)
    "none, then mean": lambda logits, targets: F.cross_entropy(logits, targets, reduction="none").mean(),
    "none, then a per-sample sum's mean": lambda logits, targets: (
        F.mse_loss(logits, F.one_hot(targets, 5).float(), reduction="none").sum(dim=1).mean()
    ),
}


@pytest.mark.parametrize("loss", list(_INFOBATCH_LOSSES))
def test_infobatch_weights_make_each_reduction_an_unbiased_estimate_of_the_offered_batchs_loss(loss):
    # held-out sweep: the weights carry k/n (kept over offered), right for a mean over the k kept samples, and
    # a reduction="sum" loss got it too: 0.76x the offered batch's sum at r=0.5, a learning rate cut by 0.75
    compute = _INFOBATCH_LOSSES[loss]
    n, ratio = 8, 0.5
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(n, 5, generator=generator, requires_grad=True)
    targets = torch.randint(0, 5, (n,), generator=generator)
    scores = F.cross_entropy(logits, targets, reduction="none").detach()
    threshold = float(scores.mean())
    below = int((scores < threshold).sum())
    # the expectation over the draws, exactly: every distinct outcome, weighted by its probability
    outcomes = {}
    draws = torch.Generator().manual_seed(1)
    while len(outcomes) < 2**below:
        selection = infobatch_prune(scores, threshold, ratio, draws)
        outcomes[tuple(selection.positions.tolist())] = selection
    value, grad = torch.zeros(()), torch.zeros_like(logits)
    for selection in outcomes.values():
        kept = selection.positions
        with LossCapture(batch_size=selection.count, sample_weights=selection.weights, offered=n):
            estimate = compute(logits[kept], targets[kept])
        dropped = n - selection.count
        probability = ratio**dropped * (1 - ratio) ** (below - dropped)
        value += probability * estimate.detach()
        grad += probability * torch.autograd.grad(estimate, logits)[0]
    full = compute(logits, targets)
    assert torch.allclose(grad, torch.autograd.grad(full, logits)[0], rtol=1e-4, atol=1e-6)
    if not loss.startswith("none"):  # a reduced loss is weighted in its value too
        assert value.item() == pytest.approx(full.item(), rel=1e-5)


@pytest.mark.parametrize("use", ["focal", "linear", "linear-in-place", "token-focal"])
def test_sample_weights_of_an_unreduced_loss_weight_its_gradient_not_its_value(use):
    # held-out sweep: InfoBatch's weights multiplied the values a reduction="none" call returned, so a focal
    # loss computed its modulating factor from w * ce and trained on (1 - exp(-w ce))^2 w ce, up to 30% off
    batch, time = 6, 3 if use == "token-focal" else 1
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(batch * time, 5, generator=generator, requires_grad=True)
    targets = torch.randint(0, 5, (batch * time,), generator=generator)
    weights = torch.tensor([2.0, 0.5, 1.0, 3.0, 1.5, 0.25])
    user_weights = torch.rand(batch * time, generator=generator)  # a per-sample weight of the module's own

    def reduce(ce: torch.Tensor) -> torch.Tensor:
        if use == "linear":
            return (ce * user_weights).mean()
        if use == "linear-in-place":
            return ce.mul_(user_weights).mean()
        return ((1 - torch.exp(-ce)) ** 2 * ce).mean()  # focal, gamma 2

    capture = LossCapture(batch_size=batch, sample_weights=weights)
    with capture:
        ce = F.cross_entropy(logits, targets, reduction="none")
    true_ce = F.cross_entropy(logits, targets, reduction="none")
    assert torch.equal(ce, true_ce)  # the module sees the true losses
    (grad,) = torch.autograd.grad(reduce(ce), logits)
    # the reference: each sample's term of the module's loss, weighted (sum_i w_i f(ce_i), here its mean)
    per_element = weights.repeat_interleave(time)
    terms = {
        "focal": lambda c: (1 - torch.exp(-c)) ** 2 * c,
        "token-focal": lambda c: (1 - torch.exp(-c)) ** 2 * c,
        "linear": lambda c: c * user_weights,
        "linear-in-place": lambda c: c * user_weights,
    }[use]
    reference = (per_element * terms(F.cross_entropy(logits, targets, reduction="none"))).mean()
    (expected,) = torch.autograd.grad(reference, logits)
    assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-7)
    # the scores stay the unweighted losses
    assert torch.allclose(capture.per_sample(), true_ce.detach().reshape(batch, time).mean(1))


def test_legacy_and_positional_reduction_arguments_are_honoured():
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    capture = LossCapture(batch_size=4)
    with capture, pytest.warns(UserWarning, match="size_average"):
        summed = F.mse_loss(a, b, size_average=False)
    with capture:
        positional = F.mse_loss(a, b, None, None, "sum")
    assert torch.allclose(summed, ((a - b) ** 2).sum())
    assert torch.allclose(positional, summed)
    assert [record.reduction for record in capture.records] == ["sum", "sum"]


def test_unreduced_caller_result_is_used_as_is():
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    capture = LossCapture(batch_size=4)
    with capture:
        result = F.l1_loss(a, b, reduction="none")
    assert result.shape == (4, 3)
    assert torch.allclose(capture.per_sample(), (a - b).abs().mean(1))


def test_per_sample_losses_read_later_ignore_what_the_caller_did_to_its_result():
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    capture = LossCapture(batch_size=4)
    with capture:
        result = F.l1_loss(a, b, reduction="none")
        result.mul_(0.0)  # e.g. masking in place; the per-sample losses are read after the step
    assert capture.records[0].maps_onto_batch
    assert torch.allclose(capture.per_sample(), (a - b).abs().mean(1))


def test_several_steps_split_together_equal_each_step_split_alone():
    generator = torch.Generator().manual_seed(0)

    def step(kind, batch):
        capture = LossCapture(batch_size=batch)
        with capture:
            if kind == "tokens":  # (B*T, V) logits, (B, T) targets with ignored tokens
                logits = torch.randn(batch * 5, 7, generator=generator)
                targets = torch.randint(0, 7, (batch, 5), generator=generator)
                targets[0, :2] = -100
                F.cross_entropy(logits, targets.reshape(-1))
            elif kind == "classes":
                targets = torch.randint(0, 4, (batch,), generator=generator)
                targets[-1] = -100  # an ignored sample scores 0
                F.cross_entropy(torch.randn(batch, 4, generator=generator), targets)
            else:
                F.mse_loss(torch.randn(batch, 3, generator=generator), torch.zeros(batch, 3))
        return capture

    for kinds in (["tokens"] * 3, ["classes"] * 4, ["classes", "tokens", "mse"]):
        captures = [step(kind, batch) for kind, batch in zip(kinds, [4, 6, 3, 5])]
        together = concat_per_sample(captures)
        alone = torch.cat([capture.per_sample() for capture in captures]).numpy()
        assert together.shape == alone.shape
        np.testing.assert_allclose(together, alone, rtol=1e-6, equal_nan=True)
        if "classes" in kinds:
            assert (together == 0).sum() == kinds.count("classes") and not np.isnan(together).any()


def test_a_loss_that_does_not_split_into_the_batch_is_reported_not_guessed():
    capture = LossCapture(batch_size=4)
    with capture:
        F.mse_loss(torch.randn(7), torch.randn(7))
    assert capture.per_sample() is None
    assert "does not split" in capture.describe()
    assert "none of the losses it captures was called" in LossCapture(batch_size=4).describe()


def test_other_threads_are_not_captured():
    capture = LossCapture(batch_size=8)
    logits, targets = _logits_and_targets()

    def other_thread():
        F.cross_entropy(logits, targets)

    with capture:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert capture.records == []


def test_nested_captures_go_to_the_innermost():
    outer, inner = LossCapture(batch_size=8), LossCapture(batch_size=8)
    logits, targets = _logits_and_targets()
    with outer:
        F.cross_entropy(logits, targets)
        with inner:
            F.cross_entropy(logits, targets)
    assert len(outer.records) == 1 and len(inner.records) == 1


def test_per_sample_from_unreduced_splits_flattened_tokens_row_major():
    unreduced = torch.arange(6.0)  # (B*T,) with B=2, T=3
    assert torch.equal(per_sample_from_unreduced(unreduced, 2), torch.tensor([1.0, 4.0]))
    assert per_sample_from_unreduced(unreduced, 4) is None


def test_bad_capture_arguments_fail_with_the_field_name():
    with pytest.raises(ValueError, match="batch_size"):
        LossCapture(batch_size=0)
    with pytest.raises(ValueError, match="sample_weights"):
        LossCapture(batch_size=3, sample_weights=torch.ones(2))
    with pytest.raises(ValueError, match="offered"):
        LossCapture(batch_size=3, sample_weights=torch.ones(3), offered=2)
    with pytest.raises(ValueError, match="loss"):
        ForwardLossScorer(loss="hinge")
    with pytest.raises(ValueError, match="key"):
        OutputKeyScorer(key="")


class _TinyClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)


def test_forward_loss_scorer_runs_a_gradient_free_eval_pass_without_touching_rng():
    module = _TinyClassifier().train()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    state = torch.get_rng_state()
    scores = ForwardLossScorer()(module, [x, y], None, batch_size=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert module.training and module.net[1].training
    module.eval()
    assert torch.allclose(scores, F.cross_entropy(module(x), y, reduction="none").detach())


def test_output_key_scorer_reads_the_modules_own_per_sample_losses():
    losses = torch.tensor([0.5, 1.5, 2.5])
    scores = OutputKeyScorer("per_sample")(
        None, None, {"loss": losses.mean(), "per_sample": losses}, batch_size=3
    )
    assert torch.equal(scores, losses)
    with pytest.raises(ValueError, match="per_sample"):
        OutputKeyScorer("per_sample")(None, None, {"loss": losses.mean()}, batch_size=3)


def test_scorer_losses_are_detached_and_their_count_checked():
    class Doubling(PerSampleScorer):
        def __call__(self, pl_module, batch, outputs, batch_size):
            return batch * 2

    batch = torch.arange(3.0, requires_grad=True)
    losses = Doubling().score(None, batch, None, batch_size=3)
    assert losses.tolist() == [0.0, 2.0, 4.0] and not losses.requires_grad
    with pytest.raises(RuntimeError, match="returned 3 losses for a batch of 4"):
        Doubling().score(None, batch, None, batch_size=4)


def test_a_contrastive_loss_over_views_is_not_cut_into_samples():
    # held-out sweep: SimCLR's cross-entropy over a 2B x 2B similarity matrix (rows i and i+B are sample i's two
    # views) was cut into B runs of two rows, i.e. other samples' rows: scores uncorrelated with hardness (-0.005)
    batch = 8
    views = torch.randn(2 * batch, 16)
    similarity = views @ views.t()
    targets = torch.arange(2 * batch).roll(batch)
    with LossCapture(batch_size=batch) as capture:
        F.cross_entropy(similarity, targets)
    assert not capture.maps_onto_batch and capture.per_sample() is None
    assert "square 16 x 16 logit matrix over 2 views of each sample" in capture.describe()
    with pytest.raises(PulseRefusal, match="contrastive loss computes.*scorer"):
        capture.require()
    # CLIP's B x B matrix has one row per sample, and an LM's (B*T) x V logits one run of T rows per sample
    with LossCapture(batch_size=batch) as clip:
        F.cross_entropy(similarity[:batch, :batch], torch.arange(batch))
    with LossCapture(batch_size=batch) as lm:
        F.cross_entropy(torch.randn(batch * 4, 50), torch.randint(0, 50, (batch * 4,)))
    assert clip.maps_onto_batch and lm.maps_onto_batch


def test_a_token_loss_whose_flattened_rows_equal_the_vocabulary_splits_a_square_matrix_over_views_does_not():
    # held-out sweep: a replay batch cut to 4 samples of 16 tokens over a vocabulary of 64 gives 64 x 64
    # logits, which were read as a contrastive matrix over 16 views of each sample: every cut step went
    # unscored (a byte-level LM, V=256, on 4 x 64 tokens hits it; with B*T = V in the whole batch the run was
    # refused)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 64)
    hidden = torch.randn(4, 16, 8)
    tokens = torch.randint(0, 64, (4, 16))
    with LossCapture(batch_size=4) as capture:
        F.cross_entropy(head(hidden).reshape(-1, 64), tokens.reshape(-1))
    assert capture.maps_onto_batch
    expected = F.cross_entropy(head(hidden).reshape(-1, 64), tokens.reshape(-1), reduction="none").view(4, 16)
    assert torch.allclose(capture.per_sample(), expected.mean(1).detach())
    # the same shape made as SimCLR makes it, from 16 views of each sample joined with torch.cat, is not cut
    views = F.normalize(torch.cat([head(hidden[:, view]) for view in range(16)]), dim=1)
    with LossCapture(batch_size=4) as capture:
        F.cross_entropy(views @ views.t() / 0.1, torch.arange(64).roll(4))
    assert not capture.maps_onto_batch
    assert "square 64 x 64 logit matrix over 16 views of each sample" in capture.describe()


def test_require_says_what_was_captured_when_nothing_splits_into_the_batch():
    logits, targets = _logits_and_targets(batch=8)
    with LossCapture(batch_size=8) as capture:
        F.cross_entropy(logits, targets)
    assert capture.require() is capture
    with LossCapture(batch_size=3) as other:
        F.cross_entropy(logits, targets)
    with pytest.raises(PulseRefusal, match=r"cross_entropy.*does not split.*scorer"):
        other.require()
    with pytest.raises(PulseRefusal, match="none of the losses it captures was called"):
        LossCapture(batch_size=3).require()


def test_numpy_and_torch_paths_give_the_same_per_sample_losses():
    from lightning_pulse.core.per_sample_loss import _per_sample_on_cpu, element_weights

    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4 * 6, 9, generator=generator)
    targets = torch.randint(0, 9, (4 * 6,), generator=generator)
    targets[:3] = -100
    for weight in (None, torch.rand(9, generator=generator) + 0.1):
        arguments = {"target": targets, "weight": weight, "ignore_index": -100}
        unreduced = F.cross_entropy(logits, targets, weight=weight, reduction="none")
        fast = _per_sample_on_cpu("cross_entropy", arguments, unreduced, 4, "mean")
        slow = per_sample_from_unreduced(unreduced, 4, element_weights("cross_entropy", arguments, unreduced))
        assert torch.allclose(fast, slow, atol=1e-6, equal_nan=True)


def test_a_compiled_functional_loss_is_captured_for_real_at_every_call():
    # torch.compile runs the patched F.cross_entropy eagerly, at a graph break: real tensors every call
    layer = nn.Linear(4, 3)
    step = torch.compile(lambda x, y: F.cross_entropy(layer(x), y), backend="aot_eager")
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    expected = F.cross_entropy(layer(x), y, reduction="none").detach()
    with loss_capture_scope():
        for _ in range(3):
            with LossCapture(batch_size=8) as capture:
                step(x, y)
            assert type(capture.records[0]._source[1]) is torch.Tensor
            torch.testing.assert_close(capture.per_sample(), expected)


def test_a_loss_module_traced_into_a_compiled_graph_is_said_not_recorded():
    # dynamo turns an nn.CrossEntropyLoss made inside forward (as HF BERT does) into a graph node: the capture
    # saw the tracer's tensors once (a compiled BERT then crashed reading them) and nothing after; now it
    # records nothing and says why
    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 3)

        def forward(self, x, y):
            return nn.CrossEntropyLoss()(self.layer(x), y)

    compiled = torch.compile(Classifier(), backend="aot_eager")
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    captures = [LossCapture(batch_size=8) for _ in range(2)]
    with loss_capture_scope():
        for capture in captures:
            with capture:
                compiled(x, y).backward()
            assert not capture.records and not capture.maps_onto_batch
    # the first call compiles, and its capture says what happened (HardSampleReplay refuses at that step)
    with pytest.raises(PulseRefusal, match=r"cross_entropy was traced into a torch.compile graph"):
        captures[0].require()


def test_rows_picked_by_a_mask_do_not_split_into_samples_but_one_picked_row_per_sample_does():
    # `logits[mask]` (labelled tokens only) gives samples different numbers of rows; when their count happened
    # to be a multiple of B, they were cut into B equal runs and scored on other samples' tokens (held-out sweep)
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 10, requires_grad=True)
    labels = torch.randint(0, 10, (4, 6))
    lengths = torch.tensor([1, 3, 2, 2])  # 8 labelled tokens: a multiple of B = 4
    mask = torch.arange(6)[None, :] < lengths[:, None]
    with LossCapture(batch_size=4) as capture:
        F.cross_entropy(logits[mask], labels[mask])
        F.cross_entropy(logits[mask].float().view(-1, 10), labels[mask])  # through a cast and a view
    assert [record.maps_onto_batch for record in capture.records] == [False, False]
    assert "picked by an index or a mask" in capture.describe()
    # one row per sample, in order (a sequence classifier pooling the last real token, as HF GPT-2 does)
    last = lengths - 1
    with LossCapture(batch_size=4) as capture:
        F.cross_entropy(logits[torch.arange(4), last], labels[torch.arange(4), last])
        F.cross_entropy(logits.reshape(-1, 10), labels.reshape(-1))  # all tokens: a reshape of the batch
    assert [record.maps_onto_batch for record in capture.records] == [True, True]
    expected = F.cross_entropy(logits[torch.arange(4), last], labels[torch.arange(4), last], reduction="none")
    assert torch.allclose(capture.records[0].per_sample, expected.detach())


def test_rows_split_into_samples_only_when_they_flatten_the_batch_sample_by_sample():
    # held-out sweep: two augmented views concatenated (2B rows), SimCLR's NT-Xent and repeats were cut into B
    # runs of consecutive rows, giving each sample other samples' rows (rank correlation with the truth ~0)
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 10)
    features = torch.randn(4, 3, 6, requires_grad=True)
    labels = torch.randint(0, 10, (4, 3))
    view_1, view_2 = features[:, 0], features[:, 1]
    with LossCapture(batch_size=4) as capture:
        F.cross_entropy(head(torch.cat([view_1, view_2])), labels[:, :2].t().reshape(-1))  # view-major
        F.cross_entropy(head(view_1).repeat(2, 1), labels[:, 0].repeat(2))
        F.cross_entropy(head(features.transpose(0, 1).reshape(-1, 6)), labels.t().reshape(-1))  # time-major
    assert [record.maps_onto_batch for record in capture.records] == [False, False, False]
    assert "not a flattening of the batch's 4 samples" in capture.describe()
    with LossCapture(batch_size=4) as capture:
        F.cross_entropy(head(features).view(-1, 10), labels.view(-1))  # (B, T, V) flattened
        F.nll_loss(F.log_softmax(head(features.reshape(-1, 6)), -1), labels.reshape(-1))  # a head on (B*T, D)
        F.cross_entropy(
            head(features)[:, :-1].contiguous().view(-1, 10), labels[:, 1:].reshape(-1)
        )  # shifted
    assert [record.maps_onto_batch for record in capture.records] == [True, True, True]
    expected = (
        F.cross_entropy(head(features).view(-1, 10), labels.view(-1), reduction="none").view(4, 3).mean(1)
    )
    assert torch.allclose(capture.records[0].per_sample, expected.detach())


def test_a_term_on_the_batch_that_does_not_split_makes_the_step_unsplittable_a_weight_penalty_does_not():
    # held-out sweep: CE on the labelled rows (`logits[mask]`) + a consistency term on all rows was scored on the
    # consistency term alone (rank correlation 0.25 with the true losses), with no word
    torch.manual_seed(0)
    logits = torch.randn(4, 10, requires_grad=True)
    labels = torch.randint(0, 10, (4,))
    mask = torch.tensor([True, False, True, True])
    with LossCapture(batch_size=4) as capture:
        F.cross_entropy(logits[mask], labels[mask]) + 0.1 * F.mse_loss(logits, torch.zeros_like(logits))
    assert not capture.maps_onto_batch and "picked by an index or a mask" in capture.describe()
    weight = torch.randn(7, 3, requires_grad=True)  # a penalty on the weights: the same for every sample
    with LossCapture(batch_size=4) as capture:
        F.cross_entropy(logits, labels) + F.mse_loss(weight, torch.zeros_like(weight))
    assert capture.maps_onto_batch
    assert torch.allclose(capture.per_sample(), F.cross_entropy(logits, labels, reduction="none").detach())


def test_a_loss_it_does_not_capture_is_named_as_such_not_as_no_loss_at_all():
    # a held-out CTC model was refused with "no torch.nn.functional / torch.nn loss was called" after F.ctc_loss
    # (captured since); a loss written with tensor ops is the case now
    log_probs = torch.randn(4, 6).log_softmax(-1)
    targets = torch.randint(0, 6, (4,))
    with LossCapture(batch_size=4) as capture:
        -log_probs.gather(1, targets[:, None]).mean()
    assert capture.records == [] and "a loss written with tensor ops" in capture.describe()
    with pytest.raises(PulseRefusal, match="none of the losses it captures was called"):
        capture.require()


def _ctc_batch(batch_size=4, frames=12, classes=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(frames, batch_size, classes, generator=generator, requires_grad=True)
    target_lengths = torch.tensor([3, 5, 1, 4])[:batch_size]
    targets = torch.randint(1, classes, (int(target_lengths.sum()),), generator=generator)
    input_lengths = torch.full((batch_size,), frames, dtype=torch.long)
    return logits, targets, input_lengths, target_lengths


@pytest.mark.parametrize("single_pass", [False, True], ids=["two-calls", "single-pass"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ctc_loss_is_captured_per_sample_and_the_callers_loss_is_torchs(monkeypatch, reduction, single_pass):
    # held-out sweep: F.ctc_loss was not captured, so `ctc + 0.1 * cross_entropy` was scored on the small
    # cross-entropy term alone (rank correlation 0.165 with the samples' real losses)
    if single_pass:
        monkeypatch.setattr(per_sample_loss, "SINGLE_PASS_ELEMENTS", 0)
    logits, targets, input_lengths, target_lengths = _ctc_batch()
    log_probs = logits.log_softmax(-1)
    expected = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction=reduction)
    (expected_grad,) = torch.autograd.grad(expected, logits, retain_graph=True)
    capture = LossCapture(batch_size=4)
    with capture:
        loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction=reduction)
    unreduced = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction="none").detach()
    # "mean" averages each sample's loss divided by its target length: that share is the sample's score
    shares = unreduced / target_lengths if reduction == "mean" else unreduced
    torch.testing.assert_close(capture.per_sample(), shares)
    if single_pass:
        torch.testing.assert_close(loss, expected)
    else:
        assert torch.equal(loss, expected)  # the caller's own call, bit for bit
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(grad, expected_grad)


def test_a_ctc_loss_with_an_auxiliary_cross_entropy_is_scored_on_both_terms():
    logits, targets, input_lengths, target_lengths = _ctc_batch()
    head = torch.randn(4, 3, requires_grad=True)
    labels = torch.tensor([0, 2, 1, 1])
    capture = LossCapture(batch_size=4)
    with capture:
        ctc = F.ctc_loss(logits.log_softmax(-1), targets, input_lengths, target_lengths)
        loss = ctc + 0.1 * F.cross_entropy(head, labels)
    assert loss.requires_grad
    ctc_shares = F.ctc_loss(logits.log_softmax(-1), targets, input_lengths, target_lengths, reduction="none")
    cross_entropy = F.cross_entropy(head, labels, reduction="none")
    # a sum of captured terms is scored as their sum (the 0.1 weight is not seen: documented)
    torch.testing.assert_close(capture.per_sample(), (ctc_shares / target_lengths + cross_entropy).detach())


def test_each_term_counts_with_its_part_in_the_backpropagated_loss_and_logged_values_not_at_all():
    # held-out sweep: `ce + 0.1 * mse` was scored `ce + mse`, and an F.mse_loss computed only for logging next to
    # a hand-written loss was the whole score (rank correlation -0.69 with the samples' losses). The parts are
    # read by gradient hooks during the real backward: several backward calls add up (manual optimization), a
    # term scaled in place keeps its scale, and a term the caller reduces counts in the same units
    torch.manual_seed(0)
    logits = torch.randn(8, 4, requires_grad=True)
    aux = torch.randn(8, requires_grad=True)
    target = torch.randint(0, 4, (8,))
    per_token = F.cross_entropy(logits, target, reduction="none")
    expected = (per_token + 0.1 * (aux - target.float()) ** 2 + 0.5 * (aux - 1.0).abs()).detach()
    capture = LossCapture(batch_size=8)
    with capture:
        ce = F.cross_entropy(logits, target, reduction="none").mean()  # reduced by the caller
        mse = F.mse_loss(aux, target.float())
        mse *= 0.1  # scaled in place, after the call
        l1 = F.l1_loss(aux, torch.ones(8))
        F.smooth_l1_loss(aux, target.float())  # for self.log only
        F.huber_loss(aux.detach(), target.float())  # for self.log, without autograd
    (ce + mse).div(2).backward(retain_graph=True)  # Lightning divides by accumulate_grad_batches
    (0.25 * l1).backward()  # a second backward in the same step (manual optimization)
    capture.drop_unused()
    assert [r.maps_onto_batch for r in capture.records] == [True, True, True, False, False]
    assert "not part of the loss that is backpropagated" in capture.describe()
    assert torch.allclose(capture.per_sample(), expected, atol=1e-5)


@pytest.mark.parametrize("class_weighted", [False, True], ids=["ignored", "ignored-and-class-weighted"])
def test_a_summed_token_cross_entropy_counts_as_its_mean_times_what_the_mean_divides_by(class_weighted):
    # a "sum" next to another term counted as its element count times its per-sample means, which leave out
    # the -100 tokens and divide out the class weights: `ce_sum / counted` was weighed numel / counted times
    # `ce_mean`, the same loss. Each sample's padding differs here: both score its mean over its own tokens
    batch, time, classes = 4, 6, 5
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(batch * time, classes, generator=generator, requires_grad=True)
    targets = torch.randint(0, classes, (batch, time), generator=generator)
    targets[torch.arange(time) >= torch.tensor([[6], [4], [2], [1]])] = -100  # 6, 4, 2 and 1 tokens counted
    targets = targets.reshape(-1)
    weight = torch.linspace(0.5, 2.0, classes) if class_weighted else None
    counted = (targets != -100) * (1.0 if weight is None else weight[targets.clamp_min(0)])
    auxiliary = torch.randn(batch, requires_grad=True)
    scores = []
    for reduction in ("sum", "mean"):
        capture = LossCapture(batch_size=batch)
        with capture:
            ce = F.cross_entropy(logits, targets, weight=weight, reduction=reduction)
            ce = ce / counted.sum() if reduction == "sum" else ce
            loss = 0.5 * ce + 0.5 * F.mse_loss(auxiliary, torch.ones(batch))
        capture.watch_loss(loss)
        loss.backward()
        capture.drop_unused()
        scores.append(capture.per_sample())
    per_token = F.cross_entropy(logits, targets, weight=weight, reduction="none").detach().reshape(batch, -1)
    own_mean = per_token.sum(1) / counted.reshape(batch, -1).sum(1)
    expected = 0.5 * own_mean + 0.5 * (auxiliary.detach() - 1.0) ** 2
    torch.testing.assert_close(scores[0], expected)
    torch.testing.assert_close(scores[1], expected)


def test_a_loss_call_with_autograd_off_is_refused_naming_the_cause_and_its_ways_out():
    torch.manual_seed(0)
    logits = torch.randn(8, 4, requires_grad=True)
    target = torch.randint(0, 4, (8,))
    capture = LossCapture(batch_size=8)
    with capture:
        with torch.no_grad():  # as in a reentrant checkpoint's forward
            F.cross_entropy(logits, target)
    (logits**2).mean().backward()
    capture.drop_unused()
    assert capture.records[0].why_not == per_sample_loss.AUTOGRAD_OFF
    with pytest.raises(PulseRefusal, match="ran with autograd off") as refusal:
        capture.require()
    assert "use_reentrant=False" in str(refusal.value) and "`scorer=`" in str(refusal.value)
    mixed = LossCapture(
        batch_size=8
    )  # one call with autograd off, one logged with it on: the general refusal
    with mixed:
        with torch.no_grad():
            F.cross_entropy(logits, target)
        F.mse_loss(logits[:, 0], target.float())
    (logits**2).mean().backward()
    mixed.drop_unused()
    with pytest.raises(PulseRefusal, match="found no per-sample loss in training_step \\(captured"):
        mixed.require()


def test_a_single_logged_value_is_refused_and_a_single_loss_keeps_its_own_scale():
    torch.manual_seed(0)
    logits = torch.randn(8, 4, requires_grad=True)
    target = torch.randint(0, 4, (8,))
    capture = LossCapture(batch_size=8)
    with capture:
        F.mse_loss(logits.softmax(-1)[:, 0], target.float())  # logged only
    hand_written = -(torch.log_softmax(logits, -1) * F.one_hot(target, 4)).sum(1).mean()
    hand_written.backward()
    capture.drop_unused()
    with pytest.raises(PulseRefusal, match="not part of the loss that is backpropagated"):
        capture.require()
    single = LossCapture(batch_size=8)
    with single:
        ce = F.cross_entropy(logits, target)
    (3.0 * ce).backward()
    single.drop_unused()  # one call: its own per-sample losses, whatever its weight
    assert torch.allclose(single.per_sample(), F.cross_entropy(logits, target, reduction="none").detach())


def test_rows_of_pairs_or_triplets_picked_from_the_batch_do_not_split_rows_that_flatten_it_do():
    # held-out sweep: a ranking loss over all pairs of a batch of 9 (`s[i], s[j]` over torch.combinations,
    # 36 rows) was cut into 9 runs of 4 consecutive pairs, some not the sample's own: the checks read `input`
    # only, and the margin / embedding losses take `input1`, `input2` or `anchor`, `positive`, `negative`
    torch.manual_seed(0)
    scores = torch.randn(9, requires_grad=True)
    embeddings = torch.randn(9, 2, 5, requires_grad=True)
    first, second = torch.combinations(torch.arange(9), 2).unbind(1)
    sign = torch.sign(torch.randn(36))
    with LossCapture(batch_size=9) as capture:
        F.margin_ranking_loss(scores[first], scores[second], sign)
        F.cosine_embedding_loss(embeddings[first, 0], embeddings[second, 0], sign)
        mined = torch.randint(0, 9, (3, 18))  # 18 mined triplets: a multiple of B by chance
        F.triplet_margin_loss(*(embeddings[index, 0] for index in mined))
        F.triplet_margin_loss(*(embeddings[index, 0] for index in mined), reduction="none")
    assert [record.maps_onto_batch for record in capture.records] == [False] * 4
    assert "36 rows (`input1`, `input2`) were picked by an index" in capture.describe()
    assert "18 rows (`anchor`, `positive`, `negative`) were picked" in capture.describe()
    # each row is a sample's when one argument flattens the batch: a triplet's anchors `z.view(-1, D)` of
    # (B, 2, D), whatever picked the negatives; a margin loss on flattened scores against shuffled ones
    flat = embeddings.reshape(-1, 5)
    shuffled = torch.randperm(18)
    with LossCapture(batch_size=9) as capture:
        F.triplet_margin_loss(flat, flat.flip(0), flat[shuffled])
        F.margin_ranking_loss(flat.sum(1), flat.sum(1)[shuffled], sign[:18])
    assert [record.maps_onto_batch for record in capture.records] == [True, True]
    expected = F.triplet_margin_loss(flat, flat.flip(0), flat[shuffled], reduction="none").view(9, 2).mean(1)
    assert torch.allclose(capture.records[0].per_sample, expected.detach())


def test_a_loss_the_caller_reduces_over_a_padding_mask_scores_each_sample_on_its_own_tokens():
    # held-out sweep: `(ce * mask).sum() / mask.sum()` was scored as the mean over every position, pads
    # included (short sequences 24% high, up to 116% off). Each element now counts by its gradient (the
    # mask's)
    torch.manual_seed(0)
    batch, length, vocabulary = 4, 6, 7
    logits = torch.randn(batch * length, vocabulary, requires_grad=True)
    targets = torch.randint(0, vocabulary, (batch, length))
    targets[0, 0] = -100  # an ignored token inside the mask still does not count
    mask = (torch.arange(length)[None] < torch.tensor([6, 2, 4, 0])[:, None]).float()  # the last: all padding
    own = F.cross_entropy(logits, targets.view(-1), reduction="none").detach().view(batch, length)
    counted = mask * (targets != -100)
    masked_mean = torch.where(counted.sum(1) > 0, (own * counted).sum(1) / counted.sum(1).clamp_min(1), 0.0)

    def step(reduce):
        capture = LossCapture(batch_size=batch)
        with capture:
            ce = F.cross_entropy(logits, targets.view(-1), reduction="none").view(batch, length)
        reduce(ce).backward()
        capture.drop_unused()
        return capture

    masked, plain, zero = (
        lambda ce: (ce * mask).sum() / mask.sum(),
        lambda ce: ce.sum() / 23,
        lambda ce: 0 * ce.mean(),
    )
    plain_mean = own.sum(1) / (targets != -100).sum(1)  # a uniform gradient, or none that tells: as before
    assert torch.allclose(step(masked).per_sample(), masked_mean)
    assert torch.allclose(step(plain).per_sample(), plain_mean)
    together = concat_per_sample(
        [step(masked), step(zero), step(plain)]
    )  # the vectorized read of several steps
    np.testing.assert_allclose(together, torch.cat([masked_mean, plain_mean, plain_mean]).numpy(), rtol=1e-6)
    record = step(masked).records[0]  # the torch path (GPU, bf16) agrees
    weights = per_sample_loss.element_weights("cross_entropy", {"target": targets.view(-1)}, record.unreduced)
    on_device = per_sample_from_unreduced(
        record.unreduced, batch, weights, "none", record.element_grad(batch)
    )
    assert torch.allclose(on_device, masked_mean)


def _spiky_and_broad_errors(batch=16, pixels=256):
    # even samples: 1-4 pixels very wrong (~3), the rest right; odd samples: every pixel moderately wrong
    generator = torch.Generator().manual_seed(0)
    error = torch.rand(batch, pixels, generator=generator) * 0.05
    for sample in range(0, batch, 2):
        wrong = torch.randperm(pixels, generator=generator)[: 1 + sample // 4]
        error[sample, wrong] = 3 + torch.rand(1, generator=generator)
    error[1::2] += 0.8 + 0.05 * torch.arange(1, batch, 2, dtype=torch.float32)[:, None]
    return error


@pytest.mark.parametrize(
    "reduce",
    [
        lambda loss: loss[loss > 0.7].mean(),  # bootstrapped OHEM: a threshold on the loss
        lambda loss: F.relu(loss - 0.5).mean(),  # a margin: a threshold too
        lambda loss: loss.topk(loss.shape[1] // 4, dim=1).values.mean(),  # each sample's hardest quarter
        lambda loss: (loss**2).mean(),  # non-linear: harder elements get a larger gradient
        lambda loss: ((1 - torch.exp(-loss)) ** 2 * loss).mean(),  # focal
        lambda loss: loss.clamp(max=2.0).mean(),  # a truncated loss: the highest losses left out
    ],
    ids=["ohem-threshold", "relu-margin", "per-sample-topk", "squared", "focal", "clamp-max"],
)
def test_a_loss_the_caller_reduces_by_its_values_is_scored_by_the_plain_mean_of_each_sample(reduce):
    # held-out sweep: weighting each element by its gradient inverted the ranking of spiky samples (a few
    # pixels very wrong) and broadly wrong ones under these reductions (rank correlation with each sample's
    # part in the trained loss -0.61 / -0.61 / -0.25 / -0.54; the plain mean +1.00). The gradient is followed
    # only where it is a mask independent of the loss (padding)
    error = _spiky_and_broad_errors()
    prediction = error.clone().requires_grad_()
    with LossCapture(batch_size=16) as capture:
        pixel_loss = F.l1_loss(prediction, torch.zeros_like(error), reduction="none")
    reduce(pixel_loss).backward()
    capture.drop_unused()
    plain_mean = error.mean(1)
    assert torch.allclose(capture.per_sample(), plain_mean)  # the NumPy path (CPU)
    on_device = per_sample_from_unreduced(  # the torch path (GPU, bf16)
        capture.records[0].unreduced, 16, None, "none", capture.records[0].element_grad(16)
    )
    assert torch.allclose(on_device, plain_mean)
    # a mean over padding per sample, then over the batch, is a mask: each sample's own elements
    lengths = torch.tensor([256, 64, 128, 200] * 4)
    mask = (torch.arange(256)[None] < lengths[:, None]).float()
    with LossCapture(batch_size=16) as capture:
        pixel_loss = F.l1_loss(prediction, torch.zeros_like(error), reduction="none")
    ((pixel_loss * mask).sum(1) / mask.sum(1)).mean().backward()
    capture.drop_unused()
    assert torch.allclose(capture.per_sample(), (error * mask).sum(1) / lengths)


def _focal(loss):
    return (1 - torch.exp(-loss)) ** 2 * loss


@pytest.mark.parametrize(
    ("elements", "reduce"),
    [
        (lambda prediction, mask: prediction, lambda loss, mask: (_focal(loss) * mask).sum() / mask.sum()),
        (lambda prediction, mask: prediction * mask, lambda loss, mask: (loss * mask).sum() / mask.sum()),
    ],
    ids=["focal-over-padding", "zero-filled-pads"],
)
def test_a_mask_is_followed_whatever_the_loss_it_masks_and_whatever_loss_its_pads_have(elements, reduce):
    # a review: a focal loss over a padding mask kept the plain mean, pads included (its gradient differs
    # between elements), and pads zero-filled in both the prediction and the target (a loss of exactly 0, the
    # usual masked regression) looked like a threshold (every sample's lowest losses left out): both now score
    # each sample on its own elements
    error = _spiky_and_broad_errors()
    lengths = torch.tensor([256, 64, 128, 200] * 4)
    mask = (torch.arange(256)[None] < lengths[:, None]).float()
    prediction = error.clone().requires_grad_()
    with LossCapture(batch_size=16) as capture:
        pixel_loss = F.l1_loss(elements(prediction, mask), torch.zeros_like(error), reduction="none")
    reduce(pixel_loss, mask).backward()
    capture.drop_unused()
    masked_mean = (error * mask).sum(1) / lengths
    assert torch.allclose(capture.per_sample(), masked_mean)  # the NumPy path (CPU)
    on_device = per_sample_from_unreduced(  # the torch path (GPU, bf16)
        capture.records[0].unreduced, 16, None, "none", capture.records[0].element_grad(16)
    )
    assert torch.allclose(on_device, masked_mean)


def test_a_masked_token_loss_next_to_a_small_second_term_keeps_each_samples_masked_mean():
    # held-out sweep: a token loss over a padding mask scored [3.0, 1.0] alone, [1.2, 1.6] once a 1e-6 * MSE
    # term was added: with several terms, a call the caller reduced was scored by B * sum(g * loss) per sample,
    # its token count times its mean. It is now its per-sample score times its weight (the sum of g), as a
    # call torch reduced is
    prediction = torch.tensor([[3.0] * 8, [1.0] * 8], requires_grad=True)
    mask = torch.tensor([[1.0] * 2 + [0.0] * 6, [1.0] * 8])
    pooled = torch.zeros(2, requires_grad=True)
    target = torch.tensor([1.0, -1.0])
    capture = LossCapture(batch_size=2)
    with capture:
        token_loss = F.l1_loss(prediction, torch.zeros(2, 8), reduction="none")
        auxiliary = F.mse_loss(pooled, target)
    ((token_loss * mask).sum() / mask.sum() + 0.5 * auxiliary).backward()
    capture.drop_unused()
    assert torch.allclose(capture.per_sample(), torch.tensor([3.0 + 0.5, 1.0 + 0.5]))


def test_a_center_loss_on_a_learned_table_is_left_out_as_a_penalty_not_refused():
    # held-out sweep: cross-entropy plus a center-loss penalty `F.mse_loss(class_means, centers[present])` was
    # refused: `centers[present]` was read as rows picked from the batch. Rows picked from a parameter are the
    # table's, not the samples'; rows picked from the batch still do not split
    torch.manual_seed(0)
    features = torch.randn(8, 4, requires_grad=True)
    labels = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    head, centers = nn.Linear(4, 10), nn.Parameter(torch.randn(10, 4))
    present = labels.unique()
    means = torch.zeros(10, 4).index_add(0, labels, features)[present] / torch.bincount(labels)[present, None]
    pairs = torch.combinations(torch.arange(10), 2)[:16].T
    for penalty in (
        lambda: F.mse_loss(means.detach(), centers[present]),
        # the centers kept apart, over 16 pairs of them: a multiple of B by chance
        lambda: F.cosine_embedding_loss(centers[pairs[0]], centers[pairs[1]], -torch.ones(16)),
    ):
        with LossCapture(batch_size=8) as capture:
            (F.cross_entropy(head(features), labels) + 0.01 * penalty()).backward()
        capture.drop_unused()
        assert capture.maps_onto_batch and "picked from a parameter" in capture.describe()
        expected = F.cross_entropy(head(features), labels, reduction="none").detach()
        assert torch.allclose(capture.per_sample(), expected)
    with LossCapture(batch_size=8) as capture:  # rows of the batch's outputs, picked: not the samples' own
        F.cross_entropy(head(features), labels) + F.mse_loss(
            (2 * features)[present], centers[present].detach()
        )
    assert not capture.maps_onto_batch and "picked by an index or a mask" in capture.describe()


class _PointsNet(nn.Module):
    """A small network holding 8 fixed points and their values (buffers) and one tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
        self.shift = nn.Parameter(torch.zeros(2))
        self.register_buffer("fixed", torch.rand(8, 2))
        self.register_buffer("values", torch.rand(8, 1))
        self.anchors = torch.rand(8, 2)


def _slope(net: nn.Module, points: torch.Tensor) -> torch.Tensor:
    points = points.clone().requires_grad_(True)
    return torch.autograd.grad(net(points).sum(), points, create_graph=True)[0][:, 1:]


_OWN_POINTS = {  # terms of 8 rows, next to a batch of 8 points, computed from the module's tensors alone
    "buffer": lambda m, x: F.mse_loss(m.net(m.fixed), m.values),
    "tensor-attribute": lambda m, x: F.mse_loss(m.net(m.anchors), m.values),
    "target-computed-in-the-step": lambda m, x: F.mse_loss(m.net(m.fixed), torch.sin(m.fixed[:, 1:])),
    "derivative-on-a-copy": lambda m, x: F.mse_loss(_slope(m.net, m.fixed), torch.zeros(8, 1)),
}
_BATCH_POINTS = {  # terms of the batch's points, however the step reached them
    "residual-on-x-clone": lambda m, x: F.mse_loss(_slope(m.net, x), torch.zeros(8, 1)),
    "x-detach-requires-grad": lambda m, x: F.mse_loss(m.net(x.detach().requires_grad_()), torch.zeros(8, 1)),
    "x-plus-a-parameter": lambda m, x: F.mse_loss(m.net(x + m.shift), torch.zeros(8, 1)),
    "x-augmented-in-the-step": lambda m, x: F.mse_loss(m.net(2 * x + 1), torch.zeros(8, 1)),
    "the-modules-points-against-the-labels": lambda m, x: F.mse_loss(m.net(m.fixed), x[:, :1]),
}


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("form", sorted(_OWN_POINTS) + sorted(_BATCH_POINTS))
def test_a_term_of_b_rows_on_the_modules_own_tensors_is_left_out_one_on_the_batch_is_kept(form, autocast):
    # held-out sweep (forty-first pass): a PINN's initial condition on B points held as buffers was split over
    # the batch's B samples. The batch is told by what the rows' graph reads (storage, or value for a copy):
    # `x.clone().requires_grad_(True)` cuts autograd's link to the batch tensor and still counts as the batch's
    module, x = _PointsNet(), torch.rand(8, 2, generator=torch.Generator().manual_seed(1))
    term = {**_OWN_POINTS, **_BATCH_POINTS}[form]
    with LossCapture(batch_size=8, batch=(x,), module=module) as capture:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            term(module, x)
    (record,) = capture.records
    if form in _OWN_POINTS:
        assert not record.maps_onto_batch and not capture.maps_onto_batch
        assert "computed from the module's own tensors" in record.why_not
    else:
        assert record.maps_onto_batch
    # without the module (LossCapture used alone) nothing is left out, as before
    with LossCapture(batch_size=8, batch=(x,)) as capture:
        term(module, x)
    assert capture.records[0].maps_onto_batch


def test_two_loss_calls_on_one_line_are_judged_apart_when_the_points_term_first_comes_in_a_later_step():
    # held-out sweep: a verdict is kept per call site over a fit, and the two calls of `mse(residual) +
    # mse(net(fixed))` shared their line's: the residual's ("the batch's", from a step without the points'
    # term) was reused for the points' term, which was split over the samples
    module, x, sources = _PointsNet(), torch.rand(8, 2), {}
    net, fixed, values, zeros = module.net, module.fixed, module.values, torch.zeros(8, 1)
    for serial, with_points in ((1, False), (2, True), (3, True)):
        with LossCapture(batch_size=8, batch=(x,), module=module) as capture:
            capture.row_sources, capture.serial = sources, serial
            _ = F.mse_loss(_slope(net, x), zeros) + (F.mse_loss(net(fixed), values) if with_points else 0)
        expected = [True, False] if with_points else [True]
        assert [record.maps_onto_batch for record in capture.records] == expected


def test_a_call_site_that_computes_a_batch_term_and_a_term_on_the_modules_points_is_judged_call_by_call():
    module, x = _PointsNet(), torch.rand(8, 2)
    sources: dict = {}

    def term(points, values):
        return F.mse_loss(module.net(points), values)  # one call site for both terms

    for serial in (1, 2, 3):
        with LossCapture(batch_size=8, batch=(x,), module=module) as capture:
            capture.row_sources, capture.serial = sources, serial
            for points, values in ((module.fixed, module.values), (x, torch.zeros(8, 1))):
                term(points, values)
        assert [record.maps_onto_batch for record in capture.records] == [False, True]
