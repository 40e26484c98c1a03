// _mha.Module: the library's multi-head attention module (mha_module_*) as a
// Python object owning one mha_module.  Arguments arrive checked for their
// Python types, ranks and PyTorch's shape rules, with the outputs allocated
// (mha/_module.py, mha/_functional.py); the library checks the rest and its
// message names the argument (the dtypes too: float32, bfloat16 or float16
// inputs, weights and gradients, each its own; out, the attention weights and
// the backward's grad_out in float32 or the query's dtype).  forward and
// backward run without the GIL; the weights are set while no forward or
// backward of the same module runs (the C API's rule for
// mha_module_set_weight).
#include <mha/mha.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "array_view.h"
#include "bindings.h"
#include "call_settings.h"
#include "errors.h"

namespace nb = nanobind;

namespace mha_python {
namespace {

// query, key, value and out are [B, L, E]; an unbatched [L, E] is one batch.
constexpr RankRule kSequence{2, 3, 3};
constexpr RankRule kKeyPadding{1, 2, 2};       // [B, Lk], unbatched [Lk]
constexpr RankRule kAttnMask{2, 3, 2};         // [Lq, Lk] or [B*H, Lq, Lk]
constexpr RankRule kAveragedWeights{2, 3, 3};  // [B, Lq, Lk], unbatched [Lq, Lk]
constexpr RankRule kHeadWeights{3, 4, 4};      // [B, H, Lq, Lk], unbatched [H, Lq, Lk]
constexpr RankRule kWeight{1, 2, 1};           // a matrix or a bias vector
constexpr RankRule kMatrix{2, 2, 2};           // a weight's gradient
constexpr RankRule kVector{1, 1, 1};           // a bias's gradient
constexpr RankRule kSinks{1, 1, 1};            // [H]
constexpr RankRule kSlopes{1, 2, 1};           // [H] or [B, H]

// A sequence-first array ([L, B, E] memory, PyTorch's batch_first=False)
// described as the library's [B, L, E]: the first two dimensions swapped.
void swap_batch_and_length(mha_tensor& tensor) {
  std::swap(tensor.shape[0], tensor.shape[1]);
  std::swap(tensor.strides[0], tensor.strides[1]);
}

// The arguments forward and backward share, as they become
// mha_module_forward_params.
struct CallOptions {
  nb::handle key_padding_mask, attn_mask;
  bool is_causal, training;
  uint64_t dropout_seed;
  int64_t window_left, window_right;
  nb::handle sinks;
  double softcap;
  nb::handle alibi_slopes;
};

// The views of one call: query, key, value and the [B, Lq, E] array in out's
// place (the output, or the backward's dout), in the library's [B, L, E]
// (sequence_first: the caller's [L, B, E] swapped), and the parameters
// pointing at the masks and variants.
class CallViews {
 public:
  CallViews(nb::handle query, nb::handle key, nb::handle value, nb::handle out,
            const char* out_name, Access out_access, bool sequence_first,
            const CallOptions& options)
      : q_(query, "query", Access::read_only, kSequence),
        k_(key, "key", Access::read_only, kSequence),
        v_(value, "value", Access::read_only, kSequence),
        o_(out, out_name, out_access, kSequence),
        padding_(optional_view(options.key_padding_mask, "key_padding_mask", Access::read_only,
                               kKeyPadding)),
        mask_(optional_view(options.attn_mask, "attn_mask", Access::read_only, kAttnMask)),
        sinks_(optional_view(options.sinks, "sinks", Access::read_only, kSinks)),
        slopes_(optional_view(options.alibi_slopes, "alibi_slopes", Access::read_only, kSlopes)) {
    if (sequence_first) {
      for (ArrayView* view : {&q_, &k_, &v_, &o_}) swap_batch_and_length(view->tensor());
    }
    mha_module_forward_params_init(&params_);
    params_.key_padding_mask = padding_ ? &padding_->tensor() : nullptr;
    params_.attn_mask = mask_ ? &mask_->tensor() : nullptr;
    params_.causal = options.is_causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
    params_.training = options.training ? 1 : 0;
    params_.dropout_seed = options.dropout_seed;
    params_.window_left = options.window_left;
    params_.window_right = options.window_right;
    params_.sinks = sinks_ ? &sinks_->tensor() : nullptr;
    params_.softcap = static_cast<float>(options.softcap);
    params_.alibi_slopes = slopes_ ? &slopes_->tensor() : nullptr;
  }
  CallViews(const CallViews&) = delete;
  CallViews& operator=(const CallViews&) = delete;

  const mha_tensor& query() const { return q_.tensor(); }
  const mha_tensor& key() const { return k_.tensor(); }
  const mha_tensor& value() const { return v_.tensor(); }
  mha_tensor& out() { return o_.tensor(); }
  mha_module_forward_params& params() { return params_; }

 private:
  ArrayView q_, k_, v_, o_;
  std::optional<ArrayView> padding_, mask_, sinks_, slopes_;
  mha_module_forward_params params_;
};

class Module {
 public:
  Module(int64_t embed_dim, int64_t num_heads, int64_t kdim, int64_t vdim, bool bias,
         double dropout, bool activations_input) {
    mha_module_config config;
    mha_module_config_init(&config);
    config.embed_dim = embed_dim;
    config.num_heads = num_heads;
    config.key_dim = kdim;
    config.value_dim = vdim;
    config.bias = bias ? 1 : 0;
    config.dropout = static_cast<float>(dropout);
    config.activations = activations_input ? MHA_ACTIVATIONS_INPUT : MHA_ACTIVATIONS_F32;
    mha_module* created = nullptr;
    const mha_status status = mha_module_create(&config, &created);
    if (status != MHA_OK) throw library_error(status);
    module_.reset(created);
  }

  // Sets every (name, array) pair of `weights` (a dict), copying them, while
  // no forward of this module runs: a forward sees all of them or none.
  void set_weights(const nb::dict& weights) {
    std::vector<std::pair<std::string, ArrayView>> views;
    for (const auto& [key, array] : weights) {
      std::string name = nb::cast<std::string>(key);
      ArrayView view(array, name.c_str(), Access::read_only, kWeight);
      views.emplace_back(std::move(name), std::move(view));
    }
    nb::gil_scoped_release without_gil;
    std::unique_lock<std::shared_mutex> lock(mutex_);
    for (const auto& [name, view] : views) {
      const mha_status status = mha_module_set_weight(module_.get(), name.c_str(), &view.tensor());
      if (status != MHA_OK) throw library_error(status);
    }
  }

  void forward(nb::handle query, nb::handle key, nb::handle value, nb::handle out,
               nb::handle key_padding_mask, nb::handle attn_mask, nb::handle attn_weights,
               bool average_attn_weights, bool is_causal, bool sequence_first, bool training,
               uint64_t dropout_seed, int64_t window_left, int64_t window_right, nb::handle sinks,
               double softcap, nb::handle alibi_slopes) {
    CallViews call(query, key, value, out, "out", Access::writable, sequence_first,
                   {key_padding_mask, attn_mask, is_causal, training, dropout_seed, window_left,
                    window_right, sinks, softcap, alibi_slopes});
    std::optional<ArrayView> weights =
        optional_view(attn_weights, "attn_weights", Access::writable,
                      average_attn_weights ? kAveragedWeights : kHeadWeights);
    mha_module_forward_params& params = call.params();
    params.attn_weights = weights ? &weights->tensor() : nullptr;
    params.average_attn_weights = average_attn_weights ? 1 : 0;

    nb::gil_scoped_release without_gil;
    std::shared_lock<std::shared_mutex> lock(mutex_);
    CallSettings::instance().run({}, [&] {
      return mha_module_forward(module_.get(), &call.query(), &call.key(), &call.value(),
                                &call.out(), &params);
    });
  }

  // The gradients of forward's call with the same arguments, from grad_out
  // (its `out`'s place), into the arrays of `gradients` {mha_module_gradients
  // field: array}, each in its own dtype (the library rounds a half-precision
  // one once): the inputs' arrive in the inputs' layout (sequence_first swaps
  // them as it swaps the inputs).
  void backward(nb::handle query, nb::handle key, nb::handle value, nb::handle grad_out,
                nb::handle key_padding_mask, nb::handle attn_mask, bool is_causal,
                bool sequence_first, bool training, uint64_t dropout_seed, int64_t window_left,
                int64_t window_right, nb::handle sinks, double softcap, nb::handle alibi_slopes,
                const nb::dict& gradients) {
    CallViews call(query, key, value, grad_out, "grad_out", Access::read_only, sequence_first,
                   {key_padding_mask, attn_mask, is_causal, training, dropout_seed, window_left,
                    window_right, sinks, softcap, alibi_slopes});
    mha_module_gradients grads;
    mha_module_gradients_init(&grads);
    struct Field {
      const char* name;
      mha_tensor* mha_module_gradients::*member;
      RankRule rule;
      bool sequence;  // an input's gradient, in the inputs' layout
    };
    static constexpr Field kFields[] = {
        {"query", &mha_module_gradients::query, kSequence, true},
        {"key", &mha_module_gradients::key, kSequence, true},
        {"value", &mha_module_gradients::value, kSequence, true},
        {"q_proj_weight", &mha_module_gradients::q_proj_weight, kMatrix, false},
        {"k_proj_weight", &mha_module_gradients::k_proj_weight, kMatrix, false},
        {"v_proj_weight", &mha_module_gradients::v_proj_weight, kMatrix, false},
        {"q_proj_bias", &mha_module_gradients::q_proj_bias, kVector, false},
        {"k_proj_bias", &mha_module_gradients::k_proj_bias, kVector, false},
        {"v_proj_bias", &mha_module_gradients::v_proj_bias, kVector, false},
        {"out_proj_weight", &mha_module_gradients::out_proj_weight, kMatrix, false},
        {"out_proj_bias", &mha_module_gradients::out_proj_bias, kVector, false},
        {"sinks", &mha_module_gradients::sinks, kSinks, false},
    };
    // Every view first, then the pointers into them (the vector never grows
    // after it is filled).
    std::vector<std::pair<const Field*, ArrayView>> views;
    views.reserve(std::size(kFields));
    for (const auto& [name_object, array] : gradients) {
      const std::string name = nb::cast<std::string>(name_object);
      const Field* field = nullptr;
      for (const Field& f : kFields) {
        if (name == f.name) field = &f;
      }
      if (field == nullptr) {
        throw nb::value_error(("gradients has an unknown key '" + name +
                               "' (mha_module_gradients has query, key, value, q_proj_weight, "
                               "k_proj_weight, v_proj_weight, q_proj_bias, k_proj_bias, "
                               "v_proj_bias, out_proj_weight, out_proj_bias and sinks)")
                                  .c_str());
      }
      const std::string label = "grad_" + name;
      views.emplace_back(field, ArrayView(array, label.c_str(), Access::writable, field->rule));
    }
    for (auto& [field, view] : views) {
      if (field->sequence && sequence_first) swap_batch_and_length(view.tensor());
      grads.*(field->member) = &view.tensor();
    }

    nb::gil_scoped_release without_gil;
    std::shared_lock<std::shared_mutex> lock(mutex_);
    CallSettings::instance().run({}, [&] {
      return mha_module_backward(module_.get(), &call.query(), &call.key(), &call.value(),
                                 &call.out(), &call.params(), &grads);
    });
  }

 private:
  struct Destroy {
    void operator()(mha_module* module) const { mha_module_destroy(module); }
  };
  std::unique_ptr<mha_module, Destroy> module_;
  std::shared_mutex mutex_;  // shared: a forward; exclusive: setting weights
};

}  // namespace

void register_module(nb::module_& module) {
  nb::class_<Module>(module, "Module",
                     "One mha_module: PyTorch's nn.MultiheadAttention computed by the library.  "
                     "Internal: use mha.MultiheadAttention.")
      .def(nb::init<int64_t, int64_t, int64_t, int64_t, bool, double, bool>(), nb::arg("embed_dim"),
           nb::arg("num_heads"), nb::arg("kdim"), nb::arg("vdim"), nb::arg("bias"),
           nb::arg("dropout"), nb::arg("activations_input") = false,
           "activations_input: a half-precision call keeps its activations in the query's dtype "
           "(mha_module_config.activations = MHA_ACTIVATIONS_INPUT).")
      .def("set_weights", &Module::set_weights, nb::arg("weights"),
           "Copies the arrays of a dict {state_dict name: array} (float32, bfloat16 or float16, "
           "widened exactly) into the module's float32 weights.")
      .def("forward", &Module::forward, nb::arg("query"), nb::arg("key"), nb::arg("value"),
           nb::arg("out"), nb::arg("key_padding_mask").none(), nb::arg("attn_mask").none(),
           nb::arg("attn_weights").none(), nb::arg("average_attn_weights"), nb::arg("is_causal"),
           nb::arg("sequence_first"), nb::arg("training"), nb::arg("dropout_seed"),
           nb::arg("window_left"), nb::arg("window_right"), nb::arg("sinks").none(),
           nb::arg("softcap"), nb::arg("alibi_slopes").none(),
           "out = the module applied to query, key and value (and the attention weights into "
           "attn_weights); sequence_first: the arrays are [L, B, E]; training: dropout as "
           "configured, with dropout_seed; the attention variants as in "
           "mha_module_forward_params.")
      .def("backward", &Module::backward, nb::arg("query"), nb::arg("key"), nb::arg("value"),
           nb::arg("grad_out"), nb::arg("key_padding_mask").none(), nb::arg("attn_mask").none(),
           nb::arg("is_causal"), nb::arg("sequence_first"), nb::arg("training"),
           nb::arg("dropout_seed"), nb::arg("window_left"), nb::arg("window_right"),
           nb::arg("sinks").none(), nb::arg("softcap"), nb::arg("alibi_slopes").none(),
           nb::arg("gradients"),
           "mha_module_backward: the gradients of forward's call with the same arguments, from "
           "grad_out, written into the arrays of `gradients`, a dict {mha_module_gradients "
           "field: array} (query, key, value, q_proj_weight, ..., out_proj_bias, sinks; one "
           "array under several of query, key and value receives their sum), each float32, "
           "bfloat16 or float16 (rounded once); the inputs' gradients in the inputs' layout.  "
           "Runs without the GIL.  Internal: use mha.multi_head_attention_backward.");
}

}  // namespace mha_python
