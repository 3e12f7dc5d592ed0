// torchckpt native ops, bound with TORCH_LIBRARY (schemas here, Python wrappers in torchckpt/_ext.py).
//
// touch_pages: write one byte per page of a host buffer so that the kernel backs it with
// memory now. A device-to-host copy into untouched pageable memory runs at about a tenth of
// the speed of one into touched memory (DESIGN.md: 1.1-2.4 GB/s against 13.3 GB/s on an
// H100 machine), so the host pool touches pageable fallback blocks before copying into them.
// Runs without the GIL, split over a few threads for large buffers.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace torchckpt {

int64_t touch_pages(at::Tensor buf, int64_t page_bytes) {
  TORCH_CHECK(buf.device().is_cpu(), "torchckpt: touch_pages expects a CPU tensor, got ", buf.device());
  TORCH_CHECK(buf.is_contiguous(), "torchckpt: touch_pages expects a contiguous tensor");
  TORCH_CHECK(page_bytes > 0 && (page_bytes & (page_bytes - 1)) == 0,
              "torchckpt: touch_pages page_bytes must be a positive power of two, got ", page_bytes);
  auto* base = static_cast<volatile uint8_t*>(buf.data_ptr());
  const int64_t nbytes = buf.numel() * buf.element_size();
  if (nbytes == 0) return 0;
  const int64_t pages = (nbytes + page_bytes - 1) / page_bytes;
  const int64_t per_thread = int64_t(64) << 20;  // one thread per 64 MiB, at most 8
  const int64_t nthreads = std::clamp<int64_t>(nbytes / per_thread, 1, 8);
  auto work = [&](int64_t t) {
    for (int64_t p = t; p < pages; p += nthreads) {
      base[p * page_bytes] = base[p * page_bytes];  // read-write keeps existing data intact
    }
  };
  if (nthreads == 1) {
    work(0);
  } else {
    std::vector<std::thread> threads;
    for (int64_t t = 0; t < nthreads; ++t) threads.emplace_back(work, t);
    for (auto& th : threads) th.join();
  }
  return pages;
}

TORCH_LIBRARY(torchckpt, m) {  // other csrc files add ops with TORCH_LIBRARY_FRAGMENT
  m.def("touch_pages(Tensor(a!) buf, int page_bytes) -> int");
}

TORCH_LIBRARY_IMPL(torchckpt, CPU, m) {
  m.impl("touch_pages", &touch_pages);
}

}  // namespace torchckpt

// An importable module so that `import torchckpt._C` loads the library and registers the ops.
#include <Python.h>
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
