// Creating, opening and mapping shared-memory segments (Note [Segment layout]).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "shm/layout.h"

namespace torch_mp_ext {

/// How anonymous (file_descriptor strategy) segments are made. memfd is not bounded by the
/// size of /dev/shm (Docker's 64 MB default); shm_open + immediate unlink is what torch does.
enum class AnonymousBackend { Memfd, ShmUnlinked };
void set_anonymous_backend(AnonymousBackend backend);
AnonymousBackend anonymous_backend();

struct SegmentSpec {
  SegmentKind kind = SegmentKind::Arena;
  uint64_t block_size = 0;
  uint32_t nblocks = 1;
  bool named = false;
  uint32_t flags = 0;  ///< FLAG_FREE_ON_ZERO / FLAG_UNLINK_ON_ZERO
  /// Bytes of the data area whose pages are reserved now; 0: all. The rest is sparse: its
  /// user reserves pages before touching them (Note [Ring growth] in queue/ring.h).
  uint64_t reserve_bytes = 0;
};

/// The fix to suggest when `size` bytes of shared memory could not be reserved (names the
/// bytes, what is free in /dev/shm, and Docker's --shm-size).
std::string no_space_message(size_t size, bool in_dev_shm);

/// Bytes a segment of this spec occupies (header, slot table, page-aligned data).
size_t segment_size_for(const SegmentSpec& spec, size_t* data_offset = nullptr);

/// The geometry of a segment, copied out of its header once, when it is mapped and validated
/// (Note [Geometry snapshot]).
struct SegmentGeometry {
  uint64_t id = 0;
  SegmentKind kind = SegmentKind::Arena;
  uint64_t block_size = 0;
  uint64_t data_offset = 0;
  uint64_t masks_offset = 0;  ///< 0: no HolderMask table
  uint32_t nblocks = 0;
};

/// Note [Geometry snapshot]
/// Every process that maps a segment can write its header, so a crashed, buggy or hostile peer
/// can change `nblocks`, `block_size` or `data_offset` after this process validated them. The
/// process-local Mapping therefore copies the geometry once, when it validates the header
/// (every sum and product overflow-checked), and never re-reads it: every index is checked
/// against the copy, every address computed from it, so a rewritten header cannot move this
/// process's reads or writes outside its own mapping. Values that change at run time (the free
/// stack, holder slots) are bounds-checked where they are read (CorruptSegmentError).

/// One mapping of one segment in this process. Owns the mmap (and the fd, when kept).
/// Not thread-safe by itself: the SegmentTable's mutex guards the mutable fields.
class Mapping {
 public:
  Mapping(char* base, size_t size, UniqueFd fd, std::string name, bool owned,
          const SegmentGeometry& geometry);
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();

  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base_); }
  BlockSlot* slots() const { return slots_of(header()); }
  /// The HolderMask table (arena segments), nullptr if none.
  HolderMask* masks() const {
    if (geo_.masks_offset == 0) return nullptr;
    return reinterpret_cast<HolderMask*>(base_ + geo_.masks_offset);
  }
  uint64_t id() const { return geo_.id; }
  SegmentKind kind() const { return geo_.kind; }
  uint32_t nblocks() const { return geo_.nblocks; }
  uint64_t block_size() const { return geo_.block_size; }
  char* base() const { return base_; }
  size_t size() const { return size_; }
  char* data_begin() const { return base_ + geo_.data_offset; }
  char* data_end() const { return data_begin() + block_size() * nblocks(); }
  char* block_data(uint32_t i) const { return data_begin() + block_size() * i; }
  /// Pops a free block (the owner only), NO_BLOCK if none; CorruptSegmentError if the shared
  /// free stack names a block outside this segment.
  uint32_t pop_free();
  /// "memfd segment <id>" or "/dev/shm/<name>": for error messages.
  std::string describe() const;
  const std::string& name() const { return name_; }  ///< "" for anonymous segments
  bool named() const { return !name_.empty(); }
  int fd() const { return fd_.get(); }
  void close_fd() { fd_.reset(); }

  bool owned = false;     ///< created by this process: its allocator may hand out blocks
  int holder_index = -1;  ///< this process's slot in the holder table, -1 if unregistered
  int64_t local_refs = 0; ///< live BlockRefs of this process on this segment
  /// Live BlockRefs of this process per block; they share one counted reference.
  std::vector<uint32_t> local_counts;
  int idle_ticks = 0;  ///< owner: expiry ticks this named segment was fully free (arena.h)

  /// Registers this process in the holder table (Note [Holder table]); idempotent.
  void register_holder();
  /// Leaves the holder table.
  void deregister_holder();

 private:
  char* base_;
  size_t size_;
  UniqueFd fd_;
  std::string name_;
  SegmentGeometry geo_;
};

/// Creates, sizes (posix_fallocate: a full /dev/shm fails here, never later with SIGBUS), maps
/// and initialises a segment. Anonymous segments keep their fd (it is what receivers get);
/// named ones close it. Partial work is rolled back before an error is thrown.
std::shared_ptr<Mapping> create_segment(const SegmentSpec& spec);

/// Maps a segment from a received fd and validates it; the fd is closed after mapping.
/// `expected_size` (0: unknown) is checked before anything is mapped.
std::shared_ptr<Mapping> map_segment_fd(UniqueFd fd, uint64_t expected_id,
                                        uint64_t expected_size = 0);

/// Opens a named segment (file_system strategy) and validates it.
std::shared_ptr<Mapping> open_named_segment(const std::string& name, uint64_t expected_id,
                                            uint64_t expected_size = 0);

/// shm_unlink that tolerates ENOENT (someone else won the race); true if this call removed it.
bool unlink_name(const std::string& name);


}  // namespace torch_mp_ext
