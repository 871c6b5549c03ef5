#ifndef FLCE_PROTO_CRC32C_H_
#define FLCE_PROTO_CRC32C_H_

// CRC-32C (Castagnoli), the checksum of PutWeight's byte stream.

#include <cstddef>
#include <cstdint>

namespace flce {

// Extends `crc` (0 to start) over `size` bytes.
uint32_t Crc32c(uint32_t crc, const void* data, size_t size);

}  // namespace flce

#endif  // FLCE_PROTO_CRC32C_H_
