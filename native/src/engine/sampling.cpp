#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "ops.h"

namespace sg {

uint64_t splitmix64_next(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

namespace {

double uniform01(uint64_t* state) { return double(splitmix64_next(state) >> 11) * 0x1.0p-53; }

// Up to this many ids, ops::best_k_ids (a vector pass and a k-id heap); past it, BucketOrder. On a flat row nearly
// every value enters the heap, and top_p's escalation asked the heap for 16384, 65536 and then all 262144 ids:
// 90 ms a token for temperature 1 and top_p 0.9 over 262144 normal logits (Zen 4). The bucket sort costs ~2 ms
// to set up, more than the heap's first 4096 ids (0.7 ms for 1000, 2.6 for 4000, on either row).
constexpr int kHeapSelectMax = 4096;

// A row's ids in exactly ops::best_k_ids' order (by value, ties to the lower id), sorted a bucket at a time as far
// as they are asked for: each id goes to bucket floor((mx - x_i) * inv_width) of kBuckets over [min, mx], monotone in
// x_i (float rounding is monotone), so the buckets come in order and each is sorted alone, as 64-bit keys (the
// value's order above the id: one integer compare, no indirect loads).
class BucketOrder {
 public:
  BucketOrder(const float* x, int n) {
    const float mx = *std::max_element(x, x + n), mn = *std::min_element(x, x + n);
    // One bucket for all when the range is empty, overflows float, or is too small for its inverse.
    const float range = mx - mn, inv = float(kBuckets) / range;
    const float inv_width = range > 0 && std::isfinite(range) && std::isfinite(inv) ? inv : 0.0f;
    const auto bucket = [&](float v) {
      const float d = (mx - v) * inv_width;
      return d < float(kBuckets - 1) ? int(d) : kBuckets - 1;
    };
    start_.assign(kBuckets + 1, 0);
    for (int i = 0; i < n; ++i) ++start_[bucket(x[i]) + 1];
    for (int b = 0; b < kBuckets; ++b) start_[b + 1] += start_[b];
    keys_.resize(n);
    std::vector<int> at(start_.begin(), start_.end() - 1);
    for (int i = 0; i < n; ++i) keys_[at[bucket(x[i])]++] = key(x[i], i);
  }

  // idx[begin, end) = the ids at those places of the order (idx holds at least end).
  void ids(int begin, int end, std::vector<int>& idx) {
    for (; sorted_ < kBuckets && start_[sorted_] < end; ++sorted_)
      std::sort(keys_.begin() + start_[sorted_], keys_.begin() + start_[sorted_ + 1]);
    for (int i = begin; i < end; ++i) idx[i] = int(uint32_t(keys_[i]));
  }

 private:
  static constexpr int kBuckets = 4096;
  // Ascending keys = descending values, then ascending ids. v + 0.0f makes -0 into +0, which compare equal.
  static uint64_t key(float v, int i) {
    uint32_t u;
    const float w = v + 0.0f;
    std::memcpy(&u, &w, 4);
    const uint32_t up = u & 0x80000000u ? ~u : u | 0x80000000u;  // ascending with the value
    return uint64_t(~up) << 32 | uint32_t(i);
  }
  std::vector<int> start_;  // bucket b's keys are keys_[start_[b], start_[b + 1])
  std::vector<uint64_t> keys_;
  int sorted_ = 0;  // buckets sorted so far
};

// The k best ids by logit, best first, in idx[0..k).
void best_k(const float* x, int n, int k, std::vector<int>& idx) {
  idx.resize(k);
  if (k > kHeapSelectMax) BucketOrder(x, n).ids(0, k, idx);
  else ops::best_k_ids(x, n, k, idx.data());
}

}  // namespace

void check_sample_params(const SampleParams& p, int n) {
  if (n < 1) throw std::invalid_argument("sample: empty logits row");
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    throw std::invalid_argument("sample: temperature must be a finite number >= 0, got " + std::to_string(p.temperature));
  if (p.top_k < 0) throw std::invalid_argument("sample: top_k must be >= 0 (0 = off), got " + std::to_string(p.top_k));
  if (!(p.top_p > 0 && p.top_p <= 1)) throw std::invalid_argument("sample: top_p must lie in (0, 1], got " + std::to_string(p.top_p));
  if (p.n_logprobs < 0 || p.n_logprobs > n)
    throw std::invalid_argument("sample: n_logprobs must lie in [0, " + std::to_string(n) + "], got " +
                                std::to_string(p.n_logprobs));
}

SampleResult sample(const float* x, int n, const SampleParams& p, uint64_t* rng_state) {
  check_sample_params(p, n);
  static const bool cpu_ok = ops::cpu_has_avx2_fma_f16c();
  if (!cpu_ok) throw std::runtime_error("sample: needs a CPU with AVX2, FMA and F16C");
  bool finite = true;
  const float mx = ops::max_finite(x, n, &finite);
  if (!finite) throw std::invalid_argument("sample: logits contain NaN or infinity");

  thread_local std::vector<int> idx;
  SampleResult res;

  // A temperature so small that its inverse overflows float (the scans below take it as one) is greedy: sampling
  // with an infinite scale would multiply 0 by infinity.
  if (p.temperature == 0 || !std::isfinite(float(1.0 / p.temperature))) {
    res.token = int(std::find(x, x + n, mx) - x);
    const double log_z = std::log(ops::exp_scan(x, n, mx, 1.0f, nullptr));
    res.logprob = float(double(x[res.token]) - mx - log_z);
    if (p.n_logprobs > 0) {
      best_k(x, n, p.n_logprobs, idx);
      for (int i = 0; i < p.n_logprobs; ++i) res.top.emplace_back(idx[i], float(double(x[idx[i]]) - mx - log_z));
    }
    return res;
  }

  const double inv_t = 1.0 / p.temperature;
  auto weight = [&](int i) { return std::exp((double(x[i]) - mx) * inv_t); };
  const bool by_k = p.top_k > 0 && p.top_k < n, by_p = p.top_p < 1;

  if (!by_k && !by_p) {
    // The whole vocabulary: the blocks' totals of the normaliser's pass, then the first id whose running total
    // exceeds the draw (ops::exp_find walks the blocks' totals and one block's exponentials, not the row again).
    thread_local std::vector<double> blocks;
    blocks.resize(ops::exp_blocks(n));
    const double z = ops::exp_scan(x, n, mx, float(inv_t), blocks.data());
    const int tok = ops::exp_find(x, n, mx, float(inv_t), blocks.data(), uniform01(rng_state) * z);
    res.token = tok;
    const double log_z = std::log(z);
    res.logprob = float((double(x[tok]) - mx) * inv_t - log_z);
    if (p.n_logprobs > 0) {
      best_k(x, n, p.n_logprobs, idx);
      for (int i = 0; i < p.n_logprobs; ++i) res.top.emplace_back(idx[i], float((double(x[idx[i]]) - mx) * inv_t - log_z));
    }
    return res;
  }

  // Kept set = a best-first prefix idx[0..kept).
  int kept;
  thread_local std::vector<double> w;  // weights of idx[0..), relative to the maximum
  if (by_k) {
    best_k(x, n, p.top_k, idx);
    kept = p.top_k;
    w.resize(kept);
    double z = 0;
    for (int i = 0; i < kept; ++i) z += (w[i] = weight(idx[i]));
    if (by_p) {
      double cum = 0;
      int i = 0;
      while (i < kept && cum < p.top_p * z) cum += w[i++];
      kept = std::max(i, 1);
    }
  } else {
    // top_p alone: sort progressively more of the vocabulary until the prefix reaches top_p of the total mass. Each
    // round's ids begin with the previous round's (both a full sort's first ids), so the sum goes on where it stopped.
    // Past kHeapSelectMax ids, one BucketOrder sorts as far as the sum goes, 16384 ids a round.
    const double z = ops::exp_scan(x, n, mx, float(inv_t), nullptr);
    int sorted = std::min(n, 64), i = 0;
    double cum = 0;
    std::optional<BucketOrder> order;
    for (;;) {
      if (sorted <= kHeapSelectMax) {
        best_k(x, n, sorted, idx);
      } else {
        if (!order) order.emplace(x, n);
        const int have = int(idx.size());
        idx.resize(sorted);
        order->ids(have, sorted, idx);
      }
      w.resize(sorted);
      while (i < sorted && cum < p.top_p * z) cum += (w[i] = weight(idx[i])), ++i;
      if (cum >= p.top_p * z || sorted == n) {
        kept = i;  // >= 1: the loop always takes the first candidate
        break;
      }
      // The weights fall best-first, so the prefix needs at least sorted · target / cum ids: once that is past the
      // heap's range (a flat row, after the first round), the next round is the bucket sort's.
      const bool past_heap = cum * kHeapSelectMax < p.top_p * z * sorted;
      sorted = sorted < kHeapSelectMax && !past_heap ? std::min(n, sorted * 4)
                                                     : std::min(n, std::max(sorted, kHeapSelectMax) + 16384);
    }
  }
  double zk = 0;
  for (int i = 0; i < kept; ++i) zk += w[i];
  const double u = uniform01(rng_state) * zk;
  double cum = 0;
  int pick = kept - 1;
  for (int i = 0; i < kept; ++i) {
    cum += w[i];
    if (cum > u) {
      pick = i;
      break;
    }
  }
  const double log_z = std::log(zk);
  res.token = idx[pick];
  res.logprob = float(std::log(w[pick]) - log_z);
  for (int i = 0; i < std::min(kept, p.n_logprobs); ++i) res.top.emplace_back(idx[i], float(std::log(w[i]) - log_z));
  return res;
}

SampleResult token_logprob(const float* x, int n, int token, int k, int* rank) {
  if (token < 0 || token >= n)
    throw std::invalid_argument("token_logprob: token " + std::to_string(token) + " out of range");
  if (k < 0 || k > n) throw std::invalid_argument("token_logprob: k must lie in [0, " + std::to_string(n) + "]");
  static const bool cpu_ok = ops::cpu_has_avx2_fma_f16c();
  if (!cpu_ok) throw std::runtime_error("token_logprob: needs a CPU with AVX2, FMA and F16C");
  bool finite = true;
  const float mx = ops::max_finite(x, n, &finite);
  if (!finite) throw std::invalid_argument("token_logprob: logits contain NaN or infinity");
  const double log_z = std::log(ops::exp_scan(x, n, mx, 1.0f, nullptr));
  SampleResult res;
  res.token = token;
  res.logprob = float(double(x[token]) - mx - log_z);
  *rank = 1 + int(std::count_if(x, x + n, [&](float v) { return v > x[token]; }));
  if (k > 0) {
    thread_local std::vector<int> idx;
    best_k(x, n, k, idx);
    for (int i = 0; i < k; ++i) res.top.emplace_back(idx[i], float(double(x[idx[i]]) - mx - log_z));
  }
  return res;
}

}  // namespace sg
