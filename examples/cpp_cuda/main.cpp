// All-reduces replica buffers on the GPU(s) with cudist's CUDA launchers and checks the results.
//
// Replica r holds x[i] = r + (i % 8) / 4 (exact in float). First a SUM all-reduce of 4 replicas on
// GPU 0 with cudist::cuda::all_reduce on a stream; then a MEAN all-reduce with
// cudist::cuda::p2p_all_reduce of 2 replicas per GPU over every GPU (at most 8 replicas), one
// launch per replica on its own GPU. Exits 77 when there is no usable GPU.
#include <cudist/cuda/launch.hpp>
#include <cudist/cuda/p2p.hpp>

#include <cstdio>
#include <vector>

namespace {

constexpr long long kCount = 1000;

float value(int r, long long i) { return static_cast<float>(r) + static_cast<float>(i % 8) / 4.0f; }

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::printf("%s failed: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
  return false;
}

// Allocates replica r on devices[r], filled with value(r, i).
bool make_replicas(const std::vector<int>& devices, std::vector<float*>& bufs) {
  std::vector<float> host(kCount);
  for (std::size_t r = 0; r < devices.size(); ++r) {
    for (long long i = 0; i < kCount; ++i) host[static_cast<std::size_t>(i)] = value(static_cast<int>(r), i);
    float* p = nullptr;
    if (!ok(cudaSetDevice(devices[r]), "cudaSetDevice") ||
        !ok(cudaMalloc(reinterpret_cast<void**>(&p), kCount * sizeof(float)), "cudaMalloc"))
      return false;
    bufs.push_back(p);
    if (!ok(cudaMemcpy(p, host.data(), kCount * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy")) return false;
  }
  return true;
}

// Every replica must hold sum_r value(r, i) (/ n for the mean).
int check(const std::vector<float*>& bufs, bool mean, const char* label) {
  const int n = static_cast<int>(bufs.size());
  std::vector<float> host(kCount);
  int bad = 0;
  for (int r = 0; r < n; ++r) {
    if (!ok(cudaMemcpy(host.data(), bufs[static_cast<std::size_t>(r)], kCount * sizeof(float), cudaMemcpyDeviceToHost),
            "cudaMemcpy"))
      return 1;
    for (long long i = 0; i < kCount; ++i) {
      float expected = 0.0f;
      for (int q = 0; q < n; ++q) expected += value(q, i);
      if (mean) expected /= static_cast<float>(n);
      if (host[static_cast<std::size_t>(i)] != expected) ++bad;
    }
  }
  std::printf("%s: %d replicas, element 5 = %g, %s\n", label, n, static_cast<double>(host[5]), bad ? "WRONG" : "ok");
  return bad ? 1 : 0;
}

}  // namespace

int main() {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1) {
    std::printf("no usable CUDA device: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 77;
  }
  int failures = 0;

  // One GPU, four replicas, one launch on a stream.
  std::vector<float*> local;
  cudaStream_t stream = nullptr;
  if (!make_replicas({0, 0, 0, 0}, local) || !ok(cudaSetDevice(0), "cudaSetDevice") ||
      !ok(cudaStreamCreate(&stream), "cudaStreamCreate") ||
      !ok(cudist::cuda::all_reduce<float>(local.data(), 4, kCount, cudist::reduce_op::sum, stream), "all_reduce") ||
      !ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize"))
    return 1;
  failures += check(local, false, "all_reduce sum");

  // Two replicas per GPU over every GPU, on the devices' default streams.
  std::vector<int> devices;
  for (int d = 0; d < gpus && devices.size() < 8; ++d) devices.insert(devices.end(), {d, d});
  std::vector<float*> spread;
  if (!make_replicas(devices, spread)) return 1;
  const cudaError_t e = cudist::cuda::p2p_all_reduce<float>(spread.data(), devices.data(), nullptr,
                                                            static_cast<int>(spread.size()), kCount,
                                                            cudist::reduce_op::mean);
  if (e == cudaErrorInvalidDevice && gpus > 1) {
    std::printf("p2p_all_reduce mean: skipped, these GPUs cannot access each other's memory\n");
  } else {
    if (!ok(e, "p2p_all_reduce")) return 1;
    for (int d = 0; d < gpus; ++d)
      if (!ok(cudaSetDevice(d), "cudaSetDevice") || !ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize")) return 1;
    failures += check(spread, true, "p2p_all_reduce mean");
  }

  for (float* p : local) cudaFree(p);
  for (float* p : spread) cudaFree(p);
  cudaStreamDestroy(stream);
  std::printf(failures ? "FAILED\n" : "OK\n");
  return failures ? 1 : 0;
}
