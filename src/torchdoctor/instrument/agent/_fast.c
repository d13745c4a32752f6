/* The agent's per-batch and per-step fast path, compiled (optional: steps.py and hooks.py keep
 * the pure-Python path, used where this module was not built or TORCHDOCTOR_AGENT_PURE_PYTHON
 * is set).
 *
 * Why C: in the job's loop the agent's Python runs cold (between two steps the job's own work
 * evicts it), so each bytecode it runs costs several times its warm price; the least a Python
 * agent can do on the same hooks measured above the per-step target. Here the common batch and
 * the common step are a few dozen loads and stores on one small struct.
 *
 * What is compiled is only the common case, written after steps.StepCounter.on_batch and
 * on_step, which stay the reference: anything else (an evaluation batch, a step that is not
 * ``fast``, a flush, the first batch of a loader) calls the same Python as the pure path, so
 * the two paths record the same rows.
 *
 * - CounterFields: the step counter's hot fields as object slots, the base class of
 *   steps.StepCounter (Python reads them as it reads __slots__).
 * - NextWrapper: _BaseDataLoaderIter.__next__ (a method descriptor, called unbound).
 * - StepHook: torch's global optimizer step post-hook.
 *
 * Errors follow hooks.guard: an Exception inside the agent's part calls agent.disable(where,
 * exc) and the user's call goes on with its own result; a BaseException that is not an
 * Exception (SystemExit of the stop rule, KeyboardInterrupt) propagates as the user's own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <structmember.h>
#include <time.h>

static PyObject *str_active, *str_steps, *str_flush_max_steps, *str_last_flush, *str_after_step,
    *str_disable, *str_initialized, *str_shape, *str_awaiting_first_batch, *str_first_batch,
    *str_dataloader_next, *str_optimizer_step;

/* time.perf_counter_ns on Linux (time.get_clock_info('perf_counter'): CLOCK_MONOTONIC); the
 * Python parts of the agent read the same clock. */
static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* -- CounterFields --------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    /* the step under way */
    PyObject *step, *boundary, *data_wait, *samples, *batches, *last_batch_size,
        *loader_batch_size, *loader_seen, *eval_ns, *prev_step_fed, *autocast_dtype,
        *scaler_used, *evaluation, *step_thread, *last_optimizer, *fast;
    /* set once (StepCounter.__init__, hooks.install) */
    PyObject *agent, *loaders, *grad_enabled, *tensor_type, *cuda_module, *batch_len;
} CounterFields;

#define FIELD(name) \
    {#name, T_OBJECT_EX, offsetof(CounterFields, name), 0, NULL}
static PyMemberDef counter_members[] = {
    FIELD(step), FIELD(boundary), FIELD(data_wait), FIELD(samples), FIELD(batches),
    FIELD(last_batch_size), FIELD(loader_batch_size), FIELD(loader_seen), FIELD(eval_ns),
    FIELD(prev_step_fed), FIELD(autocast_dtype), FIELD(scaler_used), FIELD(evaluation),
    FIELD(step_thread), FIELD(last_optimizer), FIELD(fast), FIELD(agent), FIELD(loaders),
    FIELD(grad_enabled), FIELD(tensor_type), FIELD(cuda_module), FIELD(batch_len),
    {NULL}};
#undef FIELD

#define COUNTER_FIELDS(X)                                                                      \
    X(step) X(boundary) X(data_wait) X(samples) X(batches) X(last_batch_size)                  \
    X(loader_batch_size) X(loader_seen) X(eval_ns) X(prev_step_fed) X(autocast_dtype)          \
    X(scaler_used) X(evaluation) X(step_thread) X(last_optimizer) X(fast) X(agent) X(loaders)  \
    X(grad_enabled) X(tensor_type) X(cuda_module) X(batch_len)

static int counter_traverse(CounterFields *self, visitproc visit, void *arg) {
#define VISIT(name) Py_VISIT(self->name);
    COUNTER_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int counter_clear(CounterFields *self) {
#define CLEAR(name) Py_CLEAR(self->name);
    COUNTER_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void counter_dealloc(CounterFields *self) {
    PyObject_GC_UnTrack(self);
    counter_clear(self);
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
    .tp_new = PyType_GenericNew,
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

static PyObject *slot_get(PyObject *obj, PyObject *name, SlotCache *cache) {
    PyTypeObject *type = Py_TYPE(obj);
    if (type != cache->type || type->tp_version_tag != cache->version || cache->version == 0) {
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
    if (cache->offset >= 0) {
        PyObject *value = *(PyObject **)((char *)obj + cache->offset);
        if (value != NULL) return Py_NewRef(value);
    }
    return PyObject_GetAttr(obj, name);
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
static int disable_agent(PyObject *agent, PyObject *where) {
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

/* field += delta (both Python ints); -1 with an exception set. */
static inline int add_to(PyObject **field, PyObject *delta) {
    PyObject *sum = PyNumber_Add(*field, delta);
    if (sum == NULL) return -1;
    Py_SETREF(*field, sum);
    return 0;
}

static inline void set_field(PyObject **field, PyObject *value) {
    Py_INCREF(value);
    Py_XSETREF(*field, value);
}

static PyObject *zero; /* the int 0 */
static PyObject *one;  /* the int 1 */

/* -- NextWrapper: _BaseDataLoaderIter.__next__ ------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    CounterFields *counter;
    PyObject *original;     /* torch's __next__ */
    PyObject *on_batch;     /* counter.on_batch: the full handler (evaluation batches) */
    PyObject *on_exhausted; /* guarded counter.on_exhausted */
    char record; /* 0: time the call and count nothing (instrument_overhead's ablation) */
    SlotCache active_slot, awaiting_slot;
} NextWrapper;

/* Samples in the batch: the leading dimension of its first tensor, for the common cases
 * (a tensor, a tuple or list starting with one); steps.batch_len for the rest. New reference
 * (None when unknown), NULL with an exception set. */
static PyObject *batch_samples(CounterFields *counter, PyObject *batch) {
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
    if (first == NULL)
        return PyObject_CallFunctionObjArgs(counter->batch_len, batch, tensor_type, NULL);
    PyObject *shape = PyObject_GetAttr(first, str_shape);
    if (shape == NULL) return NULL;
    PyObject *n = Py_None;
    if (PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0) n = PyTuple_GET_ITEM(shape, 0);
    Py_INCREF(n);
    Py_DECREF(shape);
    return n;
}

/* StepCounter.on_batch's training path: 0 done, 1 not the common case (call the full
 * handler), -1 with an exception set. */
static int count_batch(NextWrapper *w, PyObject *it, PyObject *batch, long long t0,
                       long long dt) {
    CounterFields *c = w->counter;
    if (!c->grad_enabled || !c->tensor_type || !c->batch_len || !c->data_wait || !c->batches ||
        !c->samples || !c->loaders)
        return 1; /* not set up: the full handler says what is missing */
    int on_step_thread = c->step_thread == NULL || c->step_thread == Py_None;
    if (!on_step_thread) {
        unsigned long ident = PyLong_AsUnsignedLong(c->step_thread);
        if (ident == (unsigned long)-1 && PyErr_Occurred()) return -1;
        on_step_thread = ident == PyThread_get_thread_ident();
    }
    if (on_step_thread) {
        if (c->evaluation != NULL && c->evaluation != Py_None) return 1;
        PyObject *grad = PyObject_CallNoArgs(c->grad_enabled);
        if (grad == NULL) return -1;
        int enabled = PyObject_IsTrue(grad);
        Py_DECREF(grad);
        if (enabled < 0) return -1;
        if (!enabled) return 1;
    }
    PyObject *n = batch_samples(c, batch);
    if (n == NULL) return -1;
    if (on_step_thread) {
        PyObject *delta = PyLong_FromLongLong(dt);
        if (delta == NULL || add_to(&c->data_wait, delta) < 0) {
            Py_XDECREF(delta);
            Py_DECREF(n);
            return -1;
        }
        Py_DECREF(delta);
    }
    if (add_to(&c->batches, one) < 0) {
        Py_DECREF(n);
        return -1;
    }
    set_field(&c->loader_seen, Py_True);
    if (c->boundary == NULL || c->boundary == Py_None) {
        PyObject *start = PyLong_FromLongLong(t0);
        if (start == NULL) {
            Py_DECREF(n);
            return -1;
        }
        Py_XSETREF(c->boundary, start);
    }
    if (n == Py_None && c->loader_batch_size != NULL) {
        Py_DECREF(n);
        n = Py_NewRef(c->loader_batch_size);
    }
    if (n != Py_None) {
        if (add_to(&c->samples, n) < 0) {
            Py_DECREF(n);
            return -1;
        }
        set_field(&c->last_batch_size, n);
    }
    Py_DECREF(n);
    PyObject *awaiting = slot_get(c->loaders, str_awaiting_first_batch, &w->awaiting_slot);
    if (awaiting == NULL) return -1;
    int first_due = PyObject_IsTrue(awaiting);
    Py_DECREF(awaiting);
    if (first_due < 0) return -1;
    if (first_due) {
        PyObject *t_end = PyLong_FromLongLong(t0 + dt);
        if (t_end == NULL) return -1;
        PyObject *r = PyObject_CallMethodObjArgs(c->loaders, str_first_batch, it, t_end, NULL);
        Py_DECREF(t_end);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
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
    if (batch == NULL) {
        /* StopIteration at the end of a pass, or the loader's own error: recorded, re-raised */
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
    active = agent_active(agent, &w->active_slot);
    if (active < 0) PyErr_Clear();
    if (active <= 0 || !w->record) return batch;
    int status = count_batch(w, it, batch, t0, dt);
    if (status == 1) {
        PyObject *r = PyObject_CallFunction(w->on_batch, "OOLL", it, batch, t0, dt);
        status = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    if (status < 0 && disable_agent(agent, str_dataloader_next) < 0) {
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
} StepHook;

/* StepCounter.on_step's short path: 0 done, 1 not the common step, -1 with an exception set. */
static int close_step(StepHook *h, PyObject *optimizer, long long t) {
    CounterFields *c = h->counter;
    PyObject *agent = c->agent;
    if (c->fast != Py_True || !c->step || !c->data_wait || !c->samples || !c->batches ||
        !c->eval_ns || (c->evaluation != NULL && c->evaluation != Py_None) ||
        c->last_optimizer == NULL || c->last_optimizer == Py_None || c->cuda_module == NULL ||
        c->cuda_module == Py_None || c->boundary == NULL || !PyLong_CheckExact(c->boundary))
        return 1;
    /* torch.cuda._initialized, from the module's dict (a module's attribute lookup goes through
     * its type first) */
    PyObject *cuda_dict = PyModule_Check(c->cuda_module) ? PyModule_GetDict(c->cuda_module) : NULL;
    PyObject *initialized = cuda_dict != NULL ? PyDict_GetItemWithError(cuda_dict, str_initialized)
                                              : NULL; /* borrowed */
    if (initialized == NULL) return PyErr_Occurred() ? -1 : 1;
    if (initialized != Py_False) return 1; /* CUDA is on (or unknown): the full step reads it */
    PyObject *last = PyObject_CallNoArgs(c->last_optimizer); /* the weakref */
    if (last == NULL) return -1;
    Py_DECREF(last); /* only its identity is compared */
    if (last != optimizer) return 1;

    long long boundary = PyLong_AsLongLong(c->boundary);
    long long eval_ns = PyLong_AsLongLong(c->eval_ns);
    if (PyErr_Occurred()) return -1;
    int samples = PyObject_IsTrue(c->samples);
    int fed = PyObject_RichCompareBool(c->batches, zero, Py_GT);
    if (samples < 0 || fed < 0) return -1;
    /* The row, as steps.StepCounter.on_step builds it: (step, t, wall, data wait, batch size,
     * samples or None, autocast dtype, scaler used). */
    PyObject *row = PyTuple_New(8);
    PyObject *t_end = PyLong_FromLongLong(t);
    PyObject *wall = PyLong_FromLongLong(t - boundary - eval_ns);
    if (row == NULL || t_end == NULL || wall == NULL) {
        Py_XDECREF(row);
        Py_XDECREF(t_end);
        Py_XDECREF(wall);
        return -1;
    }
    PyTuple_SET_ITEM(row, 0, Py_NewRef(c->step));
    PyTuple_SET_ITEM(row, 1, t_end);
    PyTuple_SET_ITEM(row, 2, wall);
    PyTuple_SET_ITEM(row, 3, Py_NewRef(c->data_wait));
    PyTuple_SET_ITEM(row, 4, Py_NewRef(c->last_batch_size ? c->last_batch_size : Py_None));
    PyTuple_SET_ITEM(row, 5, Py_NewRef(samples ? c->samples : Py_None));
    PyTuple_SET_ITEM(row, 6, Py_NewRef(c->autocast_dtype ? c->autocast_dtype : Py_None));
    PyTuple_SET_ITEM(row, 7, Py_NewRef(c->scaler_used ? c->scaler_used : Py_False));
    PyObject *steps = slot_get(agent, str_steps, &h->steps_slot);
    if (steps == NULL || !PyList_Check(steps) || PyList_Append(steps, row) < 0) {
        if (steps != NULL && !PyList_Check(steps))
            PyErr_SetString(PyExc_TypeError, "agent.steps is not a list");
        Py_XDECREF(steps);
        Py_DECREF(row);
        return -1;
    }
    Py_DECREF(row);
    Py_ssize_t buffered = PyList_GET_SIZE(steps);
    Py_DECREF(steps);
    if (add_to(&c->step, one) < 0) return -1;
    set_field(&c->boundary, t_end); /* the row holds it too */
    set_field(&c->prev_step_fed, fed ? Py_True : Py_False);
    set_field(&c->data_wait, zero);
    set_field(&c->samples, zero);
    set_field(&c->batches, zero);
    set_field(&c->eval_ns, zero);
    if ((c->autocast_dtype != NULL && c->autocast_dtype != Py_None) ||
        c->scaler_used == Py_True) {
        set_field(&c->autocast_dtype, Py_None);
        set_field(&c->scaler_used, Py_False);
    }
    /* Agent.after_step's conditions, checked here first: most steps need neither. */
    PyObject *max_steps = slot_get(agent, str_flush_max_steps, &h->max_steps_slot);
    if (max_steps == NULL) return -1;
    Py_ssize_t most = PyLong_AsSsize_t(max_steps);
    Py_DECREF(max_steps);
    PyObject *last_flush = slot_get(agent, str_last_flush, &h->last_flush_slot);
    if (last_flush == NULL) return -1;
    long long flushed = PyLong_AsLongLong(last_flush);
    Py_DECREF(last_flush);
    if (PyErr_Occurred()) return -1;
    if (buffered >= most || t - flushed >= h->flush_interval_ns) {
        PyObject *r = PyObject_CallMethodOneArg(agent, str_after_step, c->boundary);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
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
    if (status == 1) {
        PyObject *r = PyObject_CallFunction(h->full_step, "OL", args[0], t);
        status = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    if (status < 0 && disable_agent(agent, str_optimizer_step) < 0) return NULL;
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
    return 0;
}

static int step_clear(StepHook *h) {
    Py_CLEAR(h->counter);
    Py_CLEAR(h->full_step);
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
    INTERN(str_initialized, "_initialized")
    INTERN(str_shape, "shape")
    INTERN(str_awaiting_first_batch, "awaiting_first_batch")
    INTERN(str_first_batch, "first_batch")
    INTERN(str_dataloader_next, "dataloader-next")
    INTERN(str_optimizer_step, "optimizer-step")
#undef INTERN
    if ((zero = PyLong_FromLong(0)) == NULL || (one = PyLong_FromLong(1)) == NULL) return NULL;
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
