// The pieces of the Python module leanddp._C, one function per bindings*.cpp file; the module
// itself (bindings.cpp) calls them. Only bindings*.cpp files know pybind11.
#pragma once

#include <pybind11/pybind11.h>

namespace leanddp {

// bindings_reducer.cpp: the Reducer, its options and statistics, communication hooks.
void bind_reducer(pybind11::module_& m);
// bindings_optimizer.cpp: InBackwardOptimizer, its options, hyper-parameters and statistics.
void bind_optimizer(pybind11::module_& m);
// bindings_modes.cpp: leanddp._C.Modes, ModeError and check_modes. Called after
// bind_reducer, which binds the NanCheck enum that Modes holds.
void bind_modes(pybind11::module_& m);
// bindings_testing.cpp: the test seams, in the submodule leanddp._C._testing.
void bind_testing(pybind11::module_& m);

}  // namespace leanddp
