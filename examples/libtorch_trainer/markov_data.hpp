// Data: a fixed random second-order Markov chain.
#ifndef SO_TORCH_TRAINER_MARKOV_DATA_HPP
#define SO_TORCH_TRAINER_MARKOV_DATA_HPP

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace trainer {

/** A fixed random Markov chain: each context has 4 possible next tokens with probabilities
 *  0.55, 0.25, 0.12, 0.08 (entropy 1.13 nats, the loss floor). The context is the previous
 *  token (--order 1, the default: learnt within a few dozen steps), the previous two tokens
 *  (--order 2) or (3a + b) mod V of them (--order 3): harder, they need the attention. */
struct MarkovData {
    int64_t vocab;
    std::vector<int32_t> succ; // vocab * vocab * 4
    int order;
    int64_t context(int64_t a, int64_t c) const {
        return order == 1 ? c : order == 2 ? a * vocab + c : (3 * a + c) % vocab;
    }
    explicit MarkovData(int64_t v, uint64_t seed, int order_);
    static double entropy();
    /** Tokens [batch, seq + 1] for a step, the same for every run. */
    torch::Tensor batch(int64_t step, int64_t b, int64_t t, uint64_t seed) const;
};

} // namespace trainer

#endif
