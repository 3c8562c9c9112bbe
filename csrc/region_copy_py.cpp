// The extension's Python module: region copies straight from Python buffers.
//
//   copy_regions(pairs, streaming) -> None
//
// `pairs` is a sequence of (dst, src) objects with the buffer protocol (numpy
// arrays, memoryviews), each C-contiguous, dst writable, both the same number
// of bytes. Buffers are taken with the GIL held; the copies (kvp_copy_regions)
// run with it released, so several threads copy at once. Raises ValueError or
// BufferError before any byte is copied when a pair does not qualify.
//
// The torch custom ops of this extension are registered in bindings.cpp.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <vector>

#include "region_copy_cpu.h"

namespace py = pybind11;

namespace {

class HeldBuffers {
 public:
  explicit HeldBuffers(size_t capacity) { views_.reserve(capacity); }
  ~HeldBuffers() {
    for (Py_buffer& v : views_) PyBuffer_Release(&v);
  }
  HeldBuffers(const HeldBuffers&) = delete;
  HeldBuffers& operator=(const HeldBuffers&) = delete;

  // Takes obj's buffer (C-contiguous; writable if asked); throws with the Python error set.
  const Py_buffer& take(PyObject* obj, bool writable) {
    views_.emplace_back();
    if (PyObject_GetBuffer(obj, &views_.back(), writable ? PyBUF_CONTIG : PyBUF_CONTIG_RO) != 0) {
      views_.pop_back();
      throw py::error_already_set();
    }
    return views_.back();
  }

 private:
  std::vector<Py_buffer> views_;
};

void copy_regions(const py::sequence& pairs, bool streaming) {
  const size_t n = py::len(pairs);
  HeldBuffers held(2 * n);
  std::vector<KvpRegion> regions(n);
  for (size_t i = 0; i < n; ++i) {
    py::object pair = pairs[i];
    PyObject* p = pair.ptr();
    if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2) {
      throw py::value_error("kvpack copy_regions: every item must be a (dst, src) tuple");
    }
    const Py_buffer& dst = held.take(PyTuple_GET_ITEM(p, 0), true);
    const Py_buffer& src = held.take(PyTuple_GET_ITEM(p, 1), false);
    if (dst.len != src.len) {
      throw py::value_error("kvpack copy_regions: pair " + std::to_string(i) + " has " + std::to_string(dst.len) +
                            " destination bytes and " + std::to_string(src.len) + " source bytes");
    }
    regions[i] = KvpRegion{static_cast<uint8_t*>(dst.buf), static_cast<const uint8_t*>(src.buf),
                           static_cast<int64_t>(dst.len)};
  }
  py::gil_scoped_release nogil;
  kvp_copy_regions(regions.data(), static_cast<int64_t>(n), streaming ? 1 : 0);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvpack's native kernels (the block-copy ops are torch.ops.kvpack.*)";
  m.def("copy_regions", &copy_regions, py::arg("pairs"), py::arg("streaming"),
        "Copy each (dst, src) buffer pair, GIL released; streaming: non-temporal stores for long regions.");
}
