// torchckpt lazily pinned host pool (NOTE [ Lazy host pool ] in torchckpt/memory/lazy_pool.py).
//
// One anonymous mmap of the whole pool, advised MADV_HUGEPAGE. A background std::thread walks
// the pool chunk by chunk: it touches every page of a chunk (MADV_POPULATE_WRITE where the kernel
// has it, else one read-write byte per page, which keeps data already there) and then registers
// the chunk with cudaHostRegister, so that copies into it run at pinned bandwidth. Until then the
// chunk is ordinary pageable memory: copies into it are correct, only slower.
//
// NOTE [ Native host pool ]
// Rules (numbers cited below and from the Python side):
//  1. Chunk k is [offset_k, offset_k + size_k); sizes start at `first_chunk_bytes` and double up
//     to `chunk_bytes` (the last chunk holds the remainder). Every size is a multiple of the page
//     size. The Python allocator never hands out a block that straddles two chunks: a copy must
//     never span two separately registered ranges, or a registered and an unregistered one.
//  2. Chunk states only move forward: UNTOUCHED -> TOUCHED -> REGISTERED, or TOUCHED -> FAILED
//     when cudaHostRegister refuses (RLIMIT_MEMLOCK, driver limits): a failed chunk stays
//     pageable and the pool keeps working (the error is kept for Python to warn once).
//  3. Strategies: "concurrent" touches and registers while copies run; "sequential" touches only
//     while no tracked copy is in flight (copies are tracked by begin_copy/end_copy or by
//     track_copy(stream), which decrements from a host function enqueued on the copy's stream);
//     "whole" is the HiPC'22 paper's variant: touch every chunk, then register the whole region in
//     one call. The strategy may change while the worker runs (the Python "auto" model sets it).
//  4. Node-wide serialization: each cudaHostRegister runs under an exclusive flock() on a file
//     (default /dev/shm/torchckpt-register.lock), so only one process of a node registers at a
//     time; the kernel drops the lock when its holder dies. A second flock (`.gate`) in front
//     of it makes the lock fair (class NodeLock). `node_lock=false` turns it off.
//  5. A touch limit (bytes) keeps the worker from running further ahead than Python allows; it
//     waits until the limit passes the next chunk.
//  6. Lifetime (RAII): the destructor stops and joins the worker, synchronizes the device,
//     unregisters every registered range, then unmaps. The tensor returned by tensor() holds a
//     reference to the pool in its deleter, so the memory outlives every view of it; close()
//     only stops the worker (the memory goes when the last reference does).
//  7. register_mode "fake" / "fake_fail" stand in for cudaHostRegister (a sleep, or a refusal)
//     so that CPU tests can check the bookkeeping and the node lock without a GPU.
//  8. Touching and registering are pipelined: the worker touches chunk k+1 while a registrar
//     thread registers chunk k (in chunk order), so the pool becomes pinned at the rate of the
//     slower of the two, not of their sum.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#ifdef TORCHCKPT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace torchckpt {
namespace {

constexpr int64_t kUntouched = 0;
constexpr int64_t kTouched = 1;
constexpr int64_t kRegistered = 2;
constexpr int64_t kFailed = 3;

enum class Strategy : int { kConcurrent = 0, kSequential = 1, kWhole = 2 };
enum class RegisterMode : int { kNone = 0, kCuda = 1, kFake = 2, kFakeFail = 3 };

using Clock = std::chrono::steady_clock;

Strategy parse_strategy(const std::string& s) {
  if (s == "concurrent") return Strategy::kConcurrent;
  if (s == "sequential") return Strategy::kSequential;
  if (s == "whole") return Strategy::kWhole;
  TORCH_CHECK(false, "torchckpt: host pool strategy must be 'concurrent', 'sequential' or 'whole', got '", s,
              "'; pass one of those (the Python side resolves 'auto').");
}

RegisterMode parse_mode(const std::string& s) {
  if (s == "none") return RegisterMode::kNone;
  if (s == "cuda") return RegisterMode::kCuda;
  if (s == "fake") return RegisterMode::kFake;
  if (s == "fake_fail") return RegisterMode::kFakeFail;
  TORCH_CHECK(false, "torchckpt: host pool register_mode must be 'none', 'cuda', 'fake' or 'fake_fail', got '", s,
              "'.");
}

int64_t page_bytes() { return static_cast<int64_t>(sysconf(_SC_PAGESIZE)); }

bool built_with_cuda() {
#ifdef TORCHCKPT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// The pool's address range; unmapped on destruction (Rule 6).
struct Mapping {
  void* map = nullptr;
  size_t map_len = 0;
  uint8_t* base = nullptr;
  bool huge = false;

  Mapping(int64_t nbytes, bool want_huge) {
    const size_t align = size_t(2) << 20;  // 2 MiB: lets THP back the pool from its first byte
    map_len = static_cast<size_t>(nbytes) + align;
    map = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TORCH_CHECK(map != MAP_FAILED, "torchckpt: mmap of a ", nbytes, "-byte host pool failed (", std::strerror(errno),
                "); pass a smaller capacity_bytes.");
    auto addr = reinterpret_cast<uintptr_t>(map);
    base = reinterpret_cast<uint8_t*>((addr + align - 1) / align * align);
    if (want_huge) huge = madvise(base, static_cast<size_t>(nbytes), MADV_HUGEPAGE) == 0;
  }
  ~Mapping() {
    if (map != nullptr && map != MAP_FAILED) munmap(map, map_len);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

// An exclusive, fair flock on a file shared by the processes of a node (Rule 4). flock alone is
// not fair: a process that releases and re-takes it at once can keep it while another waits
// (measured: one rank waited 17 s on 2 x H200). A turnstile fixes that: take `path.gate`, then
// `path`, then drop the gate. While one process holds the lock, the next waiter holds the gate,
// so the holder cannot re-take the lock before that waiter had it. Both are flocks, so the
// kernel drops them when their holder dies.
class NodeLock {
 public:
  NodeLock(const std::string& path, bool enabled) {
    if (!enabled) return;
    fd_ = open_lock(path);
    if (fd_ >= 0) gate_ = open_lock(path + ".gate");
    if (fd_ < 0 || gate_ < 0) {
      error_ = "could not open the node registration lock " + path + " (" + std::strerror(errno) +
               "); registrations are not serialized across processes";
      if (fd_ >= 0) close(fd_);
      fd_ = -1;
    }
  }
  ~NodeLock() {
    if (fd_ >= 0) close(fd_);
    if (gate_ >= 0) close(gate_);
  }
  NodeLock(const NodeLock&) = delete;
  NodeLock& operator=(const NodeLock&) = delete;

  void lock() {
    if (fd_ < 0) return;
    take(gate_);
    take(fd_);
    flock(gate_, LOCK_UN);
  }
  void unlock() {
    if (fd_ >= 0) flock(fd_, LOCK_UN);
  }
  bool active() const { return fd_ >= 0; }
  const std::string& error() const { return error_; }

 private:
  static int open_lock(const std::string& path) {
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd >= 0) fchmod(fd, 0666);  // best effort: let other users of the node share it
    return fd;
  }
  static void take(int fd) {
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  int fd_ = -1, gate_ = -1;
  std::string error_;
};

#ifdef TORCHCKPT_WITH_CUDA
void CUDART_CB copy_done(void* arg);
#endif

}  // namespace

class NativeHostPool : public torch::CustomClassHolder {
 public:
  NativeHostPool(int64_t nbytes, int64_t chunk_bytes, int64_t first_chunk_bytes, std::string strategy,
                 std::string register_mode, bool node_lock, std::string lock_path, int64_t device, bool huge_pages,
                 int64_t touch_threads, bool populate, int64_t touch_limit, int64_t fake_register_us)
      : page_(page_bytes()),
        strategy_(static_cast<int>(parse_strategy(strategy))),
        mode_(parse_mode(register_mode)),
        device_(device),
        touch_threads_(std::max<int64_t>(1, touch_threads)),
        populate_(populate),
        fake_register_us_(fake_register_us),
        touch_limit_(touch_limit < 0 ? nbytes : touch_limit),
        t0_(Clock::now()),
        lock_(lock_path, node_lock),
        map_(check_sizes(nbytes, chunk_bytes, first_chunk_bytes), huge_pages) {
#ifndef TORCHCKPT_WITH_CUDA
    TORCH_CHECK(mode_ != RegisterMode::kCuda,
                "torchckpt: this build of torchckpt._C has no CUDA runtime, so the host pool cannot register "
                "memory; rebuild with a CUDA toolkit (pip install --no-build-isolation -e .) or pass "
                "register_mode='none'.");
#endif
    size_ = nbytes;
    int64_t off = 0, cur = std::min(first_chunk_bytes, chunk_bytes);
    while (off < nbytes) {
      const int64_t n = std::min(cur, nbytes - off);
      offsets_.push_back(off);
      sizes_.push_back(n);
      off += n;
      cur = std::min(cur * 2, chunk_bytes);
    }
    const size_t nc = offsets_.size();
    states_.reset(new std::atomic<int64_t>[nc]);
    for (size_t i = 0; i < nc; ++i) states_[i].store(kUntouched);
    t_touched_.assign(nc, -1.0);
    t_registered_.assign(nc, -1.0);
    if (!lock_.error().empty()) errors_.push_back(lock_.error());
    worker_ = std::thread([this] { run(); });
  }

  ~NativeHostPool() override {
    stop_and_join();
    {  // host functions enqueued by track_copy point at this object
      std::unique_lock<std::mutex> lk(idle_mu_);
      idle_cv_.wait(lk, [&] { return hostfn_pending_.load() <= 0; });
    }
    release();
  }

  // -- Python-visible methods --------------------------------------------------------------
  int64_t size() const { return size_; }
  int64_t num_chunks() const { return static_cast<int64_t>(offsets_.size()); }
  std::vector<int64_t> chunk_offsets() const { return offsets_; }
  std::vector<int64_t> chunk_sizes() const { return sizes_; }
  bool huge_pages() const { return map_.huge; }
  bool lock_active() const { return lock_.active(); }
  int64_t state(int64_t i) const {
    TORCH_CHECK(i >= 0 && i < num_chunks(), "torchckpt: chunk index ", i, " out of range [0, ", num_chunks(), ")");
    return states_[i].load(std::memory_order_acquire);
  }
  std::vector<int64_t> states() const {
    std::vector<int64_t> out(offsets_.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = states_[i].load(std::memory_order_acquire);
    return out;
  }

  // Blocks until chunk i is registered or failed, the worker has finished or stopped, or
  // timeout_ms passes (< 0: no timeout). Returns the chunk's state.
  int64_t wait_registered(int64_t i, int64_t timeout_ms) {
    (void)state(i);
    std::unique_lock<std::mutex> lk(mu_);
    auto ready = [&] { return states_[i].load() >= kRegistered || done_ || stop_.load(); };
    if (timeout_ms < 0) {
      cv_.wait(lk, ready);
    } else {
      cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), ready);
    }
    return states_[i].load();
  }

  bool wait_done(int64_t timeout_ms) {
    std::unique_lock<std::mutex> lk(mu_);
    auto ready = [&] { return done_; };
    if (timeout_ms < 0) {
      cv_.wait(lk, ready);
      return true;
    }
    return cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), ready);
  }

  bool done() {
    std::lock_guard<std::mutex> g(mu_);
    return done_;
  }

  void set_strategy(const std::string& s) {
    const Strategy st = parse_strategy(s);
    TORCH_CHECK((strategy_.load() == static_cast<int>(Strategy::kWhole)) == (st == Strategy::kWhole),
                "torchckpt: a host pool cannot switch to or from the 'whole' strategy after creation.");
    strategy_.store(static_cast<int>(st));
    idle_cv_.notify_all();
  }
  std::string strategy() const {
    switch (static_cast<Strategy>(strategy_.load())) {
      case Strategy::kConcurrent: return "concurrent";
      case Strategy::kSequential: return "sequential";
      case Strategy::kWhole: return "whole";
    }
    return "?";
  }

  void set_touch_limit(int64_t limit) {
    {
      std::lock_guard<std::mutex> g(idle_mu_);
      touch_limit_.store(limit < 0 ? size_ : limit);
    }
    idle_cv_.notify_all();
  }

  // Copy tracking for the sequential strategy and for close() (Rule 3).
  void begin_copy() { inflight_.fetch_add(1); }
  void end_copy() {
    {
      std::lock_guard<std::mutex> g(idle_mu_);
      inflight_.fetch_sub(1);
    }
    idle_cv_.notify_all();
  }
  int64_t copies_in_flight() const { return inflight_.load(); }

  // Counts a copy as in flight from now until `stream` (a cudaStream_t as an integer) reaches
  // this point: the end is signalled by a host function enqueued on that stream.
  void track_copy(int64_t stream) {
    begin_copy();
#ifdef TORCHCKPT_WITH_CUDA
    auto s = reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream));
    hostfn_pending_.fetch_add(1);
    if (cudaLaunchHostFunc(s, copy_done, this) == cudaSuccess) return;
    cudaGetLastError();
    hostfn_pending_.fetch_sub(1);
#else
    (void)stream;
#endif
    end_copy();
  }

  bool wait_copies(int64_t timeout_ms) {
    std::unique_lock<std::mutex> lk(idle_mu_);
    auto ready = [&] { return inflight_.load() <= 0 && hostfn_pending_.load() <= 0; };
    if (timeout_ms < 0) {
      idle_cv_.wait(lk, ready);
      return true;
    }
    return idle_cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), ready);
  }

  std::vector<std::string> errors() {
    std::lock_guard<std::mutex> g(mu_);
    return errors_;
  }

  // Per-chunk milliseconds since creation: [touched_0.., registered_0..] (-1: not yet).
  std::vector<double> chunk_times() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<double> out(t_touched_);
    out.insert(out.end(), t_registered_.begin(), t_registered_.end());
    return out;
  }

  c10::Dict<std::string, double> stats() {
    std::lock_guard<std::mutex> g(mu_);
    c10::Dict<std::string, double> d;
    int64_t touched = 0, registered = 0, failed = 0;
    for (size_t i = 0; i < offsets_.size(); ++i) {
      const int64_t s = states_[i].load();
      if (s >= kTouched) touched += sizes_[i];
      if (s == kRegistered) registered += sizes_[i];
      if (s == kFailed) failed += 1;
    }
    d.insert("touched_bytes", static_cast<double>(touched));
    d.insert("registered_bytes", static_cast<double>(registered));
    d.insert("failed_chunks", static_cast<double>(failed));
    d.insert("touch_s", touch_s_);
    d.insert("register_s", register_s_);
    d.insert("lock_wait_s", lock_wait_s_);
    d.insert("paused_s", paused_s_);
    d.insert("registrations", static_cast<double>(registrations_));
    d.insert("done_ms", done_ms_);
    d.insert("huge_pages", map_.huge ? 1.0 : 0.0);
    d.insert("populate", populate_used_ ? 1.0 : 0.0);
    return d;
  }

  void close() { stop_and_join(); }

  // The whole pool as a CPU uint8 tensor; its deleter keeps the pool alive (Rule 6).
  static at::Tensor tensor(const c10::intrusive_ptr<NativeHostPool>& self) {
    c10::intrusive_ptr<NativeHostPool> keep = self;
    return at::from_blob(
        self->map_.base, {self->size_}, [keep](void*) mutable { keep.reset(); },
        at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  }

#ifdef TORCHCKPT_WITH_CUDA
  // Runs on the driver's callback thread. Everything under idle_mu_, notify included: once the
  // lock is released the destructor may run (it waits for hostfn_pending_ under the same lock).
  void hostfn_done() {
    std::lock_guard<std::mutex> g(idle_mu_);
    inflight_.fetch_sub(1);
    hostfn_pending_.fetch_sub(1);
    idle_cv_.notify_all();
  }
#endif

 private:
  int64_t check_sizes(int64_t nbytes, int64_t chunk_bytes, int64_t first_chunk_bytes) const {
    TORCH_CHECK(nbytes > 0 && nbytes % page_ == 0, "torchckpt: host pool size must be a positive multiple of the ",
                page_, "-byte page size, got ", nbytes, "; round it up.");
    TORCH_CHECK(chunk_bytes > 0 && chunk_bytes % page_ == 0, "torchckpt: host pool chunk_bytes must be a positive "
                "multiple of the ", page_, "-byte page size, got ", chunk_bytes, "; pass e.g. 256 << 20.");
    TORCH_CHECK(first_chunk_bytes > 0 && first_chunk_bytes % page_ == 0, "torchckpt: host pool first_chunk_bytes "
                "must be a positive multiple of the ", page_, "-byte page size, got ", first_chunk_bytes, ".");
    return nbytes;
  }

  double now_ms() const { return std::chrono::duration<double, std::milli>(Clock::now() - t0_).count(); }

  void stop_and_join() {
    {
      std::lock_guard<std::mutex> g(idle_mu_);
      stop_.store(true);
    }
    idle_cv_.notify_all();
    cv_.notify_all();
    {
      std::lock_guard<std::mutex> g(reg_mu_);
    }
    reg_cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  void finish_registrar(std::thread& registrar) {
    {
      std::lock_guard<std::mutex> g(reg_mu_);
      touch_done_ = true;
    }
    reg_cv_.notify_all();
    if (registrar.joinable()) registrar.join();
  }

  // Registers touched chunks in the order the toucher hands them over, until the toucher is
  // done and the queue is empty, or the pool stops.
  void register_loop() {
    try {
#ifdef TORCHCKPT_WITH_CUDA
      if (mode_ == RegisterMode::kCuda) {
        if (cudaSetDevice(static_cast<int>(device_)) != cudaSuccess) cudaGetLastError();
      }
#endif
      for (;;) {
        size_t i = 0;
        {
          std::unique_lock<std::mutex> lk(reg_mu_);
          reg_cv_.wait(lk, [&] { return stop_.load() || touch_done_ || !reg_q_.empty(); });
          if (stop_.load() || reg_q_.empty()) return;
          i = reg_q_.front();
          reg_q_.erase(reg_q_.begin());
        }
        set_state(i, register_range(offsets_[i], sizes_[i]) ? kRegistered : kFailed);
      }
    } catch (const std::exception& e) {
      record_error(std::string("host pool registrar stopped: ") + e.what());
    } catch (...) {
      record_error("host pool registrar stopped by an unknown exception");
    }
  }

  void release() {
#ifdef TORCHCKPT_WITH_CUDA
    if (mode_ == RegisterMode::kCuda && !registered_.empty()) {
      int prev = -1;
      cudaGetDevice(&prev);
      cudaSetDevice(static_cast<int>(device_));
      cudaDeviceSynchronize();  // no copy may still use the memory (Rule 6)
      for (auto& r : registered_) cudaHostUnregister(map_.base + r.first);
      if (prev >= 0) cudaSetDevice(prev);
      cudaGetLastError();
    }
#endif
    registered_.clear();
  }

  void record_error(std::string msg) {
    std::lock_guard<std::mutex> g(mu_);
    if (errors_.size() < 16) errors_.push_back(std::move(msg));
  }

  void set_state(size_t i, int64_t s) {
    {
      std::lock_guard<std::mutex> g(mu_);
      states_[i].store(s, std::memory_order_release);
      if (s == kTouched) t_touched_[i] = now_ms();
      if (s == kRegistered || s == kFailed) t_registered_[i] = now_ms();
    }
    cv_.notify_all();
  }

  // Sequential strategy: wait while a tracked copy is in flight (Rule 3). False when stopping.
  bool wait_idle() {
    if (strategy_.load() != static_cast<int>(Strategy::kSequential) || inflight_.load() <= 0) return !stop_.load();
    const auto t = Clock::now();
    {
      std::unique_lock<std::mutex> lk(idle_mu_);
      idle_cv_.wait(lk, [&] {
        return stop_.load() || inflight_.load() <= 0 || strategy_.load() != static_cast<int>(Strategy::kSequential);
      });
    }
    const double s = std::chrono::duration<double>(Clock::now() - t).count();
    std::lock_guard<std::mutex> g(mu_);
    paused_s_ += s;
    return !stop_.load();
  }

  // Wait until the touch limit passes `offset` (Rule 5). False when stopping.
  bool wait_limit(int64_t offset) {
    std::unique_lock<std::mutex> lk(idle_mu_);
    idle_cv_.wait(lk, [&] { return stop_.load() || touch_limit_.load() > offset; });
    return !stop_.load();
  }

  // Touch [off, off + len) with touch_threads_ threads, in slices so that stop and the
  // sequential gate are checked often. False when stopped before the end.
  bool touch_range(int64_t off, int64_t len) {
    const int64_t slice = int64_t(16) << 20;
    const int64_t nslices = (len + slice - 1) / slice;
    const int64_t nthreads = std::min<int64_t>(touch_threads_, nslices);
    std::atomic<int64_t> next{0};
    std::atomic<bool> ok{true};
    auto work = [&] {
      for (;;) {
        const int64_t k = next.fetch_add(1);
        if (k >= nslices) return;
        if (!wait_idle()) {
          ok.store(false);
          return;
        }
        const int64_t lo = off + k * slice, hi = std::min(off + len, lo + slice);
        uint8_t* p = map_.base + lo;
        if (populate_ && madvise(p, static_cast<size_t>(hi - lo), MADV_POPULATE_WRITE) == 0) {
          populate_used_ = true;
          continue;
        }
        volatile uint8_t* v = map_.base;
        for (int64_t q = lo; q < hi; q += page_) v[q] = v[q];  // read-write keeps the data
      }
    };
    if (nthreads <= 1) {
      work();
    } else {
      std::vector<std::thread> ts;
      ts.reserve(static_cast<size_t>(nthreads - 1));
      try {
        for (int64_t t = 1; t < nthreads; ++t) ts.emplace_back(work);
      } catch (...) {  // could not start more threads: the ones we have finish the range
      }
      work();
      for (auto& t : ts) t.join();
    }
    return ok.load() && !stop_.load();
  }

  // Register [off, off + len) under the node lock (Rule 4). True on success.
  bool register_range(int64_t off, int64_t len) {
    if (mode_ == RegisterMode::kNone) return false;
    const auto t_lock = Clock::now();
    lock_.lock();
    const auto t_reg = Clock::now();
    bool ok = false;
    std::string err;
    switch (mode_) {
      case RegisterMode::kCuda: {
#ifdef TORCHCKPT_WITH_CUDA
        const cudaError_t e = cudaHostRegister(map_.base + off, static_cast<size_t>(len), cudaHostRegisterPortable);
        ok = e == cudaSuccess;
        if (!ok) {
          err = cudaGetErrorString(e);
          cudaGetLastError();
        }
#endif
        break;
      }
      case RegisterMode::kFake:
        std::this_thread::sleep_for(std::chrono::microseconds(fake_register_us_));
        ok = true;
        break;
      case RegisterMode::kFakeFail:
        err = "fake registration failure (register_mode='fake_fail')";
        break;
      case RegisterMode::kNone:
        break;
    }
    lock_.unlock();
    const auto t_end = Clock::now();
    {
      std::lock_guard<std::mutex> g(mu_);
      lock_wait_s_ += std::chrono::duration<double>(t_reg - t_lock).count();
      register_s_ += std::chrono::duration<double>(t_end - t_reg).count();
      registrations_ += 1;
      if (ok) {
        registered_.emplace_back(off, len);
      } else if (errors_.size() < 16) {
        errors_.push_back("cudaHostRegister of " + std::to_string(len >> 20) + " MiB at offset " +
                          std::to_string(off) + " failed: " + err + "; those bytes stay pageable");
      }
    }
    return ok;
  }

  void run() {
    try {
#ifdef TORCHCKPT_WITH_CUDA
      if (mode_ == RegisterMode::kCuda) {
        const cudaError_t e = cudaSetDevice(static_cast<int>(device_));
        if (e != cudaSuccess) {
          record_error(std::string("cudaSetDevice failed in the host pool worker: ") + cudaGetErrorString(e));
          cudaGetLastError();
        }
      }
#endif
      const size_t nc = offsets_.size();
      if (strategy_.load() == static_cast<int>(Strategy::kWhole)) {
        for (size_t i = 0; i < nc; ++i) {
          const auto t = Clock::now();
          if (!touch_range(offsets_[i], sizes_[i])) break;
          add_touch_time(t);
          set_state(i, kTouched);
        }
        if (!stop_.load()) {
          const bool ok = register_range(0, size_);
          if (mode_ != RegisterMode::kNone)
            for (size_t i = 0; i < nc; ++i) set_state(i, ok ? kRegistered : kFailed);
        }
      } else {
        // Touch chunk k+1 while a second thread registers chunk k (Rule 8).
        std::thread registrar;
        if (mode_ != RegisterMode::kNone) registrar = std::thread([this] { register_loop(); });
        try {
          for (size_t i = 0; i < nc && !stop_.load(); ++i) {
            if (!wait_limit(offsets_[i])) break;
            const auto t = Clock::now();
            if (!touch_range(offsets_[i], sizes_[i])) break;
            add_touch_time(t);
            set_state(i, kTouched);
            if (registrar.joinable()) {
              std::lock_guard<std::mutex> g(reg_mu_);
              reg_q_.push_back(i);
            }
            reg_cv_.notify_all();
          }
        } catch (...) {
          finish_registrar(registrar);
          throw;
        }
        finish_registrar(registrar);
      }
    } catch (const std::exception& e) {
      record_error(std::string("host pool worker stopped: ") + e.what());
    } catch (...) {
      record_error("host pool worker stopped by an unknown exception");
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      done_ = true;
      done_ms_ = now_ms();
    }
    cv_.notify_all();
  }

  void add_touch_time(Clock::time_point t) {
    std::lock_guard<std::mutex> g(mu_);
    touch_s_ += std::chrono::duration<double>(Clock::now() - t).count();
  }

  const int64_t page_;
  std::atomic<int> strategy_;
  const RegisterMode mode_;
  const int64_t device_;
  const int64_t touch_threads_;
  const bool populate_;
  std::atomic<bool> populate_used_{false};
  const int64_t fake_register_us_;
  std::atomic<int64_t> touch_limit_;
  const Clock::time_point t0_;
  int64_t size_ = 0;
  std::vector<int64_t> offsets_, sizes_;
  std::unique_ptr<std::atomic<int64_t>[]> states_;

  std::mutex mu_;  // guards the fields below and pairs with cv_ (state changes, done_)
  std::condition_variable cv_;
  std::vector<double> t_touched_, t_registered_;
  std::vector<std::string> errors_;
  std::vector<std::pair<int64_t, int64_t>> registered_;
  double touch_s_ = 0, register_s_ = 0, lock_wait_s_ = 0, paused_s_ = 0, done_ms_ = -1;
  int64_t registrations_ = 0;
  bool done_ = false;

  std::mutex idle_mu_;  // pairs with idle_cv_: copies in flight, touch limit, stop
  std::condition_variable idle_cv_;
  std::mutex reg_mu_;  // pairs with reg_cv_: chunks touched and waiting for registration
  std::condition_variable reg_cv_;
  std::vector<size_t> reg_q_;
  bool touch_done_ = false;

  std::atomic<int64_t> inflight_{0};
  std::atomic<int64_t> hostfn_pending_{0};
  std::atomic<bool> stop_{false};

  NodeLock lock_;
  Mapping map_;         // destroyed after release() has unregistered (Rule 6)
  std::thread worker_;  // joined in the destructor body, before any member goes
};

namespace {
#ifdef TORCHCKPT_WITH_CUDA
void CUDART_CB copy_done(void* arg) { static_cast<NativeHostPool*>(arg)->hostfn_done(); }
#endif

int64_t host_page_bytes() { return page_bytes(); }
bool host_pool_built_with_cuda() { return built_with_cuda(); }
}  // namespace

// The pool's settings arrive as one config value: integers (booleans as 0/1) and strings by name.
// Every key must be given and no other (a missing or unknown key is the caller's bug, said by name).
c10::intrusive_ptr<NativeHostPool> make_host_pool(c10::Dict<std::string, int64_t> ints,
                                                  c10::Dict<std::string, std::string> strs) {
  static const char* kInts[] = {"nbytes",      "chunk_bytes", "first_chunk_bytes", "node_lock",       "device",
                                "huge_pages",  "touch_threads", "populate",        "touch_limit",     "fake_register_us"};
  static const char* kStrs[] = {"strategy", "register_mode", "lock_path"};
  for (const auto& it : ints) {
    bool known = false;
    for (const char* k : kInts) known = known || it.key() == k;
    TORCH_CHECK(known, "torchckpt: unknown integer setting '", it.key(), "' for the native host pool");
  }
  for (const auto& it : strs) {
    bool known = false;
    for (const char* k : kStrs) known = known || it.key() == k;
    TORCH_CHECK(known, "torchckpt: unknown string setting '", it.key(), "' for the native host pool");
  }
  auto i = [&](const char* k) {
    TORCH_CHECK(ints.contains(k), "torchckpt: the native host pool needs the integer setting '", k, "'");
    return ints.at(k);
  };
  auto s = [&](const char* k) {
    TORCH_CHECK(strs.contains(k), "torchckpt: the native host pool needs the string setting '", k, "'");
    return strs.at(k);
  };
  return c10::make_intrusive<NativeHostPool>(i("nbytes"), i("chunk_bytes"), i("first_chunk_bytes"), s("strategy"),
                                             s("register_mode"), i("node_lock") != 0, s("lock_path"), i("device"),
                                             i("huge_pages") != 0, i("touch_threads"), i("populate") != 0,
                                             i("touch_limit"), i("fake_register_us"));
}

TORCH_LIBRARY_FRAGMENT(torchckpt, m) {
  m.class_<NativeHostPool>("HostPool")
      .def(torch::init(&make_host_pool))
      .def("size", &NativeHostPool::size)
      .def("num_chunks", &NativeHostPool::num_chunks)
      .def("chunk_offsets", &NativeHostPool::chunk_offsets)
      .def("chunk_sizes", &NativeHostPool::chunk_sizes)
      .def("huge_pages", &NativeHostPool::huge_pages)
      .def("lock_active", &NativeHostPool::lock_active)
      .def("state", &NativeHostPool::state)
      .def("states", &NativeHostPool::states)
      .def("wait_registered", &NativeHostPool::wait_registered)
      .def("wait_done", &NativeHostPool::wait_done)
      .def("done", &NativeHostPool::done)
      .def("set_strategy", &NativeHostPool::set_strategy)
      .def("strategy", &NativeHostPool::strategy)
      .def("set_touch_limit", &NativeHostPool::set_touch_limit)
      .def("begin_copy", &NativeHostPool::begin_copy)
      .def("end_copy", &NativeHostPool::end_copy)
      .def("track_copy", &NativeHostPool::track_copy)
      .def("copies_in_flight", &NativeHostPool::copies_in_flight)
      .def("wait_copies", &NativeHostPool::wait_copies)
      .def("errors", &NativeHostPool::errors)
      .def("chunk_times", &NativeHostPool::chunk_times)
      .def("stats", &NativeHostPool::stats)
      .def("close", &NativeHostPool::close)
      .def("tensor", [](const c10::intrusive_ptr<NativeHostPool>& self) { return NativeHostPool::tensor(self); });
  m.def("host_page_bytes() -> int", &host_page_bytes);
  m.def("host_pool_built_with_cuda() -> bool", &host_pool_built_with_cuda);
}

}  // namespace torchckpt
