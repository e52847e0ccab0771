/*
 * StabilityGuard's per-step read as a CPython extension module: the gradient sum of squares and the loss of one
 * optimizer step, in one call that walks the optimizer's parameter groups itself.
 *
 * Built at first use by lightning_pulse/_native.py (with the interpreter's headers; linked with reductions.c
 * for the arithmetic) and called from lightning_pulse/core/grad_norm.py. On a CPU step of a few milliseconds
 * the read's cost is not the arithmetic but the code around it, run on caches the backward pass has just
 * evicted: per gradient a few attribute reads in bytecode, a list and an array to hand the addresses over,
 * and a ctypes call. Here only torch's own accessors remain.
 *
 * read_step(param_groups, losses, float32) returns None when any gradient is not a contiguous fp32 tensor in
 * host memory (the caller then reads with torch) or when no parameter has a gradient; otherwise a tuple
 * (sum of squares, loss). The loss is read when `losses` holds exactly one fp32 host tensor of one element,
 * and is None otherwise (the caller reads it with torch).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

double sum_of_squares_f32(int64_t count, const float *const *tensors, const int64_t *sizes);

static PyObject *name_params, *name_grad, *name_dtype, *name_is_cpu, *name_is_contiguous, *name_data_ptr,
    *name_numel;

/* Gradients held on the stack; a model with more parameter tensors takes a heap buffer. */
#define STACK_TENSORS 64

/* 1 when `tensor` is an fp32 tensor in host memory (and contiguous, when asked), with its address and element
 * count in *data and *size; 0 when it is not one; -1 with a Python error set. */
static int host_f32(PyObject *tensor, PyObject *float32, int need_contiguous, const float **data, int64_t *size) {
    PyObject *value = PyObject_GetAttr(tensor, name_dtype);
    if (!value) return -1;
    int ok = value == float32;
    Py_DECREF(value);
    if (!ok) return 0;
    value = PyObject_GetAttr(tensor, name_is_cpu);
    if (!value) return -1;
    ok = value == Py_True;
    Py_DECREF(value);
    if (!ok) return 0;
    if (need_contiguous) {
        /* a sparse tensor is not contiguous (and has no data pointer) */
        value = PyObject_CallMethodNoArgs(tensor, name_is_contiguous);
        if (!value) return -1;
        ok = value == Py_True;
        Py_DECREF(value);
        if (!ok) return 0;
    }
    value = PyObject_CallMethodNoArgs(tensor, name_numel);
    if (!value) return -1;
    long long count = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (count == -1 && PyErr_Occurred()) return -1;
    value = PyObject_CallMethodNoArgs(tensor, name_data_ptr);
    if (!value) return -1;
    void *address = PyLong_AsVoidPtr(value);
    Py_DECREF(value);
    if (!address && PyErr_Occurred()) return -1;
    *data = (const float *)address;
    *size = (int64_t)count;
    return 1;
}

typedef struct {
    PyObject **held; /* a reference to every gradient read, so none is freed while the GIL is released */
    const float **data;
    int64_t *sizes;
    Py_ssize_t count, capacity;
    PyObject *stack_held[STACK_TENSORS];
    const float *stack_data[STACK_TENSORS];
    int64_t stack_sizes[STACK_TENSORS];
} Gathered;

static int grow(Gathered *g) {
    Py_ssize_t capacity = g->capacity * 2;
    PyObject **held = PyMem_Malloc(capacity * sizeof(PyObject *));
    const float **data = PyMem_Malloc(capacity * sizeof(const float *));
    int64_t *sizes = PyMem_Malloc(capacity * sizeof(int64_t));
    if (!held || !data || !sizes) {
        PyMem_Free(held);
        PyMem_Free(data);
        PyMem_Free(sizes);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(held, g->held, g->count * sizeof(PyObject *));
    memcpy(data, g->data, g->count * sizeof(const float *));
    memcpy(sizes, g->sizes, g->count * sizeof(int64_t));
    if (g->held != g->stack_held) {
        PyMem_Free(g->held);
        PyMem_Free(g->data);
        PyMem_Free(g->sizes);
    }
    g->held = held;
    g->data = data;
    g->sizes = sizes;
    g->capacity = capacity;
    return 0;
}

static void release(Gathered *g) {
    for (Py_ssize_t i = 0; i < g->count; ++i) Py_DECREF(g->held[i]);
    if (g->held != g->stack_held) {
        PyMem_Free(g->held);
        PyMem_Free(g->data);
        PyMem_Free(g->sizes);
    }
}

/* Gather every gradient of the groups: 1 all taken, 0 one declined, -1 error. */
static int gather(PyObject *groups, PyObject *float32, Gathered *g) {
    PyObject *groups_seq = PySequence_Fast(groups, "param_groups must be a sequence");
    if (!groups_seq) return -1;
    int status = 1;
    Py_ssize_t n_groups = PySequence_Fast_GET_SIZE(groups_seq);
    for (Py_ssize_t i = 0; i < n_groups && status == 1; ++i) {
        PyObject *params = PyObject_GetItem(PySequence_Fast_GET_ITEM(groups_seq, i), name_params);
        if (!params) {
            status = -1;
            break;
        }
        PyObject *params_seq = PySequence_Fast(params, "a parameter group's params must be a sequence");
        Py_DECREF(params);
        if (!params_seq) {
            status = -1;
            break;
        }
        Py_ssize_t n_params = PySequence_Fast_GET_SIZE(params_seq);
        for (Py_ssize_t j = 0; j < n_params; ++j) {
            PyObject *grad = PyObject_GetAttr(PySequence_Fast_GET_ITEM(params_seq, j), name_grad);
            if (!grad) {
                status = -1;
                break;
            }
            if (grad == Py_None) {
                Py_DECREF(grad);
                continue;
            }
            if (g->count == g->capacity && grow(g) < 0) {
                Py_DECREF(grad);
                status = -1;
                break;
            }
            status = host_f32(grad, float32, 1, &g->data[g->count], &g->sizes[g->count]);
            if (status != 1) {
                Py_DECREF(grad);
                break;
            }
            g->held[g->count++] = grad;
        }
        Py_DECREF(params_seq);
    }
    Py_DECREF(groups_seq);
    return status;
}

static PyObject *read_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "read_step(param_groups, losses, float32) takes 3 arguments");
        return NULL;
    }
    PyObject *float32 = args[2];
    Gathered g;
    g.held = g.stack_held;
    g.data = g.stack_data;
    g.sizes = g.stack_sizes;
    g.count = 0;
    g.capacity = STACK_TENSORS;
    PyObject *result = NULL;
    int status = gather(args[0], float32, &g);
    if (status < 0) goto done;
    if (status == 0 || g.count == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    const float *loss_data = NULL;
    PyObject *losses = PySequence_Fast(args[1], "losses must be a sequence");
    if (!losses) goto done;
    if (PySequence_Fast_GET_SIZE(losses) == 1) {
        int64_t loss_size = 0;
        status = host_f32(PySequence_Fast_GET_ITEM(losses, 0), float32, 0, &loss_data, &loss_size);
        if (status < 0) {
            Py_DECREF(losses);
            goto done;
        }
        if (status == 0 || loss_size != 1) loss_data = NULL;
    }
    double squares;
    Py_BEGIN_ALLOW_THREADS
    squares = sum_of_squares_f32((int64_t)g.count, g.data, g.sizes);
    Py_END_ALLOW_THREADS
    PyObject *loss = loss_data ? PyFloat_FromDouble((double)*loss_data) : Py_NewRef(Py_None);
    Py_DECREF(losses);  /* `losses` held the loss tensor while it was read */
    if (!loss) goto done;
    PyObject *total = PyFloat_FromDouble(squares);
    if (!total) {
        Py_DECREF(loss);
        goto done;
    }
    result = PyTuple_Pack(2, total, loss);
    Py_DECREF(total);
    Py_DECREF(loss);
done:
    release(&g);
    return result;
}

static PyMethodDef methods[] = {
    {"read_step", (PyCFunction)(void (*)(void))read_step, METH_FASTCALL,
     "read_step(param_groups, losses, float32) -> (sum of squares, loss or None) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_lp_step_reader", "StabilityGuard's per-step gradient and loss read.", -1, methods,
};

static PyObject *intern(const char *name) { return PyUnicode_InternFromString(name); }

PyMODINIT_FUNC PyInit__lp_step_reader(void) {
    name_params = intern("params");
    name_grad = intern("grad");
    name_dtype = intern("dtype");
    name_is_cpu = intern("is_cpu");
    name_is_contiguous = intern("is_contiguous");
    name_data_ptr = intern("data_ptr");
    name_numel = intern("numel");
    if (!name_params || !name_grad || !name_dtype || !name_is_cpu || !name_is_contiguous || !name_data_ptr ||
        !name_numel)
        return NULL;
    return PyModule_Create(&module_def);
}
