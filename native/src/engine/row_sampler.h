// One sequence's sampler: its parameters, the history the penalties and min_tokens depend on, and its random state;
// sample_rows() draws the next token of B such sequences from their logits rows in one call (docs/sampling.md).
//
// Processing of a row, in vLLM's order:
//   1. logit_bias: added to the listed ids' logits (OpenAI).
//   2. repetition_penalty p (!= 1), for every distinct id of the prompt and of the output so far: logit / p if the
//      logit is > 0, else logit * p (vLLM, transformers' RepetitionPenaltyLogitsProcessor).
//   3. presence / frequency penalties, over the output so far: logit -= frequency * count + presence (OpenAI).
//   4. exclusions, which shrink the set drawn from (ids outside it are neither drawn nor reported):
//      the constraint's allowed set (an llguidance bitmask, bit i of word i/32), then while fewer than min_tokens
//      tokens were generated the stop ids (unless that leaves nothing of a non-empty allowed set: a constraint
//      that admits only a stop token ends the sequence), then min_p at the request's temperature (no effect on
//      greedy): ids whose probability is below min_p times the largest are dropped.
//   5. sample() over what is left (temperature, top_k, top_p, the draw, n_logprobs). A single id left is forced:
//      no draw, logprob 0.
// Steps 1-3 rewrite the row in place, so the caller's array holds the processed logits afterwards; without a mask,
// step 4 sets the logits of the ids it excludes to the lowest float (-FLT_MAX) in place too.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sampling.h"

namespace sg {

class ThreadPool;

struct RowSamplerParams {
  SampleParams sample;        // temperature, top_k, top_p, n_logprobs
  bool want_logprob = true;   // false with greedy and n_logprobs 0: the token is the argmax, nothing else computed
  float min_p = 0.0f;         // [0, 1]
  float presence = 0.0f;      // [-2, 2]
  float frequency = 0.0f;     // [-2, 2]
  float repetition = 1.0f;    // > 0; 1 = off
  int min_tokens = 0;
  std::vector<std::pair<int, float>> bias;  // (id, bias)
  std::vector<int> stop_ids;                // held off while fewer than min_tokens were generated
};

class RowSampler {
 public:
  // Throws std::invalid_argument on a parameter out of range or an id outside [0, vocab_size).
  RowSampler(const RowSamplerParams& p, int vocab_size, const int32_t* prompt, int n_prompt, uint64_t rng_state);

  // The sequence took `token` (drawn here or elsewhere, e.g. the prefill worker's first token).
  void observe(int token);

  // The next token from `row` (vocab_size floats, rewritten by steps 1-3). mask: nullptr, or mask_words 32-bit
  // words of allowed ids. Throws std::invalid_argument (non-finite logits, a mask that admits nothing).
  SampleResult next(float* row, const uint32_t* mask, int mask_words);

  uint64_t rng_state() const { return rng_; }
  int generated() const { return generated_; }
  int vocab_size() const { return vocab_; }
  int n_logprobs() const { return p_.sample.n_logprobs; }

 private:
  // sample() over the ids in ids_ (ascending), after min_p when `cut`.
  SampleResult from_ids(const float* x, bool cut, bool argmax_only);

  RowSamplerParams p_;
  int vocab_;
  uint64_t rng_;
  int generated_ = 0;
  std::unordered_map<int, int> counts_;  // output token -> occurrences (presence/frequency)
  std::vector<int> seen_;                // distinct prompt + output ids (repetition_penalty)
  std::vector<uint8_t> seen_bit_;        // id -> in seen_, vocab_size entries when repetition != 1
  std::vector<int> ids_;                 // scratch: the ids left by the exclusions
  std::vector<float> vals_;              // scratch: their logits
};

// One row's outcome in sample_rows: the result, or the reason the row failed (the others go on).
struct RowOutcome {
  SampleResult result;
  std::string error;  // empty: result is valid
};

// One row of sample_rows: its logits (the sampler's vocab_size floats, rewritten by steps 1-3) and its mask
// (nullptr for an unconstrained row).
struct SampleRow {
  RowSampler* sampler;
  float* logits;
  const uint32_t* mask = nullptr;
  int mask_words = 0;
};

// The next token of each of n rows. A row that fails reports its error and leaves its random state as it was.
// With a pool the rows are shared out over its threads (a wide decode step's rows each scan the whole vocabulary:
// 0.3-1.5 ms a row on one thread); each row runs under IEEE denormals as on the caller, and its result depends on
// its row and sampler alone, so the tokens are those of the sequential call. Rows must have distinct samplers
// (a sampler is one sequence's state); with a repeated one the rows run in order on the calling thread.
void sample_rows(const SampleRow* rows, int n, RowOutcome* out, ThreadPool* pool = nullptr);

}  // namespace sg
