// Tensor files (little-endian), written and read by inductor_ext.tensor_file:
//   "FOTF" magic, uint32 count, then per tensor:
//   uint32 dtype code (0 f32, 1 bf16, 2 f16, 3 i64, 4 i32, 5 bool), uint32 ndim,
//   int64 sizes[ndim], the contiguous data.
// Shared by aoti_runner.cpp and generate.cpp.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace tensor_file {

constexpr char kMagic[4] = {'F', 'O', 'T', 'F'};
const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kHalf, at::kLong, at::kInt, at::kBool};

template <typename T>
T read_value(std::ifstream& in) {
  T value;
  in.read(reinterpret_cast<char*>(&value), sizeof(T));
  if (!in) throw std::runtime_error("tensor file truncated");
  return value;
}

template <typename T>
void write_value(std::ofstream& out, T value) {
  out.write(reinterpret_cast<const char*>(&value), sizeof(T));
}

inline std::vector<at::Tensor> read_tensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  char magic[4];
  in.read(magic, 4);
  if (!in || std::memcmp(magic, kMagic, 4) != 0) throw std::runtime_error(path + " is not a tensor file");
  auto count = read_value<uint32_t>(in);
  std::vector<at::Tensor> tensors;
  for (uint32_t i = 0; i < count; ++i) {
    auto code = read_value<uint32_t>(in);
    if (code >= kDtypes.size()) throw std::runtime_error("unknown dtype code " + std::to_string(code));
    auto ndim = read_value<uint32_t>(in);
    std::vector<int64_t> sizes(ndim);
    for (auto& size : sizes) size = read_value<int64_t>(in);
    auto tensor = at::empty(sizes, at::TensorOptions().dtype(kDtypes[code]));
    in.read(static_cast<char*>(tensor.data_ptr()), tensor.nbytes());
    if (!in) throw std::runtime_error("tensor file truncated in tensor " + std::to_string(i));
    tensors.push_back(tensor);
  }
  return tensors;
}

inline void write_tensors(const std::string& path, const std::vector<at::Tensor>& tensors) {
  std::ofstream out(path, std::ios::binary);
  out.write(kMagic, 4);
  write_value<uint32_t>(out, static_cast<uint32_t>(tensors.size()));
  for (const auto& t : tensors) {
    auto cpu = t.to(at::kCPU).contiguous();
    auto it = std::find(kDtypes.begin(), kDtypes.end(), cpu.scalar_type());
    if (it == kDtypes.end()) throw std::runtime_error("unsupported output dtype");
    write_value<uint32_t>(out, static_cast<uint32_t>(it - kDtypes.begin()));
    write_value<uint32_t>(out, static_cast<uint32_t>(cpu.dim()));
    for (auto size : cpu.sizes()) write_value<int64_t>(out, size);
    out.write(static_cast<const char*>(cpu.data_ptr()), cpu.nbytes());
  }
  if (!out) throw std::runtime_error("cannot write " + path);
}

}  // namespace tensor_file
