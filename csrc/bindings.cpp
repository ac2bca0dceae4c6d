// Python bindings of dapo_kernels._C. Each op family adds a register_* function
// declared in its header and called here, so the module definition stays in one place.
#include <pybind11/pybind11.h>

#include "balancing.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "dapo_kernels C++ extension (CPU, C++17)";
  m.attr("__cxx_standard__") = static_cast<long>(__cplusplus);
  register_balancing(m);
}
