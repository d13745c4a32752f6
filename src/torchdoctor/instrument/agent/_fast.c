/* The agent's per-batch and per-step fast path, compiled (optional: steps.py and hooks.py keep
 * the pure-Python path, used where this module was not built or TORCHDOCTOR_AGENT_PURE_PYTHON
 * is set).
 *
 * Why C: in the job's loop the agent's Python runs cold (between two steps the job's own work
 * evicts it), so each bytecode it runs costs several times its warm price; the least a Python
 * agent can do on the same hooks measured above the per-step target. Here the common batch and
 * the common step are a few dozen loads and stores on one small struct, and allocate nothing:
 * the counters are C integers, and a step's values go into a C array of rows that becomes the
 * message's columns only at flush time (pack_rows), in C too.
 *
 * What is compiled is only the common case, written after steps.StepCounter.on_batch and
 * on_step, which stay the reference: anything else (an evaluation batch, a step that is not
 * ``fast``, a flush, the first batch of a loader) calls the same Python as the pure path, so
 * the two paths record the same rows.
 *
 * - CounterFields: the step counter's hot fields, the base class of steps.StepCounter (Python
 *   reads and writes them as the pure path's slots: ints, None where the pure path has None),
 *   and the rows of the steps the common path ended, kept in order after agent.steps' own:
 *   whatever reads or appends to agent.steps drains them first (Agent.flush, the full path).
 * - NextWrapper: _BaseDataLoaderIter.__next__ (a method descriptor, called unbound).
 * - StepHook: torch's global optimizer step post-hook.
 *
 * Errors follow hooks.guard: an Exception inside the agent's part calls agent.disable(where,
 * exc) and the user's call goes on with its own result; a BaseException that is not an
 * Exception (SystemExit of the stop rule, KeyboardInterrupt) propagates as the user's own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pythread.h>
#include <structmember.h>
#include <limits.h>
#include <time.h>

static PyObject *str_active, *str_steps, *str_flush_max_steps, *str_last_flush, *str_after_step,
    *str_disable, *str_shape, *str_first_batch,
    *str_dataloader_next, *str_optimizer_step;

/* The common path's branches that are taken once in a long while (errors, a pass's end, a
 * flush): marked so that the compiler lays the common batch and step out as one short run of
 * code. In the job's loop that code is cold at every call (the job's own work evicts it between
 * two steps), and each instruction-cache line it spans costs a miss. */
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#define RARE __attribute__((noinline, cold))

/* time.perf_counter_ns on Linux (time.get_clock_info('perf_counter'): CLOCK_MONOTONIC); the
 * Python parts of the agent read the same clock. */
static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* -- CounterFields --------------------------------------------------------------------------- */

/* An integer field that may be None (Python's view): this value stands for None. */
#define NONE_INT LLONG_MIN

/* A step the common path ended, kept as numbers until a flush or the full path needs the rows
 * (steps.StepCounter.on_step's tuple: step, end, wall, data wait, batch size, samples, autocast
 * dtype, scaler used). */
typedef struct {
    long long step, t, wall, data_wait, batch_size, samples; /* batch_size NONE_INT: None */
    PyObject *autocast_dtype;                                /* owned */
    char scaler_used;
} StepRow;

typedef struct {
    PyObject_HEAD
    /* the step under way: plain integers, so that a batch or a step allocates nothing */
    long long step, boundary, data_wait, samples, batches, last_batch_size, loader_batch_size,
        eval_ns, first_batches_due; /* boundary and the two batch sizes may be NONE_INT */
    unsigned long step_thread; /* the thread that steps the optimizer, if has_step_thread */
    char has_step_thread, loader_seen, scaler_used, fast, cuda_started;
    PyObject *prev_step_fed, *autocast_dtype, *evaluation, *last_optimizer;
    /* set once (StepCounter.__init__, hooks.install) */
    PyObject *agent, *loaders, *grad_enabled, *tensor_type, *batch_len;
    /* c10::GradMode::is_enabled, what grad_enabled (torch.is_grad_enabled) returns, read in
     * torch's own library without Python's call protocol; NULL: call grad_enabled */
    _Bool (*grad_mode_is_enabled)(void);
    /* the length slot of tensor_type's C base, found once for the type held in length_type */
    PyObject *length_type;
    lenfunc tensor_length;
    /* steps ended by the common path, in order after agent.steps' rows (drain_rows) */
    StepRow *rows;
    Py_ssize_t row_count, row_capacity;
} CounterFields;

#define OBJECT_FIELDS(X)                                                                        \
    X(prev_step_fed) X(autocast_dtype) X(evaluation) X(last_optimizer) X(agent)                \
    X(loaders) X(grad_enabled) X(tensor_type) X(batch_len)

#define OBJECT_FIELD(name) {#name, T_OBJECT_EX, offsetof(CounterFields, name), 0, NULL},
#define INT_FIELD(name) {#name, T_LONGLONG, offsetof(CounterFields, name), 0, NULL},
#define BOOL_FIELD(name) {#name, T_BOOL, offsetof(CounterFields, name), 0, NULL},
static PyMemberDef counter_members[] = {
    INT_FIELD(step) INT_FIELD(data_wait) INT_FIELD(samples) INT_FIELD(batches)
    INT_FIELD(eval_ns) INT_FIELD(first_batches_due) BOOL_FIELD(loader_seen)
    BOOL_FIELD(scaler_used) BOOL_FIELD(fast) BOOL_FIELD(cuda_started)
    OBJECT_FIELDS(OBJECT_FIELD) {NULL}};
#undef OBJECT_FIELD
#undef INT_FIELD
#undef BOOL_FIELD

/* The fields that are an int or None, read and written by Python as such. */
static PyObject *optional_int_get(CounterFields *self, void *offset) {
    long long value = *(long long *)((char *)self + (Py_ssize_t)offset);
    if (value == NONE_INT) Py_RETURN_NONE;
    return PyLong_FromLongLong(value);
}

static int optional_int_set(CounterFields *self, PyObject *value, void *offset) {
    long long number = NONE_INT;
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the counter's fields cannot be deleted");
        return -1;
    }
    if (value != Py_None) {
        number = PyLong_AsLongLong(value);
        if (number == -1 && PyErr_Occurred()) return -1;
        if (number == NONE_INT) {
            PyErr_SetString(PyExc_OverflowError, "out of the counter's range");
            return -1;
        }
    }
    *(long long *)((char *)self + (Py_ssize_t)offset) = number;
    return 0;
}

static PyObject *counter_pending_rows(CounterFields *self, void *unused) {
    return PyLong_FromSsize_t(self->row_count);
}

/* step_thread: a thread identifier (threading.get_ident()) or None. */
static PyObject *step_thread_get(CounterFields *self, void *unused) {
    if (!self->has_step_thread) Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(self->step_thread);
}

static int step_thread_set(CounterFields *self, PyObject *value, void *unused) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the counter's fields cannot be deleted");
        return -1;
    }
    if (value == Py_None) {
        self->has_step_thread = 0;
        return 0;
    }
    unsigned long ident = PyLong_AsUnsignedLong(value);
    if (ident == (unsigned long)-1 && PyErr_Occurred()) return -1;
    self->step_thread = ident;
    self->has_step_thread = 1;
    return 0;
}

#define OPTIONAL_INT(name)                                                                     \
    {#name, (getter)optional_int_get, (setter)optional_int_set, "an int or None",           \
     (void *)offsetof(CounterFields, name)},
static PyGetSetDef counter_getset[] = {
    OPTIONAL_INT(boundary) OPTIONAL_INT(last_batch_size) OPTIONAL_INT(loader_batch_size)
    {"step_thread", (getter)step_thread_get, (setter)step_thread_set,
     "the thread that steps the optimizer, or None", NULL},
    {"pending_rows", (getter)counter_pending_rows, NULL,
     "steps ended by the compiled path and not yet drained into agent.steps", NULL},
    {NULL}};
#undef OPTIONAL_INT

static PyObject *optional_int(long long value) {
    return value == NONE_INT ? Py_NewRef(Py_None) : PyLong_FromLongLong(value);
}

/* Forget the first n kept rows (their references released). */
static void forget_rows(CounterFields *self, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) Py_CLEAR(self->rows[i].autocast_dtype);
    self->row_count -= n;
    if (self->row_count > 0)
        memmove(self->rows, self->rows + n, self->row_count * sizeof(StepRow));
}

/* The row steps.StepCounter.on_step appends, as a new tuple; NULL with an exception set. */
static PyObject *row_tuple(const StepRow *row) {
    PyObject *items[8] = {
        PyLong_FromLongLong(row->step),
        PyLong_FromLongLong(row->t),
        PyLong_FromLongLong(row->wall),
        PyLong_FromLongLong(row->data_wait),
        optional_int(row->batch_size),
        row->samples ? PyLong_FromLongLong(row->samples) : Py_NewRef(Py_None),
        Py_NewRef(row->autocast_dtype),
        Py_NewRef(row->scaler_used ? Py_True : Py_False),
    };
    PyObject *tuple = NULL;
    int complete = 1;
    for (int i = 0; i < 8; i++) complete &= items[i] != NULL;
    if (complete) tuple = PyTuple_New(8);
    if (tuple == NULL) {
        for (int i = 0; i < 8; i++) Py_XDECREF(items[i]);
        return NULL;
    }
    for (int i = 0; i < 8; i++) PyTuple_SET_ITEM(tuple, i, items[i]);
    return tuple;
}

/* Append the kept rows to `steps` (a list), in order, and forget them; -1 with an exception set
 * (the rows not appended are kept). */
static int drain_into(CounterFields *self, PyObject *steps) {
    Py_ssize_t done = 0;
    int status = 0;
    for (; done < self->row_count; done++) {
        PyObject *tuple = row_tuple(&self->rows[done]);
        if (tuple == NULL || PyList_Append(steps, tuple) < 0) {
            Py_XDECREF(tuple);
            status = -1;
            break;
        }
        Py_DECREF(tuple);
    }
    forget_rows(self, done);
    return status;
}

/* The columns of contract.pack_steps for `n` int64 values at `offset` in each row: ["=", v]
 * when all are equal, else ["Q", native int64 bytes]; with `optional`, NONE_INT is None (0 with
 * `zero_is_none`) and a column mixing None and ints is ["j", values]. New reference. */
static PyObject *int_column(const StepRow *rows, Py_ssize_t n, size_t offset, int optional,
                            int zero_is_none) {
#define VALUE(i) (*(const long long *)((const char *)&rows[i] + offset))
#define IS_NONE(v) (optional && ((v) == NONE_INT || (zero_is_none && (v) == 0)))
    long long first = VALUE(0);
    int same = 1, any_none = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = VALUE(i);
        same &= v == first || (IS_NONE(v) && IS_NONE(first));
        any_none |= IS_NONE(v);
    }
    if (same) {
        PyObject *value = IS_NONE(first) ? Py_NewRef(Py_None) : PyLong_FromLongLong(first);
        return value == NULL ? NULL : Py_BuildValue("[sN]", "=", value);
    }
    if (!any_none) {
        PyObject *data = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(long long));
        if (data == NULL) return NULL;
        long long *out = (long long *)PyBytes_AS_STRING(data);
        for (Py_ssize_t i = 0; i < n; i++) out[i] = VALUE(i);
        return Py_BuildValue("[sN]", "Q", data);
    }
    PyObject *values = PyList_New(n);
    if (values == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = VALUE(i);
        PyObject *item = IS_NONE(v) ? Py_NewRef(Py_None) : PyLong_FromLongLong(v);
        if (item == NULL) {
            Py_DECREF(values);
            return NULL;
        }
        PyList_SET_ITEM(values, i, item);
    }
    return Py_BuildValue("[sN]", "j", values);
#undef VALUE
#undef IS_NONE
}

/* The column of the autocast dtype, or (`scaler`) of the scaler flag:
 * ["=", v] when all are equal, else ["j", values]. New reference. */
static PyObject *object_column(const StepRow *rows, Py_ssize_t n, int scaler) {
#define ITEM(i) (scaler ? (rows[i].scaler_used ? Py_True : Py_False) : rows[i].autocast_dtype)
    PyObject *first = ITEM(0);
    int same = 1;
    for (Py_ssize_t i = 1; i < n && same; i++) {
        same = PyObject_RichCompareBool(ITEM(i), first, Py_EQ);
        if (same < 0) return NULL;
    }
    if (same && (first == Py_None || PyLong_CheckExact(first) || PyUnicode_CheckExact(first) ||
                 PyBool_Check(first) || PyFloat_CheckExact(first)))
        return Py_BuildValue("[sO]", "=", first);
    PyObject *values = PyList_New(n);
    if (values == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(values, i, Py_NewRef(ITEM(i)));
    return Py_BuildValue("[sN]", "j", values);
#undef ITEM
}

/* pack_rows(n): the first n kept steps as one message's columns, exactly as contract.pack_steps
 * packs the same rows, and forget them. */
static PyObject *counter_pack_rows(CounterFields *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n <= 0 || n > self->row_count) {
        PyErr_Format(PyExc_ValueError, "pack_rows takes 1 to %zd steps", self->row_count);
        return NULL;
    }
    const StepRow *rows = self->rows;
    PyObject *columns[8] = {
        int_column(rows, n, offsetof(StepRow, step), 0, 0),
        int_column(rows, n, offsetof(StepRow, t), 0, 0),
        int_column(rows, n, offsetof(StepRow, wall), 0, 0),
        int_column(rows, n, offsetof(StepRow, data_wait), 0, 0),
        int_column(rows, n, offsetof(StepRow, batch_size), 1, 0),
        int_column(rows, n, offsetof(StepRow, samples), 1, 1),
        object_column(rows, n, 0),
        object_column(rows, n, 1),
    };
    PyObject *out = PyList_New(8);
    int complete = out != NULL;
    for (int i = 0; i < 8; i++) complete &= columns[i] != NULL;
    if (!complete) {
        Py_XDECREF(out);
        for (int i = 0; i < 8; i++) Py_XDECREF(columns[i]);
        return NULL;
    }
    for (int i = 0; i < 8; i++) PyList_SET_ITEM(out, i, columns[i]);
    forget_rows(self, n);
    return out;
}

static PyObject *counter_drain_rows(CounterFields *self, PyObject *steps) {
    if (!PyList_Check(steps)) {
        PyErr_SetString(PyExc_TypeError, "drain_rows takes the agent's list of steps");
        return NULL;
    }
    if (drain_into(self, steps) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *counter_discard_rows(CounterFields *self, PyObject *unused) {
    forget_rows(self, self->row_count);
    Py_RETURN_NONE;
}

/* torch's library of core types, loaded by torch (by its soname: wherever it came from), and
 * the C++ function behind torch.is_grad_enabled (c10::GradMode::is_enabled(), exported for
 * C++ extensions; the autograd mode of the calling thread). */
#define C10_LIBRARY "libc10.so"
#define GRAD_MODE_SYMBOL "_ZN3c108GradMode10is_enabledEv"

static PyObject *counter_use_native_grad_mode(CounterFields *self, PyObject *on) {
    int wanted = PyObject_IsTrue(on);
    if (wanted < 0) return NULL;
    self->grad_mode_is_enabled = NULL;
    if (!wanted) Py_RETURN_NONE;
    /* RTLD_NOLOAD: only the copy torch loaded, never another; the handle is kept (the library
     * stays loaded while this process runs, as torch keeps it anyway). */
    void *library = dlopen(C10_LIBRARY, RTLD_LAZY | RTLD_NOLOAD);
    void *symbol = library != NULL ? dlsym(library, GRAD_MODE_SYMBOL) : NULL;
    if (symbol == NULL) Py_RETURN_NONE;
    *(void **)&self->grad_mode_is_enabled = symbol; /* POSIX's way from dlsym to a function */
    return PyBool_FromLong(self->grad_mode_is_enabled());
}

static PyMethodDef counter_methods[] = {
    {"use_native_grad_mode", (PyCFunction)counter_use_native_grad_mode, METH_O,
     "use_native_grad_mode(on): read the autograd mode in torch's libc10 instead of calling "
     "grad_enabled; returns what it reads now, or None where it cannot (see "
     "compiled.read_grad_mode_natively, which checks it against torch)."},
    {"drain_rows", (PyCFunction)counter_drain_rows, METH_O,
     "drain_rows(steps): append the steps the compiled path ended, as rows, to steps."},
    {"pack_rows", (PyCFunction)counter_pack_rows, METH_O,
     "pack_rows(n): the first n steps the compiled path ended, as contract.pack_steps's "
     "columns (they are forgotten)."},
    {"discard_rows", (PyCFunction)counter_discard_rows, METH_NOARGS,
     "Forget the steps the compiled path ended (a forked child's copy of its parent's)."},
    {NULL}};

static PyObject *counter_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    CounterFields *self = (CounterFields *)type->tp_alloc(type, 0);
    if (self != NULL) self->boundary = self->last_batch_size = self->loader_batch_size = NONE_INT;
    return (PyObject *)self;
}

static int counter_traverse(CounterFields *self, visitproc visit, void *arg) {
#define VISIT(name) Py_VISIT(self->name);
    OBJECT_FIELDS(VISIT)
#undef VISIT
    Py_VISIT(self->length_type);
    for (Py_ssize_t i = 0; i < self->row_count; i++) Py_VISIT(self->rows[i].autocast_dtype);
    return 0;
}

static int counter_clear(CounterFields *self) {
#define CLEAR(name) Py_CLEAR(self->name);
    OBJECT_FIELDS(CLEAR)
#undef CLEAR
    Py_CLEAR(self->length_type);
    forget_rows(self, self->row_count);
    return 0;
}

static void counter_dealloc(CounterFields *self) {
    PyObject_GC_UnTrack(self);
    counter_clear(self);
    PyMem_Free(self->rows);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject CounterFieldsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_torchdoctor_agent._fast.CounterFields",
    .tp_basicsize = sizeof(CounterFields),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The step counter's hot fields (the base of steps.StepCounter).",
    .tp_traverse = (traverseproc)counter_traverse,
    .tp_clear = (inquiry)counter_clear,
    .tp_dealloc = (destructor)counter_dealloc,
    .tp_members = counter_members,
    .tp_getset = counter_getset,
    .tp_methods = counter_methods,
    .tp_new = counter_new,
};

/* -- shared helpers ---------------------------------------------------------------------------- */

/* An attribute of the agent read where its class keeps it: Agent has __slots__, so the value
 * sits at a fixed offset in the object, and reading it there skips the generic attribute lookup
 * (a few hundred instructions each, several per batch and step). The offset is found once through
 * the class's member descriptor and trusted while the object's class and that class's version tag
 * are the ones it was found on (the tag changes whenever the class is modified); anything else
 * takes PyObject_GetAttr. */
typedef struct {
    PyTypeObject *type; /* borrowed: compared by identity only */
    unsigned int version;
    Py_ssize_t offset; /* -1: not a plain object slot */
} SlotCache;

static RARE void slot_find(PyTypeObject *type, PyObject *name, SlotCache *cache) {
    cache->type = type;
    cache->version = type->tp_version_tag;
    cache->offset = -1;
    PyObject *descr = _PyType_Lookup(type, name); /* borrowed */
    if (descr != NULL && Py_TYPE(descr) == &PyMemberDescr_Type) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type == T_OBJECT_EX && !(member->flags & READONLY))
            cache->offset = member->offset;
    }
}

static PyObject *slot_get(PyObject *obj, PyObject *name, SlotCache *cache) {
    PyTypeObject *type = Py_TYPE(obj);
    if (UNLIKELY(type != cache->type || type->tp_version_tag != cache->version ||
                 cache->version == 0))
        slot_find(type, name, cache);
    if (cache->offset >= 0) {
        PyObject *value = *(PyObject **)((char *)obj + cache->offset);
        if (value != NULL) return Py_NewRef(value);
    }
    return PyObject_GetAttr(obj, name);
}

/* An int attribute of the agent, as a C number. The object last converted is kept (a
 * reference held, so that it cannot be freed and its address reused): an int is immutable, so
 * the same object at the next step is the same number. last_flush is a new object at each
 * flush only, and its ~1e15 ns would take CPython's slow conversion of a multi-digit int at
 * every step. */
typedef struct {
    PyObject *object;
    long long value;
} IntCache;

static int cached_int(PyObject *obj, PyObject *name, SlotCache *slot, IntCache *cache,
                      long long *out) {
    PyObject *value = slot_get(obj, name, slot);
    if (value == NULL) return -1;
    if (UNLIKELY(value != cache->object)) {
        long long number = PyLong_AsLongLong(value);
        if (number == -1 && PyErr_Occurred()) {
            Py_DECREF(value);
            return -1;
        }
        Py_XSETREF(cache->object, value); /* takes the reference */
        cache->value = number;
    } else {
        Py_DECREF(value);
    }
    *out = cache->value;
    return 0;
}

/* agent.active, true or false; -1 with an exception set. */
static inline int agent_active(PyObject *agent, SlotCache *cache) {
    PyObject *active = slot_get(agent, str_active, cache);
    if (active == NULL) return -1;
    int result = active == Py_True ? 1 : active == Py_False ? 0 : PyObject_IsTrue(active);
    Py_DECREF(active);
    return result;
}

/* The pending exception was raised by the agent's part: switch the agent off, as hooks.guard
 * does, and clear it (0); an exception that is not an Exception stays set (-1). */
static RARE int disable_agent(PyObject *agent, PyObject *where) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) PyException_SetTraceback(value, tb);
    PyObject *result = PyObject_CallMethodObjArgs(agent, str_disable, where, value, NULL);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (result == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
        PyErr_Clear(); /* Agent.disable swallows its own errors; never the user's problem */
    }
    Py_XDECREF(result);
    return 0;
}

/* -- NextWrapper: _BaseDataLoaderIter.__next__ ------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    CounterFields *counter;
    PyObject *original;     /* torch's __next__ */
    PyObject *on_batch;     /* counter.on_batch: the full handler (evaluation batches) */
    PyObject *on_exhausted; /* guarded counter.on_exhausted */
    char record; /* 0: time the call and count nothing (instrument_overhead's ablation) */
    SlotCache active_slot;
} NextWrapper;

/* An int a Python handler returned (None: NONE_INT); -1 with an exception set. */
static int as_optional_int(PyObject *value, long long *out) {
    if (value == Py_None) {
        *out = NONE_INT;
        return 0;
    }
    *out = PyLong_AsLongLong(value);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The length slot of tensor_type's C base, kept with the type it was found for (a reference
 * held: the identity is compared at every batch). */
static RARE void find_tensor_length(CounterFields *counter) {
    PyObject *type = counter->tensor_type;
    PyTypeObject *base = ((PyTypeObject *)type)->tp_base;
    counter->tensor_length = base != NULL && base->tp_as_mapping != NULL
                                 ? base->tp_as_mapping->mp_length
                                 : NULL;
    Py_XSETREF(counter->length_type, Py_NewRef(type));
}

/* Samples in the batch: the leading dimension of its first tensor, for the common cases
 * (a tensor, a tuple or list starting with one); steps.batch_len for the rest. Sets *n
 * (NONE_INT when unknown); -1 with an exception set. */
static int batch_samples(CounterFields *counter, PyObject *batch, long long *n) {
    PyObject *first = NULL;
    PyTypeObject *kind = Py_TYPE(batch);
    PyObject *tensor_type = counter->tensor_type;
    if ((kind == &PyTuple_Type || kind == &PyList_Type) && Py_SIZE(batch) > 0) {
        PyObject *item = kind == &PyTuple_Type ? PyTuple_GET_ITEM(batch, 0)
                                               : PyList_GET_ITEM(batch, 0);
        if ((PyObject *)Py_TYPE(item) == tensor_type) first = item;
    } else if ((PyObject *)kind == tensor_type) {
        first = batch;
    }
    PyObject *value;
    if (first == NULL) {
        value = PyObject_CallFunctionObjArgs(counter->batch_len, batch, tensor_type, NULL);
    } else {
        /* The leading dimension without building torch.Size: torch.Tensor.__len__ is Python
         * code, its C base's length slot is not (a 0-d tensor gives 0 there: the shape says
         * which, as it does for an empty batch). */
        if (UNLIKELY(counter->length_type != tensor_type)) find_tensor_length(counter);
        lenfunc length = counter->tensor_length;
        if (length != NULL) {
            Py_ssize_t leading = length(first);
            if (leading > 0) {
                *n = leading;
                return 0;
            }
            if (leading < 0) return -1;
        }
        PyObject *shape = PyObject_GetAttr(first, str_shape);
        if (shape == NULL) return -1;
        value = PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0 ? PyTuple_GET_ITEM(shape, 0)
                                                                     : Py_None;
        Py_INCREF(value);
        Py_DECREF(shape);
    }
    if (value == NULL) return -1;
    int status = as_optional_int(value, n);
    Py_DECREF(value);
    return status;
}

/* loaders.first_batch(it, t_end): the first batch of an iterator (once per pass). */
static RARE int first_batch(CounterFields *c, PyObject *it, long long t_end) {
    PyObject *end = PyLong_FromLongLong(t_end);
    if (end == NULL) return -1;
    PyObject *r = PyObject_CallMethodObjArgs(c->loaders, str_first_batch, it, end, NULL);
    Py_DECREF(end);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* next() raised (StopIteration at the end of a pass, or the loader's own error): recorded by
 * the guarded counter.on_exhausted, and re-raised (NULL, the exception set) unless a
 * BaseException out of the guard replaced it. */
static RARE PyObject *next_raised(NextWrapper *w, PyObject *agent, PyObject *it, long long t0,
                                  long long dt) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (agent_active(agent, &w->active_slot) > 0) {
        PyObject *r = PyObject_CallFunction(w->on_exhausted, "OLL", it, t0, dt);
        if (r == NULL) { /* a BaseException out of the guard: it replaces the loader's */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return NULL;
        }
        Py_DECREF(r);
    }
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
    return NULL;
}

/* The full batch handler (counter.on_batch): 0, or -1 with an exception set. */
static RARE int full_batch(NextWrapper *w, PyObject *it, PyObject *batch, long long t0,
                           long long dt) {
    PyObject *r = PyObject_CallFunction(w->on_batch, "OOLL", it, batch, t0, dt);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* StepCounter.on_batch's training path: 0 done, 1 not the common case (call the full
 * handler), -1 with an exception set. */
static int count_batch(NextWrapper *w, PyObject *it, PyObject *batch, long long t0,
                       long long dt) {
    CounterFields *c = w->counter;
    if (!c->grad_enabled || !c->tensor_type || !c->batch_len || !c->loaders)
        return 1; /* not set up: the full handler says what is missing */
    int on_step_thread = !c->has_step_thread || c->step_thread == PyThread_get_thread_ident();
    if (on_step_thread) {
        if (c->evaluation != NULL && c->evaluation != Py_None) return 1;
        int enabled;
        if (c->grad_mode_is_enabled != NULL) {
            enabled = c->grad_mode_is_enabled();
        } else {
            PyObject *grad = PyObject_CallNoArgs(c->grad_enabled);
            if (grad == NULL) return -1;
            enabled = grad == Py_True ? 1 : grad == Py_False ? 0 : PyObject_IsTrue(grad);
            Py_DECREF(grad);
            if (enabled < 0) return -1;
        }
        if (!enabled) return 1;
    }
    long long n;
    if (batch_samples(c, batch, &n) < 0) return -1;
    if (on_step_thread) c->data_wait += dt;
    c->batches += 1;
    c->loader_seen = 1;
    if (c->boundary == NONE_INT) c->boundary = t0;
    if (n == NONE_INT) n = c->loader_batch_size;
    if (n != NONE_INT) {
        c->samples += n;
        c->last_batch_size = n;
    }
    if (UNLIKELY(c->first_batches_due > 0)) return first_batch(c, it, t0 + dt);
    return 0;
}

static PyObject *next_vectorcall(NextWrapper *w, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0))
        return PyObject_Vectorcall(w->original, args, nargsf, kwnames); /* torch's own error */
    PyObject *it = args[0];
    PyObject *agent = w->counter->agent;
    int active = agent == NULL ? 0 : agent_active(agent, &w->active_slot);
    if (active <= 0) {
        PyErr_Clear();
        return PyObject_CallOneArg(w->original, it);
    }
    long long t0 = now_ns();
    PyObject *batch = PyObject_CallOneArg(w->original, it);
    long long dt = now_ns() - t0;
    if (UNLIKELY(batch == NULL)) return next_raised(w, agent, it, t0, dt);
    active = agent_active(agent, &w->active_slot);
    if (UNLIKELY(active < 0)) PyErr_Clear();
    if (active <= 0 || !w->record) return batch;
    int status = count_batch(w, it, batch, t0, dt);
    if (UNLIKELY(status == 1)) status = full_batch(w, it, batch, t0, dt);
    if (UNLIKELY(status < 0) && disable_agent(agent, str_dataloader_next) < 0) {
        Py_DECREF(batch);
        return NULL;
    }
    return batch;
}

static PyObject *next_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *counter, *original, *on_batch, *on_exhausted;
    static char *names[] = {"counter", "original", "on_batch", "on_exhausted", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOO:NextWrapper", names,
                                     &CounterFieldsType, &counter, &original, &on_batch,
                                     &on_exhausted))
        return NULL;
    NextWrapper *w = (NextWrapper *)type->tp_alloc(type, 0);
    if (w == NULL) return NULL;
    w->vectorcall = (vectorcallfunc)next_vectorcall;
    w->counter = (CounterFields *)Py_NewRef(counter);
    w->original = Py_NewRef(original);
    w->on_batch = Py_NewRef(on_batch);
    w->on_exhausted = Py_NewRef(on_exhausted);
    w->record = 1;
    return (PyObject *)w;
}

static int next_traverse(NextWrapper *w, visitproc visit, void *arg) {
    Py_VISIT(w->counter);
    Py_VISIT(w->original);
    Py_VISIT(w->on_batch);
    Py_VISIT(w->on_exhausted);
    return 0;
}

static int next_clear(NextWrapper *w) {
    Py_CLEAR(w->counter);
    Py_CLEAR(w->original);
    Py_CLEAR(w->on_batch);
    Py_CLEAR(w->on_exhausted);
    return 0;
}

static void next_dealloc(NextWrapper *w) {
    PyObject_GC_UnTrack(w);
    next_clear(w);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

/* it.__next__ (a bound method), as a function in the class would give. */
static PyObject *next_descr_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyMemberDef next_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(NextWrapper, original), READONLY, NULL},
    {"record", T_BOOL, offsetof(NextWrapper, record), 0,
     "False: the call is timed and nothing is counted (the benchmark's ablation)."},
    {NULL}};

static PyTypeObject NextWrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_torchdoctor_agent._fast.NextWrapper",
    .tp_basicsize = sizeof(NextWrapper),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "NextWrapper(counter, original, on_batch, on_exhausted): the timed __next__ "
              "of torch's DataLoader iterators.",
    .tp_vectorcall_offset = offsetof(NextWrapper, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = next_descr_get,
    .tp_traverse = (traverseproc)next_traverse,
    .tp_clear = (inquiry)next_clear,
    .tp_dealloc = (destructor)next_dealloc,
    .tp_members = next_members,
    .tp_new = next_new,
};

/* -- StepHook: the optimizer step post-hook ----------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    CounterFields *counter;
    PyObject *full_step; /* counter._on_step(optimizer, t): every step that is not the common one */
    long long flush_interval_ns;
    char record; /* 0: read the clock and record nothing (instrument_overhead's ablation) */
    SlotCache active_slot, steps_slot, max_steps_slot, last_flush_slot;
    IntCache max_steps, last_flush;
} StepHook;

/* The optimizer that ended the last step, borrowed (NULL: none, or gone). */
static PyObject *last_optimizer(CounterFields *c) {
    PyObject *ref = c->last_optimizer;
    if (ref == NULL || !PyWeakref_CheckRef(ref)) return NULL;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *target;
    if (PyWeakref_GetRef(ref, &target) <= 0) {
        PyErr_Clear();
        return NULL;
    }
    Py_DECREF(target); /* only its identity is compared; the caller holds the optimizer */
    return target;
#else
    PyObject *target = PyWeakref_GET_OBJECT(ref);
    return target == Py_None ? NULL : target;
#endif
}

/* Agent.after_step(t): a flush is due. */
static RARE int after_step(PyObject *agent, long long t) {
    PyObject *end = PyLong_FromLongLong(t);
    if (end == NULL) return -1;
    PyObject *r = PyObject_CallMethodOneArg(agent, str_after_step, end);
    Py_DECREF(end);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Room for more kept rows: -1 with an exception set. */
static RARE int grow_rows(CounterFields *c) {
    Py_ssize_t capacity = c->row_capacity ? 2 * c->row_capacity : 256;
    StepRow *rows = PyMem_Realloc(c->rows, capacity * sizeof(StepRow));
    if (rows == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    c->rows = rows;
    c->row_capacity = capacity;
    return 0;
}

/* StepCounter.on_step's short path: 0 done, 1 not the common step, -1 with an exception set.
 * The step's numbers go into the counter's array of rows: Agent.flush packs them into the
 * message's columns (pack_rows); whatever else appends to agent.steps drains them first. */
static int close_step(StepHook *h, PyObject *optimizer, long long t) {
    CounterFields *c = h->counter;
    /* `fast` says what on_step's short path needs held at the last full step; CUDA's start
     * clears it (StepCounter.on_cuda_start, through torch.cuda._lazy_call) */
    if (!c->fast || c->cuda_started || (c->evaluation != NULL && c->evaluation != Py_None) ||
        c->boundary == NONE_INT || last_optimizer(c) != optimizer)
        return 1;
    if (UNLIKELY(c->row_count == c->row_capacity) && grow_rows(c) < 0) return -1;
    StepRow *row = &c->rows[c->row_count++];
    row->step = c->step;
    row->t = t;
    row->wall = t - c->boundary - c->eval_ns;
    row->data_wait = c->data_wait;
    row->batch_size = c->last_batch_size;
    row->samples = c->samples;
    row->autocast_dtype = Py_NewRef(c->autocast_dtype ? c->autocast_dtype : Py_None);
    row->scaler_used = c->scaler_used;
    c->step += 1;
    c->boundary = t;
    PyObject *fed = c->batches > 0 ? Py_True : Py_False;
    if (c->prev_step_fed != fed) Py_XSETREF(c->prev_step_fed, Py_NewRef(fed));
    c->data_wait = c->samples = c->batches = c->eval_ns = 0;
    if ((c->autocast_dtype != NULL && c->autocast_dtype != Py_None) || c->scaler_used) {
        Py_XSETREF(c->autocast_dtype, Py_NewRef(Py_None));
        c->scaler_used = 0;
    }
    /* Agent.after_step's conditions, checked here first: most steps need neither. */
    PyObject *agent = c->agent;
    PyObject *steps = slot_get(agent, str_steps, &h->steps_slot);
    if (steps == NULL) return -1;
    Py_ssize_t buffered = c->row_count + (PyList_Check(steps) ? PyList_GET_SIZE(steps) : 0);
    Py_DECREF(steps);
    long long most, flushed;
    if (cached_int(agent, str_flush_max_steps, &h->max_steps_slot, &h->max_steps, &most) < 0 ||
        cached_int(agent, str_last_flush, &h->last_flush_slot, &h->last_flush, &flushed) < 0)
        return -1;
    if (UNLIKELY(buffered >= most || t - flushed >= h->flush_interval_ns))
        return after_step(agent, t);
    return 0;
}

/* The full step path (steps.StepCounter._on_step, which drains the kept rows first): 0, or -1
 * with an exception set. */
static RARE int full_step(StepHook *h, PyObject *optimizer, long long t) {
    PyObject *r = PyObject_CallFunction(h->full_step, "OL", optimizer, t);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static PyObject *step_vectorcall(StepHook *h, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "the step hook takes (optimizer, args, kwargs)");
        return NULL;
    }
    PyObject *agent = h->counter->agent;
    int active = agent == NULL ? 0 : agent_active(agent, &h->active_slot);
    if (active <= 0) {
        if (active < 0) PyErr_Clear();
        Py_RETURN_NONE;
    }
    long long t = now_ns();
    if (!h->record) Py_RETURN_NONE;
    int status = close_step(h, args[0], t);
    if (UNLIKELY(status == 1)) status = full_step(h, args[0], t);
    if (UNLIKELY(status < 0) && disable_agent(agent, str_optimizer_step) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *step_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *counter, *full_step;
    long long interval;
    static char *names[] = {"counter", "full_step", "flush_interval_ns", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OL:StepHook", names, &CounterFieldsType,
                                     &counter, &full_step, &interval))
        return NULL;
    StepHook *h = (StepHook *)type->tp_alloc(type, 0);
    if (h == NULL) return NULL;
    h->vectorcall = (vectorcallfunc)step_vectorcall;
    h->counter = (CounterFields *)Py_NewRef(counter);
    h->full_step = Py_NewRef(full_step);
    h->flush_interval_ns = interval;
    h->record = 1;
    return (PyObject *)h;
}

static int step_traverse(StepHook *h, visitproc visit, void *arg) {
    Py_VISIT(h->counter);
    Py_VISIT(h->full_step);
    Py_VISIT(h->max_steps.object);
    Py_VISIT(h->last_flush.object);
    return 0;
}

static int step_clear(StepHook *h) {
    Py_CLEAR(h->counter);
    Py_CLEAR(h->full_step);
    Py_CLEAR(h->max_steps.object);
    Py_CLEAR(h->last_flush.object);
    return 0;
}

static void step_dealloc(StepHook *h) {
    PyObject_GC_UnTrack(h);
    step_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyMemberDef step_members[] = {
    {"record", T_BOOL, offsetof(StepHook, record), 0,
     "False: the clock is read and nothing is recorded (the benchmark's ablation)."},
    {NULL}};

static PyTypeObject StepHookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_torchdoctor_agent._fast.StepHook",
    .tp_basicsize = sizeof(StepHook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "StepHook(counter, full_step, flush_interval_ns): the step boundary, torch's "
              "global optimizer step post-hook.",
    .tp_vectorcall_offset = offsetof(StepHook, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)step_traverse,
    .tp_clear = (inquiry)step_clear,
    .tp_dealloc = (destructor)step_dealloc,
    .tp_members = step_members,
    .tp_new = step_new,
};

/* -- the module ------------------------------------------------------------------------------ */

static PyObject *perf_counter_ns(PyObject *module, PyObject *unused) {
    return PyLong_FromLongLong(now_ns());
}

static PyMethodDef module_methods[] = {
    {"perf_counter_ns", perf_counter_ns, METH_NOARGS,
     "The clock the compiled path reads (a test compares it with time.perf_counter_ns)."},
    {NULL}};

static struct PyModuleDef fast_module = {
    PyModuleDef_HEAD_INIT, "_fast",
    "The agent's per-batch and per-step fast path, compiled (see steps.py).", -1,
    module_methods};

PyMODINIT_FUNC PyInit__fast(void) {
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(str_active, "active")
    INTERN(str_steps, "steps")
    INTERN(str_flush_max_steps, "flush_max_steps")
    INTERN(str_last_flush, "last_flush")
    INTERN(str_after_step, "after_step")
    INTERN(str_disable, "disable")
    INTERN(str_shape, "shape")
    INTERN(str_first_batch, "first_batch")
    INTERN(str_dataloader_next, "dataloader-next")
    INTERN(str_optimizer_step, "optimizer-step")
#undef INTERN
    if (PyType_Ready(&CounterFieldsType) < 0 || PyType_Ready(&NextWrapperType) < 0 ||
        PyType_Ready(&StepHookType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&fast_module);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "CounterFields", (PyObject *)&CounterFieldsType) < 0 ||
        PyModule_AddObjectRef(module, "NextWrapper", (PyObject *)&NextWrapperType) < 0 ||
        PyModule_AddObjectRef(module, "StepHook", (PyObject *)&StepHookType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
