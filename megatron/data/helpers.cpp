// C++ helpers for building dataset indices (pybind11), called from megatron/data/gpt_dataset.py
// and megatron/data/blendable_dataset.py. Both loops are sequential by nature (each step depends
// on the previous one), which is why they live in C++ rather than numpy. Inputs are validated
// before the GIL is released; the loops themselves run without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using DoubleArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

// Sum of an int32 array, as int64: a smoke test that the extension builds and takes numpy arrays.
static int64_t sum_int32(Int32Array values) {
  auto v = values.unchecked<1>();
  int64_t total = 0;
  for (py::ssize_t i = 0; i < v.shape(0); ++i) total += v(i);
  return total;
}

// Sample index of a GPT dataset: row i = (position in doc_idx, token offset in that document)
// where sample i starts; sample i spans rows i..i+1 inclusive, i.e. seq_length + 1 tokens, and
// consecutive samples share one token (the last label of one is the first input of the next).
//
//   sizes            int32 [num_documents]  tokens per document
//   doc_idx          int64 [num_epochs * documents_per_epoch]  document order (ids into sizes)
//   num_samples      = (num_epochs * tokens_per_epoch - 1) / seq_length
//   returns          int64 [num_samples + 1, 2]
//
// Always int64: Megatron's int32 version overflows once num_epochs * documents exceeds 2^31, and
// the array is small (16 bytes per sample: 8 MB for 2^19 samples of 2048 tokens = 1e9 tokens).
static py::array_t<int64_t> build_sample_idx(Int32Array sizes_array, Int64Array doc_idx_array,
                                             int64_t seq_length, int64_t num_epochs,
                                             int64_t tokens_per_epoch) {
  if (sizes_array.ndim() != 1 || doc_idx_array.ndim() != 1)
    throw std::invalid_argument("build_sample_idx: sizes and doc_idx must be 1-D arrays");
  if (seq_length <= 0 || num_epochs <= 0 || tokens_per_epoch <= 0)
    throw std::invalid_argument("build_sample_idx: seq_length, num_epochs and tokens_per_epoch must be positive, got " +
                                std::to_string(seq_length) + ", " + std::to_string(num_epochs) + ", " +
                                std::to_string(tokens_per_epoch));
  const int32_t* sizes = sizes_array.data();
  const int64_t* doc_idx = doc_idx_array.data();
  const int64_t num_sizes = sizes_array.shape(0);
  const int64_t num_doc_idx = doc_idx_array.shape(0);
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;

  py::array_t<int64_t> result({num_samples + 1, static_cast<int64_t>(2)});
  int64_t* sample_idx = result.mutable_data();
  std::string error;
  {
    py::gil_scoped_release release;
    int64_t doc_idx_index = 0;  // position in doc_idx of the document being consumed
    int64_t doc_offset = 0;     // tokens of that document already consumed
    sample_idx[0] = 0;
    sample_idx[1] = 0;
    for (int64_t sample = 1; sample <= num_samples && error.empty(); ++sample) {
      // A sample needs seq_length + 1 tokens but starts on the last token of the previous one.
      int64_t remaining = seq_length + 1;
      while (remaining != 0) {
        if (doc_idx_index >= num_doc_idx) {
          error = "build_sample_idx: ran out of documents at sample " + std::to_string(sample) +
                  ": doc_idx has " + std::to_string(num_doc_idx) + " entries, too few for " +
                  std::to_string(num_samples) + " samples (tokens_per_epoch does not match sizes?)";
          break;
        }
        const int64_t doc_id = doc_idx[doc_idx_index];
        if (doc_id < 0 || doc_id >= num_sizes) {
          error = "build_sample_idx: doc_idx[" + std::to_string(doc_idx_index) + "] = " +
                  std::to_string(doc_id) + " is not a document id in [0, " + std::to_string(num_sizes) + ")";
          break;
        }
        const int64_t doc_left = static_cast<int64_t>(sizes[doc_id]) - doc_offset;
        if (remaining <= doc_left) {
          // The sample ends inside this document, on token doc_offset + remaining - 1; the next
          // sample starts on that same token.
          doc_offset += remaining - 1;
          remaining = 0;
        } else {
          remaining -= doc_left;
          ++doc_idx_index;
          doc_offset = 0;
        }
      }
      sample_idx[2 * sample] = doc_idx_index;
      sample_idx[2 * sample + 1] = doc_offset;
    }
  }
  if (!error.empty()) throw std::out_of_range(error);
  return result;
}

// Greedy blending: sample t goes to the dataset d maximizing weights[d] * (t + 1) - count[d],
// i.e. the one furthest below its target share once this sample is placed (ties: lowest d).
// Megatron uses weights[d] * max(t, 1) instead; the (t + 1) target keeps every prefix closer to the
// weights. Guarantees, for every prefix length n >= 1 and every dataset d (K datasets):
//   count[d] - weights[d] * n < 1   and   weights[d] * n - count[d] < K - 1
// (the first because the chosen deficit is at least 1/K > 0 before the pick; the second because
// the deficits sum to zero). For K = 2, |count - weight * n| <= 1/2: shares within 1/(2n).
template <typename IndexT>
static py::tuple blending_indices(const double* weights, int64_t num_datasets, int64_t size) {
  py::array_t<IndexT> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  IndexT* chosen_out = dataset_index.mutable_data();
  int64_t* sample_out = dataset_sample_index.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> counts(num_datasets, 0);
    for (int64_t t = 0; t < size; ++t) {
      const double target_step = static_cast<double>(t + 1);
      int64_t best = 0;
      double best_deficit = weights[0] * target_step - static_cast<double>(counts[0]);
      for (int64_t d = 1; d < num_datasets; ++d) {
        const double deficit = weights[d] * target_step - static_cast<double>(counts[d]);
        if (deficit > best_deficit) {
          best_deficit = deficit;
          best = d;
        }
      }
      chosen_out[t] = static_cast<IndexT>(best);
      sample_out[t] = counts[best]++;
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

// Returns (dataset_index, dataset_sample_index): dataset_index is uint8 for up to 256 datasets,
// int16 up to 32767; dataset_sample_index int64. Weights must be non-negative and sum to > 0;
// they are normalized here.
static py::tuple build_blending_indices(DoubleArray weights_array, int64_t size) {
  if (weights_array.ndim() != 1 || weights_array.shape(0) == 0)
    throw std::invalid_argument("build_blending_indices: weights must be a non-empty 1-D array");
  if (size < 0) throw std::invalid_argument("build_blending_indices: size must be >= 0, got " + std::to_string(size));
  const int64_t num_datasets = weights_array.shape(0);
  if (num_datasets > 32767)
    throw std::invalid_argument("build_blending_indices: at most 32767 datasets, got " + std::to_string(num_datasets));
  std::vector<double> weights(weights_array.data(), weights_array.data() + num_datasets);
  double total = 0.0;
  for (double w : weights) {
    if (!(w >= 0.0)) throw std::invalid_argument("build_blending_indices: weights must be >= 0 (and not NaN)");
    total += w;
  }
  if (!(total > 0.0)) throw std::invalid_argument("build_blending_indices: weights must sum to > 0");
  for (double& w : weights) w /= total;
  if (num_datasets <= 256) return blending_indices<uint8_t>(weights.data(), num_datasets, size);
  return blending_indices<int16_t>(weights.data(), num_datasets, size);
}

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "C++ helpers for Megatron dataset indices (GPT sample index, blending)";
  m.def("sum_int32", &sum_int32, "Sum of an int32 array as int64 (build smoke test)", py::arg("values"));
  m.def("build_sample_idx", &build_sample_idx,
        "GPT sample index: int64 [num_samples + 1, 2] of (doc_idx position, token offset)", py::arg("sizes"),
        py::arg("doc_idx"), py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"));
  m.def("build_blending_indices", &build_blending_indices,
        "Greedy blending order: (dataset_index uint8/int16, dataset_sample_index int64)", py::arg("weights"),
        py::arg("size"));
}
