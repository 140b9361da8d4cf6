// specrt greedy tree acceptance (temperature 0), header-only, no TensorRT / CUDA dependency.
//
// The same walk as specrt::GreedyAccept (plugins/rejection_sample.py, greedy_accept_reference):
// start at window node 0 (the root: the last committed token); among the children of the current
// node, in window order, accept the first whose token equals the target's argmax at the current
// node; repeat from it. When no child matches, stop: the accepted nodes are the path (root
// excluded, by depth) and the bonus token is the argmax at the last accepted node (the root when
// nothing was accepted). Argmax ties resolve to the lowest index, as numpy.argmax does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace specrt {

struct GreedyResult {
    std::vector<int64_t> path;  // accepted window nodes, root excluded, by depth
    int64_t next_token = -1;    // the target's token after the last accepted node (the "bonus" token)
};

// Index of the largest value of row[0..n); the first one on ties.
inline int64_t argmax_row(const float* row, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i)
        if (row[i] > row[best]) best = i;
    return best;
}

// logits: [m, v] row-major, row n = the target's logits at window node n.
// tokens[m]: window tokens (tokens[0], the root, is not tested); parents[m]: parents[0] = -1 and
// parents[c] < c for every other node (depth-sorted windows, as specrt drafts them).
inline GreedyResult greedy_accept(const float* logits, int64_t m, int64_t v, const int64_t* tokens,
                                  const int64_t* parents) {
    if (m < 1 || v < 1) throw std::invalid_argument("greedy_accept: need at least one node and one vocab entry");
    for (int64_t c = 1; c < m; ++c)
        if (parents[c] < 0 || parents[c] >= c)
            throw std::invalid_argument("greedy_accept: parents[" + std::to_string(c) +
                                        "] must be in [0, c) (depth-sorted window)");
    GreedyResult r;
    int64_t node = 0;
    for (;;) {
        const int64_t best = argmax_row(logits + static_cast<size_t>(node) * static_cast<size_t>(v), v);
        int64_t next = -1;
        for (int64_t c = node + 1; c < m; ++c) {  // children come after their parent
            if (parents[c] == node && tokens[c] == best) {
                next = c;
                break;
            }
        }
        if (next < 0) {
            r.next_token = best;
            return r;
        }
        r.path.push_back(next);
        node = next;
    }
}

inline GreedyResult greedy_accept(const std::vector<float>& logits, int64_t v, const std::vector<int64_t>& tokens,
                                  const std::vector<int64_t>& parents) {
    const int64_t m = static_cast<int64_t>(tokens.size());
    if (static_cast<int64_t>(parents.size()) != m || static_cast<int64_t>(logits.size()) != m * v)
        throw std::invalid_argument("greedy_accept: logits must be [M, V] with M = tokens.size() = parents.size()");
    return greedy_accept(logits.data(), m, v, tokens.data(), parents.data());
}

// Ancestor-or-self mask [m, m] (row t sees column u when u is t or an ancestor of t), as the
// decoder's tree_mask input wants it; 1 byte per entry (TensorRT's bool tensors are 1 byte).
inline std::vector<uint8_t> ancestor_mask(const std::vector<int64_t>& parents) {
    const size_t m = parents.size();
    for (size_t c = 1; c < m; ++c)
        if (parents[c] < 0 || parents[c] >= static_cast<int64_t>(c))
            throw std::invalid_argument("ancestor_mask: parents[" + std::to_string(c) + "] must be in [0, c)");
    std::vector<uint8_t> mask(m * m, 0);
    for (size_t t = 0; t < m; ++t)
        for (int64_t u = static_cast<int64_t>(t); u >= 0; u = u == 0 ? -1 : parents[static_cast<size_t>(u)])
            mask[t * m + static_cast<size_t>(u)] = 1;
    return mask;
}

}  // namespace specrt
