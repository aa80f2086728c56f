#include "row_sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "ops.h"
#include "threadpool.h"

namespace sg {

namespace {

constexpr float kOut = -std::numeric_limits<float>::max();  // the logit of an excluded id (no mask)

std::string id_error(const char* what, int64_t id, int vocab) {
  return std::string(what) + " " + std::to_string(id) + " is outside the vocabulary (0.." + std::to_string(vocab - 1) +
         ")";
}

}  // namespace

RowSampler::RowSampler(const RowSamplerParams& p, int vocab_size, const int32_t* prompt, int n_prompt,
                       uint64_t rng_state)
    : p_(p), vocab_(vocab_size), rng_(rng_state) {
  if (!ops::cpu_has_avx2_fma_f16c()) throw std::runtime_error("RowSampler: needs a CPU with AVX2, FMA and F16C");
  check_sample_params(p_.sample, vocab_size);  // refused here, not at the sequence's first row
  if (!(p_.min_p >= 0 && p_.min_p <= 1)) throw std::invalid_argument("RowSampler: min_p must lie in [0, 1]");
  if (!(p_.repetition > 0) || !std::isfinite(p_.repetition))
    throw std::invalid_argument("RowSampler: repetition_penalty must be a finite number > 0");
  if (!std::isfinite(p_.presence) || !std::isfinite(p_.frequency))
    throw std::invalid_argument("RowSampler: presence and frequency penalties must be finite");
  if (p_.min_tokens < 0) throw std::invalid_argument("RowSampler: min_tokens must be >= 0");
  for (const auto& [id, b] : p_.bias) {
    if (id < 0 || id >= vocab_) throw std::invalid_argument(id_error("RowSampler: logit_bias id", id, vocab_));
    if (!std::isfinite(b)) throw std::invalid_argument("RowSampler: a logit_bias value is not finite");
  }
  // Stop ids outside the vocabulary can never be drawn: nothing to hold off.
  auto& s = p_.stop_ids;
  s.erase(std::remove_if(s.begin(), s.end(), [&](int t) { return t < 0 || t >= vocab_; }), s.end());
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  if (p_.repetition != 1.0f) {
    seen_bit_.assign(vocab_, 0);
    for (int i = 0; i < n_prompt; ++i) {
      const int t = prompt[i];
      if (t < 0 || t >= vocab_) throw std::invalid_argument(id_error("RowSampler: prompt token", t, vocab_));
      if (!seen_bit_[t]) seen_bit_[t] = 1, seen_.push_back(t);
    }
  }
}

void RowSampler::observe(int token) {
  if (token < 0 || token >= vocab_) throw std::invalid_argument(id_error("observe: token", token, vocab_));
  ++generated_;
  if (p_.presence != 0 || p_.frequency != 0) ++counts_[token];
  if (!seen_bit_.empty() && !seen_bit_[token]) seen_bit_[token] = 1, seen_.push_back(token);
}

SampleResult RowSampler::next(float* x, const uint32_t* mask, int mask_words) {
  const int V = vocab_;
  // 1-3: the row itself. Only the ids named are touched: O(bias + distinct history), never O(V).
  for (const auto& [id, b] : p_.bias) x[id] += b;
  if (p_.repetition != 1.0f)
    for (int id : seen_) x[id] = x[id] > 0 ? x[id] / p_.repetition : x[id] * p_.repetition;
  if (p_.presence != 0 || p_.frequency != 0)
    for (const auto& [id, n] : counts_) x[id] -= p_.frequency * float(n) + p_.presence;

  const float T = p_.sample.temperature;
  const bool ban = generated_ < p_.min_tokens && !p_.stop_ids.empty();
  const bool cut = p_.min_p > 0 && T > 0;  // greedy keeps the maximum, which min_p never drops
  const bool argmax_only = T == 0 && !p_.want_logprob && p_.sample.n_logprobs == 0;

  if (!mask && !ban && !cut) {
    if (argmax_only) {
      bool finite = true;
      const float mx = ops::max_finite(x, V, &finite);
      if (!finite) throw std::invalid_argument("sample: logits contain NaN or infinity");
      SampleResult r;
      r.token = int(std::find(x, x + V, mx) - x);
      return r;
    }
    return sample(x, V, p_.sample, &rng_);
  }

  if (!mask) {
    // 4 in place: an excluded id's logit becomes kOut, the lowest float, so that sample() over the whole row gives
    // it no weight (and no gather of the ~V ids left is needed).
    int left = V;
    if (ban)
      for (int s : p_.stop_ids) x[s] = kOut, --left;
    if (left == 0) throw std::invalid_argument("min_tokens: every id of the vocabulary is a stop id");
    bool finite = true;
    const float mx = ops::max_finite(x, V, &finite);
    if (!finite) throw std::invalid_argument("sample: logits contain NaN or infinity");
    if (cut)  // p_i >= min_p * p_max  <=>  z_i / T >= z_max / T + log(min_p): the maximum always stays
      left -= ops::exclude_below(x, V, mx + float(double(T) * std::log(double(p_.min_p))), kOut);
    SampleResult r;
    if (left == 1 || argmax_only) {  // one id left is forced: no draw
      r.token = int(std::find(x, x + V, mx) - x);
      if (left == 1 && p_.sample.n_logprobs > 0) r.top.emplace_back(r.token, 0.0f);
      return r;
    }
    if (left <= V / 8) {
      // Most of the row excluded (min_p usually leaves a few dozen ids): draw among the ids left, gathered, rather
      // than walk the whole row's exponentials and best ids (1.4 ms a row over 262144 ids on Zen 3, against 0.1).
      ids_.clear();
      ops::ids_not_equal(x, V, kOut, ids_);
      return from_ids(x, false, false);
    }
    SampleParams q = p_.sample;  // as sample() over the ids left would take them
    q.n_logprobs = std::min(q.n_logprobs, left);
    if (q.top_k >= left) q.top_k = 0;
    const uint64_t before = rng_;
    r = sample(x, V, q, &rng_);
    if (x[r.token] != kOut) {
      r.top.erase(std::remove_if(r.top.begin(), r.top.end(), [&](const auto& t) { return x[t.first] == kOut; }),
                  r.top.end());
      return r;
    }
    // The whole-row walk's exp() is clamped at e^-87, so an excluded id keeps a weight of ~1e-38 and a draw of
    // exactly 0 can land on it: draw again among the ids left, from the same state.
    rng_ = before;
    ids_.clear();
    for (int i = 0; i < V; ++i)
      if (x[i] != kOut) ids_.push_back(i);
    return from_ids(x, false, argmax_only);
  }

  // 4 with a constraint: the ids it allows, ascending (usually far fewer than V), gathered.
  ids_.clear();
  for (int w = 0; w < mask_words; ++w) {
    for (uint32_t bits = mask[w]; bits; bits &= bits - 1) {
      const int i = w * 32 + __builtin_ctz(bits);
      if (i >= V) break;
      ids_.push_back(i);
    }
  }
  if (ids_.empty()) throw std::invalid_argument("the constraint admits no token here");
  if (ban) {
    const auto& s = p_.stop_ids;
    auto is_stop = [&](int t) { return std::binary_search(s.begin(), s.end(), t); };
    // A constraint that admits nothing but stop ids has its output whole: it ends the sequence rather than
    // min_tokens leaving no token at all.
    if (!std::all_of(ids_.begin(), ids_.end(), is_stop))
      ids_.erase(std::remove_if(ids_.begin(), ids_.end(), is_stop), ids_.end());
  }
  return from_ids(x, cut, argmax_only);
}

SampleResult RowSampler::from_ids(const float* x, bool cut, bool argmax_only) {
  const float T = p_.sample.temperature;
  vals_.resize(ids_.size());
  for (size_t i = 0; i < ids_.size(); ++i) vals_[i] = x[ids_[i]];
  int n = int(vals_.size());
  bool finite = true;
  const float mx = ops::max_finite(vals_.data(), n, &finite);
  if (!finite) throw std::invalid_argument("sample: logits contain NaN or infinity");
  if (cut) {
    const float thr = mx + float(double(T) * std::log(double(p_.min_p)));
    int k = 0;
    for (int i = 0; i < n; ++i)
      if (vals_[i] >= thr) vals_[k] = vals_[i], ids_[k] = ids_[i], ++k;
    n = k;
  }
  SampleResult r;
  if (n == 1) {  // forced: no draw
    r.token = ids_[0];
    if (p_.sample.n_logprobs > 0) r.top.emplace_back(r.token, 0.0f);
    return r;
  }
  if (argmax_only) {
    r.token = ids_[std::find(vals_.begin(), vals_.begin() + n, mx) - vals_.begin()];
    return r;
  }
  SampleParams q = p_.sample;
  q.n_logprobs = std::min(q.n_logprobs, n);
  r = sample(vals_.data(), n, q, &rng_);
  r.token = ids_[r.token];
  for (auto& t : r.top) t.first = ids_[t.first];
  return r;
}

void sample_rows(const SampleRow* rows, int n, RowOutcome* out, ThreadPool* pool) {
  auto one = [&](int b) {
    try {
      const SampleRow& r = rows[b];
      out[b].result = r.sampler->next(r.logits, r.mask, r.mask_words);
      out[b].error.clear();
    } catch (const std::exception& e) {
      out[b].error = e.what();
    }
  };
  const auto distinct = [&] {
    std::vector<const RowSampler*> s(n);
    for (int b = 0; b < n; ++b) s[b] = rows[b].sampler;
    std::sort(s.begin(), s.end());
    return std::adjacent_find(s.begin(), s.end()) == s.end();
  };
  if (!pool || pool->size() == 1 || n < 2 || !distinct()) {
    for (int b = 0; b < n; ++b) one(b);
    return;
  }
  pool->parallel_for(n, [&](int b, int) {
    ScopedDenormals ieee(false);  // the pool runs tasks with FTZ + DAZ
    one(b);
  });
}

}  // namespace sg
