// torchckpt._zfp: fixed-rate zfp 1.0.1 compression of fp32/fp64 fields of 1-3 dimensions,
// serial zfp on CPU tensors and cuZFP (zfp_exec_cuda) on CUDA tensors, bound as TORCH_LIBRARY
// ops. This file is our glue only; zfp's own sources are fetched at build time into
// .deps/zfp-1.0.1 (tools/fetch_zfp.py) and never committed. Built only when
// TORCHCKPT_BUILD_ZFP=1 (setup.py); Python side: torchckpt/codecs/zfp.py, whose
// NOTE [ ZFP fixed rate ] the rules cited here belong to.
//
// Ops (dims are the field's sizes slowest first, as in a contiguous torch shape):
//   zfp_has_cuda() -> bool   (built with cuZFP)
//   zfp_stream_bytes(int[] dims, ScalarType dtype, float rate) -> (int bits_per_block, int bytes)
//   zfp_compress(Tensor x, int[] dims, float rate, Tensor(a!) out) -> ()
//   zfp_decompress(Tensor data, int[] dims, float rate, Tensor(a!) out) -> ()
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>

#include "zfp.h"

#ifdef TORCHCKPT_ZFP_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace torchckpt_zfp {

namespace {

constexpr int64_t kMaxPadded = (int64_t(1) << 31) - 1;  // Rule 6: cuZFP indexes with 32-bit ints

struct Geometry {
  zfp_type type;
  int ndim;
  size_t n[3];  // zfp order: n[0] = nx (fastest), n[1] = ny, n[2] = nz
  uint64_t blocks;
  double rate;
  unsigned bits;  // bits per block
  uint64_t bytes; // stream bytes: blocks * bits rounded up to 64-bit words (Rule 1)
};

zfp_type to_zfp_type(at::ScalarType t) {
  TORCH_CHECK(t == at::kFloat || t == at::kDouble,
              "torchckpt: zfp compresses float32 or float64 tensors, got ", t, "; cast the tensor first.");
  return t == at::kFloat ? zfp_type_float : zfp_type_double;
}

struct StreamDeleter {
  void operator()(zfp_stream* z) const { zfp_stream_close(z); }
};
struct FieldDeleter {
  void operator()(zfp_field* f) const { zfp_field_free(f); }
};
struct BitDeleter {
  void operator()(bitstream* b) const { stream_close(b); }
};
using StreamPtr = std::unique_ptr<zfp_stream, StreamDeleter>;
using FieldPtr = std::unique_ptr<zfp_field, FieldDeleter>;
using BitPtr = std::unique_ptr<bitstream, BitDeleter>;

// The stream's rate as zfp sets it: bits per block = max(floor(4^d * rate + 0.5), 9 | 12), not
// word aligned (Rule 1). Returns the zfp_stream with no bit stream attached.
StreamPtr make_stream(const Geometry& g) {
  StreamPtr z(zfp_stream_open(nullptr));
  TORCH_CHECK(z, "torchckpt: zfp_stream_open failed (out of memory?)");
  zfp_stream_set_rate(z.get(), g.rate, g.type, static_cast<unsigned>(g.ndim), zfp_false);
  return z;
}

Geometry geometry(at::IntArrayRef dims, at::ScalarType dtype, double rate) {
  TORCH_CHECK(dims.size() >= 1 && dims.size() <= 3,
              "torchckpt: a zfp field has 1 to 3 dimensions, got ", dims.size());
  TORCH_CHECK(rate > 0 && rate <= 64, "torchckpt: zfp rate must be in (0, 64] bits per value, got ", rate);
  Geometry g{};
  g.type = to_zfp_type(dtype);
  g.ndim = static_cast<int>(dims.size());
  int64_t padded = 1;
  g.blocks = 1;
  for (int i = 0; i < g.ndim; ++i) {
    const int64_t d = dims[g.ndim - 1 - i];
    TORCH_CHECK(d >= 1, "torchckpt: zfp field sizes must be >= 1, got ", dims);
    g.n[i] = static_cast<size_t>(d);
    const int64_t p = (d + 3) / 4 * 4;
    TORCH_CHECK(p <= kMaxPadded && padded <= kMaxPadded / p,
                "torchckpt: a zfp field holds at most 2**31 - 1 values once padded to multiples of 4; got ", dims,
                ". Split the tensor and compress the parts.");
    padded *= p;
    g.blocks *= static_cast<uint64_t>(p / 4);
  }
  g.rate = rate;
  StreamPtr z = make_stream(g);
  unsigned minbits = 0, maxprec = 0;
  int minexp = 0;
  zfp_stream_params(z.get(), &minbits, &g.bits, &maxprec, &minexp);
  TORCH_CHECK(zfp_stream_compression_mode(z.get()) == zfp_mode_fixed_rate && minbits == g.bits,
              "torchckpt: internal error: zfp did not accept rate ", rate, ". Please report this bug.");
  g.bytes = (g.blocks * g.bits + 63) / 64 * 8;
  return g;
}

FieldPtr make_field(const Geometry& g, void* ptr) {
  zfp_field* f = nullptr;
  if (g.ndim == 1) f = zfp_field_1d(ptr, g.type, g.n[0]);
  else if (g.ndim == 2) f = zfp_field_2d(ptr, g.type, g.n[0], g.n[1]);
  else f = zfp_field_3d(ptr, g.type, g.n[0], g.n[1], g.n[2]);
  TORCH_CHECK(f, "torchckpt: zfp_field creation failed");
  return FieldPtr(f);
}

void check_buffer(const at::Tensor& buf, const Geometry& g, const at::Device& dev, const char* what) {
  TORCH_CHECK(buf.scalar_type() == at::kByte && buf.is_contiguous() && buf.dim() == 1,
              "torchckpt: zfp ", what, " must be a contiguous 1-d uint8 tensor");
  TORCH_CHECK(buf.device() == dev, "torchckpt: zfp ", what, " is on ", buf.device(), ", the field on ", dev);
  // Rule 1: the stream plus one zero 64-bit word that cuZFP's decoder may read past the end.
  TORCH_CHECK(static_cast<uint64_t>(buf.numel()) >= g.bytes + 8, "torchckpt: zfp ", what, " holds ", buf.numel(),
              " bytes, the stream needs ", g.bytes + 8);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(buf.data_ptr()) % 8 == 0,
              "torchckpt: zfp ", what, " must be 8-byte aligned (a fresh tensor, not a slice)");
}

void check_field(const at::Tensor& t, const Geometry& g, const char* what) {
  TORCH_CHECK(t.is_contiguous(), "torchckpt: zfp ", what, " must be contiguous");
  int64_t n = 1;
  for (int i = 0; i < g.ndim; ++i) n *= static_cast<int64_t>(g.n[i]);
  TORCH_CHECK(t.numel() == n, "torchckpt: zfp ", what, " has ", t.numel(), " elements, the field ", n);
}

#ifdef TORCHCKPT_ZFP_CUDA
// Rule 4: cuZFP 1.0.1 launches its memset and kernels on the legacy default stream (stream 0 in a
// file compiled without --default-stream per-thread). torch's side streams are non-blocking, so
// nothing orders them with it: make the legacy stream wait for `s` before, and `s` wait for the
// legacy stream after. Neither side blocks the host.
struct LegacyStreamOrder {
  cudaStream_t s;
  bool same;
  explicit LegacyStreamOrder(cudaStream_t s_) : s(s_), same(s_ == nullptr || s_ == cudaStreamLegacy) {
    if (!same) wait(cudaStreamLegacy, s);
  }
  void done() {
    if (!same) wait(s, cudaStreamLegacy);
  }
  static void wait(cudaStream_t waiter, cudaStream_t on) {
    cudaEvent_t ev;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(ev, on));
    C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, ev, 0));
    C10_CUDA_CHECK(cudaEventDestroy(ev));  // released once the wait has been satisfied
  }
};
#endif

size_t run(bool compress, const at::Tensor& field_t, const at::Tensor& buf, const Geometry& g) {
  StreamPtr z = make_stream(g);
  BitPtr bs(stream_open(buf.data_ptr(), static_cast<size_t>(g.bytes + 8)));
  TORCH_CHECK(bs, "torchckpt: zfp stream_open failed");
  zfp_stream_set_bit_stream(z.get(), bs.get());
  zfp_stream_rewind(z.get());
  FieldPtr f = make_field(g, field_t.data_ptr());
  size_t n = 0;
  if (field_t.is_cuda()) {
#ifdef TORCHCKPT_ZFP_CUDA
    TORCH_CHECK(zfp_stream_set_execution(z.get(), zfp_exec_cuda),
                "torchckpt: this zfp build has no CUDA execution policy");
    c10::cuda::CUDAGuard guard(field_t.device());
    C10_CUDA_CHECK(cudaGetLastError());  // do not blame cuZFP for an earlier error
    LegacyStreamOrder order(c10::cuda::getCurrentCUDAStream(field_t.device().index()).stream());
    n = compress ? zfp_compress(z.get(), f.get()) : zfp_decompress(z.get(), f.get());
    C10_CUDA_CHECK(cudaGetLastError());
    order.done();
#else
    TORCH_CHECK(false, "torchckpt: torchckpt._zfp was built without CUDA (no toolkit at build time); "
                "rebuild with a CUDA toolkit present, or compress CPU tensors.");
#endif
  } else {
    TORCH_CHECK(zfp_stream_set_execution(z.get(), zfp_exec_serial), "torchckpt: zfp serial execution unavailable");
    n = compress ? zfp_compress(z.get(), f.get()) : zfp_decompress(z.get(), f.get());
  }
  TORCH_CHECK(n != 0, "torchckpt: zfp_", compress ? "compress" : "decompress",
              " failed (unsupported mode for this execution policy?)");
  // cuZFP's 3-d size floors a partial last word; the stream is still the same bits (Rule 1).
  TORCH_CHECK(n <= g.bytes && n + 8 > g.bytes, "torchckpt: internal error: zfp reported ", n,
              " stream bytes, expected ", g.bytes, ". Please report this bug.");
  return n;
}

}  // namespace

std::tuple<int64_t, int64_t> zfp_stream_bytes(at::IntArrayRef dims, at::ScalarType dtype, double rate) {
  Geometry g = geometry(dims, dtype, rate);
  return {static_cast<int64_t>(g.bits), static_cast<int64_t>(g.bytes)};
}

void zfp_compress_op(const at::Tensor& x, at::IntArrayRef dims, double rate, at::Tensor out) {
  Geometry g = geometry(dims, x.scalar_type(), rate);
  check_field(x, g, "input");
  check_buffer(out, g, x.device(), "output buffer");
  run(true, x, out, g);
}

void zfp_decompress_op(const at::Tensor& data, at::IntArrayRef dims, double rate, at::Tensor out) {
  Geometry g = geometry(dims, out.scalar_type(), rate);
  check_field(out, g, "output");
  check_buffer(data, g, out.device(), "compressed buffer");
  run(false, out, data, g);
}

bool zfp_has_cuda() {
#ifdef TORCHCKPT_ZFP_CUDA
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(torchckpt, m) {
  m.def("zfp_has_cuda() -> bool", &zfp_has_cuda);
  m.def("zfp_stream_bytes(int[] dims, ScalarType dtype, float rate) -> (int, int)", &zfp_stream_bytes);
  m.def("zfp_compress(Tensor x, int[] dims, float rate, Tensor(a!) out) -> ()");
  m.def("zfp_decompress(Tensor data, int[] dims, float rate, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(torchckpt, CPU, m) {
  m.impl("zfp_compress", &zfp_compress_op);
  m.impl("zfp_decompress", &zfp_decompress_op);
}

#ifdef TORCHCKPT_ZFP_CUDA
TORCH_LIBRARY_IMPL(torchckpt, CUDA, m) {
  m.impl("zfp_compress", &zfp_compress_op);
  m.impl("zfp_decompress", &zfp_decompress_op);
}
#endif

}  // namespace torchckpt_zfp

// An importable module so that `import torchckpt._zfp` loads the library and registers the ops.
#include <Python.h>
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_zfp", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__zfp(void) { return PyModule_Create(&module); }
