// Sequence-length balancing: Karmarkar-Karp partitions, token-capped micro-batches,
// pipeline order. See balancing.h for the contract, dapo_kernels/balancing.py for the
// Python API and dapo_kernels/reference/balancing.py for the reference KK whose tie
// rules this file follows exactly (tests compare them item for item).
#include "balancing.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <queue>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

namespace dapo {
namespace balancing {
namespace {

using i128 = __int128;

// Refinement rounds per item: each accepted step strictly lowers the sum of squared
// group sums, so it terminates anyway; the cap only bounds the worst case.
constexpr int64_t kRefineStepsPerItem = 1;
// Partner bins tried for the heaviest (lightest) bin when the extreme pair has no
// improving exchange: enough to get past a blocked pair, cheap per step.
constexpr int64_t kPartnerBins = 4;
// Candidates scanned on each side of the ideal swap partner when a token cap rejects
// the closest ones; beyond that the gain is small and the scan would go quadratic.
constexpr int64_t kCapScanWindow = 32;
// Micro-batch counts tried with KK one by one from the lower bound: KK nearly always fits
// within one or two counts of it when it fits at all below the best-fit packing's count.
constexpr int64_t kLinearCounts = 8;
// ... but each try is a KK run (0.5 s at n = 1e6), so past 32k items the scan stops after
// this many items in all (at least one count): at n = 1e5 and 1e6, best-fit decreasing
// came within 0.21% of the lower bound on every shape of the tests (caps 1-3x the longest:
// 0.05-0.21% with lengths uniform in 1..cap, at most 0.008% for log-normal, equal,
// giant + tiny, tiny).
constexpr int64_t kScanItems = int64_t(1) << 18;

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

int64_t checked_sum(const int64_t* v, int64_t n, const char* name) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (v[i] < 0) fail(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(v[i]) + " is negative");
    if (__builtin_add_overflow(total, v[i], &total)) fail(std::string(name) + " sums past the int64 range");
  }
  return total;
}

void check_count(int64_t n) {
  if (n >= std::numeric_limits<int32_t>::max()) fail("at most 2^31 - 2 items are supported, got " + std::to_string(n));
}

// ------------------------------------------------------------------ Karmarkar-Karp
// A state is k groups in the order (sum desc, head asc); groups that are still empty are
// not stored (they sort last), so singleton states cost O(1) instead of O(k). The groups
// sit in a binary heap with the last one on top, plus the largest sum: a merge only ever
// takes a state's smallest groups, so it costs O(groups that move * log k), and with
// small-to-large merging KK runs in O(n log^2 n) whatever k is (a sorted vector shifted
// O(k) groups per merge: O(n * k), 11 s a run at n = 1e5, k = n / 2, against 0.07 s).
// A group is a linked list over items (next_), so joining two groups is O(1).
struct KKGroup {
  int64_t sum;
  int32_t head;
  int32_t tail;
};

inline bool group_before(const KKGroup& a, const KKGroup& b) {
  return a.sum != b.sum ? a.sum > b.sum : a.head < b.head;
}

struct KKState {
  std::vector<KKGroup> heap;  // std heap under group_before: the last group on top
  int64_t top = 0;            // largest sum (the first group's)

  KKGroup pop_last() {
    std::pop_heap(heap.begin(), heap.end(), group_before);
    const KKGroup g = heap.back();
    heap.pop_back();
    return g;
  }
  void push(const KKGroup& g) {
    heap.push_back(g);
    std::push_heap(heap.begin(), heap.end(), group_before);
  }
};

struct HeapKey {
  int64_t spread;
  int64_t top;
  int64_t id;
};

// Largest spread first, then largest top group, then oldest state.
struct HeapLess {
  bool operator()(const HeapKey& a, const HeapKey& b) const {
    if (a.spread != b.spread) return a.spread < b.spread;
    if (a.top != b.top) return a.top < b.top;
    return a.id > b.id;
  }
};

// Item indices by (value, index) ascending: KK's initial order, shared by its runs.
std::vector<int32_t> ascending_order(const int64_t* values, int64_t n) {
  std::vector<int32_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(),
            [values](int32_t a, int32_t b) { return values[a] != values[b] ? values[a] < values[b] : a < b; });
  return order;
}

class KarmarkarKarp {
 public:
  KarmarkarKarp(const int64_t* values, int64_t n, int64_t k) : values_(values), n_(n), k_(k), next_(n, -1) {}

  // order: ascending_order(values, n).
  Groups run(bool equal_size, const std::vector<int32_t>& order) {
    const int64_t per_state = equal_size ? k_ : 1;
    states_.reserve(2 * (n_ / per_state) + 1);
    for (int64_t s = 0; s < n_; s += per_state) {
      KKState state;
      state.heap.reserve(per_state);
      for (int64_t j = s; j < s + per_state; ++j) {
        state.push({values_[order[j]], order[j], order[j]});
        state.top = std::max(state.top, values_[order[j]]);
      }
      fresh_.push_back(add_state(std::move(state)));
    }
    // Initial states never change, so they wait in a sorted list (best last) and only
    // merged states go through the heap; popping the better of the two fronts yields
    // the same sequence as one heap over everything, with a much smaller heap.
    std::sort(fresh_.begin(), fresh_.end(), HeapLess());
    for (int64_t left = fresh_.size(); left > 1; --left) {
      const int64_t a = pop(), b = pop();
      heap_.push(add_state(merge(states_[a], states_[b])));
    }
    return collect(states_[pop()]);
  }

 private:
  HeapKey add_state(KKState state) {
    const int64_t low = static_cast<int64_t>(state.heap.size()) == k_ ? state.heap.front().sum : 0;
    const HeapKey key{state.top - low, state.top, static_cast<int64_t>(states_.size())};
    states_.push_back(std::move(state));
    return key;
  }

  int64_t pop() {
    if (heap_.empty() || (!fresh_.empty() && HeapLess()(heap_.top(), fresh_.back()))) {
      const int64_t id = fresh_.back().id;
      fresh_.pop_back();
      return id;
    }
    const int64_t id = heap_.top().id;
    heap_.pop();
    return id;
  }

  KKGroup join(const KKGroup& x, const KKGroup& y) {
    next_[x.tail] = y.head;
    return {x.sum + y.sum, x.head, y.tail};
  }

  // Group i of the result joins a's i-th largest with b's i-th smallest (empty groups
  // included): the `both` smallest groups of each pair up (a's largest of them with b's
  // smallest), the rest pass through. The result reuses the larger state's heap, whose
  // largest groups stay in place.
  KKState merge(KKState& a, KKState& b) {
    const int64_t na = a.heap.size(), nb = b.heap.size();
    const int64_t both = std::max<int64_t>(na + nb - k_, 0);
    smallest_a_.clear();
    for (int64_t t = 0; t < both; ++t) smallest_a_.push_back(a.pop_last());  // ascending
    incoming_.clear();
    for (int64_t t = 0; t < both; ++t) incoming_.push_back(join(smallest_a_[both - 1 - t], b.pop_last()));
    KKState& big = na >= nb ? a : b;
    KKState& small = na >= nb ? b : a;
    incoming_.insert(incoming_.end(), small.heap.begin(), small.heap.end());
    int64_t top = big.heap.empty() ? 0 : big.top;  // popping the smallest keeps the largest
    for (const KKGroup& g : incoming_) {
      big.push(g);
      top = std::max(top, g.sum);
    }
    big.top = top;
    KKState().heap.swap(small.heap);
    return std::move(big);
  }

  // Groups in state order (sum desc, head asc), as the refinement's tie rules expect.
  Groups collect(KKState& state) const {
    std::sort(state.heap.begin(), state.heap.end(), group_before);
    Groups out;
    out.reserve(state.heap.size());
    for (const auto& g : state.heap) {
      std::vector<int64_t> items;
      for (int32_t i = g.head; i >= 0; i = next_[i]) items.push_back(i);
      out.push_back(std::move(items));
    }
    return out;
  }

  const int64_t* values_;
  int64_t n_, k_;
  std::vector<int32_t> next_;
  std::vector<KKState> states_;
  std::vector<KKGroup> smallest_a_, incoming_;    // reused by merge()
  std::vector<HeapKey> fresh_;                    // initial states, best last
  std::priority_queue<HeapKey, std::vector<HeapKey>, HeapLess> heap_;
};

// ------------------------------------------------------------------ refinement
struct Item {
  int64_t w;  // balanced quantity
  int64_t t;  // tokens, for the cap
  int32_t idx;
};

inline bool item_before(const Item& a, const Item& b) { return a.w != b.w ? a.w < b.w : a.idx < b.idx; }

struct Bin {
  std::vector<Item> items;  // sorted by item_before
  int64_t w = 0;
  int64_t t = 0;
};

struct Swap {
  int64_t x = -1;  // position in the heavy bin
  int64_t y = -1;  // position in the light bin; -1 = plain move
  i128 score = 0;  // |D - 2 * delta|, lower is better
};

std::vector<Bin> make_bins(const Groups& groups, const int64_t* w, const int64_t* t) {
  std::vector<Bin> bins(groups.size());
  for (size_t b = 0; b < groups.size(); ++b) {
    for (int64_t i : groups[b]) {
      bins[b].items.push_back({w[i], t[i], static_cast<int32_t>(i)});
      bins[b].w += w[i];
      bins[b].t += t[i];
    }
    std::sort(bins[b].items.begin(), bins[b].items.end(), item_before);
  }
  return bins;
}

class Refiner {
  using Loads = std::set<std::pair<int64_t, int64_t>>;

 public:
  // cap < 0: no token cap. allow_moves: single items may change bins (group sizes free).
  Refiner(int64_t cap, bool allow_moves) : cap_(cap), moves_(allow_moves) {}

  // Repeatedly exchange items between the heaviest bin and one of the lightest (or the
  // lightest and one of the heaviest) so that the pair's difference shrinks most. Every
  // exchange keeps both bins within the pair's old range, so the largest sum never rises,
  // the smallest never falls (the spread never gets worse) and the sum of squared loads
  // strictly falls (it terminates).
  void run(std::vector<Bin>& bins, int64_t max_steps) const {
    Loads by_load;  // (w, bin): lightest first, heaviest last
    for (size_t b = 0; b < bins.size(); ++b) by_load.insert({bins[b].w, static_cast<int64_t>(b)});
    for (int64_t step = 0; step < max_steps; ++step) {
      const auto hi = *by_load.rbegin();
      const auto lo = *by_load.begin();
      if (hi.first - lo.first < 2) return;  // integers: no exchange strictly inside (0, diff)
      if (!exchange_any(bins, by_load, hi, lo)) return;
    }
  }

 private:
  bool fits(const Bin& heavy, const Bin& light, const Item& x, const Item* y) const {
    if (cap_ < 0) return true;
    const int64_t ty = y ? y->t : 0;
    return light.t - ty + x.t <= cap_ && heavy.t - x.t + ty <= cap_;
  }

  // Best (x in heavy, y in light or nothing) with delta = x.w - y.w in (0, diff).
  Swap find(const Bin& heavy, const Bin& light, int64_t diff) const {
    Swap best;
    best.score = diff;  // any admissible delta scores below diff
    if (diff < 2) return best;  // integers: no delta strictly inside (0, diff)
    const auto& ys = light.items;
    const bool can_move = moves_ && heavy.items.size() >= 2;
    for (int64_t xi = 0; xi < static_cast<int64_t>(heavy.items.size()); ++xi) {
      const Item& x = heavy.items[xi];
      if (x.w <= 0) continue;
      auto consider = [&](int64_t yi) -> bool {  // false: further out on this side is worse
        const Item* y = yi >= 0 ? &ys[yi] : nullptr;
        const int64_t delta = x.w - (y ? y->w : 0);
        if (delta <= 0 || delta >= diff) return false;
        if (!fits(heavy, light, x, y)) return true;
        const i128 score = delta * i128(2) > diff ? delta * i128(2) - diff : diff - delta * i128(2);
        if (score < best.score) best = {xi, yi, score};
        return false;
      };
      if (can_move) consider(-1);
      // ideal partner: 2 * y.w == 2 * x.w - diff
      const i128 target = i128(x.w) * 2 - diff;
      const int64_t p = std::lower_bound(ys.begin(), ys.end(), target,
                                         [](const Item& y, i128 v) { return i128(y.w) * 2 < v; }) -
                        ys.begin();
      for (int64_t j = p; j < static_cast<int64_t>(ys.size()) && j < p + kCapScanWindow; ++j)
        if (!consider(j)) break;
      for (int64_t j = p - 1; j >= 0 && j > p - 1 - kCapScanWindow; --j)
        if (!consider(j)) break;
      if (best.score <= (diff & 1)) break;  // cannot do better than an exact split
    }
    return best;
  }

  static void insert_sorted(Bin& bin, const Item& it) {
    bin.items.insert(std::lower_bound(bin.items.begin(), bin.items.end(), it, item_before), it);
    bin.w += it.w;
    bin.t += it.t;
  }

  static Item take(Bin& bin, int64_t pos) {
    const Item it = bin.items[pos];
    bin.items.erase(bin.items.begin() + pos);
    bin.w -= it.w;
    bin.t -= it.t;
    return it;
  }

  // (heaviest, one of the lightest), then (one of the heaviest, lightest); the first
  // pair with an improving exchange gets it. Iterators die with the exchange: return.
  bool exchange_any(std::vector<Bin>& bins, Loads& by_load, std::pair<int64_t, int64_t> hi,
                    std::pair<int64_t, int64_t> lo) const {
    auto light = by_load.begin();
    for (int64_t j = 0; j < kPartnerBins && light->first < hi.first; ++j, ++light)
      if (exchange(bins, by_load, hi, *light)) return true;
    auto heavy = std::next(by_load.rbegin());
    for (int64_t j = 1; j < kPartnerBins && heavy->first > lo.first; ++j, ++heavy)
      if (exchange(bins, by_load, *heavy, lo)) return true;
    return false;
  }

  // Best exchange between the two bins, applied; false if none shrinks their gap.
  bool exchange(std::vector<Bin>& bins, Loads& by_load, std::pair<int64_t, int64_t> hi,
                std::pair<int64_t, int64_t> lo) const {
    Bin& heavy = bins[hi.second];
    Bin& light = bins[lo.second];
    const Swap s = find(heavy, light, hi.first - lo.first);
    if (s.x < 0) return false;
    const Item x = take(heavy, s.x);
    if (s.y >= 0) insert_sorted(heavy, take(light, s.y));
    insert_sorted(light, x);
    by_load.erase(hi);
    by_load.erase(lo);
    by_load.insert({heavy.w, hi.second});
    by_load.insert({light.w, lo.second});
    return true;
  }

  int64_t cap_;
  bool moves_;
};

// Bins -> groups: each ascending, groups ordered by their smallest index.
Groups to_groups(const std::vector<Bin>& bins) {
  Groups out;
  out.reserve(bins.size());
  for (const auto& b : bins) {
    std::vector<int64_t> g;
    g.reserve(b.items.size());
    for (const auto& it : b.items) g.push_back(it.idx);
    std::sort(g.begin(), g.end());
    out.push_back(std::move(g));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.front() < b.front(); });
  return out;
}

int64_t max_tokens_of(const std::vector<Bin>& bins) {
  int64_t m = 0;
  for (const auto& b : bins) m = std::max(m, b.t);
  return m;
}

// Callers keep a, b <= n < 2^31 (micro_batches checks the bounds first): no overflow.
int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// ------------------------------------------------------------------ micro-batches
// Best-fit decreasing on tokens: a packing that always fits, within 11/9 OPT + 1 bins.
Groups best_fit_decreasing(const int64_t* t, int64_t n, int64_t cap) {
  std::vector<int32_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(), [t](int32_t a, int32_t b) { return t[a] != t[b] ? t[a] > t[b] : a < b; });
  Groups bins;
  std::set<std::pair<int64_t, int64_t>> room;  // (remaining tokens, bin)
  for (int32_t i : order) {
    auto it = room.lower_bound({t[i], -1});
    int64_t b;
    int64_t left;
    if (it == room.end()) {
      b = static_cast<int64_t>(bins.size());
      bins.emplace_back();
      left = cap;
    } else {
      b = it->second;
      left = it->first;
      room.erase(it);
    }
    bins[b].push_back(i);
    room.insert({left - t[i], b});
  }
  return bins;
}

// Split the fullest groups (by item count) until there are `count` of them.
void split_to(Groups& groups, int64_t count) {
  std::priority_queue<std::pair<int64_t, int64_t>> by_size;  // (items, -group)
  for (size_t g = 0; g < groups.size(); ++g) by_size.push({static_cast<int64_t>(groups[g].size()), -int64_t(g)});
  while (static_cast<int64_t>(groups.size()) < count) {
    const int64_t g = -by_size.top().second;
    by_size.pop();
    auto& src = groups[g];
    const int64_t keep = static_cast<int64_t>(src.size()) - static_cast<int64_t>(src.size()) / 2;
    std::vector<int64_t> moved(src.begin() + keep, src.end());
    src.resize(keep);
    by_size.push({keep, -g});
    by_size.push({static_cast<int64_t>(moved.size()), -static_cast<int64_t>(groups.size())});
    groups.push_back(std::move(moved));
  }
}

// No packing under the cap has fewer bins than ceil(total / cap), nor than
// ceil(c_p / p) where c_p counts items over cap / (p + 1) (at most p of them fit in a
// bin). The second bound is what keeps the count search from crawling up from
// ceil(total / cap) when many items just exceed a third (or a quarter ...) of the cap.
int64_t count_lower_bound(const int64_t* t, int64_t n, int64_t cap, int64_t total) {
  std::vector<int64_t> desc(t, t + n);
  std::sort(desc.begin(), desc.end(), std::greater<int64_t>());
  int64_t bound = total / cap + (total % cap != 0);
  int64_t c = 0;  // c_p: items with t * (p + 1) > cap
  for (int64_t p = 1; p <= n && (n + p - 1) / p > bound; ++p) {  // c_p <= n: no gain past n / p
    while (c < n && i128(desc[c]) * (p + 1) > cap) ++c;
    bound = std::max(bound, (c + p - 1) / p);
  }
  return bound;
}

class MicroBatcher {
 public:
  MicroBatcher(const int64_t* t, const int64_t* w, int64_t n, int64_t cap)
      : t_(t), w_(w), n_(n), cap_(cap), steps_(kRefineStepsPerItem * n + 64), w_order_(ascending_order(w, n)),
        t_order_(w == t ? std::vector<int32_t>() : ascending_order(t, n)) {}

  // m bins from KK (on the workloads, else on the tokens) under the cap, workloads
  // balanced; empty if neither KK partition fits the cap.
  std::vector<Bin> karmarkar_karp(int64_t m) const {
    auto bins = try_workloads(m);
    if (bins.empty() && w_ != t_) bins = try_tokens(m);
    return bins;
  }

  // The packing split into m bins, workloads balanced under the cap.
  std::vector<Bin> from_packing(Groups packing, int64_t m) const {
    split_to(packing, m);
    return refined(make_bins(packing, w_, t_));
  }

 private:
  // When workloads are the tokens, refining first can only lower the largest bin, so it
  // is done before the cap check.
  std::vector<Bin> try_workloads(int64_t m) const {
    auto bins = make_bins(KarmarkarKarp(w_, n_, m).run(false, w_order_), w_, t_);
    if (w_ == t_) Refiner(-1, true).run(bins, steps_);
    if (max_tokens_of(bins) > cap_) return {};
    return refined(std::move(bins));
  }

  // Token-balanced KK, then workloads rebalanced under the cap.
  std::vector<Bin> try_tokens(int64_t m) const {
    auto bins = make_bins(KarmarkarKarp(t_, n_, m).run(false, t_order_), t_, t_);
    Refiner(-1, true).run(bins, steps_);
    if (max_tokens_of(bins) > cap_) return {};
    return refined(make_bins(to_groups(bins), w_, t_));
  }

  std::vector<Bin> refined(std::vector<Bin> bins) const {
    Refiner(cap_, true).run(bins, steps_);
    return bins;
  }

  const int64_t *t_, *w_;
  int64_t n_, cap_, steps_;
  std::vector<int32_t> w_order_, t_order_;
};

}  // namespace

Groups balanced_partitions(const int64_t* values, int64_t n, int64_t k, bool equal_size, bool refine) {
  check_count(n);
  if (k < 1) fail("k_partitions must be >= 1, got " + std::to_string(k));
  if (k > n) fail("k_partitions = " + std::to_string(k) + " exceeds the number of items " + std::to_string(n));
  if (equal_size && n % k != 0)
    fail("equal_size needs the number of items (" + std::to_string(n) + ") divisible by k_partitions (" +
         std::to_string(k) + ")");
  checked_sum(values, n, "workloads");
  Groups groups = KarmarkarKarp(values, n, k).run(equal_size, ascending_order(values, n));
  auto bins = make_bins(groups, values, values);
  if (refine) Refiner(-1, !equal_size).run(bins, kRefineStepsPerItem * n + 64);
  return to_groups(bins);
}

Groups micro_batches(const int64_t* tokens, const int64_t* workloads, int64_t n, int64_t max_tokens,
                     int64_t min_count, int64_t multiple_of) {
  check_count(n);
  if (max_tokens < 1) fail("max_token_len must be >= 1, got " + std::to_string(max_tokens));
  if (n == 0) fail("seqlens is empty: cannot make non-empty micro-batches from 0 sequences");
  // Bounds before arithmetic: past n no count can be met (every micro-batch is
  // non-empty), and once both are <= n < 2^31 the rounding below cannot overflow.
  auto check_bound = [n](int64_t value, const char* name) {
    if (value < 1) fail(std::string(name) + " must be >= 1, got " + std::to_string(value));
    if (value > n)
      fail(std::string(name) + " = " + std::to_string(value) + " exceeds the number of sequences (" +
           std::to_string(n) + "): cannot make that many non-empty micro-batches");
  };
  check_bound(min_count, "min_num_micro_batches");
  check_bound(multiple_of, "num_micro_batches_multiple_of");
  const int64_t total = checked_sum(tokens, n, "seqlens");
  if (workloads != tokens) checked_sum(workloads, n, "workloads");
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] > max_tokens)
      fail("seqlens[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) + " exceeds max_token_len = " +
           std::to_string(max_tokens));
  auto too_many = [&](int64_t m) {
    fail("cannot make " + std::to_string(m) + " non-empty micro-batches (min_num_micro_batches = " +
         std::to_string(min_count) + ", multiple of " + std::to_string(multiple_of) + ") from " + std::to_string(n) +
         " sequences");
  };
  const int64_t lower = round_up(std::max(count_lower_bound(tokens, n, max_tokens, total), min_count), multiple_of);
  if (lower > n) too_many(lower);

  // Best-fit decreasing always fits; KK is tried below its count (fewer micro-batches)
  // and at it (KK is usually better balanced). O(n log^2 n) a try, at most kLinearCounts + 1.
  Groups packing = best_fit_decreasing(tokens, n, max_tokens);
  const int64_t packed = round_up(std::max(static_cast<int64_t>(packing.size()), lower), multiple_of);
  const MicroBatcher mb(tokens, workloads, n, max_tokens);
  const int64_t tries = std::clamp<int64_t>(kScanItems / n, 1, kLinearCounts);
  int64_t m = lower;
  for (int64_t i = 0; i < tries && m < packed; ++i, m += multiple_of) {
    auto bins = mb.karmarkar_karp(m);
    if (!bins.empty()) return to_groups(bins);
  }
  if (packed > n) too_many(packed);
  auto bins = mb.karmarkar_karp(packed);
  return to_groups(bins.empty() ? mb.from_packing(std::move(packing), packed) : bins);
}

std::vector<int64_t> pipeline_order(const std::vector<int64_t>& loads) {
  const int64_t n = loads.size();
  if (n == 0) return {};
  std::vector<int64_t> rank(n);
  for (int64_t i = 0; i < n; ++i) rank[i] = i;
  std::sort(rank.begin(), rank.end(),
            [&](int64_t a, int64_t b) { return loads[a] != loads[b] ? loads[a] > loads[b] : a < b; });
  // heaviest-first ranks 0,1,2,... placed as ..., 4, 2, 0, 1, 3, ...
  std::vector<int64_t> order;
  order.reserve(n);
  for (int64_t r = (n - 1) / 2 * 2; r >= 0; r -= 2) order.push_back(rank[r]);
  for (int64_t r = 1; r < n; r += 2) order.push_back(rank[r]);
  return order;
}

std::vector<int64_t> attention_workload(const int64_t* seqlens, int64_t n, int64_t hidden) {
  if (hidden < 1) fail("hidden_size must be >= 1, got " + std::to_string(hidden));
  std::vector<int64_t> out(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t L = seqlens[i];
    if (L < 0) fail("seqlens[" + std::to_string(i) + "] = " + std::to_string(L) + " is negative");
    int64_t lin, quad;
    if (__builtin_mul_overflow(L, hidden, &lin) || __builtin_mul_overflow(lin, int64_t(6), &lin) ||
        __builtin_mul_overflow(L, L, &quad) || __builtin_add_overflow(lin, quad, &out[i]))
      fail("attention_workload of seqlens[" + std::to_string(i) + "] = " + std::to_string(L) +
           " overflows int64 with hidden_size = " + std::to_string(hidden));
  }
  return out;
}

}  // namespace balancing
}  // namespace dapo
