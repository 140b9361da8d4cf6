// specrt_verify: one speculative verify step of a specrt TensorRT target engine, from C++.
//
//   specrt_verify (--engine FILE | --manifest BUNDLE/manifest.json) [--plugin LIB.so]...
//                 [--prompt 1,2,3,...] [--draft a,b,c,d] [--capacity S] [--kv-heads KV] [--head-dim d]
//
// Steps: load plugin libraries into TensorRT's plugin registry, deserialize the engine, allocate the
// KV cache once on the device (past_key.i / past_value.i, [1, KV, S, d]) and bind each buffer as
// both past_* (input) and present_* (output) so the engine updates it in place; prefill the prompt;
// then verify a root + 4-token chain window with the causal tree mask, walk the greedy acceptance on
// the host (greedy_accept.hpp) and print the accepted tokens and the bonus token.
//
// Without --draft the drafts are made by plain greedy decoding (4 single-token steps), then past_len
// is rolled back to the prompt and the same tokens are verified as one window: all 4 must be accepted
// and the bonus token must equal the 5th greedy token. That checks in-place KV binding, rollback by
// past_len and acceptance together (exit 1 on a mismatch).
//
// The I/O contract is specrt's decoder graph: inputs input_ids [B,T] int64, position_ids [B,T] int64,
// past_len [B] int64, tree_mask [B,T,T] bool, logits_index [B,R] int64, past_key.i / past_value.i
// [B,KV,S,d]; outputs logits [B,R,V], hidden_states [B,T,H], present_key.i / present_value.i. B = 1 here.
#include <NvInferRuntime.h>
#include <NvInferVersion.h>
#include <cuda_runtime_api.h>
#ifdef SPECRT_HAVE_NVINFER_PLUGIN
#include <NvInferPlugin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "greedy_accept.hpp"

namespace {

using nvinfer1::DataType;

#define CUDA_CHECK(call)                                                                                  \
    do {                                                                                                  \
        cudaError_t err_ = (call);                                                                        \
        if (err_ != cudaSuccess)                                                                          \
            throw std::runtime_error(std::string(#call) + " failed: " + cudaGetErrorString(err_));       \
    } while (0)

class Logger : public nvinfer1::ILogger {
  public:
    void log(Severity severity, char const* msg) noexcept override {
        if (severity <= Severity::kWARNING) std::fprintf(stderr, "[TensorRT] %s\n", msg);
    }
};

struct Args {
    std::string engine, manifest;
    std::vector<std::string> plugins;
    std::vector<int64_t> prompt{1, 2, 3, 4, 5, 6, 7, 8};
    std::vector<int64_t> draft;  // empty: self-check with greedy-decoded drafts
    int64_t capacity = 256, kv_heads = -1, head_dim = -1;
};

std::vector<int64_t> parse_ints(const std::string& s) {
    std::vector<int64_t> out;
    std::stringstream ss(s);
    for (std::string item; std::getline(ss, item, ',');)
        if (!item.empty()) out.push_back(std::stoll(item));
    return out;
}

std::string read_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot read " + path);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// Not a JSON parser: finds artifacts.tensorrt.graphs.target.file by scanning for the keys in order,
// which is enough for the manifests specrt writes ("tensorrt" → "graphs" → "target" → "file").
std::string engine_from_manifest(const std::string& manifest_path) {
    const std::string text = read_file(manifest_path);
    size_t at = 0;
    for (const char* key : {"\"tensorrt\"", "\"graphs\"", "\"target\"", "\"file\""}) {
        at = text.find(key, at);
        if (at == std::string::npos)
            throw std::runtime_error(manifest_path + " has no artifacts.tensorrt.graphs.target.file (missing " + key +
                                     "): build the engines first");
        at += std::strlen(key);
    }
    const size_t open = text.find('"', text.find(':', at));
    const size_t close = text.find('"', open + 1);
    if (open == std::string::npos || close == std::string::npos) throw std::runtime_error("malformed " + manifest_path);
    const std::string file = text.substr(open + 1, close - open - 1);
    const size_t slash = manifest_path.find_last_of('/');
    return file.front() == '/' || slash == std::string::npos ? file : manifest_path.substr(0, slash + 1) + file;
}

size_t element_size(DataType t) {
    switch (t) {
        case DataType::kFLOAT: case DataType::kINT32: return 4;
        case DataType::kHALF: case DataType::kBF16: return 2;
        case DataType::kINT8: case DataType::kUINT8: case DataType::kBOOL: case DataType::kFP8: return 1;
        case DataType::kINT64: return 8;
        default: throw std::runtime_error("unsupported tensor data type " + std::to_string(static_cast<int>(t)));
    }
}

nvinfer1::Dims dims(std::initializer_list<int64_t> values) {
    nvinfer1::Dims d{};
    d.nbDims = static_cast<int32_t>(values.size());
    int32_t i = 0;
    for (int64_t v : values) d.d[i++] = static_cast<std::remove_reference_t<decltype(d.d[0])>>(v);
    return d;
}

int64_t volume(const nvinfer1::Dims& d) {
    int64_t n = 1;
    for (int32_t i = 0; i < d.nbDims; ++i) n *= d.d[i];
    return n;
}

// Integer tensors as the engine wants them: int64 (TensorRT >= 9) or int32 (engines that narrowed them).
std::vector<uint8_t> pack_ints(const std::vector<int64_t>& xs, DataType t) {
    std::vector<uint8_t> out(xs.size() * element_size(t));
    for (size_t i = 0; i < xs.size(); ++i) {
        if (t == DataType::kINT64) std::memcpy(out.data() + 8 * i, &xs[i], 8);
        else if (t == DataType::kINT32) { const int32_t v = static_cast<int32_t>(xs[i]); std::memcpy(out.data() + 4 * i, &v, 4); }
        else throw std::runtime_error("integer input of unexpected data type " + std::to_string(static_cast<int>(t)));
    }
    return out;
}

struct DeviceBuffer {  // one cudaMalloc, grown on demand, freed on destruction; not copyable
    void* ptr = nullptr;
    size_t bytes = 0;
    DeviceBuffer() = default;
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    void reserve(size_t n) {
        if (n <= bytes) return;
        if (ptr) CUDA_CHECK(cudaFree(ptr));
        CUDA_CHECK(cudaMalloc(&ptr, n));
        bytes = n;
    }
    ~DeviceBuffer() { if (ptr) cudaFree(ptr); }
};

class Verifier {
  public:
    explicit Verifier(const Args& a) : args_(a) {
        runtime_.reset(nvinfer1::createInferRuntime(logger_));
        if (!runtime_) throw std::runtime_error("createInferRuntime failed");
#ifdef SPECRT_HAVE_NVINFER_PLUGIN
        initLibNvInferPlugins(&logger_, "");  // NVIDIA's stock plugins, in case the engine uses any
#endif
        for (const auto& lib : a.plugins) {  // before deserializing: the engine looks its plugins up by name
            if (!getPluginRegistry()->loadLibrary(lib.c_str()))
                throw std::runtime_error("TensorRT could not load plugin library " + lib);
            std::printf("plugin library loaded: %s\n", lib.c_str());
        }
        const std::string blob = read_file(a.engine);
        engine_.reset(runtime_->deserializeCudaEngine(blob.data(), blob.size()));
        if (!engine_) throw std::runtime_error("deserializeCudaEngine failed for " + a.engine +
                                               " (TensorRT version / GPU mismatch, or a plugin not loaded?)");
        context_.reset(engine_->createExecutionContext());
        if (!context_) throw std::runtime_error("createExecutionContext failed");
        CUDA_CHECK(cudaStreamCreate(&stream_));
        discover_io();
        allocate_kv();
    }
    ~Verifier() { if (stream_) cudaStreamDestroy(stream_); }

    int64_t vocab() const { return vocab_; }

    // One decoder call on window `tokens` at positions past_len.., mask [T,T], logits rows `logits_index`.
    // Returns the logits [R, V] on the host. KV rows past_len..past_len+T-1 are written in place.
    std::vector<float> step(const std::vector<int64_t>& tokens, int64_t past_len, const std::vector<uint8_t>& mask,
                            const std::vector<int64_t>& logits_index) {
        const int64_t t = static_cast<int64_t>(tokens.size()), r = static_cast<int64_t>(logits_index.size());
        if (past_len + t > args_.capacity) throw std::runtime_error("KV capacity exceeded: raise --capacity");
        std::vector<int64_t> positions(tokens.size());
        for (int64_t i = 0; i < t; ++i) positions[static_cast<size_t>(i)] = past_len + i;
        set_input("input_ids", dims({1, t}), pack_ints(tokens, dtype("input_ids")));
        set_input("position_ids", dims({1, t}), pack_ints(positions, dtype("position_ids")));
        set_input("past_len", dims({1}), pack_ints({past_len}, dtype("past_len")));
        set_input("tree_mask", dims({1, t, t}), std::vector<uint8_t>(mask.begin(), mask.end()));
        set_input("logits_index", dims({1, r}), pack_ints(logits_index, dtype("logits_index")));
        for (int64_t i = 0; i < layers_; ++i)
            for (const char* kind : {"past_key.", "past_value."})
                if (!context_->setInputShape((kind + std::to_string(i)).c_str(), dims({1, kv_heads_, args_.capacity, head_dim_})))
                    throw std::runtime_error(std::string("setInputShape failed for ") + kind + std::to_string(i));
        // outputs other than present_* (bound to the KV buffers once) get scratch buffers sized now
        for (const auto& name : outputs_) {
            if (name.rfind("present_", 0) == 0) continue;
            const nvinfer1::Dims shape = context_->getTensorShape(name.c_str());
            if (volume(shape) < 0) throw std::runtime_error("unresolved output shape for " + name);
            auto& buf = scratch_[name];
            buf.reserve(static_cast<size_t>(volume(shape)) * element_size(dtype(name)) + 1);
            if (!context_->setTensorAddress(name.c_str(), buf.ptr)) throw std::runtime_error("setTensorAddress " + name);
        }
        const nvinfer1::Dims lshape = context_->getTensorShape("logits");
        vocab_ = lshape.d[lshape.nbDims - 1];
        if (!context_->allInputDimensionsSpecified()) throw std::runtime_error("not every input shape was set");
        if (!context_->enqueueV3(stream_)) throw std::runtime_error("enqueueV3 failed");
        std::vector<float> logits(static_cast<size_t>(r * vocab_));
        CUDA_CHECK(cudaMemcpyAsync(logits.data(), scratch_["logits"].ptr, logits.size() * sizeof(float),
                                   cudaMemcpyDeviceToHost, stream_));
        CUDA_CHECK(cudaStreamSynchronize(stream_));
        return logits;
    }

  private:
    DataType dtype(const std::string& name) const { return engine_->getTensorDataType(name.c_str()); }

    void discover_io() {
        const int32_t n = engine_->getNbIOTensors();
        std::printf("engine: %d I/O tensors\n", n);
        for (int32_t i = 0; i < n; ++i) {
            const std::string name = engine_->getIOTensorName(i);
            const bool input = engine_->getTensorIOMode(name.c_str()) == nvinfer1::TensorIOMode::kINPUT;
            (input ? inputs_ : outputs_).push_back(name);
            if (name.rfind("past_key.", 0) == 0) ++layers_;
        }
        for (const char* need : {"input_ids", "position_ids", "past_len", "tree_mask", "logits_index"})
            if (std::find(inputs_.begin(), inputs_.end(), need) == inputs_.end())
                throw std::runtime_error(std::string("the engine has no input ") + need + ": not a specrt decoder?");
        if (std::find(outputs_.begin(), outputs_.end(), "logits") == outputs_.end())
            throw std::runtime_error("the engine has no output logits");
        if (dtype("logits") != DataType::kFLOAT) throw std::runtime_error("expected float32 logits");
        if (layers_ == 0) throw std::runtime_error("the engine has no past_key.i inputs");
        const nvinfer1::Dims kv = engine_->getTensorShape("past_key.0");  // [B, KV, S, d], -1 where dynamic
        kv_heads_ = kv.d[1] > 0 ? kv.d[1] : args_.kv_heads;
        head_dim_ = kv.d[3] > 0 ? kv.d[3] : args_.head_dim;
        if (kv_heads_ <= 0 || head_dim_ <= 0)
            throw std::runtime_error("KV heads / head dim are dynamic in the engine: pass --kv-heads and --head-dim");
        std::printf("engine: %lld layers, KV heads %lld, head dim %lld, KV dtype %d, capacity %lld\n",
                    static_cast<long long>(layers_), static_cast<long long>(kv_heads_), static_cast<long long>(head_dim_),
                    static_cast<int>(dtype("past_key.0")), static_cast<long long>(args_.capacity));
    }

    // The KV cache: allocated once, zeroed, bound as past_* and present_* at the same address.
    void allocate_kv() {
        const size_t bytes = static_cast<size_t>(kv_heads_ * args_.capacity * head_dim_) * element_size(dtype("past_key.0"));
        for (int64_t i = 0; i < layers_; ++i) {
            for (const char* kind : {"key.", "value."}) {
                const std::string past = std::string("past_") + kind + std::to_string(i);
                const std::string present = std::string("present_") + kind + std::to_string(i);
                auto& buf = kv_[past];
                buf.reserve(bytes);
                CUDA_CHECK(cudaMemset(buf.ptr, 0, bytes));
                if (!context_->setTensorAddress(past.c_str(), buf.ptr) || !context_->setTensorAddress(present.c_str(), buf.ptr))
                    throw std::runtime_error("setTensorAddress failed for " + past + " / " + present);
#if NV_TENSORRT_MAJOR > 10 || (NV_TENSORRT_MAJOR == 10 && NV_TENSORRT_MINOR >= 15)
                const char* alias = engine_->getAliasedInputTensor(present.c_str());
                if (i == 0 && (alias == nullptr || past != alias))
                    std::fprintf(stderr, "warning: the engine does not declare %s as an alias of %s; sharing one "
                                 "buffer is then only safe if the graph writes the new rows alone\n",
                                 present.c_str(), past.c_str());
#endif
            }
        }
        std::printf("KV cache: %lld x 2 buffers of %zu bytes, bound in place (past_* == present_*)\n",
                    static_cast<long long>(layers_), bytes);
    }

    void set_input(const std::string& name, const nvinfer1::Dims& shape, const std::vector<uint8_t>& host) {
        if (!context_->setInputShape(name.c_str(), shape)) throw std::runtime_error("setInputShape failed for " + name);
        auto& buf = scratch_[name];
        buf.reserve(host.size() + 1);
        CUDA_CHECK(cudaMemcpyAsync(buf.ptr, host.data(), host.size(), cudaMemcpyHostToDevice, stream_));
        if (!context_->setTensorAddress(name.c_str(), buf.ptr)) throw std::runtime_error("setTensorAddress " + name);
    }

    Args args_;
    Logger logger_;
    std::unique_ptr<nvinfer1::IRuntime> runtime_;
    std::unique_ptr<nvinfer1::ICudaEngine> engine_;
    std::unique_ptr<nvinfer1::IExecutionContext> context_;
    cudaStream_t stream_ = nullptr;
    std::vector<std::string> inputs_, outputs_;
    std::map<std::string, DeviceBuffer> kv_, scratch_;
    int64_t layers_ = 0, kv_heads_ = 0, head_dim_ = 0, vocab_ = 0;
};

std::vector<uint8_t> causal_mask(int64_t t) {
    std::vector<int64_t> parents(static_cast<size_t>(t));
    for (int64_t i = 0; i < t; ++i) parents[static_cast<size_t>(i)] = i - 1;
    return specrt::ancestor_mask(parents);
}

std::string join(const std::vector<int64_t>& xs) {
    std::string s;
    for (size_t i = 0; i < xs.size(); ++i) s += (i ? "," : "") + std::to_string(xs[i]);
    return s;
}

Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw std::runtime_error(k + " needs a value");
            return argv[++i];
        };
        if (k == "--engine") a.engine = value();
        else if (k == "--manifest") a.manifest = value();
        else if (k == "--plugin") a.plugins.push_back(value());
        else if (k == "--prompt") a.prompt = parse_ints(value());
        else if (k == "--draft") a.draft = parse_ints(value());
        else if (k == "--capacity") a.capacity = std::stoll(value());
        else if (k == "--kv-heads") a.kv_heads = std::stoll(value());
        else if (k == "--head-dim") a.head_dim = std::stoll(value());
        else if (k == "-h" || k == "--help") {
            std::printf("usage: specrt_verify (--engine FILE | --manifest manifest.json) [--plugin LIB.so]... "
                        "[--prompt 1,2,3] [--draft a,b,c,d] [--capacity S] [--kv-heads KV] [--head-dim d]\n");
            std::exit(0);
        } else throw std::runtime_error("unknown argument " + k + " (see --help)");
    }
    if (a.engine.empty() && !a.manifest.empty()) a.engine = engine_from_manifest(a.manifest);
    if (a.engine.empty()) throw std::runtime_error("pass --engine FILE or --manifest BUNDLE/manifest.json");
    if (a.prompt.empty()) throw std::runtime_error("--prompt needs at least one token");
    if (!a.draft.empty() && a.draft.size() != 4) throw std::runtime_error("--draft takes exactly 4 tokens (a chain window)");
    return a;
}

int run(const Args& a) {
    std::printf("TensorRT headers %d.%d.%d; engine %s\n", NV_TENSORRT_MAJOR, NV_TENSORRT_MINOR, NV_TENSORRT_PATCH,
                a.engine.c_str());
    Verifier v(a);
    const int64_t n = static_cast<int64_t>(a.prompt.size());
    // 1. prefill the prompt; the logits of its last row give the first token (the window's root)
    std::vector<float> logits = v.step(a.prompt, 0, causal_mask(n), {n - 1});
    const int64_t root = specrt::argmax_row(logits.data(), v.vocab());
    std::printf("prefill: %lld tokens, vocab %lld, next token %lld\n", static_cast<long long>(n),
                static_cast<long long>(v.vocab()), static_cast<long long>(root));

    // 2. drafts: given, or plain greedy decoding (one token per step) for the self-check
    std::vector<int64_t> draft = a.draft, greedy;
    const bool self_check = draft.empty();
    if (self_check) {
        int64_t tok = root;
        for (int64_t k = 0; k < 5; ++k) {  // 4 drafts, then the token after them (the expected bonus)
            logits = v.step({tok}, n + k, {1}, {0});
            tok = specrt::argmax_row(logits.data(), v.vocab());
            greedy.push_back(tok);
        }
        draft.assign(greedy.begin(), greedy.begin() + 4);
        std::printf("plain greedy decoding: %s\n", join(greedy).c_str());
    }

    // 3. verify: rollback is just past_len = n (the rows written above are overwritten in place)
    std::vector<int64_t> window{root};
    window.insert(window.end(), draft.begin(), draft.end());
    const int64_t t = static_cast<int64_t>(window.size());
    std::vector<int64_t> rows(static_cast<size_t>(t)), parents(static_cast<size_t>(t));
    for (int64_t i = 0; i < t; ++i) { rows[static_cast<size_t>(i)] = i; parents[static_cast<size_t>(i)] = i - 1; }
    logits = v.step(window, n, specrt::ancestor_mask(parents), rows);
    const specrt::GreedyResult r = specrt::greedy_accept(logits.data(), t, v.vocab(), window.data(), parents.data());
    std::vector<int64_t> accepted;
    for (int64_t node : r.path) accepted.push_back(window[static_cast<size_t>(node)]);
    std::printf("verify window: %s (root + %zu drafted, chain)\n", join(window).c_str(), draft.size());
    std::printf("accepted nodes: [%s] tokens: [%s]\n", join(r.path).c_str(), join(accepted).c_str());
    std::printf("bonus token: %lld\n", static_cast<long long>(r.next_token));
    std::printf("next step: past_len = %lld (root + accepted rows kept; later rows are stale, overwritten next)\n",
                static_cast<long long>(n + 1 + static_cast<int64_t>(r.path.size())));
    if (self_check) {
        const bool ok = r.path.size() == 4 && r.next_token == greedy[4];
        std::printf("self-check (verify == plain greedy decoding): %s\n", ok ? "OK" : "MISMATCH");
        return ok ? 0 : 1;
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return run(parse(argc, argv));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "specrt_verify: error: %s\n", e.what());
        return 2;
    }
}
