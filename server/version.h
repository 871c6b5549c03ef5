#ifndef FLCE_SERVER_VERSION_H_
#define FLCE_SERVER_VERSION_H_

namespace flce {

// The server's version, reported by GetServerInfo and --version.
inline constexpr char kVersion[] = "0.1.0";

}  // namespace flce

#endif  // FLCE_SERVER_VERSION_H_
