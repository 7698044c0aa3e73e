// All-reduces four replica buffers with cudist's C++ API and prints the results.
//
// Replica r holds x[i] = r + i / 4; after a SUM all-reduce every replica holds
// (0 + 1 + 2 + 3) + 4 * i / 4 = 6 + i, after a MEAN all-reduce 1.5 + i / 4.
#include <cudist/cudist.hpp>

#include <cstdio>
#include <vector>

int main() {
  const std::size_t replicas = 4, count = 6;
  std::vector<std::vector<float>> bufs(replicas, std::vector<float>(count));
  for (std::size_t r = 0; r < replicas; ++r)
    for (std::size_t i = 0; i < count; ++i) bufs[r][i] = static_cast<float>(r) + static_cast<float>(i) / 4.0f;
  auto means = bufs;

  cudist::all_reduce(bufs, cudist::reduce_op::sum);
  cudist::all_reduce(means, cudist::reduce_op::mean);

  // Mirrored SGD step on the summed buffers: w = w - 0.5 * 2 on every copy.
  const std::vector<float> grad(count, 2.0f);
  std::vector<std::vector<float>> after = bufs;
  std::vector<float*> after_ptrs;
  for (auto& b : after) after_ptrs.push_back(b.data());
  cudist::sgd(after_ptrs.data(), after_ptrs.size(), count, grad.data(), 0.5, /*decay=*/0.0);

  std::printf("cudist %s, %u threads\n", cudist::version_string, cudist::thread_pool::global().size());
  for (std::size_t r = 0; r < replicas; ++r) {
    std::printf("sum  replica %zu:", r);
    for (float v : bufs[r]) std::printf(" %g", v);
    std::printf("\n");
  }
  std::printf("mean replica 0:");
  for (float v : means[0]) std::printf(" %g", v);
  std::printf("\nsgd  replica 3:");
  for (float v : after[3]) std::printf(" %g", v);
  std::printf("\n");
  return 0;
}
