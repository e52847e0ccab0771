"""The native step read (lightning_pulse.core.grad_norm) that StabilityGuard uses on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_pulse import _native
from lightning_pulse.callbacks import stability_guard
from lightning_pulse.core import grad_norm
from lightning_pulse.core.grad_norm import HostStepReader
from tests.conftest import trainer_kwargs

pytestmark = pytest.mark.skipif(
    _native.compiler() is None, reason="no C compiler: the guard reads with torch"
)


@pytest.fixture(autouse=True, params=["extension", "ctypes"])
def native_path(request, monkeypatch):
    """Every test runs on both native paths: the extension module, and ctypes where it cannot be built."""
    if request.param == "extension":
        if _native.step_reader() is None:
            pytest.skip(f"the extension module cannot be built here: {_native.step_reader_error}")
    else:
        monkeypatch.setattr(grad_norm, "_extension_read", None)
        monkeypatch.setattr(grad_norm, "_extension_resolved", True)
    return request.param


def _as_groups(grads: list[torch.Tensor]) -> list[dict]:
    """Optimizer-style parameter groups whose parameters carry ``grads``."""
    params = []
    for grad in grads:
        param = nn.Parameter(torch.zeros(grad.shape, dtype=grad.dtype))
        param.grad = grad
        params.append(param)
    return [{"params": params[:2]}, {"params": params[2:]}]


def _squares(grads: list[torch.Tensor]) -> float:
    return HostStepReader()(_as_groups(grads), [])[0]


def test_native_sum_of_squares_equals_torchs_total_norm():
    generator = torch.Generator().manual_seed(0)
    # sizes below, at and past the 16 lanes, a 0-d tensor, and a large one
    grads = [torch.randn(shape, generator=generator) for shape in [(3,), (16,), (37, 5), (), (300_001,)]]
    expected = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False).double().item()
    assert math.sqrt(_squares(grads)) == pytest.approx(expected, rel=1e-6)


def test_non_finite_entries_and_an_overflowing_tensor_give_a_non_finite_norm_as_torch_does():
    grads = [torch.ones(40), torch.ones(7)]
    grads[1][3] = float("nan")
    assert math.isnan(_squares(grads))
    grads[1][3] = float("-inf")
    assert _squares(grads) == float("inf")
    # one tensor whose fp32 norm overflows: torch's per-tensor norm is inf, and so is this
    huge = [torch.full((3,), 3e38)]
    assert _squares(huge) == float("inf") == torch._foreach_norm(huge, 2.0)[0].item()
    # two tensors whose norms are each finite in fp32: the total is a finite (double) number, as with hypot
    two = [torch.full((1,), 3e38), torch.full((1,), 3e38)]
    assert math.sqrt(_squares(two)) == pytest.approx(math.hypot(3e38, 3e38), rel=1e-6)


def test_the_torch_read_gives_the_same_norm_and_loss_as_the_native_read():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    squares, native_loss = HostStepReader()([{"params": list(model.parameters())}], [loss])
    read_loss, read_norm = stability_guard._loss_and_grad_norm(grads, [loss], read_each=True)
    assert read_norm == pytest.approx(math.sqrt(squares), rel=1e-6)
    assert read_loss == pytest.approx(native_loss) == pytest.approx(loss.item())


def _groups_with_gradients(accumulate: int = 1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2), nn.Linear(2, 2))
    model[3].weight.requires_grad_(False)  # a parameter without a gradient is left out, not read
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(accumulate):
        loss = model(torch.randn(8, 4)).pow(2).mean() / accumulate
        loss.backward()
        losses.append(loss)
    return model, optimizer, losses


def _fit_mlp(max_steps: int, callbacks: list, num_samples: int, batch_size: int) -> None:
    """A short, quiet fit of the MNIST-1D MLP (no logger, checkpoint or validation) with ``callbacks``."""
    import lightning.pytorch as pl

    from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule

    pl.seed_everything(0)
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_steps=max_steps, limit_val_batches=0))
    data = MNIST1DDataModule(num_samples=num_samples, batch_size=batch_size)
    trainer.fit(MNIST1DClassifier(arch="mlp"), data)


@pytest.mark.parametrize("accumulate", [1, 3], ids=["one-loss-read-natively", "accumulated-losses"])
def test_step_reads_give_torchs_total_norm_and_the_summed_loss(accumulate):
    model, optimizer, losses = _groups_with_gradients(accumulate)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == 5
    squares, loss = HostStepReader()(optimizer.param_groups, losses)
    assert math.sqrt(squares) == pytest.approx(torch.nn.utils.get_total_norm(grads, 2.0).item(), rel=1e-6)
    assert loss == pytest.approx(sum(value.item() for value in losses), rel=1e-6)
    assert HostStepReader()(optimizer.param_groups, [])[1] is None
    # a non-finite loss and a non-finite gradient are read as such
    losses[0].detach()[...] = float("nan")
    grads[1][0] = float("inf")
    squares, loss = HostStepReader()(optimizer.param_groups, losses)
    assert squares == float("inf") and math.isnan(loss)


def test_step_reads_take_a_loss_of_another_dtype_with_item():
    model, optimizer, _ = _groups_with_gradients()
    loss = torch.tensor(1.5, dtype=torch.bfloat16)
    assert HostStepReader()(optimizer.param_groups, [loss])[1] == 1.5


def test_step_reads_leave_gradients_they_cannot_take_to_torch():
    model, optimizer, losses = _groups_with_gradients()
    first = model[0].weight
    first.grad = first.grad.t().contiguous().t()  # same shape, transposed strides
    assert HostStepReader()(optimizer.param_groups, losses) is None
    double = nn.Linear(3, 2).double()
    double(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    assert HostStepReader()([{"params": list(double.parameters())}], losses) is None
    for param in model.parameters():
        param.grad = None
    assert HostStepReader()(optimizer.param_groups, losses) is None  # nothing to read
    embedding = nn.Embedding(5, 3, sparse=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    assert HostStepReader()([{"params": [embedding.weight]}], []) is None


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_the_guard_sees_the_loss_and_gradient_norm_of_every_step(monkeypatch, native):
    """In a real fit, the values the guard's detector receives are the step's loss and total gradient norm."""
    from lightning.pytorch.callbacks import Callback

    from lightning_pulse.callbacks.stability_guard import StabilityGuard
    from lightning_pulse.phase import Phase

    class Reference(Callback):
        def __init__(self):
            self.losses, self.norms = [], []

        def on_before_backward(self, trainer, pl_module, loss):
            self.losses.append(loss.item())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.norms.append(torch.nn.utils.get_total_norm(grads, 2.0).item())

    guard, reference = StabilityGuard(window=50), Reference()
    if not native:  # the torch read
        monkeypatch.setattr(guard, "_host_reader", lambda groups, losses: None)
    _fit_mlp(8, [guard, reference], num_samples=400, batch_size=64)
    # every step was quiet, so each entered the windows of the burst baseline (the phase of a run without
    # PulseCycle), which keep log values in step order
    seen_losses = [math.exp(value) for value in guard.detector._loss[Phase.BURST.value].values]
    seen_norms = [math.exp(value) for value in guard.detector._grad_norm[Phase.BURST.value].values]
    assert len(reference.losses) == len(reference.norms) == 8
    assert seen_losses == pytest.approx(reference.losses, rel=1e-6)
    assert seen_norms == pytest.approx(reference.norms, rel=1e-5)


def test_without_the_kernels_the_reader_declines_and_the_caller_reads_with_torch(monkeypatch):
    monkeypatch.setattr(grad_norm, "_extension_read", None)
    monkeypatch.setattr(grad_norm, "_extension_resolved", True)
    monkeypatch.setattr(_native, "library", lambda: None)
    _, optimizer, losses = _groups_with_gradients()
    assert HostStepReader()(optimizer.param_groups, losses) is None


def test_a_copied_or_pickled_reader_writes_into_its_own_buffer():
    import copy
    import pickle

    _, optimizer, losses = _groups_with_gradients()
    original = HostStepReader()
    for reader in (copy.deepcopy(original), pickle.loads(pickle.dumps(original))):
        assert reader(optimizer.param_groups, losses)[1] == pytest.approx(losses[0].item())
    assert original._loss_out[0] == 0.0  # never written by the copies


def test_more_gradients_than_the_extension_holds_on_its_stack_are_all_read():
    torch.manual_seed(0)
    grads = [torch.randn(3, 2) for _ in range(150)]  # past the 64 held on the stack
    expected = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False).double().item()
    assert math.sqrt(_squares(grads)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("native_path", ["extension"], indirect=True)  # about losing the extension module
@pytest.mark.parametrize("missing", ["python-headers", "torch-headers", "cxx-compiler"])
def test_where_the_extension_cannot_be_built_the_reader_falls_back_to_ctypes(
    monkeypatch, tmp_path, native_path, missing
):
    monkeypatch.setattr(_native, "_step_reader", None)
    monkeypatch.setattr(_native, "_step_reader_failed", False)
    monkeypatch.setattr(_native, "step_reader_error", "")
    monkeypatch.setattr(grad_norm, "_extension_read", None)
    monkeypatch.setattr(grad_norm, "_extension_resolved", False)
    if missing == "python-headers":
        monkeypatch.setattr(_native.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
        reason = "Python.h"
    elif missing == "torch-headers":  # a torch installed without its include directory
        monkeypatch.setattr(_native.torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
        reason = "torch's C++ headers"
    else:
        monkeypatch.setattr(_native, "cxx_compiler", lambda: None)
        reason = "no C++ compiler"
    assert _native.step_reader() is None
    assert reason in _native.step_reader_error
    _, optimizer, losses = _groups_with_gradients()
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    squares, loss = HostStepReader()(optimizer.param_groups, losses)
    assert math.sqrt(squares) == pytest.approx(torch.nn.utils.get_total_norm(grads, 2.0).item(), rel=1e-6)
    assert loss == pytest.approx(losses[0].item())


@pytest.mark.parametrize("native_path", ["extension"], indirect=True)
def test_the_extension_reads_one_fp32_loss_itself_and_leaves_others_to_the_caller(native_path):
    read_step = _native.step_reader().read_step
    _, optimizer, losses = _groups_with_gradients(accumulate=2)
    groups = optimizer.param_groups
    assert read_step(groups, losses[:1])[1] == pytest.approx(losses[0].item())
    assert read_step(groups, losses)[1] is None  # several micro-batches: read with item
    assert read_step(groups, [losses[0].bfloat16()])[1] is None
    assert read_step(groups, [torch.ones(2)])[1] is None  # not one element
    assert read_step(groups, [1.5])[1] is None  # not a tensor
    with pytest.raises(TypeError):
        read_step(groups)
    with pytest.raises(KeyError):
        read_step([{"parameters": []}], losses)
    with pytest.raises(TypeError):
        read_step(groups, 3)  # losses must be a sequence


class _LoggingTensor(torch.Tensor):
    """A tensor subclass with Python dispatch: what its data means is its own business."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.as_subclass(torch.Tensor) if isinstance(t, _LoggingTensor) else t  # noqa: E731
        return func(
            *torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {})
        )


def test_gradient_views_are_read_at_their_offset_and_other_tensors_are_declined():
    torch.manual_seed(0)
    base = torch.randn(10, 4)
    param = nn.Parameter(torch.zeros(6, 4))
    param.grad = base[3:9]  # a contiguous view with a storage offset: only its own rows count
    squares, _ = HostStepReader()([{"params": [param]}], [])
    assert squares == pytest.approx(base[3:9].double().square().sum().item(), rel=1e-6)
    # a parameter with a dispatching subclass gradient: declined, the caller reads with torch
    param.grad = base[3:9].clone().as_subclass(_LoggingTensor)
    assert HostStepReader()([{"params": [param]}], []) is None


@pytest.mark.parametrize("native_path", ["extension"], indirect=True)
def test_the_guard_builds_the_extension_at_fit_start_not_inside_a_step(monkeypatch, native_path):
    from lightning.pytorch.callbacks import Callback

    from lightning_pulse.callbacks.stability_guard import StabilityGuard

    monkeypatch.setattr(grad_norm, "_extension_read", None)
    monkeypatch.setattr(grad_norm, "_extension_resolved", False)
    resolved_at_first_batch = []

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            resolved_at_first_batch.append(grad_norm._extension_resolved)

    _fit_mlp(1, [StabilityGuard(), Probe()], num_samples=200, batch_size=32)
    assert resolved_at_first_batch == [True]
    assert grad_norm._extension_read is _native.step_reader().read_step
