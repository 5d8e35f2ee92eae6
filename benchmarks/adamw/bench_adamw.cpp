// ts_bench_adamw: the optimizer kernels against the memory-bandwidth roofline of this machine, in one run.
//
// Measures, with the daemon's WorkerPool (threads pinned, one static block per thread, memory first
// touched by the thread that later updates it): (a) a STREAM triad a = b + s*c, the roofline; (b) every
// kernel configuration the daemon uses (1 and 4 ranks; fp32/bf16 gradients; fp32/bf16 moments; with the
// bf16 upload copy), and the squared-norm pass clipping needs. Bytes are counted honestly: every stream
// read or written once (read-modify-write = 2x), no write-allocate traffic. Prints a table and writes
// JSON (--json) that benchmarks/adamw/run.py merges with torch's fused AdamW measured in the same run.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "daemon/engine/worker_pool.h"
#include "daemon/optimizer/adamw_kernels.h"
#include "daemon/optimizer/float_convert.h"
#include "daemon/optimizer/kernel_table.h"
#include "shm/error.h"

namespace ts = trainstream;
namespace opt = trainstream::optimizer;

namespace {

struct Options {
  size_t params = 100'000'000;
  size_t threads = std::max(1u, std::thread::hardware_concurrency());
  int reps = 7;
  std::string kernel;  // empty: the active one
  std::string json;
  bool huge_pages = false;
  bool all_kernels = true;  // also the fp32 baseline with every other supported variant
  std::string only;         // non-empty: only the update configurations whose name contains it, no norms
};

[[noreturn]] void Usage(const char* argv0) {
  std::fprintf(
      stderr,
      "usage: %s [--params N] [--threads T] [--reps R] [--kernel avx512bf16|avx512|avx2|portable] [--json FILE]\n"
      "          [--huge-pages] [--no-all-kernels] [--only NAME-SUBSTRING]\n",
      argv0);
  std::exit(2);
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Usage(argv[0]);
      return argv[++i];
    };
    if (arg == "--params")
      o.params = static_cast<size_t>(std::stod(value()));
    else if (arg == "--threads")
      o.threads = std::stoul(value());
    else if (arg == "--reps")
      o.reps = std::stoi(value());
    else if (arg == "--kernel")
      o.kernel = value();
    else if (arg == "--json")
      o.json = value();
    else if (arg == "--huge-pages")
      o.huge_pages = true;
    else if (arg == "--no-all-kernels")
      o.all_kernels = false;
    else if (arg == "--only")
      o.only = value();
    else
      Usage(argv[0]);
  }
  if (o.params < 1024 || o.threads == 0 || o.reps < 1) Usage(argv[0]);
  return o;
}

// Page-aligned anonymous memory, not yet touched (first touch happens on the pool, block by block).
class Region {
 public:
  Region(size_t bytes, bool huge) : bytes_(std::max<size_t>(bytes, 4096)) {
    data_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data_ == MAP_FAILED) {
      std::fprintf(stderr, "mmap of %zu bytes failed\n", bytes_);
      std::exit(1);
    }
    if (huge) madvise(data_, bytes_, MADV_HUGEPAGE);
  }
  ~Region() { munmap(data_, bytes_); }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  size_t bytes_;
  void* data_;
};

// One static block per thread, boundaries on 64-element multiples (whole cache lines for every dtype).
struct Blocks {
  size_t n, count;  // elements, blocks
  [[nodiscard]] size_t Begin(size_t block) const { return std::min(n, (n * block / count) & ~size_t{63}); }
  [[nodiscard]] size_t End(size_t block) const { return block + 1 == count ? n : Begin(block + 1); }
};

void RunOnPool(ts::daemon::WorkerPool& pool, size_t blocks, const std::function<void(size_t)>& fn) {
  std::promise<void> done;
  pool.Submit(blocks, fn, [&] { done.set_value(); });
  done.get_future().wait();
}

double Seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct Timing {
  double best, median;
};

Timing Measure(int reps, const std::function<void()>& fn) {
  fn();  // warm-up (and page faults, if any are left)
  std::vector<double> times;
  times.reserve(reps);
  for (int r = 0; r < reps; ++r) times.push_back(Seconds(fn));
  std::sort(times.begin(), times.end());
  return {times.front(), times[times.size() / 2]};
}

// torch.optim.AdamW(fused=True) on fp32 moves 28 bytes per parameter: reads param, grad, exp_avg, exp_avg_sq
// and writes param, exp_avg, exp_avg_sq (4 bytes each). A variant moving B bytes per parameter can beat it by
// at most 28 / B at the same bandwidth (GB/s): the physical bound of its ratio unless it streams faster.
constexpr double kTorchFusedBytesPerParam = 28.0;

struct Result {
  std::string name, kernel;
  double bytes_per_param, best_s, median_s;
  size_t params;
  bool update = true;  // an optimizer step (has a torch bound), not the norm pass
  [[nodiscard]] double ParamsPerSecond() const { return static_cast<double>(params) / best_s; }
  [[nodiscard]] double GBps() const { return bytes_per_param * static_cast<double>(params) / best_s / 1e9; }
  // The largest params/s ratio to torch fused at equal bandwidth (kTorchFusedBytesPerParam / bytes).
  [[nodiscard]] double EqualBandwidthBound() const { return kTorchFusedBytesPerParam / bytes_per_param; }
};

std::string Json(const Options& o, const std::string& host, const std::string& cpu, const Result& triad,
                 const std::vector<Result>& results) {
  std::string out = "{\n";
  out += "  \"host\": \"" + host + "\",\n  \"cpu\": \"" + cpu + "\",\n";
  out += "  \"params\": " + std::to_string(o.params) + ",\n  \"threads\": " + std::to_string(o.threads) + ",\n";
  out += "  \"reps\": " + std::to_string(o.reps) + ",\n  \"huge_pages\": " + (o.huge_pages ? "true" : "false") + ",\n";
  out += std::string("  \"active_kernel\": \"") + opt::ActiveKernelName() + "\",\n";
  auto entry = [](const Result& r) {
    char bound[128] = "";
    if (r.update) {
      std::snprintf(bound, sizeof bound,
                    ", \"torch_fused_bytes_per_param\": %.1f, \"max_torch_ratio_at_equal_bandwidth\": %.4f",
                    kTorchFusedBytesPerParam, r.EqualBandwidthBound());
    }
    char buffer[768];
    std::snprintf(buffer, sizeof buffer,
                  "{\"name\": \"%s\", \"kernel\": \"%s\", \"bytes_per_param\": %.1f, \"best_s\": %.6f, "
                  "\"median_s\": %.6f, \"params_per_s\": %.6g, \"gb_per_s\": %.3f%s}",
                  r.name.c_str(), r.kernel.c_str(), r.bytes_per_param, r.best_s, r.median_s, r.ParamsPerSecond(),
                  r.GBps(), bound);
    return std::string(buffer);
  };
  out += "  \"triad\": " + entry(triad) + ",\n  \"variants\": [\n";
  for (size_t i = 0; i < results.size(); ++i)
    out += "    " + entry(results[i]) + (i + 1 < results.size() ? ",\n" : "\n");
  out += "  ]\n}\n";
  return out;
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// Where an update writes its state: in place, or into the other half of a double-buffered state
// (the daemon's two state halves), whose blocks are 64-byte aligned like the read half's (streamed) or,
// for comparison, one element off (no head aligns them: ordinary stores, which read the lines first).
enum class Placement { kInPlace, kOtherHalf, kOtherHalfMisaligned };

// `data` moved on by `at` elements of `dtype`.
const void* Advance(const void* data, ts::DType dtype, size_t at) {
  return static_cast<const std::byte*>(data) + at * ts::SizeOf(dtype);
}
void* Advance(void* data, ts::DType dtype, size_t at) {
  return static_cast<std::byte*>(data) + at * ts::SizeOf(dtype);
}

// An optimization barrier: the compiler must assume `value` is used.
void Keep(double value) {
  asm volatile("" : : "r,m"(value) : "memory");
}

// Speculative clipping's pass also sums the gradients' squares: as a pass of its own before each of the
// engine's blocks' update (what it did until 2026-12-02), or inside the update (update_with_norm).
enum class Norm { kNone, kFirst, kFused };
constexpr size_t kEngineBlock = size_t{1} << 16;  // daemon/engine/step_engine.cpp's kBlockElements

// The update of `count` elements block by block as the engine runs it, each block's squared norm with it.
void UpdateWithNorms(const opt::KernelTable& k, Norm norm, const opt::GradSources& grads, const opt::AdamWStep& step,
                     const opt::StateIn& in, float* master, const opt::MomentBuffers& moments,
                     const opt::Upload& upload, size_t count) {
  const size_t block = kEngineBlock;
  const void* slots[8];
  for (size_t at = 0; at < count; at += block) {
    const size_t n = std::min(block, count - at);
    for (size_t r = 0; r < grads.slots.size(); ++r) slots[r] = Advance(grads.slots[r], grads.dtype, at);
    const opt::GradSources part{std::span<const void* const>(slots, grads.slots.size()), grads.dtype, nullptr,
                                grads.scale};
    bool bad = false;
    double sum = 0;
    const opt::StateIn from{in.master + at, Advance(in.exp_avg, moments.dtype, at),
                            Advance(in.exp_avg_sq, moments.dtype, at)};
    const opt::MomentBuffers to{Advance(moments.exp_avg, moments.dtype, at),
                                Advance(moments.exp_avg_sq, moments.dtype, at), moments.dtype, moments.sr_seed,
                                moments.element_base + at};
    const opt::Upload up{upload.data != nullptr ? Advance(upload.data, upload.dtype, at) : nullptr, upload.dtype};
    if (norm == Norm::kFirst) {
      sum = k.sum_of_squares(part, n, &bad);
      k.update(part, step, from, master + at, to, up, n);
    } else {
      k.update_with_norm(part, step, from, master + at, to, up, n, &sum, &bad);
    }
    Keep(sum);  // the engine adds it to the step's norm
  }
}

struct Config {
  const char* name;
  ts::DType grad;
  size_t ranks;
  ts::DType moment;
  bool upload;  // bf16 upload copy
  Placement placement = Placement::kInPlace;
  Norm norm = Norm::kNone;
};

}  // namespace

int Run(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  const size_t n = o.params;
  char host[256] = "unknown";
  gethostname(host, sizeof host - 1);
  const opt::KernelTable& kernel = o.kernel.empty() ? opt::ActiveKernels() : opt::KernelByName(o.kernel);

  ts::daemon::WorkerPool pool(o.threads, /*pin_threads=*/true);
  const Blocks blocks{n, o.threads};
  std::printf("ts_bench_adamw: host %s, %s\n", host, CpuModel().c_str());
  std::printf("  %zu params, %zu threads (pinned), kernel %s (supported:", n, o.threads, kernel.name);
  for (const auto* k : opt::SupportedKernels()) std::printf(" %s", k->name);
  std::printf("), %d reps, best time reported, huge pages %s\n\n", o.reps, o.huge_pages ? "on" : "off");

  // ---- (a) STREAM triad with the same threads and blocks --------------------------------------------
  Result triad;
  {
    Region a(n * 4, o.huge_pages), b(n * 4, o.huge_pages), c(n * 4, o.huge_pages);
    float *pa = a.as<float>(), *pb = b.as<float>(), *pc = c.as<float>();
    RunOnPool(pool, o.threads, [&](size_t block) {
      for (size_t i = blocks.Begin(block); i < blocks.End(block); ++i) pa[i] = 0, pb[i] = 1, pc[i] = 2;
    });
    const float scalar = 3.0f;
    const Timing t = Measure(o.reps + 3, [&] {
      RunOnPool(pool, o.threads, [&](size_t block) {
        const size_t end = blocks.End(block);
        for (size_t i = blocks.Begin(block); i < end; ++i) pa[i] = pb[i] + scalar * pc[i];
      });
    });
    triad = {"triad", "plain", 12.0, t.best, t.median, n, false};  // 3 arrays x 4 bytes, STREAM's convention
    std::printf("  %-44s %8.2f GB/s  (a = b + s*c, 12 B/elem, ordinary stores)\n", "STREAM triad", triad.GBps());
#if defined(__SSE2__)
    // The same with non-temporal stores (no write-allocate read of a): usually the higher of the two.
    const Timing nt = Measure(o.reps + 3, [&] {
      RunOnPool(pool, o.threads, [&](size_t block) {
        const size_t begin = blocks.Begin(block), end = blocks.End(block);  // 64-element aligned begin
        const __m128 s = _mm_set1_ps(scalar);
        size_t i = begin;
        for (; i + 4 <= end; i += 4)
          _mm_stream_ps(pa + i, _mm_add_ps(_mm_loadu_ps(pb + i), _mm_mul_ps(s, _mm_loadu_ps(pc + i))));
        for (; i < end; ++i) pa[i] = pb[i] + scalar * pc[i];
        _mm_sfence();
      });
    });
    const Result streamed{"triad", "nt-store", 12.0, nt.best, nt.median, n, false};
    std::printf("  %-44s %8.2f GB/s  (non-temporal stores)\n", "STREAM triad", streamed.GBps());
    if (streamed.best_s < triad.best_s) triad = streamed;
#endif
  }
  std::printf("  roofline = the faster triad: %.2f GB/s\n\n", triad.GBps());

  // ---- (b) the kernels ------------------------------------------------------------------------------
  const size_t max_ranks = 4;
  Region grads_f32(n * 4 * max_ranks, o.huge_pages), grads_bf16(n * 2 * max_ranks, o.huge_pages);
  Region master(n * 4, o.huge_pages), m_f32(n * 4, o.huge_pages), v_f32(n * 4, o.huge_pages);
  Region m_bf16(n * 2, o.huge_pages), v_bf16(n * 2, o.huge_pages), upload(n * 2, o.huge_pages);
  // The other half (one element more: room for the misaligned placement).
  Region master2((n + 64) * 4, o.huge_pages), m2(n * 4 + 256, o.huge_pages), v2(n * 4 + 256, o.huge_pages);
  // Rank r's slot is its own n-element array (as in the daemon's per-rank gradient slots).
  auto f32_slot = [&](size_t r) { return grads_f32.as<float>() + r * n; };
  auto bf16_slot = [&](size_t r) { return grads_bf16.as<uint16_t>() + r * n; };
  RunOnPool(pool, o.threads, [&](size_t block) {
    for (size_t i = blocks.Begin(block); i < blocks.End(block); ++i) {
      const float x = static_cast<float>(static_cast<int>(i % 2001) - 1000) * 1e-4f;
      for (size_t r = 0; r < max_ranks; ++r) {
        f32_slot(r)[i] = x + static_cast<float>(r) * 1e-5f;
        bf16_slot(r)[i] = opt::FloatToBF16(x);
      }
      master.as<float>()[i] = x * 10.0f;
      m_f32.as<float>()[i] = 0, v_f32.as<float>()[i] = 0;
      m_bf16.as<uint16_t>()[i] = 0, v_bf16.as<uint16_t>()[i] = 0, upload.as<uint16_t>()[i] = 0;
      master2.as<float>()[i] = 0, m2.as<float>()[i] = 0, v2.as<float>()[i] = 0;
    }
  });

  const std::vector<Config> configs = {
      {"fp32 grad, fp32 moments, no upload (=torch)", ts::DType::kFloat32, 1, ts::DType::kFloat32, false},
      {"fp32 grad, fp32 moments, bf16 upload", ts::DType::kFloat32, 1, ts::DType::kFloat32, true},
      {"fp32 grad x4 ranks, fp32 moments, bf16 upload", ts::DType::kFloat32, 4, ts::DType::kFloat32, true},
      {"bf16 grad, fp32 moments, bf16 upload", ts::DType::kBFloat16, 1, ts::DType::kFloat32, true},
      {"bf16 grad x4 ranks, fp32 moments, bf16 upload", ts::DType::kBFloat16, 4, ts::DType::kFloat32, true},
      {"fp32 grad, bf16 moments, bf16 upload", ts::DType::kFloat32, 1, ts::DType::kBFloat16, true},
      {"fp32 grad x4 ranks, bf16 moments, bf16 upload", ts::DType::kFloat32, 4, ts::DType::kBFloat16, true},
      {"bf16 grad, bf16 moments, bf16 upload", ts::DType::kBFloat16, 1, ts::DType::kBFloat16, true},
      {"bf16 grad x4 ranks, bf16 moments, bf16 upload", ts::DType::kBFloat16, 4, ts::DType::kBFloat16, true},
      {"fp32 grad, fp32 moments, no upload, other half", ts::DType::kFloat32, 1, ts::DType::kFloat32, false,
       Placement::kOtherHalf},
      {"fp32 grad, fp32 moments, no upload, half misaligned", ts::DType::kFloat32, 1, ts::DType::kFloat32, false,
       Placement::kOtherHalfMisaligned},
      {"bf16 grad, fp32 moments, bf16 upload, other half", ts::DType::kBFloat16, 1, ts::DType::kFloat32, true,
       Placement::kOtherHalf},
      {"bf16 grad, bf16 moments, bf16 upload, other half", ts::DType::kBFloat16, 1, ts::DType::kBFloat16, true,
       Placement::kOtherHalf},
      {"fp32 grad, fp32 moments, other half, norm first", ts::DType::kFloat32, 1, ts::DType::kFloat32, false,
       Placement::kOtherHalf, Norm::kFirst},
      {"fp32 grad, fp32 moments, other half, norm fused", ts::DType::kFloat32, 1, ts::DType::kFloat32, false,
       Placement::kOtherHalf, Norm::kFused},
      {"bf16 grad, bf16 moments, bf16 upload, other half, norm first", ts::DType::kBFloat16, 1, ts::DType::kBFloat16,
       true, Placement::kOtherHalf, Norm::kFirst},
      {"bf16 grad, bf16 moments, bf16 upload, other half, norm fused", ts::DType::kBFloat16, 1, ts::DType::kBFloat16,
       true, Placement::kOtherHalf, Norm::kFused},
  };

  std::vector<Result> results;
  auto print = [&](const Result& r) {
    std::printf("  %-44s %-8s %6.1f B/p %8.3f Gparam/s %8.2f GB/s %6.1f%% of triad  (%.2f ms)\n", r.name.c_str(),
                r.kernel.c_str(), r.bytes_per_param, r.ParamsPerSecond() / 1e9, r.GBps(),
                100.0 * r.GBps() / triad.GBps(), r.best_s * 1e3);
    if (r.update) {
      std::printf("    bound: %.0f B/p vs torch fused's %.0f: at most %.2fx torch fused at equal bandwidth\n",
                  r.bytes_per_param, kTorchFusedBytesPerParam, r.EqualBandwidthBound());
    }
    std::fflush(stdout);
  };
  auto run_update = [&](const opt::KernelTable& k, const Config& c) {
    const opt::AdamWStep step = opt::AdamWStep::For(1e-3, 0.9, 0.999, 1e-8, 0.01, true, 10);
    const bool bf16_moments = c.moment == ts::DType::kBFloat16;
    const Timing t = Measure(o.reps, [&] {
      RunOnPool(pool, o.threads, [&](size_t block) {
        const size_t begin = blocks.Begin(block), count = blocks.End(block) - begin;
        const void* slots[max_ranks];
        for (size_t r = 0; r < c.ranks; ++r) {
          slots[r] = c.grad == ts::DType::kFloat32 ? static_cast<const void*>(f32_slot(r) + begin)
                                                   : static_cast<const void*>(bf16_slot(r) + begin);
        }
        const opt::GradSources grads{std::span<const void* const>(slots, c.ranks), c.grad, nullptr,
                                     1.0f / static_cast<float>(c.ranks)};
        void* m = bf16_moments ? static_cast<void*>(m_bf16.as<uint16_t>() + begin) : m_f32.as<float>() + begin;
        void* v = bf16_moments ? static_cast<void*>(v_bf16.as<uint16_t>() + begin) : v_f32.as<float>() + begin;
        float* p = master.as<float>() + begin;
        const opt::StateIn in{p, m, v};
        if (c.placement != Placement::kInPlace) {  // the other half: same offsets, or one element off
          const size_t at = begin + (c.placement == Placement::kOtherHalfMisaligned ? 1 : 0);
          p = master2.as<float>() + at;
          m = bf16_moments ? static_cast<void*>(m2.as<uint16_t>() + at) : m2.as<float>() + at;
          v = bf16_moments ? static_cast<void*>(v2.as<uint16_t>() + at) : v2.as<float>() + at;
        }
        const opt::MomentBuffers moments{m, v, c.moment, 0x1234, begin};
        const opt::Upload up{c.upload ? upload.as<uint16_t>() + begin : nullptr, ts::DType::kBFloat16};
        if (c.norm == Norm::kNone) {
          k.update(grads, step, in, p, moments, up, count);
        } else {
          UpdateWithNorms(k, c.norm, grads, step, in, p, moments, up, count);
        }
      });
    });
    const double bytes =
        static_cast<double>(c.ranks * ts::SizeOf(c.grad) + 8 + 4 * ts::SizeOf(c.moment) + (c.upload ? 2 : 0));
    Result r{c.name, k.name, bytes, t.best, t.median, n};
    print(r);
    results.push_back(r);
  };
  std::printf("  %-44s %-8s %10s %17s %13s\n", "AdamW update (one fused pass)", "kernel", "bytes", "params/s",
              "bandwidth");
  if (!o.only.empty()) {  // a quick look at some configurations (no json, no norms, no other variants)
    for (const Config& c : configs) {
      if (std::string(c.name).find(o.only) != std::string::npos) run_update(kernel, c);
    }
    return 0;
  }
  for (const Config& c : configs) run_update(kernel, c);
  if (o.all_kernels) {
    for (const auto* k : opt::SupportedKernels()) {
      if (k == &kernel) continue;
      run_update(*k, configs[0]);
      run_update(*k, configs[7]);
    }
  }

  std::printf("\n  %-44s\n", "squared norm + non-finite check (clipping pass)");
  auto run_norm = [&](ts::DType dtype, size_t ranks, const char* name) {
    const Timing t = Measure(o.reps, [&] {
      std::vector<double> partial(o.threads);
      RunOnPool(pool, o.threads, [&](size_t block) {
        const size_t begin = blocks.Begin(block), count = blocks.End(block) - begin;
        const void* slots[max_ranks];
        for (size_t r = 0; r < ranks; ++r) {
          slots[r] = dtype == ts::DType::kFloat32 ? static_cast<const void*>(f32_slot(r) + begin)
                                                  : static_cast<const void*>(bf16_slot(r) + begin);
        }
        bool bad = false;
        partial[block] =
            kernel.sum_of_squares({std::span<const void* const>(slots, ranks), dtype, nullptr, 1.0f}, count, &bad);
      });
    });
    Result r{name, kernel.name, static_cast<double>(ranks * ts::SizeOf(dtype)), t.best, t.median, n, false};
    print(r);
    results.push_back(r);
  };
  run_norm(ts::DType::kFloat32, 1, "norm: fp32 grad");
  run_norm(ts::DType::kBFloat16, 1, "norm: bf16 grad");
  run_norm(ts::DType::kBFloat16, 4, "norm: bf16 grad x4 ranks");

  std::printf("\n  4 ranks / 1 rank time (fused reduction; <= 1.3x wanted):\n");
  auto find = [&](const char* name) -> const Result* {
    for (const auto& r : results) {
      if (r.name == name && r.kernel == kernel.name) return &r;
    }
    return nullptr;
  };
  for (auto [one, four] : {std::pair{configs[1].name, configs[2].name}, std::pair{configs[3].name, configs[4].name},
                           std::pair{configs[5].name, configs[6].name}, std::pair{configs[7].name, configs[8].name}}) {
    std::printf("    %-44s %.2fx\n", four, find(four)->best_s / find(one)->best_s);
  }

  if (!o.json.empty()) {
    std::ofstream out(o.json);
    out << Json(o, host, CpuModel(), triad, results);
    std::printf("\n  wrote %s\n", o.json.c_str());
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const trainstream::Error& error) {  // e.g. TRAINSTREAM_KERNEL / --kernel names an unsupported variant
    std::fprintf(stderr, "ts_bench_adamw: %s\n", error.what());
    return 1;
  }
}
