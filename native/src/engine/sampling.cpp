#include "sampling.h"

#include <algorithm>
#include <cmath>
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

// The k best ids by logit, best first, in idx[0..k).
void best_k(const float* x, int n, int k, std::vector<int>& idx) {
  idx.resize(k);
  ops::best_k_ids(x, n, k, idx.data());
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
    // The whole vocabulary: the running totals in id order, then the first id whose total exceeds the draw (the
    // last id when none does, as round-off can leave u * z above every total).
    thread_local std::vector<double> running;
    running.resize(n);
    const double z = ops::exp_scan(x, n, mx, float(inv_t), running.data());
    const double u = uniform01(rng_state) * z;
    const int tok = std::min(n - 1, int(std::upper_bound(running.begin(), running.end(), u) - running.begin()));
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
    // top_p alone: sort progressively more of the vocabulary until the prefix reaches top_p of the total mass.
    const double z = ops::exp_scan(x, n, mx, float(inv_t), nullptr);
    int sorted = std::min(n, 64);
    for (;;) {
      best_k(x, n, sorted, idx);
      w.resize(sorted);
      double cum = 0;
      int i = 0;
      while (i < sorted && cum < p.top_p * z) cum += (w[i] = weight(idx[i])), ++i;
      if (cum >= p.top_p * z || sorted == n) {
        kept = i;  // >= 1: the loop always takes the first candidate
        break;
      }
      sorted = int(std::min<int64_t>(n, int64_t(sorted) * 4));
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
