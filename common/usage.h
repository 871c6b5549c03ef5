#ifndef FLCE_COMMON_USAGE_H_
#define FLCE_COMMON_USAGE_H_

// --help and --version for flce's binaries.

#include "absl/strings/string_view.h"

namespace flce {

// Sets the program's usage text and its --version line ("<program>
// <kVersion>"). Call before absl::ParseCommandLine.
void InitUsage(absl::string_view program, absl::string_view usage);

// If argv asks for help (--help, -help, --helpshort; -h where the program
// has no flag of that name), prints the usage
// text and every flag defined in `main_file` (the file holding main(), e.g.
// "server/main.cc"): name, default and meaning, sorted; then exits 0.
// --helpfull stays absl's (every flag, libraries' too). Call before
// absl::ParseCommandLine.
void HandleHelp(int argc, char** argv, absl::string_view main_file);

}  // namespace flce

#endif  // FLCE_COMMON_USAGE_H_
