// mha-info: what the mha library sees on this machine -- version, CPU
// features, backends (usable or why not), the selected backend, threads.
//
//   mha-info [--json] [--output FILE] [--version]
//
// Exit status: 0, 1 when no backend can be selected (the report is printed
// all the same) or the report cannot be written, CLI11's codes (100-127) for
// a command line it cannot parse.
#include "tool_main.h"

int main(int argc, char** argv) {
  return mha_tools::mha_info_main(argc, argv);
}
