#include "backward_run.h"

#include <CLI/CLI.hpp>
#include <cstddef>
#include <optional>
#include <vector>

#include "common/dtype.h"
#include "tool_util.h"

namespace mha_tools {
namespace {

// A gradient of Q, K or V: mha writes it in `dtype` (F32, or its input's
// dtype), `file` is what its .npy gets.  F32 and F16 are written straight
// into the file's array (NumPy has both); BF16 into `bf16`, then widened
// into a float32 file -- exactly: NumPy has no bfloat16, and every bf16
// value is a float32.
struct Gradient {
  mha_dtype dtype = MHA_DTYPE_F32;
  NpyArray file;
  TypedInput bf16;
  mha_tensor t{};
};

Gradient make_gradient(mha_dtype dtype, const std::vector<int64_t>& shape, const char* flag,
                       bool add_batch) {
  Gradient g;
  g.dtype = dtype;
  g.file = NpyArray(dtype == MHA_DTYPE_F16 ? NpyDtype::F16 : NpyDtype::F32, shape);
  if (dtype != MHA_DTYPE_BF16) {
    g.t = describe_array(g.file, dtype, flag, add_batch);
    return g;
  }
  g.bf16.dtype = MHA_DTYPE_BF16;
  g.bf16.shape = shape;
  g.bf16.strides = g.file.strides();
  g.bf16.converted.assign(static_cast<std::size_t>(g.file.size()) / 4 + 1, 0);  // 2 bytes each
  g.t = describe_input(g.bf16, flag, add_batch);
  return g;
}

// The file's values once mha has written the gradient.
void widen_to_file(Gradient& g) {
  if (g.dtype != MHA_DTYPE_BF16) return;
  float* to = g.file.data_as<float>();
  for (int64_t i = 0; i < g.file.size(); ++i) {
    to[i] = mha_types::load_float(g.bf16.data(), MHA_DTYPE_BF16, i);
  }
}

// The gradients' arrays and descriptors (the shapes of what they
// differentiate; dsinks and dmask F32).
struct Gradients {
  Gradient dq, dk, dv;
  NpyArray dsinks, dmask;
  std::optional<mha_tensor> tdsinks, tdmask;
};

// --grad-dtype: F32, or the input's dtype ("input"; an int8 cache, which
// the backward refuses, keeps F32 so that the library says why).
mha_dtype gradient_dtype(const std::string& grad_dtype, int32_t input) {
  if (grad_dtype != "input" || input == MHA_DTYPE_I8) return MHA_DTYPE_F32;
  return static_cast<mha_dtype>(input);
}

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
  if (!o.block_table.empty()) {
    throw UsageError(
        "--block-table: a paged KV cache has no backward pass (a packed batch has: "
        "--cu-seqlens-q and --cu-seqlens-k)");
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
                 "the gradient of the loss by the output: float32 or float16 [B,H,Lq,Dv] .npy "
                 "([H,Lq,Dv] for rank-3 inputs, [total_q,H,Dv] for a packed batch; float64 "
                 "too), passed as --dtype")
      ->check(filled);
  app.add_option("--dq", o.dq,
                 "gradient of Q to write: .npy of Q's shape, in --grad-dtype (float16 for f16; "
                 "bf16 values as float32, which holds them exactly)")
      ->check(filled);
  app.add_option("--dk", o.dk,
                 "gradient of K to write: .npy of K's shape (summed over "
                 "each KV head's query heads), in --grad-dtype")
      ->check(filled);
  app.add_option("--dv", o.dv, "gradient of V to write: .npy of V's shape, in --grad-dtype")
      ->check(filled);
  app.add_option("--grad-dtype", o.grad_dtype,
                 "the dtype mha computes the gradients in: input (the default: dQ in --dtype, dK "
                 "and dV in --kv-dtype, as PyTorch's autograd returns them; float32 inputs give "
                 "float32 gradients) or f32. Either way mha accumulates in float32 and rounds "
                 "once")
      ->check(filled)
      ->check(CLI::IsMember({"input", "f32"}))
      ->option_text("input|f32");
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
    if (!call.lse) {  // [B,H,Lq] ([H,Lq]), or a packed batch's [H,total_q]
      std::vector<int64_t> lse_shape = in.q.shape;
      lse_shape.pop_back();
      if (call.cu_seqlens_q) lse_shape = {in.q.shape[1], in.q.shape[0]};
      call.lse_array = NpyArray(NpyDtype::F32, lse_shape);
      call.lse = describe_array(call.lse_array, MHA_DTYPE_F32, "the LSE", b1);
    }
    call_attention(call);

    // dout in Q's dtype (the dtypes the backward takes for it are out's: F32
    // or Q's), converted like --mask.
    const auto q_dtype = static_cast<mha_dtype>(call.q.dtype);
    TypedInput dout = read_typed_input("--dout", o.dout, q_dtype, "dout");
    const mha_tensor tdout = describe_input(dout, "--dout", b1);
    Gradients g;
    g.dq =
        make_gradient(gradient_dtype(o.grad_dtype, call.q.dtype), shape_of(call.q, b1), "--dq", b1);
    g.dk =
        make_gradient(gradient_dtype(o.grad_dtype, call.k.dtype), shape_of(call.k, b1), "--dk", b1);
    g.dv =
        make_gradient(gradient_dtype(o.grad_dtype, call.v.dtype), shape_of(call.v, b1), "--dv", b1);
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
    // A packed batch (--cu-seqlens-q/-k, --seqused-k): its backward.
    mha_varlen_params varlen;
    mha_varlen_params_init(&varlen);
    if (call.cu_seqlens_q) {
      varlen.cu_seqlens_q = &*call.cu_seqlens_q;
      varlen.cu_seqlens_k = call.cu_seqlens_k ? &*call.cu_seqlens_k : nullptr;
      varlen.seqused_k = call.seqused_k ? &*call.seqused_k : nullptr;
    }
    const auto run = [&] {
      const bool packed = call.cu_seqlens_q.has_value();
      const mha_status status =
          packed ? mha_attention_varlen_backward(&call.q, &call.k, &call.v, &call.out, &*call.lse,
                                                 &tdout, &g.dq.t, &g.dk.t, &g.dv.t, &varlen,
                                                 &params, &backward)
                 : mha_attention_backward(&call.q, &call.k, &call.v, &call.out, &*call.lse, &tdout,
                                          &g.dq.t, &g.dk.t, &g.dv.t, &params, &backward);
      if (status != MHA_OK) {
        throw ToolError(
            std::string(packed ? "mha_attention_varlen_backward" : "mha_attention_backward") +
            " failed (" + mha_status_name(status) + "): " + mha_last_error());
      }
    };
    run();
    for (Gradient* grad : {&g.dq, &g.dk, &g.dv}) widen_to_file(*grad);
    std::vector<const NpyArray*> arrays;  // in the order of backward_outputs()
    if (!o.lse.empty()) arrays.push_back(&call.lse_array);
    if (!o.out.empty()) arrays.push_back(&call.out_array);
    if (!o.dsinks.empty()) arrays.push_back(&g.dsinks);
    if (!o.dmask.empty()) arrays.push_back(&g.dmask);
    arrays.push_back(&g.dv.file);
    arrays.push_back(&g.dk.file);
    arrays.push_back(&g.dq.file);
    outputs.commit(arrays);
    if (o.repeat > 0) {
      const Timing timing = time_calls(run, o.repeat);
      // FlashAttention-2's count: 2.5 times the forward's useful FLOPs.
      print_stdout_line(timing_json(timing, 2.5 * attention_flops(call),
                                    Dtypes{q_dtype, static_cast<mha_dtype>(call.k.dtype)}));
    }
    return kExitOk;
  });
}

}  // namespace mha_tools
