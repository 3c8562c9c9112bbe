// The extension's Python module: region copies and object-file writes straight
// from Python buffers.
//
//   copy_regions(pairs, streaming) -> None
//   write_objects(root_fd, temp_dir_fd, objects, fsync) -> list[tuple[int, int]]
//   remove_objects(root_fd, files, folders) -> tuple[list[int], list[int]]
//   read_objects(root_fd, objects, digest_from=-1) -> list[tuple[int, int, int, int]]
//   checksums(payloads) -> list[int]
//
// `pairs` is a sequence of (dst, src) objects with the buffer protocol (numpy
// arrays, memoryviews), each C-contiguous, dst writable, both the same number
// of bytes. Buffers are taken with the GIL held; the copies (kvp_copy_regions)
// run with it released, so several threads copy at once. Raises ValueError or
// BufferError before any byte is copied when a pair does not qualify.
//
// `objects` is a sequence of (leaf, temp, final, parts): three bytes (a relative
// folder path, two file names) and a sequence of buffers, written in order as one
// file (kvp_write_objects; a missing leaf folder made first with make_leaves).
// Everything is taken with the GIL held, then every file of the batch is written
// with it released once; the result is one (errno, temp_removed) per object,
// errno 0 for a written object.
//
// `files` is a sequence of (leaf, name) bytes and `folders` of (parent, name,
// chain_start): the object files to unlink, then the folders to remove while
// empty (kvp_remove_objects), all with the GIL released once; the result is one
// errno per file (0 removed) and one 0/1 per folder (1 removed).
//
// `objects` (read) is a sequence of (path, parts): a relative file path (bytes)
// and a sequence of writable buffers (the header page, then the payload's
// destination). Everything is taken with the GIL held, then every file is read
// with it released once (kvp_read_objects); the result is one (errno, size, got,
// digest) per object: errno 0 for an opened regular file, got the bytes read (-1
// when its size was not the parts' total and nothing was read), digest the
// xxh3_64 of parts[digest_from:] of a whole read when digest_from >= 0 (else 0).
//
// `payloads` (checksums) is a sequence of sequences of buffers: each object's
// parts in order. Every buffer is taken with the GIL held, then every digest is
// computed with it released once (kvp_xxh3_many: xxh3_64, seed 0, as Python's
// xxhash gives); one int per object.
//
// The torch custom ops of this extension are registered in bindings.cpp.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <vector>

#include "checksum_cpu.h"
#include "object_read_cpu.h"
#include "object_write_cpu.h"
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

// The NUL-terminated text of a bytes object (no NUL inside: a path never has one).
const char* path_bytes(PyObject* obj, const char* what) {
  if (!PyBytes_Check(obj)) throw py::type_error(std::string("kvpack object files: ") + what + " must be bytes");
  if (static_cast<size_t>(PyBytes_GET_SIZE(obj)) != strlen(PyBytes_AS_STRING(obj))) {
    throw py::value_error(std::string("kvpack object files: ") + what + " has a NUL byte");
  }
  return PyBytes_AS_STRING(obj);
}

py::list write_objects(int root_fd, int temp_dir_fd, const py::sequence& objects, bool fsync, bool make_leaves) {
  const size_t n = py::len(objects);
  std::vector<py::object> keep;  // the items (and so their bytes) stay alive until the writes end
  keep.reserve(2 * n);
  std::vector<KvpObjectWrite> objs(n);
  std::vector<std::vector<struct iovec>> iovs(n);
  HeldBuffers held(4 * n);
  for (size_t i = 0; i < n; ++i) {
    keep.push_back(objects[i]);
    PyObject* item = keep.back().ptr();
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
      throw py::value_error("kvpack write_objects: every item must be a (leaf, temp, final, parts) tuple");
    }
    py::sequence parts = py::reinterpret_borrow<py::sequence>(PyTuple_GET_ITEM(item, 3));
    keep.push_back(parts);
    const size_t np = py::len(parts);
    iovs[i].reserve(np);
    for (size_t j = 0; j < np; ++j) {
      py::object part = parts[j];
      const Py_buffer& view = held.take(part.ptr(), false);
      iovs[i].push_back(iovec{view.buf, static_cast<size_t>(view.len)});
    }
    objs[i] = KvpObjectWrite{path_bytes(PyTuple_GET_ITEM(item, 0), "leaf"),
                             path_bytes(PyTuple_GET_ITEM(item, 1), "temp"),
                             path_bytes(PyTuple_GET_ITEM(item, 2), "final"),
                             iovs[i].data(),
                             static_cast<int>(np),
                             0,
                             0};
  }
  {
    py::gil_scoped_release nogil;
    kvp_write_objects(root_fd, temp_dir_fd, objs.data(), static_cast<int64_t>(n), fsync ? 1 : 0, make_leaves ? 1 : 0);
  }
  py::list out(n);
  for (size_t i = 0; i < n; ++i) out[i] = py::make_tuple(objs[i].err, objs[i].temp_removed);
  return out;
}

// Item `at` of a tuple of bytes, checked as `path_bytes` does.
const char* tuple_path(PyObject* item, Py_ssize_t at, const char* what) {
  return path_bytes(PyTuple_GET_ITEM(item, at), what);
}

py::tuple remove_objects(int root_fd, const py::sequence& files, const py::sequence& folders) {
  const size_t n = py::len(files);
  const size_t nf = py::len(folders);
  std::vector<py::object> keep;  // the items (and so their bytes) stay alive until the removals end
  keep.reserve(n + nf);
  std::vector<KvpObjectRemove> objs(n);
  for (size_t i = 0; i < n; ++i) {
    keep.push_back(files[i]);
    PyObject* item = keep.back().ptr();
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
      throw py::value_error("kvpack remove_objects: every file must be a (leaf, name) tuple");
    }
    objs[i] = KvpObjectRemove{tuple_path(item, 0, "leaf"), tuple_path(item, 1, "name"), 0};
  }
  std::vector<KvpFolderRemove> dirs(nf);
  for (size_t i = 0; i < nf; ++i) {
    keep.push_back(folders[i]);
    PyObject* item = keep.back().ptr();
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
      throw py::value_error("kvpack remove_objects: every folder must be a (parent, name, chain_start) tuple");
    }
    const int start = PyObject_IsTrue(PyTuple_GET_ITEM(item, 2));
    if (start < 0) throw py::error_already_set();
    dirs[i] = KvpFolderRemove{tuple_path(item, 0, "parent"), tuple_path(item, 1, "name"), start, 0};
  }
  {
    py::gil_scoped_release nogil;
    kvp_remove_objects(root_fd, objs.data(), static_cast<int64_t>(n), dirs.data(), static_cast<int64_t>(nf));
  }
  py::list errs(n);
  for (size_t i = 0; i < n; ++i) errs[i] = objs[i].err;
  py::list removed(nf);
  for (size_t i = 0; i < nf; ++i) removed[i] = dirs[i].removed;
  return py::make_tuple(errs, removed);
}

py::list read_objects(int root_fd, const py::sequence& objects, int digest_from) {
  const size_t n = py::len(objects);
  std::vector<py::object> keep;  // the items (and so their paths) stay alive until the reads end
  keep.reserve(2 * n);
  std::vector<KvpObjectRead> objs(n);
  std::vector<std::vector<struct iovec>> iovs(n);
  HeldBuffers held(4 * n);
  for (size_t i = 0; i < n; ++i) {
    keep.push_back(objects[i]);
    PyObject* item = keep.back().ptr();
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
      throw py::value_error("kvpack read_objects: every item must be a (path, parts) tuple");
    }
    py::sequence parts = py::reinterpret_borrow<py::sequence>(PyTuple_GET_ITEM(item, 1));
    keep.push_back(parts);
    const size_t np = py::len(parts);
    iovs[i].reserve(np);
    for (size_t j = 0; j < np; ++j) {
      py::object part = parts[j];
      const Py_buffer& view = held.take(part.ptr(), true);
      iovs[i].push_back(iovec{view.buf, static_cast<size_t>(view.len)});
    }
    objs[i] = KvpObjectRead{tuple_path(item, 0, "path"), iovs[i].data(), static_cast<int>(np), digest_from, 0, -1, -1, 0};
  }
  {
    py::gil_scoped_release nogil;
    kvp_read_objects(root_fd, objs.data(), static_cast<int64_t>(n));
  }
  py::list out(n);
  for (size_t i = 0; i < n; ++i) out[i] = py::make_tuple(objs[i].err, objs[i].size, objs[i].got, objs[i].digest);
  return out;
}

py::list checksums(const py::sequence& payloads) {
  const size_t n = py::len(payloads);
  std::vector<py::object> keep;  // each payload's sequence stays alive until the digests end
  keep.reserve(n);
  std::vector<struct iovec> parts;
  parts.reserve(n);
  std::vector<int64_t> first(n), count(n);
  HeldBuffers held(n);
  for (size_t i = 0; i < n; ++i) {
    keep.push_back(payloads[i]);
    py::sequence seq = py::reinterpret_borrow<py::sequence>(keep.back());
    const size_t np = py::len(seq);
    first[i] = static_cast<int64_t>(parts.size());
    count[i] = static_cast<int64_t>(np);
    for (size_t j = 0; j < np; ++j) {
      py::object part = seq[j];
      const Py_buffer& view = held.take(part.ptr(), false);
      parts.push_back(iovec{view.buf, static_cast<size_t>(view.len)});
    }
  }
  std::vector<uint64_t> out(n);
  {
    py::gil_scoped_release nogil;
    kvp_xxh3_many(parts.data(), first.data(), count.data(), static_cast<int64_t>(n), out.data());
  }
  py::list digests(n);
  for (size_t i = 0; i < n; ++i) digests[i] = py::int_(out[i]);
  return digests;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvpack's native kernels (the block-copy ops are torch.ops.kvpack.*)";
  m.def("copy_regions", &copy_regions, py::arg("pairs"), py::arg("streaming"),
        "Copy each (dst, src) buffer pair, GIL released; streaming: non-temporal stores for long regions.");
  m.def("write_objects", &write_objects, py::arg("root_fd"), py::arg("temp_dir_fd"), py::arg("objects"),
        py::arg("fsync"), py::arg("make_leaves") = false,
        "Write each (leaf, temp, final, parts) object file beneath root_fd (making a missing leaf folder "
        "when make_leaves), GIL released once; one (errno, temp_removed) per object.");
  m.def("remove_objects", &remove_objects, py::arg("root_fd"), py::arg("files"), py::arg("folders"),
        "Unlink each (leaf, name) file beneath root_fd, then rmdir each (parent, name, chain_start) folder while "
        "empty, GIL released once; (one errno per file, one 0/1 per folder).");
  m.def("read_objects", &read_objects, py::arg("root_fd"), py::arg("objects"), py::arg("digest_from") = -1,
        "Read each (path, parts) object file beneath root_fd into its parts when its size is theirs, hashing "
        "parts[digest_from:] of each whole read when digest_from >= 0, GIL released once; one (errno, size, got, "
        "digest) per object.");
  m.def("checksums", &checksums, py::arg("payloads"),
        "xxh3_64 of each payload's parts in order (Python xxhash's digest), the GIL released once.");
}
