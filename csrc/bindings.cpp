// Python bindings of dapo_kernels._C: the only file that includes pybind11, so the op
// sources stay plain C++17. Each op family gets a register_* function here that wraps
// its header's C++ API (numpy in and out, GIL released around the work), and the
// module definition at the bottom calls them all.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "balancing.h"

namespace py = pybind11;

namespace {

using Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

py::list to_py(const dapo::balancing::Groups& groups) {
  py::list out(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) out[g] = py::cast(groups[g]);
  return out;
}

void check_1d(const Array& a, const char* name) {
  if (a.ndim() != 1) throw std::invalid_argument(std::string(name) + " must be 1-D, got " + std::to_string(a.ndim()) + "-D");
}

// ---------------------------------------------------------------------- balancing
void register_balancing(py::module_& m) {
  namespace bal = dapo::balancing;
  m.def(
      "balanced_partitions",
      [](Array values, int64_t k, bool equal_size, bool refine) {
        check_1d(values, "workloads");
        bal::Groups g;
        {
          py::gil_scoped_release nogil;
          g = bal::balanced_partitions(values.data(), values.shape(0), k, equal_size, refine);
        }
        return to_py(g);
      },
      py::arg("workloads"), py::arg("k_partitions"), py::arg("equal_size"), py::arg("refine") = true,
      "Karmarkar-Karp partitions of int64 workloads (+ refinement); list[list[int]].");
  m.def(
      "micro_batches",
      [](Array seqlens, py::object workloads, int64_t max_tokens, int64_t min_count, int64_t multiple_of) {
        check_1d(seqlens, "seqlens");
        Array w = workloads.is_none() ? seqlens : workloads.cast<Array>();
        check_1d(w, "workloads");
        if (w.shape(0) != seqlens.shape(0))
          throw std::invalid_argument("workloads must have one entry per sequence (" + std::to_string(seqlens.shape(0)) +
                                      "), got " + std::to_string(w.shape(0)));
        const int64_t* wp = workloads.is_none() ? seqlens.data() : w.data();
        bal::Groups g;
        {
          py::gil_scoped_release nogil;
          g = bal::micro_batches(seqlens.data(), wp, seqlens.shape(0), max_tokens, min_count, multiple_of);
        }
        return to_py(g);
      },
      py::arg("seqlens"), py::arg("workloads"), py::arg("max_token_len"), py::arg("min_num_micro_batches"),
      py::arg("num_micro_batches_multiple_of"), "Token-capped, workload-balanced micro-batches; list[list[int]].");
  m.def(
      "pipeline_order",
      [](const std::vector<std::vector<int64_t>>& groups, Array workloads) {
        check_1d(workloads, "workloads");
        const int64_t n = workloads.shape(0);
        const int64_t* w = workloads.data();
        std::vector<int64_t> loads(groups.size(), 0);
        for (size_t g = 0; g < groups.size(); ++g)
          for (int64_t i : groups[g]) {
            if (i < 0 || i >= n)
              throw std::invalid_argument("micro_batches[" + std::to_string(g) + "] holds index " + std::to_string(i) +
                                          ", outside 0.." + std::to_string(n - 1));
            if (w[i] < 0) throw std::invalid_argument("workloads[" + std::to_string(i) + "] is negative");
            if (__builtin_add_overflow(loads[g], w[i], &loads[g]))
              throw std::invalid_argument("workloads of micro_batches[" + std::to_string(g) + "] overflow int64");
          }
        return bal::pipeline_order(loads);
      },
      py::arg("micro_batches"), py::arg("workloads"), "Pipeline-friendly order of micro-batches; list[int].");
  m.def(
      "attention_workload",
      [](Array seqlens, int64_t hidden) {
        check_1d(seqlens, "seqlens");
        auto w = bal::attention_workload(seqlens.data(), seqlens.shape(0), hidden);
        Array out(static_cast<py::ssize_t>(w.size()));
        std::copy(w.begin(), w.end(), out.mutable_data());
        return out;
      },
      py::arg("seqlens"), py::arg("hidden_size"), "6*h*L + L*L per sequence as an int64 numpy array.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dapo_kernels C++ extension (CPU, C++17)";
  m.attr("__cxx_standard__") = static_cast<long>(__cplusplus);
  register_balancing(m);
}
