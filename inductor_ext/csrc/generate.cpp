// aoti_generate: generate tokens with a package from inductor_ext.runtime.generation.export_generation, no Python.
//
//   aoti_generate PACKAGE.pt2 PROMPT.bin OUT.bin --max-new-tokens N [--device cpu|cuda]
//                 [--sample [--temperature T] [--top-k K] [--seed S]] [--cuda-graph] [--iters N]
//
// PROMPT.bin (a tensor file, format below) holds input_ids (b, T) int64 and optionally a second tensor,
// the attention_mask (b, T) int64 of a left-padded batch. OUT.bin receives the (b, T + generated) int64
// sequences. The loop is inductor_ext/runtime/generation/runtime.py's: one prefill call with the prompt (positions
// count only a row's real tokens), then one decode call per new token; a row that emits an end token
// (package metadata) is finished and gets the pad token afterwards; the loop stops when every row is
// finished or after N tokens. Greedy (argmax) by default; --sample divides the logits by the temperature
// (default 1), keeps the top K (default: all) and draws with at::multinomial from a generator seeded with
// --seed (default 0): reproducible, not Python's draws. The KV cache (max_batch_size rows) and the slot
// mask are allocated once; a batch of b rows uses their first b rows. The package's graphs share one copy
// of its weights (read here, handed to each graph); the decode calls use the static decode graph for the
// batch size where the package has one (export_generation's decode_batch_sizes), else the dynamic graph.
//
// Timing: the whole generation runs --iters times (default 1; the first run's tokens are written), each
// reseeded, and one line is printed: "prefill_ms median=... decode_ms_per_token median=... tokens=..."
// (host wall clock, the device synchronised before reading it; decode_ms_per_token = the time after the
// prefill over the decode calls, nan without any; tokens = the tokens generated per row).
//
// --cuda-graph (CUDA builds only): the first decode call runs eagerly (the warm-up), the second is
// captured in an at::cuda::CUDAGraph over static inputs (token, position, cache slot, slot mask, cache)
// and every later decode step updates those inputs in place and replays it. Not tested on CPU-only
// machines (it is not compiled there); see decode() below.
//
// Tensor files: tensor_file.h.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include "tensor_file.h"

#ifdef INDUCTOR_EXT_WITH_CUDA  // defined by CMakeLists.txt when torch was built with CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// ---- command line ----

const char kUsage[] =
    " PACKAGE.pt2 PROMPT.bin OUT.bin --max-new-tokens N [--device cpu|cuda]"
    " [--sample [--temperature T] [--top-k K] [--seed S]] [--cuda-graph] [--iters N]";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::string package, prompt, out;
  int64_t max_new_tokens = 0;
  std::string device = "cpu";
  bool sample = false, cuda_graph = false;
  double temperature = 1.0;
  std::optional<int64_t> top_k;
  uint64_t seed = 0;
  int iters = 1;
};

// `convert(text, &end)` (std::stoll, std::stod) over the whole of `text`, else a UsageError naming `flag`.
template <typename Convert>
auto parse_number(const std::string& flag, const std::string& text, const char* expected, Convert convert) {
  size_t end = 0;
  decltype(convert(text, &end)) value{};
  try {
    value = convert(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  if (end == 0 || end != text.size()) throw UsageError(flag + " expects " + expected + ", got '" + text + "'");
  return value;
}

int64_t parse_int(const std::string& flag, const std::string& text) {
  return parse_number(flag, text, "an integer", [](const std::string& s, size_t* end) { return std::stoll(s, end); });
}

double parse_double(const std::string& flag, const std::string& text) {
  return parse_number(flag, text, "a number", [](const std::string& s, size_t* end) { return std::stod(s, end); });
}

Options parse_args(int argc, char** argv) {
  if (argc < 4) throw UsageError("expected PACKAGE.pt2 PROMPT.bin OUT.bin");
  Options o;
  o.package = argv[1];
  o.prompt = argv[2];
  o.out = argv[3];
  bool sampling_flag = false;
  for (int i = 4; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--sample") {
      o.sample = true;
      continue;
    }
    if (flag == "--cuda-graph") {
      o.cuda_graph = true;
      continue;
    }
    if (i + 1 >= argc) throw UsageError(flag + " expects a value");
    std::string value = argv[++i];
    if (flag == "--max-new-tokens") {
      o.max_new_tokens = parse_int(flag, value);
    } else if (flag == "--device") {
      o.device = value;
    } else if (flag == "--temperature") {
      o.temperature = parse_double(flag, value), sampling_flag = true;
    } else if (flag == "--top-k") {
      o.top_k = parse_int(flag, value), sampling_flag = true;
    } else if (flag == "--seed") {
      int64_t seed = parse_int(flag, value);
      if (seed < 0) throw UsageError("--seed must be >= 0, got " + value);
      o.seed = static_cast<uint64_t>(seed), sampling_flag = true;
    } else if (flag == "--iters") {
      int64_t iters = parse_int(flag, value);
      if (iters < 1 || iters > 1000000) throw UsageError("--iters must be in 1..1000000, got " + value);
      o.iters = static_cast<int>(iters);
    } else {
      throw UsageError("unknown flag " + flag);
    }
  }
  if (o.max_new_tokens < 1) throw UsageError("--max-new-tokens N (>= 1) is required");
  if (o.device != "cpu" && o.device != "cuda") throw UsageError("--device must be cpu or cuda, got " + o.device);
  if (sampling_flag && !o.sample) throw UsageError("--temperature, --top-k and --seed need --sample");
  if (!(o.temperature > 0)) throw UsageError("--temperature must be > 0");
  if (o.top_k && *o.top_k < 1) throw UsageError("--top-k must be >= 1");
  if (o.cuda_graph && o.device != "cuda") throw UsageError("--cuda-graph needs --device cuda (it captures GPU work)");
#ifndef INDUCTOR_EXT_WITH_CUDA
  if (o.cuda_graph) throw UsageError("--cuda-graph: this aoti_generate was built against a torch without CUDA");
#endif
  return o;
}

// ---- the package ----

const std::string kPrefix = "inductor_ext.generation.";

std::vector<int64_t> parse_ints(const std::string& text) {
  std::vector<int64_t> values;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) {
    if (!item.empty()) values.push_back(std::stoll(item));
  }
  return values;
}

// What export_generation stored as the package's metadata (flat strings, see runtime/generation/export.py).
struct Metadata {
  int64_t max_batch_size, max_seq_len, vocab_size;
  std::vector<int64_t> kv_cache_shape, eos_token_ids, decode_batch_sizes;
  std::optional<int64_t> pad_token_id;
  at::ScalarType dtype;
  std::string device;

  static Metadata read(torch::inductor::AOTIModelPackageLoader& loader, const std::string& path) {
    auto found = loader.get_metadata();
    auto get = [&](const std::string& name) -> std::string {
      auto it = found.find(kPrefix + name);
      if (it == found.end()) {
        throw std::runtime_error(path + " is not a generation package (no metadata " + kPrefix + name +
                                 "; export_generation writes one)");
      }
      return it->second;
    };
    Metadata m;
    m.max_batch_size = std::stoll(get("max_batch_size"));
    m.max_seq_len = std::stoll(get("max_seq_len"));
    m.vocab_size = std::stoll(get("vocab_size"));
    m.kv_cache_shape = parse_ints(get("kv_cache_shape"));
    m.eos_token_ids = parse_ints(get("eos_token_ids"));
    auto sizes = found.find(kPrefix + "decode_batch_sizes");  // absent in packages without static decode graphs
    if (sizes != found.end()) m.decode_batch_sizes = parse_ints(sizes->second);
    auto pad = get("pad_token_id");
    if (!pad.empty()) m.pad_token_id = std::stoll(pad);
    auto dtype = get("dtype");
    if (dtype == "float32") {
      m.dtype = at::kFloat;
    } else if (dtype == "bfloat16") {
      m.dtype = at::kBFloat16;
    } else if (dtype == "float16") {
      m.dtype = at::kHalf;
    } else {
      throw std::runtime_error(path + ": unsupported cache dtype " + dtype);
    }
    m.device = get("device");
    if (m.kv_cache_shape.size() != 6 || m.kv_cache_shape[1] != 2 || m.kv_cache_shape[2] != m.max_batch_size) {
      throw std::runtime_error(path + ": kv_cache_shape " + get("kv_cache_shape") +
                               " is not (layers, 2, max_batch_size, kv_heads, max_seq_len, head_dim)");
    }
    return m;
  }
};

// The package's shared weights (inductor_ext/runtime/shared_weights.py) on `device`, by name (tied weights:
// several names, one tensor); empty if its models hold their own.
std::unordered_map<std::string, at::Tensor> read_weights(const std::string& path, const at::Device& device) {
  caffe2::serialize::PyTorchStreamReader reader(path);
  if (!reader.hasRecord("inductor_ext/weight_names")) return {};
  auto [names_data, names_size] = reader.getRecord("inductor_ext/weight_names");
  std::stringstream lines(std::string(static_cast<const char*>(names_data.get()), names_size));
  auto [data, size] = reader.getRecord("inductor_ext/weights");
  auto tensors = tensor_file::parse_tensors(static_cast<const char*>(data.get()), size, path + ":inductor_ext/weights");
  std::unordered_map<std::string, at::Tensor> weights;
  size_t index = 0;
  for (std::string line; std::getline(lines, line); ++index) {
    if (index >= tensors.size()) throw std::runtime_error(path + ": more weight names than weight tensors");
    auto tensor = tensors[index].to(device);
    std::stringstream aliases(line);
    for (std::string name; std::getline(aliases, name, ' ');) weights.emplace(name, tensor);
  }
  if (index != tensors.size()) throw std::runtime_error(path + ": fewer weight names than weight tensors");
  return weights;
}

// Gives a model compiled without its weights the shared tensors, user-managed: not copied, kept alive by
// the caller's map.
void share_weights(torch::inductor::AOTIModelPackageLoader& loader,
                   const std::unordered_map<std::string, at::Tensor>& weights) {
  std::unordered_map<std::string, at::Tensor> needed;
  for (const auto& name : loader.get_constant_fqns()) {
    auto it = weights.find(name);
    if (it == weights.end()) throw std::runtime_error("the package's weights lack " + name);
    needed.emplace(name, it->second);
  }
  loader.load_constants(needed, /*use_inactive=*/false, /*check_full_update=*/true, /*user_managed=*/true);
}

// The prompt: input_ids and its attention mask (all ones if PROMPT.bin has none), checked against the package.
std::pair<at::Tensor, at::Tensor> read_prompt(const std::string& path, const Metadata& m, int64_t max_new_tokens) {
  auto tensors = tensor_file::read_tensors(path);
  if (tensors.empty() || tensors.size() > 2) {
    throw std::invalid_argument(path + " must hold input_ids and optionally attention_mask, got " +
                                std::to_string(tensors.size()) + " tensors");
  }
  auto ids = tensors[0];
  if (ids.dim() != 2 || ids.scalar_type() != at::kLong) {
    throw std::invalid_argument("input_ids must be an int64 tensor of shape (batch, prompt length), got " +
                                std::string(c10::toString(ids.scalar_type())) + " of rank " +
                                std::to_string(ids.dim()));
  }
  int64_t batch = ids.size(0), length = ids.size(1);
  if (batch < 1 || batch > m.max_batch_size) {
    throw std::invalid_argument("batch " + std::to_string(batch) + " is outside the package's 1.." +
                                std::to_string(m.max_batch_size) + " (max_batch_size)");
  }
  if (length < 1 || length + max_new_tokens > m.max_seq_len) {
    throw std::invalid_argument("prompt length " + std::to_string(length) + " + max_new_tokens " +
                                std::to_string(max_new_tokens) + " exceeds the package's max_seq_len " +
                                std::to_string(m.max_seq_len));
  }
  if (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= m.vocab_size) {
    throw std::invalid_argument("input_ids must be token ids in 0.." + std::to_string(m.vocab_size - 1) +
                                " (vocab_size " + std::to_string(m.vocab_size) + ")");
  }
  if (tensors.size() == 1) return {ids, at::ones_like(ids)};
  auto mask = tensors[1];
  if (mask.scalar_type() != at::kLong || mask.sizes() != ids.sizes()) {
    throw std::invalid_argument("attention_mask must be int64 with input_ids' shape (" + std::to_string(batch) +
                                ", " + std::to_string(length) + ")");
  }
  if (!at::logical_or(mask == 0, mask == 1).all().item<bool>()) {
    throw std::invalid_argument("attention_mask must hold only 0 and 1");
  }
  if (!(mask.sum(1) > 0).all().item<bool>()) {
    throw std::invalid_argument("attention_mask has a row without any real token");
  }
  return {ids, mask};
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Waits for the device: copying one element to the host follows the current stream's work.
void sync(const at::Tensor& t) {
  if (t.is_cuda()) t.reshape(-1).slice(0, 0, 1).to(at::kCPU);
}

// The median of the values that are not nan (nan if none is).
double median(std::vector<double> values) {
  values.erase(std::remove_if(values.begin(), values.end(), [](double v) { return std::isnan(v); }), values.end());
  if (values.empty()) return std::nan("");
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// ---- the loop ----

struct Timing {
  double prefill_ms = 0, decode_ms_per_token = 0;
  int64_t tokens = 0;
};

class Generation {
 public:
  // `decode_loader`: the package's static decode graph for this batch, else `loader` (which serves any batch)
  Generation(torch::inductor::AOTIModelPackageLoader& loader, torch::inductor::AOTIModelPackageLoader& decode_loader,
             const Metadata& m, const Options& o, int64_t batch)
      : loader_(loader), decode_loader_(decode_loader), metadata_(m), options_(o), device_(o.device) {
    auto on_device = at::TensorOptions().device(device_);
    // allocated once for max_batch_size rows; the batch uses their first `batch` rows (contiguous views):
    // the step takes each layer's keys and values, [keys_0, values_0, keys_1, ...] (cache_layout.py)
    kv_cache_ = at::zeros(m.kv_cache_shape, on_device.dtype(m.dtype));
    slot_mask_ = at::zeros({m.max_batch_size, m.max_seq_len}, on_device.dtype(at::kLong));
    for (int64_t layer = 0; layer < m.kv_cache_shape[0]; ++layer) {
      for (int64_t kind = 0; kind < 2; ++kind) caches_.push_back(kv_cache_[layer][kind].slice(0, 0, batch));
    }
    slots_ = slot_mask_.slice(0, 0, batch);
    // the decode call's inputs: fixed addresses, updated in place (what a CUDA graph replays)
    token_ = at::zeros({batch, 1}, on_device.dtype(at::kLong));
    position_ = at::zeros({batch, 1}, on_device.dtype(at::kLong));
    cache_position_ = at::zeros({1}, on_device.dtype(at::kLong));
    eos_ = at::tensor(m.eos_token_ids, at::TensorOptions().dtype(at::kLong)).to(device_);
  }

  // The prompt and its continuation, (b, T + generated), as runtime.py's GenerationPackage.generate.
  at::Tensor generate(const at::Tensor& ids, const at::Tensor& mask, Timing& timing) {
    double start = now_ms();
    int64_t batch = ids.size(0), length = ids.size(1);
    slots_.zero_();
    slots_.slice(1, 0, length).copy_(mask);
    auto positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1);
    std::vector<at::Tensor> inputs = {ids, positions, at::arange(length, ids.options()), slots_};
    inputs.insert(inputs.end(), caches_.begin(), caches_.end());
    auto logits = run(loader_, inputs);
    sync(logits);
    double prefill_end = now_ms();
    auto next_position = positions.slice(1, length - 1, length) + 1;
    auto unfinished = at::ones({batch}, ids.options().dtype(at::kBool));
    std::vector<at::Tensor> generated;
    int64_t decode_calls = 0;
    for (int64_t index = 0; index < options_.max_new_tokens; ++index) {
      auto token = choose(logits);
      if (metadata_.pad_token_id) token = at::where(unfinished, token, *metadata_.pad_token_id);
      generated.push_back(token);
      if (eos_.numel() > 0) unfinished = unfinished.logical_and(at::isin(token, eos_).logical_not());
      if (index + 1 == options_.max_new_tokens || !unfinished.any().item<bool>()) break;
      int64_t slot = length + index;
      slots_.select(1, slot).fill_(1);
      logits = decode(token, next_position, slot);
      next_position = next_position + 1;
      ++decode_calls;
    }
    auto result = at::cat({ids, at::stack(generated, 1)}, 1).to(at::kCPU);  // waits for the device
    double end = now_ms();
    timing.prefill_ms = prefill_end - start;
    timing.decode_ms_per_token = decode_calls ? (end - prefill_end) / decode_calls : std::nan("");
    timing.tokens = static_cast<int64_t>(generated.size());
    return result;
  }

  void seed(uint64_t seed) {
    auto generator = at::globalContext().defaultGenerator(device_);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(seed);
  }

 private:
  at::Tensor run(torch::inductor::AOTIModelPackageLoader& loader, const std::vector<at::Tensor>& inputs) {
    void* stream = nullptr;
#ifdef INDUCTOR_EXT_WITH_CUDA
    if (device_.is_cuda()) stream = c10::cuda::getCurrentCUDAStream().stream();
#endif
    auto outputs = loader.run(inputs, stream);
    if (outputs.size() != 1) throw std::runtime_error("the package returned " + std::to_string(outputs.size()) +
                                                      " outputs; a generation step returns the logits only");
    return outputs[0];
  }

  // One decode call: the new token of each row at cache slot `slot`.
  at::Tensor decode(const at::Tensor& token, const at::Tensor& position, int64_t slot) {
    token_.copy_(token.unsqueeze(1));
    position_.copy_(position);
    cache_position_.fill_(slot);
    std::vector<at::Tensor> inputs = {token_, position_, cache_position_, slots_};
    inputs.insert(inputs.end(), caches_.begin(), caches_.end());
    if (!options_.cuda_graph) return run(decode_loader_, inputs);
#ifdef INDUCTOR_EXT_WITH_CUDA
    // Tested on the H200 (tests/gpu/test_generation_gpu.py: the captured loop gives the launched loop's tokens).
    // The loader runs single-threaded (main()), so the AOTI container neither records nor queries its
    // completion event: nothing in run() but kernel launches and caching-allocator calls, which capture
    // takes into the graph's private pool. The current stream is main()'s side stream (capture cannot
    // use the legacy default stream), and every in-place update above is ordered on it.
    if (!graph_) {
      if (!warmed_up_) {  // the warm-up: a real decode step, eagerly (lazy initialisation, autotuned choices)
        warmed_up_ = true;
        return run(decode_loader_, inputs);
      }
      c10::cuda::getCurrentCUDAStream().synchronize();
      graph_ = std::make_unique<at::cuda::CUDAGraph>();
      graph_->capture_begin();
      graph_logits_ = run(decode_loader_, inputs);  // recorded, not run: the replay below computes this step
      graph_->capture_end();
    }
    graph_->replay();
    return graph_logits_;  // the graph's output buffer, rewritten by every replay
#else
    throw std::logic_error("--cuda-graph without CUDA");  // parse_args refuses it first
#endif
  }

  at::Tensor choose(const at::Tensor& logits) {
    if (!options_.sample) return logits.argmax(-1);
    auto scaled = logits / options_.temperature;
    if (options_.top_k) {
      auto kth = std::get<0>(at::topk(scaled, std::min(*options_.top_k, scaled.size(-1)))).slice(-1, -1);
      scaled = scaled.masked_fill(scaled < kth, -std::numeric_limits<double>::infinity());
    }
    auto generator = at::globalContext().defaultGenerator(device_);
    return at::multinomial(at::softmax(scaled, -1), 1, false, generator).squeeze(1);
  }

  torch::inductor::AOTIModelPackageLoader& loader_;
  torch::inductor::AOTIModelPackageLoader& decode_loader_;
  const Metadata& metadata_;
  const Options& options_;
  at::Device device_;
  at::Tensor kv_cache_, slot_mask_, slots_, token_, position_, cache_position_, eos_;
  std::vector<at::Tensor> caches_;
#ifdef INDUCTOR_EXT_WITH_CUDA
  bool warmed_up_ = false;
  std::unique_ptr<at::cuda::CUDAGraph> graph_;  // declared before its output: destroyed after it
#endif
  at::Tensor graph_logits_;
};

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse_args(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "aoti_generate: " << e.what() << "\nusage: " << argv[0] << kUsage << "\n";
    return 2;
  }
  try {
    if (options.device == "cuda" && !at::hasCUDA()) {
      throw std::runtime_error("--device cuda: this torch has no CUDA or sees no GPU");
    }
#ifdef INDUCTOR_EXT_WITH_CUDA
    // all the work on one side stream: the package's calls, the in-place updates, the token choice
    // (CUDA graph capture needs a stream other than the legacy default one)
    std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
    if (options.device == "cuda") stream_guard.emplace(c10::cuda::getStreamFromPool());
#endif
    // single-threaded: the AOTI container skips its per-run CUDA event (recorded in a capture, it could
    // not be queried afterwards); this process calls the package from one thread only
    torch::inductor::AOTIModelPackageLoader loader(options.package, "model", /*run_single_threaded=*/true);
    auto metadata = Metadata::read(loader, options.package);
    if (metadata.device != options.device) {
      throw std::invalid_argument("the package was exported for " + metadata.device + "; pass --device " +
                                  metadata.device);
    }
    auto [ids, mask] = read_prompt(options.prompt, metadata, options.max_new_tokens);
    ids = ids.to(at::Device(options.device)), mask = mask.to(at::Device(options.device));
    // every graph of the package over one copy of the weights, which `weights` keeps alive
    auto weights = read_weights(options.package, at::Device(options.device));
    // the static decode graph for this batch, if the package has one (runtime/generation/metadata.py names it)
    std::unique_ptr<torch::inductor::AOTIModelPackageLoader> static_decode;
    const auto& sizes = metadata.decode_batch_sizes;
    if (std::find(sizes.begin(), sizes.end(), ids.size(0)) != sizes.end()) {
      static_decode = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
          options.package, "decode_batch_" + std::to_string(ids.size(0)), /*run_single_threaded=*/true);
    }
    if (!weights.empty()) {
      share_weights(loader, weights);
      if (static_decode) share_weights(*static_decode, weights);
    }
    auto& decode_loader = static_decode ? *static_decode : loader;
    Generation generation(loader, decode_loader, metadata, options, ids.size(0));
    std::vector<double> prefill, decode;
    Timing timing, first;
    for (int i = 0; i < options.iters; ++i) {
      generation.seed(options.seed);
      auto tokens = generation.generate(ids, mask, timing);
      if (i == 0) tensor_file::write_tensors(options.out, {tokens}), first = timing;
      prefill.push_back(timing.prefill_ms);
      decode.push_back(timing.decode_ms_per_token);
    }
    std::cout << "prefill_ms median=" << median(prefill) << " decode_ms_per_token median=" << median(decode)
              << " tokens=" << first.tokens << "\n";
  } catch (const std::exception& e) {
    std::cerr << "aoti_generate: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
