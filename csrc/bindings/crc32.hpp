// CRC-32 (zlib's: the reflected polynomial 0xEDB88320) with PCLMULQDQ folding, bound in core.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cudist_bindings {

/// zlib.crc32(buf[0:len], value): PCLMULQDQ folding where the CPU has it, a table loop otherwise.
uint32_t crc32(const unsigned char* buf, size_t len, uint32_t value);

/// Whether crc32 folds with PCLMULQDQ on this CPU (else the table loop is slower than zlib's).
bool crc32_accelerated();

}  // namespace cudist_bindings
