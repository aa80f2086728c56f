// Token sampling from one logits row: greedy, temperature, top-k, top-p, seeded, with top-n logprobs.
//
// Order (as transformers' warpers): z = logits / temperature, keep the top_k largest z, then keep the smallest
// prefix (by descending probability, renormalised over what top_k kept) whose cumulative probability reaches
// top_p, then draw from the kept set renormalised. temperature == 0 is greedy (the lowest id among maxima).
// Ties in the ordering break towards the lower token id.
//
// Random numbers: SplitMix64 on a 64-bit state the caller keeps per request (state += 0x9E3779B97F4A7C15, output
// = the SplitMix64 finaliser of the new state); a draw is (output >> 11) * 2^-53 in [0, 1). A sampled token
// consumes exactly one draw; greedy consumes none. Seeding = setting the state.
//
// Logprobs are the log-softmax of the distribution the token was drawn from: for sampling, z restricted to the
// kept set (tokens outside it are not reported); for greedy, the raw logits over the whole vocabulary.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace sg {

struct SampleParams {
  float temperature = 1.0f;  // >= 0; 0 = greedy
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // (0, 1]
  int n_logprobs = 0;        // top-n alternatives to report
};

struct SampleResult {
  int token = -1;
  float logprob = 0.0f;                    // of the chosen token
  std::vector<std::pair<int, float>> top;  // up to n_logprobs (id, logprob), best first
};

uint64_t splitmix64_next(uint64_t* state);

// Throws std::invalid_argument on parameters sample() would refuse for a row of n logits.
void check_sample_params(const SampleParams& p, int n);

// Throws std::invalid_argument on bad parameters or non-finite logits.
SampleResult sample(const float* logits, int n, const SampleParams& p, uint64_t* rng_state);

// Scoring a known token (prompt logprobs): the log-softmax of row x at `token`, in result.token / result.logprob,
// its rank (1 + how many ids have a larger logit) and the k best (id, logprob) in result.top, best first. Throws
// std::invalid_argument on non-finite logits or an id / k out of range.
SampleResult token_logprob(const float* x, int n, int token, int k, int* rank);

}  // namespace sg
