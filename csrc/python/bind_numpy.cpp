// numpy's memory handler (NEP 49) over arena blocks (Note [Arrays born shared]).
//
// numpy's headers are not needed (the build takes setuptools and pybind11 only): the handler
// struct is numpy's version-1 layout, stable since numpy 1.22, and PyDataMem_SetHandler is
// slot 304 of numpy's C-API table (the `_ARRAY_API` capsule of numpy's multiarray module),
// where numpy's ABI keeps it.
#include <cstddef>
#include <cstdint>
#include <limits>

#include "python/bindings.h"
#include "shm/block_allocator.h"

namespace py = pybind11;

namespace torch_mp_ext::python {

namespace {

/// numpy's PyDataMemAllocator (ndarraytypes.h, version 1).
struct NpyAllocator {
  void* ctx;
  void* (*malloc)(void* ctx, size_t size);
  void* (*calloc)(void* ctx, size_t nelem, size_t elsize);
  void* (*realloc)(void* ctx, void* ptr, size_t new_size);
  void (*free)(void* ctx, void* ptr, size_t size);
};

/// numpy's PyDataMem_Handler.
struct NpyHandler {
  char name[127];
  uint8_t version;
  NpyAllocator allocator;
};
static_assert(offsetof(NpyHandler, allocator) == 128, "numpy's PyDataMem_Handler layout");

/// numpy's C-API slots used here (numpy/__multiarray_api.h, NPY_1_22_API_VERSION).
constexpr size_t NPY_SET_HANDLER_SLOT = 304;
constexpr size_t NPY_DEFAULT_HANDLER_SLOT = 306;
constexpr const char* NPY_HANDLER_CAPSULE = "mem_handler";

void* handler_malloc(void*, size_t size) {
  return BlockAllocator::instance().allocate(size, false);
}

void* handler_calloc(void*, size_t nelem, size_t elsize) {
  if (elsize != 0 && nelem > std::numeric_limits<size_t>::max() / elsize) return nullptr;
  return BlockAllocator::instance().allocate(nelem * elsize, true);
}

void* handler_realloc(void*, void* ptr, size_t new_size) {
  return BlockAllocator::instance().reallocate(ptr, new_size);
}

void handler_free(void*, void* ptr, size_t) { BlockAllocator::instance().release(ptr); }

NpyHandler g_handler = {"torch_mp_ext", 1,
                        {nullptr, handler_malloc, handler_calloc, handler_realloc, handler_free}};

using SetHandler = PyObject* (*)(PyObject*);

void** api_table(const py::capsule& array_api) {
  void* table = PyCapsule_GetPointer(array_api.ptr(), nullptr);
  if (table == nullptr) throw py::error_already_set();
  return static_cast<void**>(table);
}

/// Calls PyDataMem_SetHandler(handler) and drops the previous handler it returns.
void set_handler(const py::capsule& array_api, PyObject* handler) {
  auto set = reinterpret_cast<SetHandler>(api_table(array_api)[NPY_SET_HANDLER_SLOT]);
  PyObject* previous = set(handler);
  if (previous == nullptr) throw py::error_already_set();
  Py_DECREF(previous);
}

}  // namespace

void init_numpy(py::module_& m) {
  m.def(
      "set_numpy_allocator",
      [](const py::capsule& array_api, bool arena, size_t min_bytes) {
        if (!arena) {
          auto* slot = static_cast<PyObject**>(api_table(array_api)[NPY_DEFAULT_HANDLER_SLOT]);
          set_handler(array_api, *slot);
          return;
        }
        BlockAllocator::instance().set_min_bytes(min_bytes);
        py::capsule handler(static_cast<void*>(&g_handler), NPY_HANDLER_CAPSULE);
        set_handler(array_api, handler.ptr());
      },
      py::arg("array_api"), py::arg("arena"), py::arg("min_bytes") = 64 * 1024,
      R"pbdoc(Sets numpy's memory handler for the calling context (thread): arena blocks
      for arrays of at least `min_bytes` (arena=True) or numpy's default (arena=False).
      `array_api` is numpy's `_ARRAY_API` capsule (numpy >= 1.22).)pbdoc");
  m.def("numpy_allocator_blocks", [] { return BlockAllocator::instance().live_blocks(); },
        R"pbdoc(Blocks the numpy handler has handed out and numpy has not freed yet.)pbdoc");
}

}  // namespace torch_mp_ext::python
