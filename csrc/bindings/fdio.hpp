// Checkpoint file writes without the GIL (write(2) + CRC-32 per chunk), bound into cudist._core.
#pragma once

#include <pybind11/pybind11.h>

namespace cudist_bindings {

/// Adds ``write_crc32`` to the module.
void bind_fdio(pybind11::module_& m);

}  // namespace cudist_bindings
