// _mha.Module: the library's multi-head attention module (mha_module_*) as a
// Python object owning one mha_module.  Arguments arrive checked for their
// Python types, ranks and PyTorch's shape rules, with the outputs allocated
// (mha/_module.py); the library checks the rest and its message names the
// argument.  forward runs without the GIL; the weights are set while no
// forward of the same module runs (the C API's rule for mha_module_set_weight).
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
constexpr RankRule kSinks{1, 1, 1};            // [H]
constexpr RankRule kSlopes{1, 2, 1};           // [H] or [B, H]

// A sequence-first array ([L, B, E] memory, PyTorch's batch_first=False)
// described as the library's [B, L, E]: the first two dimensions swapped.
void swap_batch_and_length(mha_tensor& tensor) {
  std::swap(tensor.shape[0], tensor.shape[1]);
  std::swap(tensor.strides[0], tensor.strides[1]);
}

class Module {
 public:
  Module(int64_t embed_dim, int64_t num_heads, int64_t kdim, int64_t vdim, bool bias,
         double dropout) {
    mha_module_config config;
    mha_module_config_init(&config);
    config.embed_dim = embed_dim;
    config.num_heads = num_heads;
    config.key_dim = kdim;
    config.value_dim = vdim;
    config.bias = bias ? 1 : 0;
    config.dropout = static_cast<float>(dropout);
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
               bool average_attn_weights, bool is_causal, bool sequence_first, int64_t window_left,
               int64_t window_right, nb::handle sinks, double softcap, nb::handle alibi_slopes) {
    ArrayView q(query, "query", Access::read_only, kSequence);
    ArrayView k(key, "key", Access::read_only, kSequence);
    ArrayView v(value, "value", Access::read_only, kSequence);
    ArrayView o(out, "out", Access::writable, kSequence);
    if (sequence_first) {
      for (ArrayView* view : {&q, &k, &v, &o}) swap_batch_and_length(view->tensor());
    }
    const std::optional<ArrayView> padding =
        optional_view(key_padding_mask, "key_padding_mask", Access::read_only, kKeyPadding);
    const std::optional<ArrayView> mask =
        optional_view(attn_mask, "attn_mask", Access::read_only, kAttnMask);
    std::optional<ArrayView> weights =
        optional_view(attn_weights, "attn_weights", Access::writable,
                      average_attn_weights ? kAveragedWeights : kHeadWeights);
    const std::optional<ArrayView> sink_view =
        optional_view(sinks, "sinks", Access::read_only, kSinks);
    const std::optional<ArrayView> slope_view =
        optional_view(alibi_slopes, "alibi_slopes", Access::read_only, kSlopes);

    mha_module_forward_params params;
    mha_module_forward_params_init(&params);
    params.key_padding_mask = padding ? &padding->tensor() : nullptr;
    params.attn_mask = mask ? &mask->tensor() : nullptr;
    params.causal = is_causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
    params.attn_weights = weights ? &weights->tensor() : nullptr;
    params.average_attn_weights = average_attn_weights ? 1 : 0;
    params.window_left = window_left;
    params.window_right = window_right;
    params.sinks = sink_view ? &sink_view->tensor() : nullptr;
    params.softcap = static_cast<float>(softcap);
    params.alibi_slopes = slope_view ? &slope_view->tensor() : nullptr;

    nb::gil_scoped_release without_gil;
    std::shared_lock<std::shared_mutex> lock(mutex_);
    CallSettings::instance().run({}, [&] {
      return mha_module_forward(module_.get(), &q.tensor(), &k.tensor(), &v.tensor(), &o.tensor(),
                                &params);
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
      .def(nb::init<int64_t, int64_t, int64_t, int64_t, bool, double>(), nb::arg("embed_dim"),
           nb::arg("num_heads"), nb::arg("kdim"), nb::arg("vdim"), nb::arg("bias"),
           nb::arg("dropout"))
      .def("set_weights", &Module::set_weights, nb::arg("weights"),
           "Copies the float32 arrays of a dict {state_dict name: array} into the module.")
      .def("forward", &Module::forward, nb::arg("query"), nb::arg("key"), nb::arg("value"),
           nb::arg("out"), nb::arg("key_padding_mask").none(), nb::arg("attn_mask").none(),
           nb::arg("attn_weights").none(), nb::arg("average_attn_weights"), nb::arg("is_causal"),
           nb::arg("sequence_first"), nb::arg("window_left"), nb::arg("window_right"),
           nb::arg("sinks").none(), nb::arg("softcap"), nb::arg("alibi_slopes").none(),
           "out = the module applied to query, key and value (and the attention weights into "
           "attn_weights); sequence_first: the arrays are [L, B, E]; the attention variants as "
           "in mha_module_forward_params.");
}

}  // namespace mha_python
