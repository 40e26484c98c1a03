// The whole programs mha-run and mha-info as functions, so that tests run
// them in process (exit status, stdout and stderr) without starting a child
// process.  Each returns the exit status its --help documents; main() only
// calls them.
#pragma once

namespace mha_tools {

int mha_run_main(int argc, const char* const* argv);
int mha_info_main(int argc, const char* const* argv);

}  // namespace mha_tools
