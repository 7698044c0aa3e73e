// The replica engine's greenlet loop in C (replica_engine.cpp), added to cudist._core.
#pragma once

#include <Python.h>

namespace cudist_bindings {

/// Adds replica_engine_setup, replica_main, replica_meet and replica_run to
/// ``module``; returns -1 with a Python error set on failure.
int add_replica_engine(PyObject* module);

}  // namespace cudist_bindings
