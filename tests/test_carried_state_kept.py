"""Tensor state a module carries between batches is given back after an evaluation in the middle of training."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pulse.core.carried_state import batch_shaped_attributes, kept_carried_state


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.state = None
        self.note = None
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        out, state = self.rnn(x, self.state)
        self.state = tuple(s.detach() for s in state)
        return out


def test_the_batch_shaped_attribute_is_the_rnn_hidden_state_and_not_parameters_or_buffers():
    module = Stateful()
    assert batch_shaped_attributes(module, 2) == {}
    module(torch.randn(2, 5, 3))
    found = batch_shaped_attributes(module, 2)
    assert list(found) == ["state"] and found["state"][0].shape == (1, 2, 4)


def test_an_evaluation_inside_kept_carried_state_leaves_the_training_state_as_it_was():
    module = Stateful()
    module(torch.randn(2, 5, 3))
    training_state = module.state
    with kept_carried_state(module):
        module.state = None  # an evaluation starts its own stream, as the LSTM client's validation does
        module(torch.randn(7, 5, 3))  # another batch size, as a validation loader may have
        module.cache = torch.zeros(3)  # tensor state that appears inside goes away again
        module.note = "kept"  # a plain attribute that is not tensor state is not ours to undo
    assert module.state is training_state
    assert not hasattr(module, "cache")
    assert module.note == "kept"
    module(torch.randn(2, 5, 3))  # training continues with its own hidden state's batch size


def test_a_list_empty_on_entry_that_fills_with_tensors_is_kept_and_emptied_again():
    """Sweep: the Lightning docs' ``self.validation_step_outputs = []`` filled by an evaluation was taken for
    tensor state that appeared inside and deleted; the next ``validation_step`` raised AttributeError."""
    module = Stateful()
    outputs, per_loader = [], [[], [torch.zeros(1)]]
    module.validation_step_outputs, module.per_loader = outputs, per_loader
    with kept_carried_state(module):
        module.validation_step_outputs.append(torch.ones(1))
        module.per_loader[0].append(torch.ones(1))
        module.per_loader = [[torch.ones(1)]]
    assert module.validation_step_outputs is outputs and outputs == []
    assert module.per_loader is per_loader and per_loader[0] == [] and len(per_loader[1]) == 1


def test_buffers_written_inside_kept_buffers_come_back():
    from lightning_pulse.core.carried_state import kept_buffers

    module = Stateful()
    scale = module.scale
    with kept_buffers(module):
        module.scale.mul_(3)  # written in place
        module.scale = module.scale + 1  # and rebound
        module.register_buffer("seen", torch.zeros(1))  # registered inside: a lazy setup, kept
    assert module.scale is scale and torch.equal(scale, torch.ones(1))
    assert "seen" in module._buffers
    with kept_buffers(module):
        module.scale.data.mul_(5)  # a write through ``.data`` bumps no version counter
        module.seen.data.resize_(3).fill_(2)  # resized in place (an observer's first forward)
    assert torch.equal(scale, torch.ones(1)) and torch.equal(module.seen, torch.zeros(1))


def test_python_state_of_a_subclassed_dict_is_left_alone_and_a_lazy_setup_survives():
    """A review: a Hugging Face ``ModelOutput`` kept as an attribute (a dict subclass whose ``update`` raises)
    crashed every probe; a list a ``validation_step`` builds at its first call was dropped, and the real
    validation raised ``AttributeError``."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    from lightning_pulse.core.carried_state import kept_python_state

    module = Stateful()
    module.last_output = SequenceClassifierOutput(logits=torch.zeros(2, 3))
    with kept_python_state(module):
        module.class_weights = [1.0, 2.0]  # a lazy setup behind its own flag
        module._built = True
    assert isinstance(module.last_output, SequenceClassifierOutput)
    assert module.class_weights == [1.0, 2.0]
