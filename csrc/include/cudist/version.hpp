/// @file version.hpp
/// @brief cudist's version, as numbers.
///
/// The one place the version is written: pyproject.toml reads these three macros (scikit-build-core's
/// regex provider), CMake reads them for project(VERSION) and `cudist.__version__` is the installed
/// distribution's version.
#pragma once

#define CUDIST_VERSION_MAJOR 0
#define CUDIST_VERSION_MINOR 1
#define CUDIST_VERSION_PATCH 0

#define CUDIST_DETAIL_STRINGIFY_(x) #x
#define CUDIST_DETAIL_STRINGIFY(x) CUDIST_DETAIL_STRINGIFY_(x)
/// "MAJOR.MINOR.PATCH" as a string literal.
#define CUDIST_VERSION_STRING                                                                   \
  CUDIST_DETAIL_STRINGIFY(CUDIST_VERSION_MAJOR)                                                 \
  "." CUDIST_DETAIL_STRINGIFY(CUDIST_VERSION_MINOR) "." CUDIST_DETAIL_STRINGIFY(CUDIST_VERSION_PATCH)

namespace cudist {
/// The version of these headers, "MAJOR.MINOR.PATCH".
inline constexpr const char* version_string = CUDIST_VERSION_STRING;
}  // namespace cudist
