// mha-run: scaled dot-product attention on .npy files, with the mha library.
//
//   mha-run --q Q.npy --k K.npy --v V.npy --out O.npy [--mask M.npy]
//           [--valid-lens VL.npy] [--causal top-left|bottom-right] [--scale S]
//           [--lse LSE.npy] [--backend NAME] [--threads N] [--repeat N]
//   mha-run module --weights DIR --query Q.npy [--key K.npy] [--value V.npy]
//           --out O.npy [--heads N] [--valid-lens VL.npy] [--key-padding-mask M.npy]
//           [--attn-mask M.npy] [--causal] [--need-weights W.npy [--average-weights]]
//           [--sequence-first] [--threads N] [--backend NAME] [--repeat N]
//
// The attention flags sit on the top-level command; further modes come as
// subcommands (`mha-run module ...`), each registered in main() below and
// dispatched when parsed, without changing the flags above.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <string>

#include "attention_run.h"
#include "module_run.h"

namespace {

std::string one_line_failure(const CLI::App* /*app*/, const CLI::Error& e) {
  return std::string("mha-run: ") + e.what() + " (see mha-run --help)\n";
}

int run(int argc, char** argv) {
  CLI::App app{"Scaled dot-product attention on .npy files with the mha library.", "mha-run"};
  app.failure_message(one_line_failure);
  app.require_subcommand(0, 1);

  mha_tools::AttentionOptions attention;
  mha_tools::add_attention_options(app, attention);

  mha_tools::ModuleOptions module_options;
  CLI::App* module = app.add_subcommand(
      "module", "The multi-head attention module (PyTorch's nn.MultiheadAttention) on .npy files");
  mha_tools::add_module_options(*module, module_options);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (module->parsed()) return mha_tools::run_module_command(module_options);
  return mha_tools::run_attention_command(attention);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mha-run: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "mha-run: unknown exception\n");
  }
  return 1;
}
