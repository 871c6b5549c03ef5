#include "common/usage.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/version.h"

namespace flce {

void InitUsage(absl::string_view program, absl::string_view usage) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.version_string = [line = absl::StrCat(program, " ", kVersion, "\n")] { return line; };
  absl::SetFlagsUsageConfig(config);
}

void HandleHelp(int argc, char** argv, absl::string_view main_file) {
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;
    // -h is help unless the program has a flag h (flce's hidden size).
    help = help || arg == "--help" || arg == "-help" || arg == "--helpshort" ||
           (arg == "-h" && absl::FindCommandLineFlag("h") == nullptr);
  }
  if (!help) return;
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), main_file)) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::string text = absl::StrCat(absl::ProgramUsageMessage(), "\n\nflags:\n");
  for (const absl::CommandLineFlag* flag : flags) {
    std::string value = flag->DefaultValue();
    if (value.empty()) value = "\"\"";
    absl::StrAppend(&text, "  --", flag->Name(), "  (default ", value, ")\n      ", flag->Help(),
                    "\n");
  }
  absl::StrAppend(&text,
                  "\n  --version  print the version and exit\n"
                  "  --flagfile=FILE  read flags from FILE, one per line\n"
                  "  --helpfull  every flag, the libraries' too\n");
  std::fputs(text.c_str(), stdout);
  std::exit(0);
}

}  // namespace flce
