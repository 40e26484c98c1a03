#include "cli_options.h"

#include <mha/mha.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <cfloat>
#include <exception>

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

void add_variant_options(CLI::App& app, VariantOptions& o) {
  const CLI::Validator& filled = non_empty();
  app.add_option("--window", o.window,
                 "sliding window L,R: query i sees keys i+Lk-Lq-L .. i+Lk-Lq+R "
                 "(FlashAttention-2's convention); -1 leaves a side unbounded, e.g. 4095,0")
      ->check(filled)
      ->option_text("L,R");
  app.add_option("--sinks", o.sinks,
                 "attention sinks .npy, float32 [H]: per-head logits that join each row's "
                 "softmax denominator without a value row (gpt-oss); -inf: no sink")
      ->check(filled);
  app.add_option("--softcap", o.softcap,
                 "logit softcap C > 0: scores become C*tanh(score/C) before ALiBi and the mask "
                 "(Gemma 2)")
      ->check(filled)
      ->check(CLI::Validator(
          [](const std::string& text) {
            double cap = 0;
            const bool number = CLI::detail::lexical_cast(text, cap);
            return number && cap > 0 && static_cast<float>(cap) <= FLT_MAX
                       ? std::string()
                       : "the softcap must be a finite number > 0 (not " + text + ")";
          },
          "", "C > 0"))
      ->option_text("C");
  app.add_option("--alibi", o.alibi,
                 "ALiBi slopes .npy, float32 [H] or [B,H]: adds -slope*|i+Lk-Lq-j| to the "
                 "scores (FlashAttention-2's convention)")
      ->check(filled);
}

WindowEdges parse_window(const std::string& text) {
  const auto bad = [&text](const std::string& why) {
    return UsageError("--window " + text + ": " + why +
                      " (it must be L,R: two integers >= -1, -1 for an unbounded side)");
  };
  const size_t comma = text.find(',');
  if (comma == std::string::npos || text.find(',', comma + 1) != std::string::npos) {
    throw bad("not two values separated by one comma");
  }
  const auto edge = [&bad](const std::string& part) {
    size_t used = 0;
    long long value = 0;
    try {
      value = std::stoll(part, &used);
    } catch (const std::exception&) {
      throw bad("'" + part + "' is not an integer");
    }
    if (used != part.size() || part.empty() || std::isspace(static_cast<unsigned char>(part[0]))) {
      throw bad("'" + part + "' is not an integer");
    }
    if (value < -1) throw bad(part + " is below -1");
    return static_cast<int64_t>(value);
  };
  return {edge(text.substr(0, comma)), edge(text.substr(comma + 1))};
}

}  // namespace mha_tools
