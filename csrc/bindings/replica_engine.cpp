// The replica engine's per-step loop in C: cudist._replica_engine's greenlet mode without the
// bytecode. Python keeps every decision that is not the common case (errors, mismatches, unwinding,
// the thread mode, the `auto` policy); these functions move messages and run the collectives of a
// step whose replicas agree, with the exact protocol of the Python versions they replace:
//
//   replica_main(box)           the body of a pooled replica greenlet   (_replica_engine._greenlet_main)
//   replica_meet(kind, payload) a replica at a collective               (_replica_engine.meet)
//   replica_run(...)            the tasks, then the collectives every replica agrees on (run_replicas'
//                               first branch), and the results when every replica returned
//
// Why: a 4-replica `run` + `all_reduce` of 256 KiB spent ~18 us in Python around an 8 us kernel;
// these take ~4 us of it (bench/PERFORMANCE.md, seventh session). Everything here holds the GIL.
#include "replica_engine.hpp"

#include <chrono>

namespace {

struct State {
  PyObject* ctxvar = nullptr;      // cudist._context.CTX
  PyObject* abort_type = nullptr;  // _replica_engine._Abort
  PyObject* getcurrent = nullptr;  // greenlet.getcurrent
  PyObject* globals = nullptr;     // _replica_engine's module dict (its _replica_thread is rebound after fork)
  PyObject* done = nullptr;        // _DONE, _ERROR, _ABORTED: the event kinds that end a task
  PyObject* error = nullptr;
  PyObject* aborted = nullptr;
};
State st;

PyObject* s_parent = nullptr;
PyObject* s_switch = nullptr;
PyObject* s_slot = nullptr;
PyObject* s_meet = nullptr;
PyObject* s_replica_thread = nullptr;

bool ready() {
  if (st.ctxvar == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "cudist._core: replica_engine_setup() was not called");
    return false;
  }
  return true;
}

void replace(PyObject*& slot, PyObject* value) {
  PyObject* old = slot;
  Py_XINCREF(value);
  slot = value;
  Py_XDECREF(old);
}

PyObject* engine_setup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !PyDict_Check(args[3]) || !PyTuple_Check(args[4]) || PyTuple_GET_SIZE(args[4]) != 3) {
    PyErr_SetString(PyExc_TypeError, "replica_engine_setup(ctxvar, abort_type, getcurrent, globals: dict, (done, error, aborted))");
    return nullptr;
  }
  replace(st.ctxvar, args[0]);
  replace(st.abort_type, args[1]);
  replace(st.getcurrent, args[2]);
  replace(st.globals, args[3]);
  replace(st.done, PyTuple_GET_ITEM(args[4], 0));
  replace(st.error, PyTuple_GET_ITEM(args[4], 1));
  replace(st.aborted, PyTuple_GET_ITEM(args[4], 2));
  Py_RETURN_NONE;
}

// The pending exception as an object carrying its traceback (as `except BaseException as e` gives it).
PyObject* take_exception() {
#if PY_VERSION_HEX >= 0x030C0000
  return PyErr_GetRaisedException();
#else
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr && value != nullptr) PyException_SetTraceback(value, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  return value;
#endif
}

// greenlet.getcurrent().parent.switch(arg)
PyObject* switch_to_parent(PyObject* arg) {
  PyObject* cur = PyObject_CallNoArgs(st.getcurrent);
  if (cur == nullptr) return nullptr;
  PyObject* parent = PyObject_GetAttr(cur, s_parent);
  Py_DECREF(cur);
  if (parent == nullptr) return nullptr;
  PyObject* call[2] = {parent, arg};
  PyObject* r = PyObject_VectorcallMethod(s_switch, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  Py_DECREF(parent);
  return r;
}

// (kind, [value]), stealing `value`.
PyObject* boxed_event(PyObject* kind, PyObject* value) {
  PyObject* box = PyList_New(1);
  if (box == nullptr) {
    Py_DECREF(value);
    return nullptr;
  }
  PyList_SET_ITEM(box, 0, value);
  PyObject* ev = PyTuple_Pack(2, kind, box);
  Py_DECREF(box);
  return ev;
}

// Empties a one-element list (a box), returning its item.
PyObject* unbox(PyObject* box, const char* what) {
  if (!PyList_CheckExact(box) || PyList_GET_SIZE(box) != 1) {
    PyErr_Format(PyExc_RuntimeError, "cudist replica engine: %s is not a one-element list", what);
    return nullptr;
  }
  PyObject* item = PyList_GET_ITEM(box, 0);
  Py_INCREF(item);
  if (PyList_SetSlice(box, 0, 1, nullptr) < 0) {
    Py_DECREF(item);
    return nullptr;
  }
  return item;
}

// _run_task(frame, fn, args, kwargs): the replica's outcome, its kind in `*kind` (borrowed) and
// the value returned (a new reference), or nullptr with a Python error set.
PyObject* run_task(PyObject* task, PyObject** kind_out) {
  if (!PyTuple_CheckExact(task) || PyTuple_GET_SIZE(task) != 4) {
    PyErr_SetString(PyExc_RuntimeError, "cudist replica engine: a task is (frame, fn, args, kwargs)");
    return nullptr;
  }
  PyObject* fn = PyTuple_GET_ITEM(task, 1);
  PyObject* args = PyTuple_GET_ITEM(task, 2);
  PyObject* kwargs = PyTuple_GET_ITEM(task, 3);
  PyObject* token = PyContextVar_Set(st.ctxvar, PyTuple_GET_ITEM(task, 0));
  if (token == nullptr) return nullptr;
  PyObject* result = nullptr;
  PyObject* targs = PyTuple_CheckExact(args) ? Py_NewRef(args) : PySequence_Tuple(args);
  if (targs != nullptr) {
    const int has_kwargs = PyObject_IsTrue(kwargs);
    if (has_kwargs >= 0) result = PyObject_Call(fn, targs, has_kwargs ? kwargs : nullptr);
    Py_DECREF(targs);
  }
  PyObject* kind;
  if (result != nullptr) {
    kind = st.done;
  } else if (PyErr_ExceptionMatches(st.abort_type)) {
    PyErr_Clear();
    kind = st.aborted;
    result = Py_NewRef(Py_None);
  } else {
    kind = st.error;
    result = take_exception();
    if (result == nullptr) result = Py_NewRef(Py_None);
  }
  if (PyContextVar_Reset(st.ctxvar, token) < 0) {
    Py_DECREF(token);
    Py_DECREF(result);
    return nullptr;
  }
  Py_DECREF(token);
  *kind_out = kind;
  return result;
}

// The relay: while the caller hands tasks or results to every replica in order (relay()), each
// replica, at its next event, stores it and switches straight to the next replica with that one's
// message; the last one switches back to the caller. n + 1 switches per exchange instead of 2n
// (~1 us of a 4-replica run + all_reduce). One relay at a time per thread (a collective's handler,
// where a nested run may happen, runs between relays), kept in thread-local storage: not on the
// caller's C stack, which greenlets swap out while the replicas run.
struct Relay {
  PyObject* workers = nullptr;  // borrowed, for the relay's duration
  PyObject* events = nullptr;
  PyObject* msgs = nullptr;
  Py_ssize_t pos = 0;
  Py_ssize_t n = 0;
  bool active = false;
};
thread_local Relay t_relay;

// A replica's event (kind, value; `value` stolen) to its exchange; returns what it is sent next. In
// a relay (this greenlet the replica whose turn it is), stored in the events and passed on;
// otherwise boxed to the parent, as the Python engine does.
PyObject* report(PyObject* kind, PyObject* value) {
  Relay& r = t_relay;
  if (r.active) {
    PyObject* cur = PyObject_CallNoArgs(st.getcurrent);
    if (cur == nullptr) {
      Py_DECREF(value);
      return nullptr;
    }
    if (r.pos < r.n && PyList_GET_ITEM(r.workers, r.pos) == cur) {
      PyObject* ev = PyTuple_Pack(2, kind, value);
      Py_DECREF(value);
      if (ev == nullptr || PyList_SetItem(r.events, r.pos, ev) < 0) {
        Py_DECREF(cur);
        return nullptr;
      }
      ++r.pos;
      PyObject* target;
      PyObject* msg;
      if (r.pos < r.n) {
        target = Py_NewRef(PyList_GET_ITEM(r.workers, r.pos));
        msg = PySequence_GetItem(r.msgs, r.pos);
      } else {
        target = PyObject_GetAttr(cur, s_parent);
        msg = Py_NewRef(Py_None);
      }
      Py_DECREF(cur);
      if (target == nullptr || msg == nullptr) {
        Py_XDECREF(target);
        Py_XDECREF(msg);
        return nullptr;
      }
      PyObject* call[2] = {target, msg};
      PyObject* next = PyObject_VectorcallMethod(s_switch, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
      Py_DECREF(target);
      Py_DECREF(msg);
      return next;
    }
    Py_DECREF(cur);
  }
  PyObject* ev = boxed_event(kind, value);
  if (ev == nullptr) return nullptr;
  PyObject* next = switch_to_parent(ev);
  Py_DECREF(ev);
  return next;
}

// The body of a pooled replica greenlet: run tasks forever, reporting each outcome to the parent.
// A GreenletExit thrown at the idle switch (the pool discarded) ends it, as in _greenlet_main.
PyObject* replica_main(PyObject*, PyObject* box) {
  if (!ready()) return nullptr;
  Py_INCREF(box);
  for (;;) {
    PyObject* task = unbox(box, "a task box");
    Py_DECREF(box);
    if (task == nullptr) return nullptr;
    PyObject* kind = nullptr;
    PyObject* value = run_task(task, &kind);
    Py_DECREF(task);  // an idle replica holds nothing of its last step
    if (value == nullptr) return nullptr;
    box = report(kind, value);
    if (box == nullptr) return nullptr;
  }
}

PyObject* replica_meet(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "meet(kind, payload)");
    return nullptr;
  }
  if (!ready()) return nullptr;
  PyObject* local = PyDict_GetItemWithError(st.globals, s_replica_thread);  // borrowed
  if (local == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "cudist replica engine: no _replica_thread");
    return nullptr;
  }
  PyObject* slot = PyObject_GetAttr(local, s_slot);
  if (slot == nullptr) return nullptr;
  if (slot != Py_None) {  // a replica thread: its _Slot.meet
    PyObject* call[3] = {slot, args[0], args[1]};
    PyObject* r = PyObject_VectorcallMethod(s_meet, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
    Py_DECREF(slot);
    return r;
  }
  Py_DECREF(slot);
  return report(args[0], Py_NewRef(args[1]));
}

// Sends msgs[i] (boxed tasks or results) to replica i, for every i in order, one switch there and
// one back each, storing each replica's next event unboxed in events[i]: relay()'s fallback.
int exchange(PyObject* workers, PyObject* events, PyObject* msgs) {
  const Py_ssize_t n = PyList_GET_SIZE(workers);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* g = PyList_GET_ITEM(workers, i);
    PyObject* msg = PySequence_GetItem(msgs, i);
    if (msg == nullptr) return -1;
    PyObject* call[2] = {g, msg};
    PyObject* ev = PyObject_VectorcallMethod(s_switch, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
    Py_DECREF(msg);
    if (ev == nullptr) return -1;
    if (!PyTuple_CheckExact(ev) || PyTuple_GET_SIZE(ev) != 2) {
      Py_DECREF(ev);
      PyErr_SetString(PyExc_RuntimeError, "cudist replica engine: a replica switched back without an event");
      return -1;
    }
    PyObject* item = unbox(PyTuple_GET_ITEM(ev, 1), "an event's box");
    if (item == nullptr) {
      Py_DECREF(ev);
      return -1;
    }
    PyObject* unboxed = PyTuple_Pack(2, PyTuple_GET_ITEM(ev, 0), item);
    Py_DECREF(item);
    Py_DECREF(ev);
    if (unboxed == nullptr || PyList_SetItem(events, i, unboxed) < 0) return -1;
  }
  return 0;
}

// exchange() by relay: msgs[i] (boxed tasks or results) to every replica in order, events[i] its
// next event. A plain exchange if a relay is under way on this thread already (one whose caller
// never got control back: a replica that switched to some other greenlet and stayed there).
int relay(PyObject* workers, PyObject* events, PyObject* msgs) {
  Relay& r = t_relay;
  const Py_ssize_t n = PyList_GET_SIZE(workers);
  if (r.active) return exchange(workers, events, msgs);
  PyObject* first = PySequence_GetItem(msgs, 0);
  if (first == nullptr) return -1;
  r.workers = workers;
  r.events = events;
  r.msgs = msgs;
  r.pos = 0;
  r.n = n;
  r.active = true;
  PyObject* call[2] = {PyList_GET_ITEM(workers, 0), first};
  PyObject* ret = PyObject_VectorcallMethod(s_switch, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  const Py_ssize_t reached = r.pos;
  r = Relay{};
  Py_DECREF(first);
  if (ret == nullptr) return -1;  // a replica greenlet died (its exception reached us, its parent)
  Py_DECREF(ret);
  if (reached != n) {
    PyErr_SetString(PyExc_RuntimeError,
                    "strategy.run: a replica switched greenlets by itself (to its parent) instead of returning or "
                    "calling a collective; the run is abandoned");
    return -1;
  }
  return 0;
}

bool check_lists(PyObject* workers, PyObject* events) {
  if (!PyList_CheckExact(workers) || !PyList_CheckExact(events) || PyList_GET_SIZE(events) != PyList_GET_SIZE(workers) ||
      PyList_GET_SIZE(workers) == 0) {
    PyErr_SetString(PyExc_TypeError, "workers and events must be lists of the same (non-zero) length");
    return false;
  }
  return true;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// While every replica waits at the same collective: events[i] = (kind, None), results =
// handlers[kind](payloads), each replica gets results[i] and runs to its next event. Adds the
// seconds spent in the replicas to `work`. Returns 0 once they no longer agree on a collective (all
// done, an error, a mismatch: run_replicas decides), 1 with `*exc` set when a handler raised (the
// replicas then wait at that collective, their events (kind, None), for run_replicas to unwind),
// -1 with a Python error set when an exchange failed.
int collect(PyObject* workers, PyObject* events, PyObject* handlers, double& work, PyObject** exc) {
  const Py_ssize_t n = PyList_GET_SIZE(events);
  for (;;) {
    PyObject* ev0 = PyList_GET_ITEM(events, 0);
    if (!PyTuple_CheckExact(ev0) || PyTuple_GET_SIZE(ev0) != 2) return 0;
    PyObject* kind = PyTuple_GET_ITEM(ev0, 0);
    if (kind == st.done || kind == st.error || kind == st.aborted) return 0;
    for (Py_ssize_t i = 1; i < n; ++i) {
      PyObject* ev = PyList_GET_ITEM(events, i);
      if (!PyTuple_CheckExact(ev) || PyTuple_GET_SIZE(ev) != 2) return 0;
      const int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(ev, 0), kind, Py_EQ);
      if (eq < 0) return -1;
      if (eq == 0) return 0;
    }
    Py_INCREF(kind);  // events[0], which holds it, is replaced below
    PyObject* payloads = PyList_New(n);
    PyObject* waiting = payloads == nullptr ? nullptr : PyTuple_Pack(2, kind, Py_None);
    if (waiting == nullptr) {
      Py_XDECREF(payloads);
      Py_DECREF(kind);
      return -1;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* ev = PyList_GET_ITEM(events, i);
      PyList_SET_ITEM(payloads, i, Py_NewRef(PyTuple_GET_ITEM(ev, 1)));
      PyList_SetItem(events, i, Py_NewRef(waiting));  // the payloads are the handler's now
    }
    Py_DECREF(waiting);
    PyObject* handler = PyObject_GetItem(handlers, kind);
    Py_DECREF(kind);
    PyObject* results = nullptr;
    if (handler != nullptr) {
      results = PyObject_CallOneArg(handler, payloads);
      Py_DECREF(handler);
    }
    Py_DECREF(payloads);
    if (results == nullptr) {
      *exc = take_exception();
      return *exc == nullptr ? -1 : 1;
    }
    // Every replica gets its result and runs on, even after another one raised (TF's rule).
    const double t0 = now();
    const int rc = relay(workers, events, results);
    work += now() - t0;
    Py_DECREF(results);
    if (rc < 0) return -1;
  }
}

// A whole run whose replicas agree: tasks (frames[i], fn, args_list[i], kwargs_list[i]) to every
// replica (`me` their parent), then collect(). Returns (seconds in the replicas, the handler's
// exception or None, the replicas' results or None): results only when every replica returned;
// otherwise run_replicas decides from `events` (an error, a mismatch) as after its own exchange.
PyObject* replica_run(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError, "replica_run(workers, me, frames, fn, args_list, kwargs_list, events, handlers)");
    return nullptr;
  }
  PyObject* workers = args[0];
  PyObject* events = args[6];
  if (!ready() || !check_lists(workers, events)) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(workers);
  PyObject* me = args[1];
  // Per replica its boxed task; and the caller becomes every replica's parent (the relay's last
  // replica switches back to it).
  PyObject* tasks = PyList_New(n);
  if (tasks == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* g = PyList_GET_ITEM(workers, i);
    PyObject* parent = PyObject_GetAttr(g, s_parent);
    if (parent == nullptr || (parent != me && PyObject_SetAttr(g, s_parent, me) < 0)) {
      Py_XDECREF(parent);
      Py_DECREF(tasks);
      return nullptr;
    }
    Py_DECREF(parent);
    PyObject* frame = PySequence_GetItem(args[2], i);
    PyObject* a = frame == nullptr ? nullptr : PySequence_GetItem(args[4], i);
    PyObject* kw = a == nullptr ? nullptr : PySequence_GetItem(args[5], i);
    PyObject* task = kw == nullptr ? nullptr : PyTuple_Pack(4, frame, args[3], a, kw);
    Py_XDECREF(frame);
    Py_XDECREF(a);
    Py_XDECREF(kw);
    PyObject* box = task == nullptr ? nullptr : PyList_New(1);
    if (box == nullptr) {
      Py_XDECREF(task);
      Py_DECREF(tasks);
      return nullptr;
    }
    PyList_SET_ITEM(box, 0, task);
    PyList_SET_ITEM(tasks, i, box);
  }
  double work = 0.0;
  const double t0 = now();
  const int rc = relay(workers, events, tasks);
  work += now() - t0;
  Py_DECREF(tasks);
  if (rc < 0) return nullptr;
  PyObject* exc = nullptr;
  if (collect(workers, events, args[7], work, &exc) < 0) return nullptr;
  PyObject* results = nullptr;
  if (exc == nullptr) {
    bool done = true;
    for (Py_ssize_t i = 0; i < n && done; ++i) {
      PyObject* ev = PyList_GET_ITEM(events, i);
      done = PyTuple_CheckExact(ev) && PyTuple_GET_SIZE(ev) == 2 && PyTuple_GET_ITEM(ev, 0) == st.done;
    }
    if (done) {
      results = PyList_New(n);
      if (results == nullptr) return nullptr;
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* ev = PyList_GET_ITEM(events, i);
        PyList_SET_ITEM(results, i, Py_NewRef(PyTuple_GET_ITEM(ev, 1)));
      }
    }
  }
  PyObject* w = PyFloat_FromDouble(work);
  PyObject* r = w == nullptr ? nullptr
                             : PyTuple_Pack(3, w, exc == nullptr ? Py_None : exc, results == nullptr ? Py_None : results);
  Py_XDECREF(w);
  Py_XDECREF(exc);
  Py_XDECREF(results);
  return r;
}

// Each docstring's first line is the signature, as pybind11 writes it (tests/test_typing.py reads it).
PyMethodDef methods[] = {
    {"replica_engine_setup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(engine_setup)), METH_FASTCALL,
     "replica_engine_setup(ctxvar, abort_type, getcurrent, engine_globals, kinds) -> None\n\nWhat the replica "
     "engine's C functions use (called once by cudist._replica_engine); kinds: (done, error, aborted)."},
    {"replica_main", replica_main, METH_O,
     "replica_main(box) -> None\n\nThe body of a pooled replica greenlet (cudist._replica_engine)."},
    {"replica_meet", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(replica_meet)), METH_FASTCALL,
     "replica_meet(kind, payload) -> object\n\nA replica at a collective (cudist._replica_engine.meet)."},
    {"replica_run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(replica_run)), METH_FASTCALL,
     "replica_run(workers, me, frames, fn, args_list, kwargs_list, events, handlers) -> tuple\n\nA run whose "
     "replicas agree: the tasks, then the collectives they agree on; returns (seconds in the replicas, the handler's exception "
     "or None, the results when every replica returned, else None)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

namespace cudist_bindings {

int add_replica_engine(PyObject* module) {
  s_parent = PyUnicode_InternFromString("parent");
  s_switch = PyUnicode_InternFromString("switch");
  s_slot = PyUnicode_InternFromString("slot");
  s_meet = PyUnicode_InternFromString("meet");
  s_replica_thread = PyUnicode_InternFromString("_replica_thread");
  if (s_parent == nullptr || s_switch == nullptr || s_slot == nullptr || s_meet == nullptr || s_replica_thread == nullptr)
    return -1;
  return PyModule_AddFunctions(module, methods);
}

}  // namespace cudist_bindings
