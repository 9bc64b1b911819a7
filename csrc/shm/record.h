// A tensor or array on an arena block as one flat record (Note [Lean tensor records]).
//
// Note [Lean tensor records]
// The common message, one CPU tensor on an arena block, used to cross as a pickle: the
// general pickler, a reduce function, a handle tuple, global names, and on the receiver an
// unpickler calling back into Python for each of them: about 17 us of the ~45 us a 4 KB
// hand-off took. Such a tensor now crosses as one queue frame of tag TAG_RECORD holding
// this record, built and read in one C++ call each:
//
//   RecordHead (80 bytes, little-endian, fixed)                      then, packed:
//   magic version kind flags ndim dtype | handle: named segment_id    int64 sizes[ndim]
//   secret segment_size index generation owner_pid location_len |     int64 strides[ndim]
//   block offset, storage nbytes, storage_offset (elements)           char location[len]
//
// A record carries one counted reference, exactly as the handle it contains does (Note
// [Block lifetime]): the receiver takes it over (attach) or gives it back (release), and a
// frame nobody will take is released by release_frame. The reader trusts nothing in it:
// lengths, ndim and the location are checked before any use; the dtype code and shape are
// checked again by torch/numpy when the view is made: the view is made over the block's
// buffer, whose length is the block's capacity, so torch.frombuffer, set_ and numpy refuse an
// extent past it. Which tensors take records: Note [Which tensors take records] in
// torch_mp_ext/sharing/records.py.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shm/registry.h"

namespace torch_mp_ext {

constexpr uint32_t RECORD_MAGIC = 0x544d5852;  // "RXMT"
constexpr uint8_t RECORD_VERSION = 1;
constexpr uint8_t RECORD_MAX_NDIM = 64;
constexpr uint8_t RECORD_KIND_TENSOR = 0;
constexpr uint8_t RECORD_KIND_ARRAY = 1;

struct Record {
  uint8_t kind = RECORD_KIND_TENSOR;
  uint8_t flags = 0;    ///< the caller's bits (requires_grad, ...), carried as they are
  uint32_t dtype = 0;   ///< the caller's dtype code
  Handle handle;
  uint64_t offset = 0;  ///< where the storage starts in the block
  uint64_t nbytes = 0;  ///< the storage's bytes
  int64_t storage_offset = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
};

/// The bytes of `r`.
std::string encode_record(const Record& r);
/// Parses a record from a peer; throws CorruptSegmentError naming what is wrong.
Record decode_record(const char* data, size_t size);

}  // namespace torch_mp_ext
