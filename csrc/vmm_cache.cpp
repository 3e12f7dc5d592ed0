// torchckpt device arena on CUDA virtual memory management (VMM): the incremental device cache.
//
// NOTE [ VMM device arena ]
// A device cache of tens of GiB taken with one cudaMalloc is usable only once the whole of it
// is backed. The arena instead reserves the whole virtual range at once and backs it chunk by
// chunk, so its first bytes are usable after one small mapping (Maurya et al., HiPC'22).
// 1. cuMemAddressReserve takes the whole range (rounded up to the allocation granularity,
//    2 MiB on current GPUs). Its address never changes, so views made early stay valid.
// 2. The range is split into chunks: an optional first chunk of ``first_bytes`` (rounded up
//    to the granularity), mapped synchronously by the constructor so that the first slot is
//    usable when it returns, then chunks of ``chunk_bytes`` (rounded UP to the granularity,
//    never an error), the last one shorter. Each chunk has its own physical allocation:
//    cuMemCreate, cuMemMap at its offset, cuMemSetAccess read-write for the owning device.
// 3. A background std::thread maps the remaining chunks in address order. A counter of
//    mapped chunks (the prefix [0, mapped) is mapped) and a per-chunk flag live under one
//    mutex with a condition variable; ``wait(offset, nbytes)`` blocks only until the chunks
//    covering that range are mapped, so a write waits for its own range, not for the arena.
// 4. The thread makes the device's primary context current (cudaSetDevice, which in CUDA 12+
//    initializes and binds the primary context) before its first driver call.
// 5. A mapping failure (e.g. CUDA_ERROR_OUT_OF_MEMORY when another process took the memory)
//    stops the thread and is recorded: chunks already mapped stay usable, a wait on a later
//    range returns the recorded error (Rule 10), which the Python wrapper raises.
// 6. Lifetime: all resources belong to one shared ``State``. The arena holds one reference and
//    each tensor view holds one through its deleter (at::for_blob), so memory is never unmapped
//    under a live tensor. ``close()`` stops and joins the thread and drops the arena's
//    reference; the memory returns to the driver when the last view dies too.
// 7. Releasing synchronizes the device first (as cudaFree does), then unmaps, releases the
//    physical handles and frees the reservation. Kernels still running on the arena therefore
//    finish before their memory goes away. Errors while releasing are ignored (the process may
//    be exiting and the driver already shut down). Construction is RAII: a failure part way
//    drops the State, whose destructor releases whatever was taken.
// 8. Driver functions come from cudaGetDriverEntryPointByVersion at run time; libcuda is never
//    linked (it does not exist on CPU-only machines). Without TORCHCKPT_WITH_CUDA the class
//    exists but every constructed arena reports ``init_error()``, and ``vmm_status`` says why.
// 9. The memory is outside PyTorch's caching allocator: torch.cuda.memory_allocated() and
//    memory_reserved() do not count it; ``mapped_bytes()`` does.
// 10. No C++ exception leaves this file on a normal path, and messages are built with
//    std::string, not streams: the constructor records a failure in ``init_error()`` and
//    ``wait`` returns "" or the message; the Python wrapper (torchckpt/memory/device_arena.py)
//    validates arguments first and raises. Why: on the H100 test machine (torch 2.11.0+cu130,
//    gcc 13.3, driver 580) a TORCH_CHECK thrown from this class after CUDA was initialized ended
//    the process with SIGSEGV (constructor with nbytes < 0; view() after a background
//    out-of-memory), and so did a minimal load_inline extension built there; the same code
//    raised cleanly on a CPU-only machine. Compare pytorch/pytorch#117597 (libgcc's unwinder
//    crashing inside backtrace() whenever a C++ exception is raised). The TORCH_CHECKs left
//    guard misuse of the raw class only.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#ifdef TORCHCKPT_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

namespace torchckpt {
namespace vmm {

using Clock = std::chrono::steady_clock;

#ifdef TORCHCKPT_WITH_CUDA

// ---- driver entry points (Rule 8) ------------------------------------------------------------
struct Driver {
  decltype(&::cuGetErrorName) getErrorName = nullptr;
  decltype(&::cuDeviceGetAttribute) deviceGetAttribute = nullptr;
  decltype(&::cuMemGetAllocationGranularity) memGetAllocationGranularity = nullptr;
  decltype(&::cuMemAddressReserve) memAddressReserve = nullptr;
  decltype(&::cuMemAddressFree) memAddressFree = nullptr;
  decltype(&::cuMemCreate) memCreate = nullptr;
  decltype(&::cuMemRelease) memRelease = nullptr;
  decltype(&::cuMemMap) memMap = nullptr;
  decltype(&::cuMemUnmap) memUnmap = nullptr;
  decltype(&::cuMemSetAccess) memSetAccess = nullptr;
  std::string error;  // why the functions could not be loaded ("" when they were)
};

template <class F>
static bool load_symbol(const char* name, F& fn, std::string& error) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
#else
  cudaError_t e = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &q);
#endif
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr) {
    error = std::string("torchckpt: the CUDA driver does not provide ") + name + " (cudaGetDriverEntryPoint: " +
            cudaGetErrorString(e) + ", query result " + std::to_string(static_cast<int>(q)) +
            "); the VMM device arena needs a driver for CUDA 12.0 or newer. Fix: update the NVIDIA "
            "driver, or use the cudaMalloc fallback (make_device_slots(..., use_vmm=False)).";
    cudaGetLastError();  // clear the sticky-free error so later runtime calls do not see it
    return false;
  }
  fn = reinterpret_cast<F>(p);
  return true;
}

static const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    std::string& err = r.error;
    load_symbol("cuGetErrorName", r.getErrorName, err) &&
        load_symbol("cuDeviceGetAttribute", r.deviceGetAttribute, err) &&
        load_symbol("cuMemGetAllocationGranularity", r.memGetAllocationGranularity, err) &&
        load_symbol("cuMemAddressReserve", r.memAddressReserve, err) &&
        load_symbol("cuMemAddressFree", r.memAddressFree, err) &&
        load_symbol("cuMemCreate", r.memCreate, err) && load_symbol("cuMemRelease", r.memRelease, err) &&
        load_symbol("cuMemMap", r.memMap, err) && load_symbol("cuMemUnmap", r.memUnmap, err) &&
        load_symbol("cuMemSetAccess", r.memSetAccess, err);
    return r;
  }();
  return d;
}

static std::string cu_name(CUresult r) {
  const char* s = nullptr;
  if (driver().getErrorName != nullptr && driver().getErrorName(r, &s) == CUDA_SUCCESS && s != nullptr) return s;
  return "CUresult " + std::to_string(static_cast<int>(r));
}

// Sets the current device for a scope and restores the previous one.
struct DeviceScope {
  int prev = -1;
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (prev >= 0) cudaSetDevice(prev);
  }
};

// "" when device ``device`` can host an arena, else a torchckpt: message saying what to do.
static std::string status(int64_t device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::string why = e != cudaSuccess ? cudaGetErrorString(e) : "no devices";
    cudaGetLastError();
    return "torchckpt: no CUDA device is visible (cudaGetDeviceCount: " + why +
           "); the VMM device arena needs a GPU. Fix: run on a GPU machine, or keep the cache in "
           "PyTorch's allocator (make_device_slots(..., use_vmm=False)).";
  }
  if (device < 0 || device >= count) {
    return "torchckpt: DeviceArena expected a device index in [0, " + std::to_string(count) + "), found " +
           std::to_string(device) + ". Fix: pass an existing device, e.g. 'cuda:0'.";
  }
  const Driver& d = driver();
  if (!d.error.empty()) return d.error;
  int vmm = 0;
  CUresult r = d.deviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                    static_cast<CUdevice>(device));
  if (r != CUDA_SUCCESS) {
    return "torchckpt: could not ask device " + std::to_string(device) +
           " for virtual memory management support (cuDeviceGetAttribute: " + cu_name(r) +
           "). Fix: use the cudaMalloc fallback (make_device_slots(..., use_vmm=False)).";
  }
  if (vmm == 0) {
    return "torchckpt: device " + std::to_string(device) +
           " does not support CUDA virtual memory management "
           "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0, as under some vGPU or WSL "
           "set-ups). Fix: use the cudaMalloc fallback (make_device_slots(..., use_vmm=False)).";
  }
  return "";
}

struct Chunk {
  size_t off = 0;
  size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  bool created = false;  // handle holds physical memory
  bool in_va = false;    // mapped at base + off
  bool mapped = false;   // mapped and accessible (Rule 3)
};

// Everything the arena owns (Rule 6). Views and the arena share it.
struct State {
  int device = 0;
  size_t nbytes = 0;    // asked for
  size_t reserved = 0;  // virtual range, a multiple of the granularity
  size_t granularity = 0;
  size_t chunk_bytes = 0;
  int64_t delay_us = 0;  // tests only: sleep before mapping each background chunk
  CUdeviceptr base = 0;
  std::vector<Chunk> chunks;
  std::vector<size_t> ends;  // ends[i] = chunks[i].off + chunks[i].size (sorted)

  std::mutex mu;
  std::condition_variable cv;
  size_t mapped_chunks = 0;  // chunks [0, mapped_chunks) are mapped
  std::atomic<uint64_t> mapped_bytes{0};
  std::string error;  // first background failure (Rule 5)
  bool stop = false;
  std::thread worker;
  std::atomic<int64_t> live_views{0};
  Clock::time_point t0;
  std::atomic<double> all_mapped_s{-1.0};

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // Maps chunk i; returns "" or a message. Called by one thread at a time per chunk.
  std::string map_chunk(size_t i) {
    const Driver& d = driver();
    Chunk& c = chunks[i];
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    CUresult r = d.memCreate(&c.handle, c.size, &prop, 0);
    const char* what = "cuMemCreate";
    if (r == CUDA_SUCCESS) {
      c.created = true;
      r = d.memMap(base + c.off, c.size, 0, c.handle, 0);
      what = "cuMemMap";
    }
    if (r == CUDA_SUCCESS) {
      c.in_va = true;
      CUmemAccessDesc access = {};
      access.location = prop.location;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      r = d.memSetAccess(base + c.off, c.size, &access, 1);
      what = "cuMemSetAccess";
    }
    if (r != CUDA_SUCCESS) {
      std::string msg = "torchckpt: DeviceArena could not map chunk " + std::to_string(i) + " (bytes [" +
                        std::to_string(c.off) + ", " + std::to_string(c.off + c.size) + ") of " +
                        std::to_string(nbytes) + ") on cuda:" + std::to_string(device) + ": " + what +
                        " returned " + cu_name(r) + ".";
      if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        msg += " The device ran out of memory while the arena was being mapped (another process or PyTorch's "
               "caching allocator took it). Fix: ask for fewer bytes, or free memory first "
               "(torch.cuda.empty_cache()).";
      }
      return msg;
    }
    return "";
  }

  void mark_mapped(size_t i) {
    {
      std::lock_guard<std::mutex> g(mu);
      chunks[i].mapped = true;
      mapped_chunks = i + 1;
      mapped_bytes += chunks[i].size;
      if (mapped_chunks == chunks.size()) {
        all_mapped_s = std::chrono::duration<double>(Clock::now() - t0).count();
      }
    }
    cv.notify_all();
  }

  void run(size_t from) {  // the background thread (Rules 3-5)
    cudaSetDevice(device);  // Rule 4: binds the primary context to this thread
    for (size_t i = from; i < chunks.size(); ++i) {
      if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      {
        std::lock_guard<std::mutex> g(mu);
        if (stop) return;
      }
      std::string err = map_chunk(i);
      if (!err.empty()) {
        {
          std::lock_guard<std::mutex> g(mu);
          error = err;
        }
        cv.notify_all();
        return;
      }
      mark_mapped(i);
    }
  }

  // Index of the last chunk that holds a byte of [offset, offset + n), n > 0.
  size_t last_chunk(size_t offset, size_t n) const {
    size_t last_byte = offset + n - 1;
    return static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), last_byte) - ends.begin());
  }

  // "" once bytes [offset, offset + n) are mapped, else why they never will be (Rule 10).
  std::string wait(size_t offset, size_t n) {
    if (n == 0) return "";
    size_t need = last_chunk(offset, n) + 1;
    std::unique_lock<std::mutex> g(mu);
    cv.wait(g, [&] { return mapped_chunks >= need || !error.empty() || stop; });
    if (mapped_chunks >= need) return "";
    if (!error.empty()) return error;
    return "torchckpt: DeviceArena was closed while bytes [" + std::to_string(offset) + ", " +
           std::to_string(offset + n) + ") were not mapped yet; make views before close().";
  }

  void shutdown() {  // stop and join the thread; idempotent
    {
      std::lock_guard<std::mutex> g(mu);
      stop = true;
    }
    cv.notify_all();
    if (worker.joinable() && worker.get_id() != std::this_thread::get_id()) worker.join();
  }

  ~State() {  // Rule 7
    shutdown();
    const Driver& d = driver();
    if (base == 0 && chunks.empty()) return;
    DeviceScope scope(device);
    cudaDeviceSynchronize();
    cudaGetLastError();
    for (auto& c : chunks) {
      if (c.in_va) d.memUnmap(base + c.off, c.size);
      if (c.created) d.memRelease(c.handle);
    }
    if (base != 0) d.memAddressFree(base, reserved);
  }
};

static size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

#endif  // TORCHCKPT_WITH_CUDA

[[maybe_unused]] static const char* kNoCuda =
    "torchckpt: the native extension was built without CUDA (no toolkit with headers at build time), so the "
    "VMM device arena is unavailable. Fix: rebuild on a machine with a CUDA toolkit (set CUDA_HOME) with "
    "`pip install --no-build-isolation -e .`, or use make_device_slots(..., use_vmm=False).";

std::string vmm_status(int64_t device) {
#ifdef TORCHCKPT_WITH_CUDA
  return status(device);
#else
  (void)device;
  return kNoCuda;
#endif
}

struct DeviceArena : torch::CustomClassHolder {
  std::string init_error_;  // why construction failed ("" when it did not; Rule 10)
#ifdef TORCHCKPT_WITH_CUDA
  std::shared_ptr<State> s_;
  // Copies of the State's sizes, still readable after close().
  int64_t device_ = 0, nbytes_ = 0, reserved_ = 0, granularity_ = 0, chunk_bytes_ = 0, nchunks_ = 0;
#endif

  DeviceArena(int64_t nbytes, int64_t device, int64_t chunk_bytes, int64_t first_bytes, bool background,
              int64_t delay_us) {
#ifndef TORCHCKPT_WITH_CUDA
    (void)nbytes, (void)device, (void)chunk_bytes, (void)first_bytes, (void)background, (void)delay_us;
    init_error_ = kNoCuda;
#else
    init_error_ = init(nbytes, device, chunk_bytes, first_bytes, background, delay_us);
    if (!init_error_.empty()) s_.reset();  // releases whatever was taken (Rule 7)
#endif
  }

  ~DeviceArena() override {
#ifdef TORCHCKPT_WITH_CUDA
    close();
#endif
  }

  std::string init_error() const { return init_error_; }

#ifdef TORCHCKPT_WITH_CUDA
  std::string init(int64_t nbytes, int64_t device, int64_t chunk_bytes, int64_t first_bytes, bool background,
                   int64_t delay_us) {
    using std::to_string;
    if (nbytes <= 0) {
      return "torchckpt: DeviceArena expected nbytes > 0, found " + to_string(nbytes) +
             ". Fix: pass the cache size in bytes.";
    }
    if (chunk_bytes <= 0) {
      return "torchckpt: DeviceArena expected chunk_bytes > 0, found " + to_string(chunk_bytes) +
             ". Fix: pass e.g. 256 MiB (it is rounded up to the allocation granularity).";
    }
    if (first_bytes < 0 || first_bytes > nbytes) {
      return "torchckpt: DeviceArena expected 0 <= first_bytes <= " + to_string(nbytes) + ", found " +
             to_string(first_bytes) + ". Fix: pass the size of the first slot, or 0.";
    }
    if (delay_us < 0) return "torchckpt: DeviceArena expected delay_us >= 0, found " + to_string(delay_us) + ".";
    std::string why = status(device);
    if (!why.empty()) return why;
    const Driver& d = driver();
    DeviceScope scope(static_cast<int>(device));
    cudaFree(nullptr);  // make sure the primary context exists
    s_ = std::make_shared<State>();
    State& s = *s_;
    s.t0 = Clock::now();
    s.device = static_cast<int>(device);
    s.nbytes = static_cast<size_t>(nbytes);
    s.delay_us = delay_us;
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = s.device;
    size_t gran = 0;
    CUresult r = d.memGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS || gran == 0) {
      return "torchckpt: cuMemGetAllocationGranularity failed on cuda:" + to_string(device) + ": " + cu_name(r) +
             ". Fix: use make_device_slots(..., use_vmm=False).";
    }
    s.granularity = gran;
    s.chunk_bytes = round_up(static_cast<size_t>(chunk_bytes), gran);  // Rule 2: rounded, not refused
    s.reserved = round_up(s.nbytes, gran);
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
      if (s.reserved > free_b) {
        return "torchckpt: DeviceArena of " + to_string(s.reserved) + " bytes does not fit: cuda:" +
               to_string(device) + " has " + to_string(free_b) + " bytes free of " + to_string(total_b) +
               ". Fix: ask for fewer bytes, or free device memory first (torch.cuda.empty_cache() returns "
               "PyTorch's cached blocks to the driver).";
      }
    } else {
      cudaGetLastError();
    }
    // Rule 2: chunk layout.
    size_t off = 0;
    if (first_bytes > 0) {
      size_t first = std::min(round_up(static_cast<size_t>(first_bytes), gran), s.reserved);
      s.chunks.push_back(Chunk{0, first});
      off = first;
    }
    while (off < s.reserved) {
      size_t n = std::min(s.chunk_bytes, s.reserved - off);
      s.chunks.push_back(Chunk{off, n});
      off += n;
    }
    for (auto& c : s.chunks) s.ends.push_back(c.off + c.size);
    r = d.memAddressReserve(&s.base, s.reserved, 0, 0, 0);  // Rule 1
    if (r != CUDA_SUCCESS) {
      s.base = 0;
      return "torchckpt: cuMemAddressReserve of " + to_string(s.reserved) + " bytes failed on cuda:" +
             to_string(device) + ": " + cu_name(r) + ". Fix: ask for fewer bytes, or use "
             "make_device_slots(..., use_vmm=False).";
    }
    // Map synchronously: the first chunk when asked (Rule 2), or everything without a thread.
    size_t sync = background ? (first_bytes > 0 ? 1 : 0) : s.chunks.size();
    for (size_t i = 0; i < sync; ++i) {
      std::string err = s.map_chunk(i);
      if (!err.empty()) return err;  // the caller drops s_, which releases what was mapped (Rule 7)
      s.mark_mapped(i);
    }
    if (sync < s.chunks.size()) {
      State* raw = s_.get();
      s.worker = std::thread([raw, sync] { raw->run(sync); });
    }
    device_ = device;
    nbytes_ = nbytes;
    reserved_ = static_cast<int64_t>(s.reserved);
    granularity_ = static_cast<int64_t>(gran);
    chunk_bytes_ = static_cast<int64_t>(s.chunk_bytes);
    nchunks_ = static_cast<int64_t>(s.chunks.size());
    return "";
  }

  bool in_range(int64_t offset, int64_t n) const {
    return offset >= 0 && n >= 0 && offset <= nbytes_ && n <= nbytes_ - offset;
  }
  std::string range_error(int64_t offset, int64_t n) const {
    return "torchckpt: DeviceArena expected a byte range inside [0, " + std::to_string(nbytes_) + "), found offset " +
           std::to_string(offset) + " and nbytes " + std::to_string(n) +
           ". Fix: keep offset + nbytes <= the arena's size.";
  }
#endif

  // "" once bytes [offset, offset + n) are mapped, else why not (Rules 3 and 10).
  std::string wait(int64_t offset, int64_t n) {
#ifdef TORCHCKPT_WITH_CUDA
    if (!in_range(offset, n)) return range_error(offset, n);
    std::shared_ptr<State> s = s_;
    if (s == nullptr) return "torchckpt: DeviceArena.wait() after close(); make a new arena.";
    return s->wait(static_cast<size_t>(offset), static_cast<size_t>(n));
#else
    (void)offset, (void)n;
    return kNoCuda;
#endif
  }

  std::string wait_all() { return wait(0, size()); }

  // A CUDA uint8 tensor over bytes [offset, offset + n) that keeps the memory alive (Rule 6).
  // The Python wrapper calls wait() first and checks the range; the checks here guard the raw class.
  at::Tensor view(int64_t offset, int64_t n, bool wait_mapped) {
#ifdef TORCHCKPT_WITH_CUDA
    TORCH_CHECK(in_range(offset, n), range_error(offset, n));
    TORCH_CHECK(s_ != nullptr, "torchckpt: DeviceArena.view() after close(); make a new arena.");
    if (wait_mapped) {
      std::string err = s_->wait(static_cast<size_t>(offset), static_cast<size_t>(n));
      TORCH_CHECK(err.empty(), err);
    }
    std::shared_ptr<State> keep = s_;
    keep->live_views++;
    void* ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(keep->base + static_cast<size_t>(offset)));
    at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
    return at::for_blob(ptr, {n})
        .deleter([keep](void*) { keep->live_views--; })
        .options(at::TensorOptions().dtype(at::kByte).device(dev))
        .target_device(dev)
        .make_tensor();
#else
    (void)offset, (void)n, (void)wait_mapped;
    TORCH_CHECK(false, kNoCuda);
#endif
  }

  // Stops the mapping thread and drops the arena's hold on the memory (Rule 6). Idempotent.
  void close() {
#ifdef TORCHCKPT_WITH_CUDA
    if (s_ == nullptr) return;
    s_->shutdown();
    s_.reset();
#endif
  }

#ifdef TORCHCKPT_WITH_CUDA
  bool closed() const { return s_ == nullptr; }
  int64_t size() const { return nbytes_; }
  int64_t reserved_bytes() const { return reserved_; }
  int64_t granularity() const { return granularity_; }
  int64_t chunk_bytes() const { return chunk_bytes_; }
  int64_t num_chunks() const { return nchunks_; }
  int64_t device() const { return device_; }
  int64_t mapped_bytes() const { return s_ ? static_cast<int64_t>(s_->mapped_bytes.load()) : 0; }
  int64_t mapped_chunks() const {
    if (!s_) return 0;
    std::lock_guard<std::mutex> g(s_->mu);
    return static_cast<int64_t>(s_->mapped_chunks);
  }
  bool ready() const { return s_ != nullptr && mapped_chunks() == nchunks_; }
  std::string error() const {
    if (!s_) return "";
    std::lock_guard<std::mutex> g(s_->mu);
    return s_->error;
  }
  int64_t live_views() const { return s_ ? s_->live_views.load() : 0; }
  double all_mapped_s() const { return s_ ? s_->all_mapped_s.load() : -1.0; }
  int64_t base_ptr() const { return s_ ? static_cast<int64_t>(s_->base) : 0; }
#else
  bool closed() const { return true; }
  int64_t size() const { return 0; }
  int64_t reserved_bytes() const { return 0; }
  int64_t granularity() const { return 0; }
  int64_t chunk_bytes() const { return 0; }
  int64_t num_chunks() const { return 0; }
  int64_t device() const { return -1; }
  int64_t mapped_bytes() const { return 0; }
  int64_t mapped_chunks() const { return 0; }
  bool ready() const { return false; }
  std::string error() const { return kNoCuda; }
  int64_t live_views() const { return 0; }
  double all_mapped_s() const { return -1.0; }
  int64_t base_ptr() const { return 0; }
#endif
};

}  // namespace vmm

TORCH_LIBRARY_FRAGMENT(torchckpt, m) {
  m.class_<vmm::DeviceArena>("DeviceArena")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, bool, int64_t>())
      .def("init_error", &vmm::DeviceArena::init_error)
      .def("view", &vmm::DeviceArena::view)
      .def("wait", &vmm::DeviceArena::wait)
      .def("wait_all", &vmm::DeviceArena::wait_all)
      .def("close", &vmm::DeviceArena::close)
      .def("closed", &vmm::DeviceArena::closed)
      .def("size", &vmm::DeviceArena::size)
      .def("reserved_bytes", &vmm::DeviceArena::reserved_bytes)
      .def("granularity", &vmm::DeviceArena::granularity)
      .def("chunk_bytes", &vmm::DeviceArena::chunk_bytes)
      .def("num_chunks", &vmm::DeviceArena::num_chunks)
      .def("device", &vmm::DeviceArena::device)
      .def("mapped_bytes", &vmm::DeviceArena::mapped_bytes)
      .def("mapped_chunks", &vmm::DeviceArena::mapped_chunks)
      .def("ready", &vmm::DeviceArena::ready)
      .def("error", &vmm::DeviceArena::error)
      .def("live_views", &vmm::DeviceArena::live_views)
      .def("all_mapped_s", &vmm::DeviceArena::all_mapped_s)
      .def("base_ptr", &vmm::DeviceArena::base_ptr);
  m.def("vmm_status(int device) -> str", &vmm::vmm_status);
}

}  // namespace torchckpt
