// aoti_runner: run an AOTInductor package (.pt2) with no Python.
//
//   aoti_runner PACKAGE.pt2 INPUTS.bin OUTPUTS.bin [--iters N] [--device cpu|cuda]
//
// Reads the inputs from a tensor file, runs the package once and writes its outputs,
// then times N more runs (default 10) and prints "latency_ms median=... min=...".
// Tensor files: tensor_file.h.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <ATen/ATen.h>

#include "tensor_file.h"

#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: " << argv[0] << " PACKAGE.pt2 INPUTS.bin OUTPUTS.bin [--iters N] [--device cpu|cuda]\n";
    return 2;
  }
  int iters = 10;
  std::string device = "cpu";
  for (int i = 4; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--iters") {
      iters = std::stoi(argv[i + 1]);
    } else if (flag == "--device") {
      device = argv[i + 1];
    } else {
      std::cerr << "unknown flag " << flag << "\n";
      return 2;
    }
  }
  try {
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);
    auto inputs = tensor_file::read_tensors(argv[2]);
    for (auto& t : inputs) t = t.to(at::Device(device));
    auto outputs = loader.run(inputs);
    tensor_file::write_tensors(argv[3], outputs);
    std::vector<double> times;
    for (int i = 0; i < iters; ++i) {
      auto start = std::chrono::steady_clock::now();
      auto result = loader.run(inputs);
      if (device != "cpu") result[0].reshape(-1).slice(0, 0, 1).to(at::kCPU);  // waits for the device (copies one element)
      times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    if (!times.empty()) {
      std::sort(times.begin(), times.end());
      std::cout << "latency_ms median=" << times[times.size() / 2] << " min=" << times.front() << " iters=" << iters
                << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "aoti_runner: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
