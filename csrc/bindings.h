// What the binding files declare for bindings.cpp's PYBIND11_MODULE, which calls each once, in
// order, while the module leanddp._C is imported.
#pragma once

#include <pybind11/pybind11.h>

// leanddp._C.Modes, ModeError and check_modes (bindings_modes.cpp). Called after the Reducer's
// bindings, which bind the NanCheck enum that Modes holds.
void bind_modes(pybind11::module_& m);
