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
 */
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <exception>

extern "C" double sum_of_squares_f32(int64_t count, const float *const *tensors, const int64_t *sizes);

namespace {

PyObject *name_params = nullptr;

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

PyMethodDef methods[] = {
    {"read_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(read_step)), METH_FASTCALL,
     "read_step(param_groups, losses) -> (sum of squares, loss or None) or None"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_lp_step_reader", "StabilityGuard's per-step gradient and loss read.", -1, methods,
};

}  // namespace

PyMODINIT_FUNC PyInit__lp_step_reader(void) {
    name_params = PyUnicode_InternFromString("params");
    if (!name_params) return nullptr;
    return PyModule_Create(&module_def);
}
