// Tensor files (little-endian), written and read by inductor_ext.runtime.tensor_file:
//   "FOTF" magic, uint32 count, then per tensor:
//   uint32 dtype code (0 f32, 1 bf16, 2 f16, 3 i64, 4 i32, 5 bool, 6 u8, 7 i8, 8 f64), uint32 ndim,
//   int64 sizes[ndim], the contiguous data.
// Shared by aoti_runner.cpp and generate.cpp (which also parses a generation package's weights record).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tensor_file {

constexpr char kMagic[4] = {'F', 'O', 'T', 'F'};
const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kHalf, at::kLong, at::kInt,
                                            at::kBool,  at::kByte,     at::kChar, at::kDouble};

// Reads a tensor file's bytes, front to back, with bounds checks.
class Cursor {
 public:
  Cursor(const char* data, size_t size, std::string source) : data_(data), size_(size), source_(std::move(source)) {}

  const char* take(size_t n) {
    if (n > size_ - offset_) throw std::runtime_error(source_ + ": tensor file truncated");
    const char* at = data_ + offset_;
    offset_ += n;
    return at;
  }

  template <typename T>
  T value() {
    T v;
    std::memcpy(&v, take(sizeof(T)), sizeof(T));
    return v;
  }

 private:
  const char* data_;
  size_t size_, offset_ = 0;
  std::string source_;
};

template <typename T>
void write_value(std::ofstream& out, T value) {
  out.write(reinterpret_cast<const char*>(&value), sizeof(T));
}

// The tensors of a tensor file's bytes (CPU, copied out of `data`); `source` names it in errors.
inline std::vector<at::Tensor> parse_tensors(const char* data, size_t size, const std::string& source) {
  Cursor cursor(data, size, source);
  if (size < 4 || std::memcmp(cursor.take(4), kMagic, 4) != 0) throw std::runtime_error(source + " is not a tensor file");
  auto count = cursor.value<uint32_t>();
  std::vector<at::Tensor> tensors;
  for (uint32_t i = 0; i < count; ++i) {
    auto code = cursor.value<uint32_t>();
    if (code >= kDtypes.size()) throw std::runtime_error(source + ": unknown dtype code " + std::to_string(code));
    auto ndim = cursor.value<uint32_t>();
    std::vector<int64_t> sizes(ndim);
    for (auto& s : sizes) s = cursor.value<int64_t>();
    auto tensor = at::empty(sizes, at::TensorOptions().dtype(kDtypes[code]));
    std::memcpy(tensor.data_ptr(), cursor.take(tensor.nbytes()), tensor.nbytes());
    tensors.push_back(tensor);
  }
  return tensors;
}

inline std::vector<at::Tensor> read_tensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_tensors(data.data(), data.size(), path);
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
