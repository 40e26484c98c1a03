#include "backward_run.h"

#include <CLI/CLI.hpp>
#include <optional>
#include <vector>

#include "tool_util.h"

namespace mha_tools {
namespace {

// The gradients' arrays and descriptors (F32, the shapes of what they
// differentiate).
struct Gradients {
  NpyArray dq, dk, dv, dsinks, dmask;
  mha_tensor tdq{}, tdk{}, tdv{};
  std::optional<mha_tensor> tdsinks, tdmask;
};

std::vector<int64_t> shape_of(const mha_tensor& t, bool drop_batch) {
  std::vector<int64_t> shape(t.shape + (drop_batch ? 1 : 0), t.shape + t.ndim);
  return shape;
}

void check_backward_options(const BackwardOptions& o) {
  check_attention_options(o);
  std::string missing;
  for (const auto& [value, flag] : {std::pair{&o.dout, "--dout"}, std::pair{&o.dq, "--dq"},
                                    std::pair{&o.dk, "--dk"}, std::pair{&o.dv, "--dv"}}) {
    if (value->empty()) missing += missing.empty() ? flag : std::string(", ") + flag;
  }
  if (!missing.empty()) throw UsageError("backward: missing " + missing + " (see --help)");
  for (const auto& [value, flag] :
       {std::pair{&o.cu_seqlens_q, "--cu-seqlens-q"}, std::pair{&o.cu_seqlens_k, "--cu-seqlens-k"},
        std::pair{&o.block_table, "--block-table"}, std::pair{&o.seqused_k, "--seqused-k"}}) {
    if (!value->empty()) {
      throw UsageError(std::string(flag) +
                       ": mha-run backward takes batches of [B,H,L,D] (packed and paged layouts "
                       "have no backward pass yet)");
    }
  }
  if (!o.dsinks.empty() && o.sinks.empty()) {
    throw UsageError("--dsinks needs --sinks (the gradient of the sinks)");
  }
  if (!o.dmask.empty() && o.mask.empty()) {
    throw UsageError("--dmask needs --mask (the gradient of an additive mask)");
  }
}

std::vector<NamedFile> backward_outputs(const BackwardOptions& o) {
  std::vector<NamedFile> files = attention_outputs(o);
  for (const auto& [flag, path] :
       {std::pair{"--dsinks", &o.dsinks}, std::pair{"--dmask", &o.dmask}, std::pair{"--dv", &o.dv},
        std::pair{"--dk", &o.dk}, std::pair{"--dq", &o.dq}}) {
    if (!path->empty()) files.push_back({flag, *path});
  }
  return files;
}

}  // namespace

void add_backward_options(CLI::App& app, BackwardOptions& o) {
  add_attention_options(app, o);
  const CLI::Validator& filled = non_empty();
  app.add_option("--dout", o.dout,
                 "the gradient of the loss by the output: float32 [B,H,Lq,Dv] .npy ([H,Lq,Dv] "
                 "for rank-3 inputs)")
      ->check(filled);
  app.add_option("--dq", o.dq, "gradient of Q to write: float32 .npy of Q's shape")->check(filled);
  app.add_option("--dk", o.dk,
                 "gradient of K to write: float32 .npy of K's shape (summed over "
                 "each KV head's query heads)")
      ->check(filled);
  app.add_option("--dv", o.dv, "gradient of V to write: float32 .npy of V's shape")->check(filled);
  app.add_option("--dsinks", o.dsinks, "gradient of --sinks to write: float32 [H] .npy")
      ->check(filled);
  app.add_option("--dmask", o.dmask,
                 "gradient of an additive --mask to write: float32 .npy of the mask's shape "
                 "(summed over the axes it broadcasts)")
      ->check(filled);
}

int run_backward_command(const BackwardOptions& o) {
  return run_guarded([&o] {
    BackwardOptions forward_options = o;
    if (forward_options.out.empty()) forward_options.out = "/dev/null";  // checked, not written
    check_backward_options(forward_options);
    std::vector<NamedFile> inputs = attention_inputs(o);
    inputs.push_back({"--dout", o.dout});
    OutputFiles outputs(backward_outputs(o), inputs);
    configure_runtime(o.backend, o.threads);
    AttentionInputs in = load_attention_inputs(o);
    AttentionCall call = prepare_attention_call(in, o);
    // The forward, always with its LSE (the backward needs it).
    const bool b1 = in.unbatched;
    if (!call.lse) {
      std::vector<int64_t> lse_shape = in.q.shape;
      lse_shape.pop_back();
      call.lse_array = NpyArray(NpyDtype::F32, lse_shape);
      call.lse = describe_array(call.lse_array, MHA_DTYPE_F32, "the LSE", b1);
    }
    call_attention(call);

    NpyArray dout = read_float_input("--dout", o.dout);
    const mha_tensor tdout = describe_array(dout, MHA_DTYPE_F32, "--dout", b1);
    Gradients g;
    g.dq = NpyArray(NpyDtype::F32, shape_of(call.q, b1));
    g.dk = NpyArray(NpyDtype::F32, shape_of(call.k, b1));
    g.dv = NpyArray(NpyDtype::F32, shape_of(call.v, b1));
    g.tdq = describe_array(g.dq, MHA_DTYPE_F32, "--dq", b1);
    g.tdk = describe_array(g.dk, MHA_DTYPE_F32, "--dk", b1);
    g.tdv = describe_array(g.dv, MHA_DTYPE_F32, "--dv", b1);
    mha_backward_params backward;
    mha_backward_params_init(&backward);
    if (!o.dsinks.empty() && call.sinks) {
      g.dsinks = NpyArray(NpyDtype::F32, shape_of(*call.sinks, false));
      g.tdsinks = describe_array(g.dsinks, MHA_DTYPE_F32, "--dsinks", false);
      backward.dsinks = &*g.tdsinks;
    }
    if (!o.dmask.empty() && call.mask) {
      g.dmask = NpyArray(NpyDtype::F32, shape_of(*call.mask, false));
      g.tdmask = describe_array(g.dmask, MHA_DTYPE_F32, "--dmask", false);
      backward.dmask = &*g.tdmask;
    }
    mha_attention_params params = call.params();
    params.lse = nullptr;
    const auto run = [&] {
      const mha_status status =
          mha_attention_backward(&call.q, &call.k, &call.v, &call.out, &*call.lse, &tdout, &g.tdq,
                                 &g.tdk, &g.tdv, &params, &backward);
      if (status != MHA_OK) {
        throw ToolError(std::string("mha_attention_backward failed (") + mha_status_name(status) +
                        "): " + mha_last_error());
      }
    };
    run();
    std::vector<const NpyArray*> arrays;  // in the order of backward_outputs()
    if (!o.lse.empty()) arrays.push_back(&call.lse_array);
    if (!o.out.empty()) arrays.push_back(&call.out_array);
    if (!o.dsinks.empty()) arrays.push_back(&g.dsinks);
    if (!o.dmask.empty()) arrays.push_back(&g.dmask);
    arrays.push_back(&g.dv);
    arrays.push_back(&g.dk);
    arrays.push_back(&g.dq);
    outputs.commit(arrays);
    if (o.repeat > 0) {
      const Timing timing = time_calls(run, o.repeat);
      // FlashAttention-2's count: 2.5 times the forward's useful FLOPs.
      print_stdout_line(timing_json(timing, 2.5 * attention_flops(call)));
    }
    return kExitOk;
  });
}

}  // namespace mha_tools
