#include "cli_options.h"

#include <mha/mha.h>

#include <CLI/CLI.hpp>

namespace mha_tools {

void add_run_options(CLI::App& app, RunOptions& o) {
  const CLI::Validator& filled = non_empty();
  app.add_option("--backend", o.backend, "backend to use (default: MHA_BACKEND, else auto)")
      ->check(filled);
  app.add_option_function<int>(
         "--threads", [&o](const int& n) { o.threads = n; }, "threads inside one call")
      ->check(filled);
  app.add_option("--repeat", o.repeat,
                 "time N calls after the first and print one JSON line with the median")
      ->check(filled)
      ->check(CLI::Range(1, 1000000000));
}

const CLI::Validator& non_empty() {
  static const CLI::Validator validator(
      [](const std::string& value) {
        return value.empty() ? std::string("the value is empty") : std::string();
      },
      "", "NON-EMPTY");
  return validator;
}

void add_causal_option(CLI::App& app, std::string& causal, const char* what) {
  app.add_option("--causal", causal, what)
      ->expected(0, 1)
      ->default_str("top-left")  // what --causal alone means
      ->check(CLI::IsMember({"none", "top-left", "bottom-right"}))
      ->option_text("[none|top-left|bottom-right]");
}

int32_t causal_mode(const std::string& causal) {
  if (causal == "none") return MHA_CAUSAL_NONE;
  if (causal == "top-left") return MHA_CAUSAL_TOP_LEFT;
  if (causal == "bottom-right") return MHA_CAUSAL_BOTTOM_RIGHT;
  throw UsageError("--causal " + causal + ": it must be none, top-left or bottom-right");
}

}  // namespace mha_tools
