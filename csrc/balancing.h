// Sequence-length balancing for RL training batches (host-side, exact int64).
//
// Plain C++17 on raw int64 buffers, with no pybind11 or Python header, so this part
// compiles (and can be checked) without them; bindings.cpp converts numpy arrays and
// releases the GIL around these calls. Every function is deterministic: ties are
// broken by item index / creation order, never by address.
// Errors are std::invalid_argument (ValueError in Python).
#pragma once

#include <cstdint>
#include <vector>

namespace dapo {
namespace balancing {

using Groups = std::vector<std::vector<int64_t>>;

// Split indices 0..n-1 into k groups with balanced sums of `values`: Karmarkar-Karp's
// largest differencing method, then (refine) moves/swaps between the heaviest and the
// lightest group. Groups are ordered by their smallest index, each ascending.
Groups balanced_partitions(const int64_t* values, int64_t n, int64_t k, bool equal_size, bool refine);

// Micro-batches with token sums <= max_tokens, as few as the search finds (see .cpp),
// balanced by `workloads` (may alias `tokens`). The count is >= min_count and a
// multiple of `multiple_of`; both must be in 1..n (checked before any arithmetic: a count
// above n is an error, never clamped, as in verl). O(n log^2 n) (see .cpp).
Groups micro_batches(const int64_t* tokens, const int64_t* workloads, int64_t n, int64_t max_tokens,
                     int64_t min_count, int64_t multiple_of);

// Permutation of micro-batches for pipeline schedules: lightest at both ends, heaviest
// in the middle, neighbours adjacent in weight.
std::vector<int64_t> pipeline_order(const std::vector<int64_t>& loads);

// 6 * hidden * L + L * L per sequence, overflow-checked.
std::vector<int64_t> attention_workload(const int64_t* seqlens, int64_t n, int64_t hidden);

}  // namespace balancing
}  // namespace dapo
