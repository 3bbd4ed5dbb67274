// vllm.fs_io_C: batched block-file I/O for the file-system offload tier, with the GIL released
// for a whole batch. A plain CPython extension (no torch): it only moves bytes between files and
// Python buffers. The block-file format (header fields, checksum) stays in Python
// (vllm/v1/kv_offload/tiering/fs/block_file.py); this module writes a given header before each
// payload and hands back the header it read, so the format can change without touching C++.
//
//   batch_lookup(paths, size=-1) -> list[bool]
//   batch_store_block(tmp_paths, paths, headers, payloads, use_o_direct=True) -> None
//   batch_load_block(paths, headers, skip_offset, skip_bytes, payloads, use_o_direct=True)
//       -> list[bytes]
//
// A load compares the header it reads with the expected one, except bytes
// [skip_offset, skip_offset + skip_bytes) (a field only the writer knows, e.g. a checksum,
// returned for the caller to check), before any payload byte reaches the buffer.
// A failure raises OSError carrying ``num_succeeded`` (blocks of the batch done before the
// failing one) and ``bad_file`` (True when the file was of the wrong kind, size or header and
// was removed).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

#ifdef O_DIRECT
constexpr int kODirect = O_DIRECT;
#else
constexpr int kODirect = 0;
#endif
// Direct I/O needs buffer addresses, lengths and file offsets aligned to the logical block size;
// 4 KiB covers every common file system.
constexpr size_t kAlign = 4096;

bool aligned(const void* ptr, size_t len) {
  return reinterpret_cast<uintptr_t>(ptr) % kAlign == 0 && len % kAlign == 0;
}

// One block's outcome: 0, or the errno of the failure; bad_file marks a removed bad file.
struct Failure {
  int err = 0;
  bool bad_file = false;
};

// A page-aligned copy of a header, so a header can be written with direct I/O.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t len) : len_(len) {
    if (len_ && posix_memalign(&ptr_, kAlign, len_) != 0) ptr_ = nullptr;
  }
  ~AlignedBuffer() { free(ptr_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data() { return static_cast<char*>(ptr_); }
  bool ok() const { return len_ == 0 || ptr_ != nullptr; }

 private:
  void* ptr_ = nullptr;
  size_t len_;
};

int write_all(int fd, const char* data, size_t len) {
  while (len) {
    ssize_t n = write(fd, data, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;
    data += n;
    len -= static_cast<size_t>(n);
  }
  return 0;
}

// Bytes read before end of file or an error (errno in *err).
size_t read_all(int fd, char* data, size_t len, int* err) {
  size_t done = 0;
  *err = 0;
  while (done < len) {
    ssize_t n = read(fd, data + done, len - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      break;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

int write_file(const std::string& path, int extra_flags, const char* header, size_t header_len,
               const char* payload, size_t payload_len) {
  int fd = open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC | extra_flags, 0644);
  if (fd < 0) return errno;
  int err = write_all(fd, header, header_len);
  if (!err) err = write_all(fd, payload, payload_len);
  if (close(fd) != 0 && !err) err = errno;
  return err;
}

bool is_block_file(const std::string& path, long long size) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  return size < 0 || st.st_size == size;
}

// Writes header + payload to tmp_path, then renames it over path; a file of the full size
// already at path is kept (names are content hashes, so it holds these bytes).
Failure store_one(const std::string& tmp_path, const std::string& path, AlignedBuffer& header,
                  size_t header_len, const char* payload, size_t payload_len, bool use_o_direct) {
  Failure f;
  if (is_block_file(path, static_cast<long long>(header_len + payload_len))) return f;
  const bool direct =
      use_o_direct && kODirect && aligned(payload, payload_len) && header_len % kAlign == 0;
  f.err =
      write_file(tmp_path, direct ? kODirect : 0, header.data(), header_len, payload, payload_len);
  if (f.err == EINVAL && direct)  // the file system refuses direct I/O: buffered instead
    f.err = write_file(tmp_path, 0, header.data(), header_len, payload, payload_len);
  if (!f.err && rename(tmp_path.c_str(), path.c_str()) != 0) {
    // Some shared file systems refuse to replace a file another writer just published.
    f.err = errno == EEXIST ? 0 : errno;
    unlink(tmp_path.c_str());
  } else if (f.err) {
    unlink(tmp_path.c_str());
  }
  return f;
}

// Removes path only if it is still the regular file that was read (not a good file a
// concurrent store put in its place since: another inode, or a reused one changed later).
void remove_if_same(const std::string& path, const struct stat& read_st) {
  struct stat now;
  if (stat(path.c_str(), &now) == 0 && S_ISREG(now.st_mode) && now.st_dev == read_st.st_dev &&
      now.st_ino == read_st.st_ino && now.st_ctim.tv_sec == read_st.st_ctim.tv_sec &&
      now.st_ctim.tv_nsec == read_st.st_ctim.tv_nsec)
    unlink(path.c_str());
}

// The header a load expects: bytes other than [skip_offset, skip_end) must match.
struct ExpectedHeader {
  const char* bytes;
  size_t len, skip_offset, skip_end;
  bool matches(const char* got) const {
    return std::memcmp(got, bytes, skip_offset) == 0 &&
           std::memcmp(got + skip_end, bytes + skip_end, len - skip_end) == 0;
  }
};

Failure read_file(const std::string& path, int extra_flags, const ExpectedHeader& want,
                  char* header, char* payload, size_t payload_len) {
  const size_t header_len = want.len;
  Failure f;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | extra_flags);
  if (fd < 0) {
    f.err = errno;
    return f;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    f.err = errno;
  } else if (!S_ISREG(st.st_mode) || st.st_size != static_cast<off_t>(header_len + payload_len)) {
    // Stores are atomic, so a file of the wrong size is damage, not a write in progress.
    f.err = EIO;
    f.bad_file = S_ISREG(st.st_mode);
  } else {
    // A short read here means the file was truncated in place after the size check.
    int err = 0;
    if (read_all(fd, header, header_len, &err) != header_len && !err) err = EIO;
    if (!err && !want.matches(header)) {
      err = EIO;
      f.bad_file = true;
    }
    if (!err && read_all(fd, payload, payload_len, &err) != payload_len && !err) err = EIO;
    f.err = err;
  }
  close(fd);
  if (f.bad_file) remove_if_same(path, st);
  return f;
}

Failure load_one(const std::string& path, const ExpectedHeader& want, char* header, char* payload,
                 size_t payload_len, bool use_o_direct) {
  const bool direct =
      use_o_direct && kODirect && aligned(payload, payload_len) && want.len % kAlign == 0;
  Failure f = read_file(path, direct ? kODirect : 0, want, header, payload, payload_len);
  if (f.err == EINVAL && direct) f = read_file(path, 0, want, header, payload, payload_len);
  return f;
}

// ---- argument conversion (GIL held) ------------------------------------------------------

bool paths_from(PyObject* list, const char* arg, std::vector<std::string>* out) {
  if (!PyList_Check(list)) {
    PyErr_Format(PyExc_TypeError, "%s: expected a list of str, got %s", arg,
                 Py_TYPE(list)->tp_name);
    return false;
  }
  Py_ssize_t n = PyList_GET_SIZE(list);
  out->reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* item = PyList_GET_ITEM(list, i);
    if (!PyUnicode_Check(item)) {
      PyErr_Format(PyExc_TypeError, "%s[%zd]: expected str, got %s", arg, i,
                   Py_TYPE(item)->tp_name);
      return false;
    }
    PyObject* encoded = PyUnicode_EncodeFSDefault(item);
    if (encoded == nullptr) return false;
    out->emplace_back(PyBytes_AS_STRING(encoded), static_cast<size_t>(PyBytes_GET_SIZE(encoded)));
    Py_DECREF(encoded);
  }
  return true;
}

// Buffers of a list, held (and released by the destructor) while the GIL is released.
class Buffers {
 public:
  ~Buffers() {
    for (Py_buffer& b : views_) PyBuffer_Release(&b);
  }
  bool acquire(PyObject* list, const char* arg, bool writable, Py_ssize_t expected) {
    if (!PyList_Check(list)) {
      PyErr_Format(PyExc_TypeError, "%s: expected a list of buffers, got %s", arg,
                   Py_TYPE(list)->tp_name);
      return false;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n != expected) {
      PyErr_Format(PyExc_ValueError, "%s: expected %zd items, got %zd", arg, expected, n);
      return false;
    }
    views_.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; i++) {
      Py_buffer view;
      int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
      if (PyObject_GetBuffer(PyList_GET_ITEM(list, i), &view, flags) != 0) return false;
      views_.push_back(view);
    }
    return true;
  }
  char* data(size_t i) { return static_cast<char*>(views_[i].buf); }
  size_t len(size_t i) const { return static_cast<size_t>(views_[i].len); }

 private:
  std::vector<Py_buffer> views_;
};

PyObject* raise_failure(const Failure& f, const std::string& path, size_t index) {
  errno = f.err;
  PyObject* name = PyUnicode_DecodeFSDefault(path.c_str());
  PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
  Py_XDECREF(name);
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  PyObject* count = PyLong_FromSize_t(index);
  if (value != nullptr && count != nullptr) {
    PyObject_SetAttrString(value, "num_succeeded", count);
    PyObject_SetAttrString(value, "bad_file", f.bad_file ? Py_True : Py_False);
  }
  Py_XDECREF(count);
  PyErr_Restore(type, value, tb);
  return nullptr;
}

// ---- module functions ----------------------------------------------------------------------

PyObject* batch_lookup(PyObject*, PyObject* args) {
  PyObject* list;
  long long size = -1;
  if (!PyArg_ParseTuple(args, "O|L:batch_lookup", &list, &size)) return nullptr;
  std::vector<std::string> paths;
  if (!paths_from(list, "paths", &paths)) return nullptr;
  std::vector<char> found(paths.size());
  Py_BEGIN_ALLOW_THREADS;
  for (size_t i = 0; i < paths.size(); i++) found[i] = is_block_file(paths[i], size);
  Py_END_ALLOW_THREADS;
  PyObject* result = PyList_New(static_cast<Py_ssize_t>(paths.size()));
  if (result == nullptr) return nullptr;
  for (size_t i = 0; i < paths.size(); i++)
    PyList_SET_ITEM(result, static_cast<Py_ssize_t>(i), PyBool_FromLong(found[i]));
  return result;
}

PyObject* batch_store_block(PyObject*, PyObject* args) {
  PyObject *tmp_list, *path_list, *header_list, *payload_list;
  int use_o_direct = 1;
  if (!PyArg_ParseTuple(args, "OOOO|p:batch_store_block", &tmp_list, &path_list, &header_list,
                        &payload_list, &use_o_direct))
    return nullptr;
  std::vector<std::string> tmp_paths, paths;
  if (!paths_from(tmp_list, "tmp_paths", &tmp_paths) || !paths_from(path_list, "paths", &paths))
    return nullptr;
  const auto n = static_cast<Py_ssize_t>(paths.size());
  if (static_cast<Py_ssize_t>(tmp_paths.size()) != n)
    return PyErr_Format(PyExc_ValueError, "tmp_paths: expected %zd items, got %zd", n,
                        static_cast<Py_ssize_t>(tmp_paths.size()));
  Buffers headers, payloads;
  if (!headers.acquire(header_list, "headers", false, n) ||
      !payloads.acquire(payload_list, "payloads", false, n))
    return nullptr;
  Failure f;
  size_t i = 0;
  Py_BEGIN_ALLOW_THREADS;
  for (; i < paths.size(); i++) {
    AlignedBuffer header(headers.len(i));
    if (!header.ok()) {
      f.err = ENOMEM;
      break;
    }
    if (headers.len(i)) std::memcpy(header.data(), headers.data(i), headers.len(i));
    f = store_one(tmp_paths[i], paths[i], header, headers.len(i), payloads.data(i), payloads.len(i),
                  use_o_direct);
    if (f.err) break;
  }
  Py_END_ALLOW_THREADS;
  if (f.err) return raise_failure(f, paths[i], i);
  Py_RETURN_NONE;
}

PyObject* batch_load_block(PyObject*, PyObject* args) {
  PyObject *path_list, *header_list, *payload_list;
  Py_ssize_t skip_offset, skip_bytes;
  int use_o_direct = 1;
  if (!PyArg_ParseTuple(args, "OOnnO|p:batch_load_block", &path_list, &header_list, &skip_offset,
                        &skip_bytes, &payload_list, &use_o_direct))
    return nullptr;
  std::vector<std::string> paths;
  if (!paths_from(path_list, "paths", &paths)) return nullptr;
  const auto n = static_cast<Py_ssize_t>(paths.size());
  Buffers expected, payloads;
  if (!expected.acquire(header_list, "headers", false, n) ||
      !payloads.acquire(payload_list, "payloads", true, n))
    return nullptr;
  const size_t hlen = n ? expected.len(0) : 0;
  for (size_t j = 0; j < paths.size(); j++)
    if (expected.len(j) != hlen)
      return PyErr_Format(PyExc_ValueError, "headers[%zu]: expected %zu bytes, got %zu", j, hlen,
                          expected.len(j));
  if (n &&
      (skip_offset < 0 || skip_bytes < 0 || static_cast<size_t>(skip_offset + skip_bytes) > hlen))
    return PyErr_Format(PyExc_ValueError,
                        "skip_offset, skip_bytes: expected a range inside the %zu-byte header, "
                        "got %zd, %zd",
                        hlen, skip_offset, skip_bytes);
  AlignedBuffer headers(hlen * paths.size());
  if (!headers.ok()) return PyErr_NoMemory();
  Failure f;
  size_t i = 0;
  Py_BEGIN_ALLOW_THREADS;
  for (; i < paths.size(); i++) {
    const ExpectedHeader want{expected.data(i), hlen, static_cast<size_t>(skip_offset),
                              static_cast<size_t>(skip_offset + skip_bytes)};
    f = load_one(paths[i], want, headers.data() + i * hlen, payloads.data(i), payloads.len(i),
                 use_o_direct);
    if (f.err) break;
  }
  Py_END_ALLOW_THREADS;
  if (f.err) return raise_failure(f, paths[i], i);
  PyObject* result = PyList_New(static_cast<Py_ssize_t>(paths.size()));
  if (result == nullptr) return nullptr;
  for (size_t j = 0; j < paths.size(); j++) {
    PyObject* raw =
        PyBytes_FromStringAndSize(headers.data() + j * hlen, static_cast<Py_ssize_t>(hlen));
    if (raw == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyList_SET_ITEM(result, static_cast<Py_ssize_t>(j), raw);
  }
  return result;
}

PyMethodDef kMethods[] = {
    {"batch_lookup", batch_lookup, METH_VARARGS,
     "batch_lookup(paths, size=-1) -> list[bool]: whether each path is a regular file (of "
     "exactly size bytes, when size >= 0)."},
    {"batch_store_block", batch_store_block, METH_VARARGS,
     "batch_store_block(tmp_paths, paths, headers, payloads, use_o_direct=True): write "
     "headers[i] + payloads[i] to tmp_paths[i] and rename it to paths[i], unless a file of that "
     "size is there already. Stops at the first failure (OSError with num_succeeded)."},
    {"batch_load_block", batch_load_block, METH_VARARGS,
     "batch_load_block(paths, headers, skip_offset, skip_bytes, payloads, use_o_direct=True) "
     "-> list[bytes]: read each file's header (returned; it must equal headers[i] outside the "
     "skipped bytes) and the rest into payloads[i]. A file of the wrong size or header is "
     "removed (OSError with bad_file=True); stops at the first failure."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT,
                       "fs_io_C",
                       "Batched block-file I/O for the file-system KV offload tier.",
                       -1,
                       kMethods,
                       nullptr,
                       nullptr,
                       nullptr,
                       nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_fs_io_C(void) { return PyModule_Create(&kModule); }
