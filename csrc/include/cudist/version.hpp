/// @file version.hpp
/// @brief cudist's version, as numbers.
#pragma once

#define CUDIST_VERSION_MAJOR 0
#define CUDIST_VERSION_MINOR 1
#define CUDIST_VERSION_PATCH 0

namespace cudist {
/// The version of these headers, "MAJOR.MINOR.PATCH".
inline constexpr const char* version_string = "0.1.0";
}  // namespace cudist
