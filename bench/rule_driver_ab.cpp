// Host A/B of the shared rule driver (detail::run_rule over rules::momentum / rules::nesterov)
// against the hand-written momentum loop (detail::momentum_update): 4 copies, 4 gradients, float32,
// inline (no pool), the two alternating in 41 rounds; prints min and median per call and their ratio.
//
//   g++ -std=c++17 -O3 -fno-math-errno -ffp-contract=off -Icsrc/include bench/rule_driver_ab.cpp \
//       -o /tmp/rule_driver_ab -lpthread && /tmp/rule_driver_ab
//
// Why the driver is slower for momentum (issue #27; GCC 12, -O3): its compute loop runs over one
// cache line with a compile-time trip count (16 floats); for a rule body as small as momentum's, GCC
// peels that loop completely and the SLP vectorizer covers the peeled code only in part
// (-fopt-info-vec: the driver's constant-count copies are "basic block part vectorized", not "loop
// vectorized"; the hand loop, whose runtime Nesterov select makes its body too big to peel, stays a
// vectorized loop; the assembly has ~3x the scalar mulss/movss of the hand loop). Hiding the trip count
// from the compiler (an empty asm on it) makes every instantiation a vectorized loop and momentum
// ties the hand loop (ratio 1.02-1.03), but slows SGD and Adam, whose constant-count loops were
// vectorized well (Adam 5.9 -> 8.6 us, SGD 2.2 -> 2.4 us at 4 x 4096): the fix has to keep the
// constant trip count and stop the complete peeling (e.g. a compute call over two lines, a trip count
// past GCC's max-completely-peel-times of 16).
#include <cudist/updates.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

using namespace cudist;

int main() {
  thread_pool* pool = nullptr;
  for (std::size_t count : {std::size_t(4096), std::size_t(65536)}) {
    for (bool nesterov : {false, true}) {
      const std::size_t n = 4;
      std::vector<std::vector<float>> w(n, std::vector<float>(count, 1.f)), v(n, std::vector<float>(count, 0.5f)),
          g(4, std::vector<float>(count, 0.01f));
      std::vector<float*> wp, vp;
      std::vector<const float*> gp;
      for (auto& x : w) wp.push_back(x.data());
      for (auto& x : v) vp.push_back(x.data());
      for (auto& x : g) gp.push_back(x.data());
      const int reps = count == 4096 ? 200 : 20;
      float* const* const state[2] = {vp.data(), wp.data()};
      std::vector<double> hand, rule;
      for (int round = 0; round < 41; ++round) {
        const auto a = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i)
          detail::momentum_update<float, float>(wp.data(), vp.data(), n, count, gp.data(), 4, 0.01, 0.9, nesterov,
                                                pool);
        const auto b = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) {
          if (nesterov) {
            detail::run_rule<rules::nesterov>(state, n, count, gp.data(), 4, 0.0, pool, 0.01, 0.9);
          } else {
            detail::run_rule<rules::momentum>(state, n, count, gp.data(), 4, 0.0, pool, 0.01, 0.9);
          }
        }
        const auto c = std::chrono::steady_clock::now();
        hand.push_back(std::chrono::duration<double, std::micro>(b - a).count() / reps);
        rule.push_back(std::chrono::duration<double, std::micro>(c - b).count() / reps);
      }
      std::sort(hand.begin(), hand.end());
      std::sort(rule.begin(), rule.end());
      std::printf("4 x %zu float32 nesterov=%d: hand min %.2f us, rule min %.2f us, ratio min %.3f median %.3f\n",
                  count, int(nesterov), hand[0], rule[0], rule[0] / hand[0], rule[20] / hand[20]);
    }
  }
}
