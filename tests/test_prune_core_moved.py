"""The pieces ScheduledPrune's callback handed to its core (lean core: 496 -> 350 lines), without a Trainer:
:class:`~lightning_pulse.core.prune_events.PruneEvents`, the fit-start selection and the epoch length in
:mod:`~lightning_pulse.core.prune_setup`, and the BaseFinetuning renaming and run precision in
:mod:`~lightning_pulse.core.pruning`."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.mnist1d.models import build_mnist1d_network
from lightning_pulse.core import prune_setup, pruning
from lightning_pulse.core.distillation import DistillConfig
from lightning_pulse.core.prune_events import PruneEvents
from lightning_pulse.core.prune_schedule import PruneSchedule
from lightning_pulse.errors import PulseRefusal
from lightning_pulse.phase import Phase, PhaseChange


def _cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_mnist1d_network("cnn", channels=25)


def _schedule(start: int = 0, end: int = 10, every: int = 5, final: float = 0.5) -> PruneSchedule:
    schedule = PruneSchedule(final_sparsity=final, start=start, end=end, every=every)
    schedule.resolve(100.0)
    return schedule


def _events(mode: str = "unstructured", distill: DistillConfig | None = None, **schedule) -> tuple:
    said: list[tuple[str, str]] = []
    pruner = pruning.Pruner(mode, ("Conv1d", "Linear"), None, "layer", 1)
    events = PruneEvents(
        _schedule(**schedule),
        pruner,
        distill,
        warn=lambda text: said.append(("warn", text)),
        info=lambda text: said.append(("info", text)),
    )
    return events, said


# ---------------------------------------------------------------------------------------------- prune_setup
def test_steps_per_epoch_take_the_accumulation_in_force_and_none_when_it_changes_later():
    assert prune_setup.steps_per_epoch(10, 3, 0, None) == 4  # a short last window steps too
    assert prune_setup.steps_per_epoch(math.inf, 1, 0, None) is None  # an epoch of unknown length
    scheduling = {0: 1, 4: 2}
    assert prune_setup.steps_per_epoch(10, 1, 1, scheduling) is None  # 1 now, 2 from epoch 4: no one figure
    assert prune_setup.steps_per_epoch(10, 2, 5, scheduling) == 5  # past the last change: 2 batches a step


def test_fit_start_selection_reads_the_frozen_set_masks_folded_zeros_and_keeps_the_example():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight[0, :2] = 0  # zeros a fit's end folded into the weight
    model[2].requires_grad_(False)
    pruner = pruning.Pruner("unstructured", ("Linear",), None, "layer", 1)
    schedule = _schedule()
    schedule.sparsity = 0.25  # the schedule pruned before
    selection, masked, example = prune_setup.fit_start_selection(pruner, model, schedule, None, [], "kept")
    assert pruner.user_frozen == frozenset({"2"}) and list(selection.layers) == ["0"]
    assert masked == ["0"] and example == "kept"
    assert pruning.current_mask(model[0]).sum().item() == 14  # the two folded zeros stay behind the mask
    # a resumed run keeps the set its checkpoint read, whatever is frozen now
    _, masked, _ = prune_setup.fit_start_selection(pruner, model, schedule, frozenset({"0"}), [], None)
    assert pruner.user_frozen == frozenset({"0"}) and masked == []


def test_fit_start_selection_refuses_a_compiled_part_holding_a_layer_to_cut_in_structured_mode():
    model = _cnn()
    pruner = pruning.Pruner("structured", ("Conv1d", "Linear"), None, "layer", 1)
    with pytest.raises(PulseRefusal, match=r"torch.compile \(the LightningModule is compiled"):
        prune_setup.fit_start_selection(pruner, model, _schedule(), None, [""], None)
    model.example_input_array = torch.randn(8, 40)
    _, masked, example = prune_setup.fit_start_selection(pruner, model, _schedule(), None, [], None)
    assert masked == [] and example.shape == (2, 40)  # example_input_array, two samples kept


# ---------------------------------------------------------------------------------------------- pruning
def test_a_finetuning_state_names_each_parameter_as_the_module_names_it_now():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    pruning.add_mask(model[0])  # `0.weight` is `0.weight_orig` now
    group = {"params": ["0.weight", "0.bias", "1.weight"], "lr": 0.1}
    states = {
        "BackboneFinetuning": {"internal_optimizer_metadata": {0: [group]}, "other": 1},
        "EarlyStopping": {"internal_optimizer_metadata": {0: [group]}},
        "Older": {"no_metadata": True},
    }
    pruning.rename_in_finetuning_states(states, ["BackboneFinetuning", "Older", "Absent"], model)
    renamed = states["BackboneFinetuning"]["internal_optimizer_metadata"][0][0]
    assert renamed == {"params": ["0.weight_orig", "0.bias", "1.weight"], "lr": 0.1}
    assert states["BackboneFinetuning"]["other"] == 1 and states["Older"] == {"no_metadata": True}
    assert states["EarlyStopping"]["internal_optimizer_metadata"][0][0]["params"][0] == "0.weight"
    assert "Absent" not in states
    # folding the mask renames it back
    assert pruning.finetuning_state_renamed(states["BackboneFinetuning"], {"0.weight"}) == {
        "internal_optimizer_metadata": {0: [{**group, "params": ["0.weight", "0.bias", "1.weight"]}]},
        "other": 1,
    }


def test_the_run_precision_of_a_plugin_is_what_it_makes_of_a_float32_tensor():
    true_bf16 = SimpleNamespace(convert_input=lambda tensor: tensor.to(torch.bfloat16))
    plain = SimpleNamespace(convert_input=lambda tensor: tensor)
    assert pruning.RunPrecision.of_plugin(true_bf16, False) == pruning.RunPrecision(torch.bfloat16)
    assert pruning.RunPrecision.of_plugin(plain, True) == pruning.RunPrecision(torch.float32, autocast=True)


# ---------------------------------------------------------------------------------------------- PruneEvents
def test_a_maintain_start_is_an_events_chance_on_the_maintain_cadence_and_not_at_a_resume():
    events, _ = _events(distill=DistillConfig())  # the window lasts until the maintain phase ends
    events.uses_maintain = True
    enters = PhaseChange(Phase.BURST, Phase.MAINTAIN, 1, 15, "budget")
    leaves = PhaseChange(Phase.MAINTAIN, Phase.BURST, 1, 20, "budget")
    assert events.after_phase_change(enters) == (False, True)
    assert events.after_phase_change(PhaseChange(None, Phase.MAINTAIN, 1, 15, "resume")) == (False, False)
    assert events.after_phase_change(leaves) == (True, False)
    events.uses_maintain = False
    assert events.after_phase_change(enters) == (False, False)


def test_the_cadence_is_decided_at_fit_start_and_its_warnings_are_given():
    events, said = _events(start=10, end=50, every=100)  # one cut of 0.5 at once
    events.plan_cadence("auto", None, 0, 100.0)
    assert events.uses_maintain is False
    assert said == [("warn", prune_setup.abrupt_schedule_warning(events.schedule))]
    with pytest.raises(PulseRefusal, match="`cadence`='maintain' needs a PulseCycle"):
        _events()[0].plan_cadence("maintain", None, 0, 100.0)


def test_selection_says_which_folded_zeros_were_masked_again_and_training_starts_with_the_summary():
    events, said = _events()
    model = _cnn()
    with torch.no_grad():
        model[1].weight[0] = 0
    events.schedule.sparsity = 0.5
    selection = events.select(model, compiled=[])
    assert said == [("info", "ScheduledPrune: resumed after a fit's end; pruned zeros masked again: ['1']")]
    events.uses_maintain = False
    events.masks.refresh(model, grad=False)
    events.start_training(model, selection, 7, 1)
    summary = prune_setup.setup_summary("unstructured", model, selection, events.schedule, False)
    assert said[-1] == ("info", summary) and events.last_step == 7 and events.masks._masked is None


def test_the_structured_example_comes_from_the_first_batch_only():
    events, _ = _events("structured")
    model = _cnn()
    events.example_from(model, (torch.randn(8, 40), torch.zeros(8)))
    first = events.example
    assert isinstance(first, tuple) and first[0].shape == (2, 40)
    events.example_from(model, (torch.randn(8, 40), torch.zeros(8)))
    assert events.example is first
    unstructured, _ = _events()
    unstructured.example_from(model, (torch.randn(8, 40), torch.zeros(8)))
    assert unstructured.example is None


def test_an_event_is_cut_recorded_and_followed_by_its_distillation_window():
    events, said = _events(distill=DistillConfig(steps=5))
    model = _cnn()
    outcome, teacher = events.cut(model, 0.5, [], teacher=True)
    assert outcome.sparsity == pytest.approx(0.5, abs=0.01) and said == []
    assert pruning.masked_layer_names(model) == ["1", "3", "5", "8"] and not pruning.masked_layer_names(
        teacher
    )
    event = events.record(10, 0.5, outcome, model, ({"acc": 0.9}, None), "maintain")
    assert events.events == [event] and event["phase"] == "maintain" and event["probe_before"] == {"acc": 0.9}
    events.open_window(model, teacher, accumulation=2)
    assert events.window.event_step == 10 and events.window.distiller.weight == 0.5
    model.train()
    F.cross_entropy(model(torch.randn(4, 40)), torch.zeros(4, dtype=torch.long)).backward()
    metrics = events.end_distillation()
    assert list(metrics) == ["prune/distill_loss"] and metrics["prune/distill_loss"] > 0
    assert event["distill_calls"] == 1 and events.window.distiller is None
    assert events.end_distillation() == {}  # none open


def test_a_distillation_window_that_never_reached_the_student_is_said():
    events, said = _events(distill=DistillConfig(steps=5))
    model = _cnn()
    outcome, teacher = events.cut(model, 0.5, [], teacher=True)
    events.record(10, 0.5, outcome, model, (None, None), None)
    events.open_window(model, teacher, 1)
    assert events.end_distillation() == {}
    assert said == [("warn", prune_setup.DISTILL_NO_EFFECT)] and events.events[0]["distill_calls"] == 0
    assert events.cut(model, 0.6, [], teacher=False)[1] is None  # no distillation: no teacher copied


def test_the_state_round_trips_and_a_loaded_teacher_waits_for_the_fit():
    events, _ = _events(distill=DistillConfig(steps=5))
    model = _cnn()
    target = events.schedule.advance(10)
    outcome, teacher = events.cut(model, target, [], teacher=True)
    events.record(10, target, outcome, model, (None, None), None)
    events.open_window(model, teacher, 1)
    events.uses_maintain, events.pruner.user_frozen = True, frozenset({"3", "1"})
    state = events.state_dict()
    assert state["user_frozen"] == ["1", "3"] and state["uses_maintain"] is True
    assert state["events"] == events.events and state["events"][0] is not events.events[0]
    assert state["teacher"]["event_step"] == 10 and state["teacher"]["steps_left"] == 5
    fresh, _ = _events(distill=DistillConfig(steps=5))
    fresh.load_state_dict(state)
    assert fresh.events == events.events and fresh.uses_maintain is True
    assert fresh.schedule.sparsity == target == 0.5 and fresh.schedule.finished
    assert fresh.pending_teacher is state["teacher"]
    student = _cnn()  # the teacher is rebuilt from the student: the model before the event
    fresh.restore_teacher(student, 2)
    assert (
        fresh.pending_teacher is None
        and fresh.window.event_step == 10
        and fresh.window.distiller.weight == 0.5
    )
    fresh.load_state_dict({k: v for k, v in state.items() if k not in ("uses_maintain", "teacher")})
    assert fresh.uses_maintain is True and fresh.pending_teacher is None  # an older checkpoint


def _masked_linear_events(sparsity_now: float) -> tuple[PruneEvents, nn.Module]:
    events, _ = _events()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    events.pruner.prune(model, 0.5)
    events.schedule.sparsity = sparsity_now
    return events, model


def test_a_rollback_unmasks_the_layers_of_an_undone_event_and_keeps_those_masked_at_the_snapshot():
    events, model = _masked_linear_events(0.0)  # the restored record has no event
    kept = pruning.current_mask(model[2]).clone()
    events.masks_after_rollback(model, ["2"])
    assert bool(pruning.current_mask(model[0]).all()) and torch.equal(model[0].weight, model[0].weight_orig)
    assert torch.equal(pruning.current_mask(model[2]), kept) and not bool(kept.all())
    # a fit resumed after a fit's end: the zeros folded into the weights go back behind the mask
    events, model = _masked_linear_events(0.5)
    with torch.no_grad():
        model[0].weight_orig[0, 0] = 0
        pruning.current_mask(model[0]).fill_(1)
    events.masks_after_rollback(model, [])
    assert torch.equal(pruning.current_mask(model[0]), (model[0].weight_orig != 0).float())
    events, model = _masked_linear_events(0.0)
    before = pruning.current_mask(model[0]).clone()
    events.masks_after_rollback(model, None)  # unknown: left as restored
    assert torch.equal(pruning.current_mask(model[0]), before)


def test_a_fit_end_warns_of_an_unfinished_schedule_folds_the_masks_and_says_the_last_event():
    events, said = _events(start=5, end=50)
    model = _cnn()
    outcome, _ = events.cut(model, 0.3, [], teacher=False)
    events.record(5, 0.3, outcome, model, (None, None), None)
    events.end_fit(model, 20, fold=True)
    summary = pruning.event_summary(events.events[-1])  # no probe: nothing said of one
    assert said == [
        ("warn", prune_setup.unfinished_warning(events.schedule, 20, events.events)),
        ("info", f"ScheduledPrune: at fit end, step 20; the last prune event, {summary}."),
    ]
    assert pruning.masked_layer_names(model) == [] and "weight_orig" not in dict(model[1].named_parameters())
    kept, said = _events(start=5, end=50)
    masked = _cnn()
    kept.cut(masked, 0.3, [], teacher=False)
    kept.end_fit(masked, 20, fold=False)
    assert pruning.masked_layer_names(masked) == ["1", "3", "5", "8"]
    assert said == [("warn", prune_setup.unfinished_warning(kept.schedule, 20, []))]  # no event recorded


def test_a_fresh_module_takes_a_pruned_state_dict_while_the_fitter_is_on():
    events, _ = _events()
    pruned = _cnn()
    events.cut(pruned, 0.5, [], teacher=False)
    fresh = _cnn(1)
    hooks = len(fresh._load_state_dict_pre_hooks)
    events.fit_loads(fresh, events.pruner.state_dict)
    events.fit_loads(fresh, events.pruner.state_dict)  # once
    assert len(fresh._load_state_dict_pre_hooks) == hooks + 1
    fresh.load_state_dict(pruned.state_dict())
    assert torch.equal(fresh[1].weight_mask, pruned[1].weight_mask)
    events.stop_fitting_loads()
    assert len(fresh._load_state_dict_pre_hooks) == hooks
    with pytest.raises(RuntimeError, match="weight_mask"):
        _cnn(2).load_state_dict(pruned.state_dict())
