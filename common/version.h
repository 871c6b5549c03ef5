#ifndef FLCE_COMMON_VERSION_H_
#define FLCE_COMMON_VERSION_H_

namespace flce {

// flce's version: GetServerInfo reports it, and both binaries print it
// for --version.
inline constexpr char kVersion[] = "0.1.0";

}  // namespace flce

#endif  // FLCE_COMMON_VERSION_H_
