/*
 * StabilityGuard's per-step read as an extension module built against torch's C++ headers: the gradient sum of
 * squares and the loss of one optimizer step, in one call that walks the optimizer's parameter groups itself.
 *
 * Built at first use by lightning_pulse/_native.py (linked with reductions.c for the arithmetic) and called from
 * lightning_pulse/core/grad_norm.py. On a CPU step of a few milliseconds the read's cost is not the arithmetic
 * but the code around it, run on caches the backward pass has just evicted. Going through Python's attribute
 * protocol costs five of torch's Python bindings per gradient (`grad`, `dtype`, `is_cpu`, `is_contiguous()`,
 * `numel()`, `data_ptr()`, each through torch's argument parser); here each is an inline read of the tensor's
 * own fields.
 *
 * read_step(param_groups, losses) returns None when any parameter or gradient is not a plain (no Python
 * subclass dispatch), strided, contiguous fp32 tensor in host memory (the caller then reads with torch) or when
 * no parameter has a gradient; otherwise a tuple (sum of squares, loss). The loss is read when `losses` holds
 * exactly one such tensor of one element, and is None otherwise (the caller reads it with torch).
 *
 * quiet_step(detector, loss, grad_norm, key) is SpikeDetector.assess_quiet_step (lightning_pulse/core/
 * spike_detection.py) with accept=True, on the same Python objects: True when the step is a common, quiet one
 * (its values then entered the windows, as there), False when the detector's general path must judge it (and
 * nothing changed). The rare branches (a key warming up, pooled windows of several keys) call the detector's
 * own Python methods, so there is one definition of each rule; the Python function stays the reference and is
 * tested against this one.
 */
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cmath>
#include <cstdint>
#include <exception>

extern "C" double sum_of_squares_f32(int64_t count, const float *const *tensors, const int64_t *sizes);

namespace {

PyObject *name_params = nullptr;
// SpikeDetector's and RunningRobustZ's attributes, and the pooled key
PyObject *name_log_loss, *name_loss, *name_grad_norm, *name_log_min_ratio, *name_below_spike_level, *name_add_pooled,
    *name_sorted, *name_values, *name_window, *name_warmup, *name_popleft, *name_append, *pooled_key;

// Gradients held inline; a model with more parameter tensors spills to the heap.
constexpr unsigned kInlineTensors = 64;

// Whether `tensor` is a tensor the raw read may take: fp32, in host memory, strided and (when asked) contiguous,
// and without Python dispatch (a subclass with __torch_dispatch__ decides itself what its data means).
bool host_f32(const at::Tensor &tensor, bool need_contiguous) {
    return tensor.scalar_type() == at::kFloat && tensor.is_cpu() && tensor.layout() == c10::kStrided &&
           !tensor.unsafeGetTensorImpl()->is_python_dispatch() && (!need_contiguous || tensor.is_contiguous());
}

struct Gathered {
    // a reference to every gradient read, so none is freed while the GIL is released
    c10::SmallVector<at::Tensor, kInlineTensors> held;
    c10::SmallVector<const float *, kInlineTensors> data;
    c10::SmallVector<int64_t, kInlineTensors> sizes;
};

// An owned reference, released however the scope is left (torch's accessors may throw).
struct OwnedRef {
    PyObject *object;
    explicit OwnedRef(PyObject *owned = nullptr) : object(owned) {}
    OwnedRef(const OwnedRef &) = delete;
    OwnedRef &operator=(const OwnedRef &) = delete;
    ~OwnedRef() { Py_XDECREF(object); }
};

// Gather every gradient of the groups: 1 all taken, 0 one declined, -1 Python error set.
int gather(PyObject *groups, Gathered &gathered) {
    OwnedRef groups_seq(PySequence_Fast(groups, "param_groups must be a sequence"));
    if (!groups_seq.object) return -1;
    const Py_ssize_t n_groups = PySequence_Fast_GET_SIZE(groups_seq.object);
    for (Py_ssize_t i = 0; i < n_groups; ++i) {
        OwnedRef params(PyObject_GetItem(PySequence_Fast_GET_ITEM(groups_seq.object, i), name_params));
        if (!params.object) return -1;
        OwnedRef params_seq(PySequence_Fast(params.object, "a parameter group's params must be a sequence"));
        if (!params_seq.object) return -1;
        const Py_ssize_t n_params = PySequence_Fast_GET_SIZE(params_seq.object);
        for (Py_ssize_t j = 0; j < n_params; ++j) {
            PyObject *param = PySequence_Fast_GET_ITEM(params_seq.object, j);
            if (!THPVariable_Check(param)) return 0;
            const at::Tensor &grad = THPVariable_Unpack(param).grad();
            if (!grad.defined()) continue;
            if (!host_f32(grad, true)) return 0;
            gathered.held.push_back(grad);
            gathered.data.push_back(grad.const_data_ptr<float>());
            gathered.sizes.push_back(grad.numel());
        }
    }
    return 1;
}

// The loss, when `losses` is one fp32 host tensor of one element; nullptr (no error) otherwise.
PyObject *single_loss(PyObject *losses_seq) {
    if (PySequence_Fast_GET_SIZE(losses_seq) != 1) return nullptr;
    PyObject *value = PySequence_Fast_GET_ITEM(losses_seq, 0);
    if (!THPVariable_Check(value)) return nullptr;
    const at::Tensor &loss = THPVariable_Unpack(value);
    if (!host_f32(loss, false) || loss.numel() != 1) return nullptr;
    return PyFloat_FromDouble(static_cast<double>(*loss.const_data_ptr<float>()));
}

PyObject *read_step_impl(PyObject *groups, PyObject *losses) {
    Gathered gathered;
    const int status = gather(groups, gathered);
    if (status < 0) return nullptr;
    if (status == 0 || gathered.held.empty()) Py_RETURN_NONE;
    OwnedRef loss;
    {
        OwnedRef losses_seq(PySequence_Fast(losses, "losses must be a sequence"));
        if (!losses_seq.object) return nullptr;
        loss.object = single_loss(losses_seq.object);
    }
    if (!loss.object) {
        if (PyErr_Occurred()) return nullptr;
        loss.object = Py_NewRef(Py_None);
    }
    double squares;
    Py_BEGIN_ALLOW_THREADS
    squares = sum_of_squares_f32(static_cast<int64_t>(gathered.data.size()), gathered.data.data(),
                                 gathered.sizes.data());
    Py_END_ALLOW_THREADS
    OwnedRef total(PyFloat_FromDouble(squares));
    if (!total.object) return nullptr;
    return PyTuple_Pack(2, total.object, loss.object);
}

PyObject *read_step(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read_step(param_groups, losses) takes 2 arguments");
        return nullptr;
    }
    try {
        return read_step_impl(args[0], args[1]);
    } catch (const std::exception &error) {
        // torch's accessors throw c10::Error for tensors they cannot describe; never let it cross into Python
        // as an abort: decline, and the caller reads with torch (which raises its own error if there is one)
        if (PyErr_Occurred()) return nullptr;
        Py_RETURN_NONE;
    }
}

// ------------------------------------------------------------------------------------ the detector's quiet step

// `ordered[middle]`, or the mean of the two middle values: the median of a sorted list of floats.
bool sorted_median(PyObject *ordered, double *median) {
    const Py_ssize_t size = PyList_GET_SIZE(ordered), middle = size / 2;
    const double upper = PyFloat_AsDouble(PyList_GET_ITEM(ordered, middle));
    if (upper == -1.0 && PyErr_Occurred()) return false;
    if (size % 2) {
        *median = upper;
        return true;
    }
    const double lower = PyFloat_AsDouble(PyList_GET_ITEM(ordered, middle - 1));
    if (lower == -1.0 && PyErr_Occurred()) return false;
    *median = (lower + upper) / 2;
    return true;
}

// bisect.bisect_left (right=false) or bisect.bisect_right (right=true) on a sorted list of floats; -1 on error.
Py_ssize_t bisect(PyObject *ordered, double value, bool right) {
    Py_ssize_t low = 0, high = PyList_GET_SIZE(ordered);
    while (low < high) {
        const Py_ssize_t middle = low + (high - low) / 2;
        const double item = PyFloat_AsDouble(PyList_GET_ITEM(ordered, middle));
        if (item == -1.0 && PyErr_Occurred()) return -1;
        // the comparisons of Python's bisect module: right goes left past equal items, left does not
        const bool go_left = right ? value < item : !(item < value);
        if (go_left)
            high = middle;
        else
            low = middle + 1;
    }
    return low;
}

Py_ssize_t int_attribute(PyObject *object, PyObject *name) {
    OwnedRef value(PyObject_GetAttr(object, name));
    return value.object ? PyLong_AsSsize_t(value.object) : -1;
}

// RunningRobustZ.add on its `values` deque and `_sorted` list: drop the oldest value when the window is full.
bool window_add(PyObject *tracker, PyObject *ordered, double value) {
    OwnedRef values(PyObject_GetAttr(tracker, name_values));
    if (!values.object) return false;
    const Py_ssize_t window = int_attribute(tracker, name_window);
    const Py_ssize_t length = PyObject_Length(values.object);
    if ((window == -1 || length == -1) && PyErr_Occurred()) return false;
    if (length == window) {
        OwnedRef oldest(PyObject_CallMethodNoArgs(values.object, name_popleft));
        if (!oldest.object) return false;
        const double old_value = PyFloat_AsDouble(oldest.object);
        if (old_value == -1.0 && PyErr_Occurred()) return false;
        const Py_ssize_t at = bisect(ordered, old_value, false);
        if (at < 0 || PyList_SetSlice(ordered, at, at + 1, nullptr) < 0) return false;
    }
    OwnedRef entry(PyFloat_FromDouble(value));
    if (!entry.object) return false;
    OwnedRef appended(PyObject_CallMethodOneArg(values.object, name_append, entry.object));
    if (!appended.object) return false;
    const Py_ssize_t at = bisect(ordered, value, true);
    return at >= 0 && PyList_Insert(ordered, at, entry.object) == 0;
}

// detector._below_spike_level(trackers, own, value, key), the warm-up rule, in Python; -1 on error.
int below_spike_level(PyObject *detector, PyObject *trackers, PyObject *own, double value, PyObject *key) {
    OwnedRef scaled(PyFloat_FromDouble(value));
    if (!scaled.object) return -1;
    PyObject *call_args[] = {detector, trackers, own, scaled.object, key};
    OwnedRef result(PyObject_VectorcallMethod(
        name_below_spike_level, call_args, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
    return result.object ? PyObject_IsTrue(result.object) : -1;
}

// The pooled window's update, as assess_quiet_step does it: through detector._add_pooled unless it is `own`.
bool add_pooled(PyObject *detector, PyObject *trackers, PyObject *own, double value) {
    PyObject *pooled = PyDict_GetItemWithError(trackers, pooled_key);  // borrowed
    if (!pooled && PyErr_Occurred()) return false;
    if (pooled == own) return true;
    OwnedRef scaled(PyFloat_FromDouble(value));
    if (!scaled.object) return false;
    PyObject *call_args[] = {detector, trackers, pooled ? pooled : Py_None, scaled.object};
    OwnedRef result(
        PyObject_VectorcallMethod(name_add_pooled, call_args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
    return result.object != nullptr;
}

// 1 quiet (values accepted), 0 not a common step (nothing changed), -1 Python error set.
int quiet_step_impl(PyObject *detector, PyObject *loss_arg, PyObject *grad_arg, PyObject *key) {
    if (loss_arg == Py_None || grad_arg == Py_None) return 0;
    const double loss = PyFloat_AsDouble(loss_arg), grad_norm = PyFloat_AsDouble(grad_arg);
    if (PyErr_Occurred()) return -1;
    OwnedRef log_loss(PyObject_GetAttr(detector, name_log_loss));
    if (!log_loss.object) return -1;
    const int on_log_scale = PyObject_IsTrue(log_loss.object);
    if (on_log_scale < 0) return -1;
    // NaN fails every comparison
    if (!on_log_scale || !(0.0 < loss && loss < INFINITY && 0.0 < grad_norm && grad_norm < INFINITY)) return 0;
    OwnedRef loss_trackers(PyObject_GetAttr(detector, name_loss));
    OwnedRef grad_trackers(PyObject_GetAttr(detector, name_grad_norm));
    if (!loss_trackers.object || !grad_trackers.object) return -1;
    if (!PyDict_Check(loss_trackers.object) || !PyDict_Check(grad_trackers.object)) {
        PyErr_SetString(PyExc_TypeError, "quiet_step: the detector's windows must be dicts");
        return -1;
    }
    PyObject *loss_tracker = PyDict_GetItemWithError(loss_trackers.object, key);  // borrowed
    if (!loss_tracker) return PyErr_Occurred() ? -1 : 0;
    PyObject *grad_tracker = PyDict_GetItemWithError(grad_trackers.object, key);
    if (!grad_tracker) return PyErr_Occurred() ? -1 : 0;
    const double scaled_loss = std::log(loss), scaled_grad = std::log(grad_norm);
    OwnedRef ordered_loss(PyObject_GetAttr(loss_tracker, name_sorted));
    OwnedRef ordered_grad(PyObject_GetAttr(grad_tracker, name_sorted));
    if (!ordered_loss.object || !ordered_grad.object) return -1;
    if (!PyList_Check(ordered_loss.object) || !PyList_Check(ordered_grad.object)) {
        PyErr_SetString(PyExc_TypeError, "quiet_step: a window's sorted values must be a list");
        return -1;
    }
    const Py_ssize_t loss_warmup = int_attribute(loss_tracker, name_warmup);
    const Py_ssize_t grad_warmup = int_attribute(grad_tracker, name_warmup);
    if ((loss_warmup == -1 || grad_warmup == -1) && PyErr_Occurred()) return -1;
    if (PyList_GET_SIZE(ordered_loss.object) >= loss_warmup && PyList_GET_SIZE(ordered_grad.object) >= grad_warmup) {
        OwnedRef limit_value(PyObject_GetAttr(detector, name_log_min_ratio));
        if (!limit_value.object) return -1;
        const double limit = PyFloat_AsDouble(limit_value.object);
        double median;
        if ((limit == -1.0 && PyErr_Occurred()) || !sorted_median(ordered_loss.object, &median)) return -1;
        if (scaled_loss - median > limit) return 0;
        if (!sorted_median(ordered_grad.object, &median)) return -1;
        if (scaled_grad - median > limit) return 0;
    } else {
        int below = below_spike_level(detector, loss_trackers.object, loss_tracker, scaled_loss, key);
        if (below <= 0) return below;
        below = below_spike_level(detector, grad_trackers.object, grad_tracker, scaled_grad, key);
        if (below <= 0) return below;
    }
    if (!window_add(loss_tracker, ordered_loss.object, scaled_loss) ||
        !window_add(grad_tracker, ordered_grad.object, scaled_grad))
        return -1;
    const int is_pooled = PyUnicode_Check(key) ? PyUnicode_Compare(key, pooled_key) == 0 : 0;
    if (PyErr_Occurred()) return -1;
    if (!is_pooled && (!add_pooled(detector, loss_trackers.object, loss_tracker, scaled_loss) ||
                       !add_pooled(detector, grad_trackers.object, grad_tracker, scaled_grad)))
        return -1;
    return 1;
}

PyObject *quiet_step(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "quiet_step(detector, loss, grad_norm, key) takes 4 arguments");
        return nullptr;
    }
    const int quiet = quiet_step_impl(args[0], args[1], args[2], args[3]);
    if (quiet < 0) return nullptr;
    return PyBool_FromLong(quiet);
}

PyMethodDef methods[] = {
    {"quiet_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(quiet_step)), METH_FASTCALL,
     "quiet_step(detector, loss, grad_norm, key) -> bool: SpikeDetector.assess_quiet_step with accept=True"},
    {"read_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(read_step)), METH_FASTCALL,
     "read_step(param_groups, losses) -> (sum of squares, loss or None) or None"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_lp_step_reader", "StabilityGuard's per-step gradient and loss read.", -1, methods,
};

}  // namespace

PyMODINIT_FUNC PyInit__lp_step_reader(void) {
    PyObject **names[] = {&name_params, &name_log_loss, &name_loss, &name_grad_norm, &name_log_min_ratio,
                          &name_below_spike_level, &name_add_pooled, &name_sorted, &name_values, &name_window,
                          &name_warmup, &name_popleft, &name_append, &pooled_key};
    const char *spellings[] = {"params", "_log_loss", "_loss", "_grad_norm", "_log_min_ratio", "_below_spike_level",
                               "_add_pooled", "_sorted", "values", "window", "warmup", "popleft", "append", "*"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); ++i) {
        *names[i] = PyUnicode_InternFromString(spellings[i]);
        if (!*names[i]) return nullptr;
    }
    return PyModule_Create(&module_def);
}
