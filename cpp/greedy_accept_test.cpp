// Tests of greedy_accept.hpp: plain C++, builds and runs everywhere (no TensorRT, no CUDA).
//
//   greedy_accept_test           run the built-in cases; prints one line per case, exit 0 when all pass
//   greedy_accept_test --stdin   read one case and print "path=<n,n,...> next=<token>", for cross-checks:
//                                  M V
//                                  tokens (M ints)
//                                  parents (M ints, parents[0] = -1)
//                                  logits (M*V floats, row-major)
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "greedy_accept.hpp"

namespace {

std::string join(const std::vector<int64_t>& xs) {
    std::string s;
    for (size_t i = 0; i < xs.size(); ++i) s += (i ? "," : "") + std::to_string(xs[i]);
    return s;
}

std::string show(const specrt::GreedyResult& r) { return "path=" + join(r.path) + " next=" + std::to_string(r.next_token); }

// Logits [M, V] whose row n peaks at argmax[n] (every other entry 0, the peak 1).
std::vector<float> peaked(const std::vector<int64_t>& argmax, int64_t v) {
    std::vector<float> l(argmax.size() * static_cast<size_t>(v), 0.0f);
    for (size_t n = 0; n < argmax.size(); ++n) l[n * static_cast<size_t>(v) + static_cast<size_t>(argmax[n])] = 1.0f;
    return l;
}

int check(const char* name, const specrt::GreedyResult& got, const std::vector<int64_t>& path, int64_t next) {
    const bool ok = got.path == path && got.next_token == next;
    std::printf("%s %s: %s\n", ok ? "PASS" : "FAIL", name, show(got).c_str());
    if (!ok) std::printf("     expected path=%s next=%lld\n", join(path).c_str(), static_cast<long long>(next));
    return ok ? 0 : 1;
}

int builtin() {
    const int64_t v = 8;
    int failures = 0;
    // chain root -> 1 -> 2 -> 3 -> 4 drafting 5,6,7,2; the target agrees everywhere and says 3 after node 4
    {
        std::vector<int64_t> tokens{1, 5, 6, 7, 2}, parents{-1, 0, 1, 2, 3};
        failures += check("chain_all_accepted", specrt::greedy_accept(peaked({5, 6, 7, 2, 3}, v), v, tokens, parents),
                          {1, 2, 3, 4}, 3);
    }
    // same chain, the target wants 4 at the root: nothing accepted, the bonus token is 4
    {
        std::vector<int64_t> tokens{1, 5, 6, 7, 2}, parents{-1, 0, 1, 2, 3};
        failures += check("root_rejected", specrt::greedy_accept(peaked({4, 6, 7, 2, 3}, v), v, tokens, parents), {}, 4);
    }
    // chain accepted up to node 2, rejected at node 3 (target says 0 after node 2)
    {
        std::vector<int64_t> tokens{1, 5, 6, 7, 2}, parents{-1, 0, 1, 2, 3};
        failures += check("chain_partial", specrt::greedy_accept(peaked({5, 6, 0, 2, 3}, v), v, tokens, parents),
                          {1, 2}, 0);
    }
    // tree: root children 1 (tok 3), 2 (tok 5), 3 (tok 6); node 2's children 4 (tok 1), 5 (tok 7);
    // the target picks 5 at the root (second sibling), then 7 at node 2, then 2 at node 5
    {
        std::vector<int64_t> tokens{0, 3, 5, 6, 1, 7}, parents{-1, 0, 0, 0, 2, 2};
        failures += check("tree_matching_sibling",
                          specrt::greedy_accept(peaked({5, 0, 7, 0, 0, 2}, v), v, tokens, parents), {2, 5}, 2);
    }
    // argmax ties resolve to the lowest index (numpy.argmax): row 0 ties tokens 2 and 6 -> 2 (node 2)
    {
        std::vector<int64_t> tokens{0, 6, 2}, parents{-1, 0, 0};
        std::vector<float> l(3 * v, 0.0f);
        l[2] = l[6] = 1.0f;
        l[2 * v + 4] = 1.0f;
        failures += check("argmax_tie_lowest", specrt::greedy_accept(l, v, tokens, parents), {2}, 4);
    }
    // the ancestor-or-self mask of the tree above
    {
        const auto mask = specrt::ancestor_mask({-1, 0, 0, 0, 2, 2});
        const std::vector<uint8_t> want{1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0,
                                        1, 0, 0, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 0, 1};
        const bool ok = mask == want;
        std::printf("%s ancestor_mask\n", ok ? "PASS" : "FAIL");
        failures += ok ? 0 : 1;
    }
    std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "OK", failures);
    return failures ? 1 : 0;
}

int from_stdin() {
    int64_t m = 0, v = 0;
    if (!(std::cin >> m >> v) || m < 1 || v < 1) {
        std::fprintf(stderr, "expected 'M V' on the first line\n");
        return 2;
    }
    std::vector<int64_t> tokens(static_cast<size_t>(m)), parents(static_cast<size_t>(m));
    std::vector<float> logits(static_cast<size_t>(m * v));
    for (auto& t : tokens) std::cin >> t;
    for (auto& p : parents) std::cin >> p;
    for (auto& x : logits) std::cin >> x;  // decimal text with 9 significant digits round-trips float32
    if (!std::cin) {
        std::fprintf(stderr, "short input: need M tokens, M parents and M*V logits\n");
        return 2;
    }
    std::printf("%s\n", show(specrt::greedy_accept(logits, v, tokens, parents)).c_str());
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        if (argc > 1 && std::string(argv[1]) == "--stdin") return from_stdin();
        return builtin();
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
}
