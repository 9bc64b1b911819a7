#include "shm/record.h"

#include <cstring>

#include "common/check.h"
#include "common/errors.h"

namespace torch_mp_ext {

namespace {

struct RecordHead {
  uint32_t magic;
  uint8_t version;
  uint8_t kind;
  uint8_t flags;
  uint8_t ndim;
  uint32_t dtype;
  uint8_t named;
  uint8_t pad[3];
  uint64_t segment_id;
  uint64_t secret;
  uint64_t segment_size;
  uint32_t index;
  uint32_t generation;
  int32_t owner_pid;
  uint32_t location_len;
  uint64_t offset;
  uint64_t nbytes;
  int64_t storage_offset;
};
static_assert(sizeof(RecordHead) == 80, "RecordHead is a wire format");

constexpr size_t MAX_LOCATION = 256;

[[noreturn]] void bad(const char* what, uint64_t value) {
  throw CorruptSegmentError(detail::str_cat(
      "a queue item that should hold a shared tensor record is malformed: ", what, " (", value,
      "); it was not written by this version of torch_mp_ext, or was overwritten"));
}

}  // namespace

std::string encode_record(const Record& r) {
  TMX_CHECK_VALUE(r.sizes.size() == r.strides.size() && r.sizes.size() <= RECORD_MAX_NDIM,
                  "a shared tensor record holds at most ", int{RECORD_MAX_NDIM},
                  " dimensions with one stride each, got ", r.sizes.size(), " sizes and ",
                  r.strides.size(), " strides");
  TMX_CHECK_VALUE(r.handle.location.size() <= MAX_LOCATION, "a block location of ",
                  r.handle.location.size(), " bytes is too long");
  RecordHead head{};
  head.magic = RECORD_MAGIC;
  head.version = RECORD_VERSION;
  head.kind = r.kind;
  head.flags = r.flags;
  head.ndim = static_cast<uint8_t>(r.sizes.size());
  head.dtype = r.dtype;
  head.named = r.handle.named ? 1 : 0;
  head.segment_id = r.handle.segment_id;
  head.secret = r.handle.secret;
  head.segment_size = r.handle.size;
  head.index = r.handle.index;
  head.generation = r.handle.generation;
  head.owner_pid = r.handle.owner_pid;
  head.location_len = static_cast<uint32_t>(r.handle.location.size());
  head.offset = r.offset;
  head.nbytes = r.nbytes;
  head.storage_offset = r.storage_offset;
  size_t dims = r.sizes.size() * sizeof(int64_t);
  std::string out(sizeof(head) + 2 * dims + r.handle.location.size(), '\0');
  char* at = out.data();
  std::memcpy(at, &head, sizeof(head));
  at += sizeof(head);
  if (dims > 0) {
    std::memcpy(at, r.sizes.data(), dims);
    std::memcpy(at + dims, r.strides.data(), dims);
  }
  at += 2 * dims;
  if (!r.handle.location.empty()) {
    std::memcpy(at, r.handle.location.data(), r.handle.location.size());
  }
  return out;
}

Record decode_record(const char* data, size_t size) {
  RecordHead head;
  if (size < sizeof(head)) bad("it is shorter than a record's head", size);
  std::memcpy(&head, data, sizeof(head));
  if (head.magic != RECORD_MAGIC) bad("wrong magic", head.magic);
  if (head.version != RECORD_VERSION) bad("unknown version", head.version);
  if (head.kind != RECORD_KIND_TENSOR && head.kind != RECORD_KIND_ARRAY) bad("kind", head.kind);
  if (head.ndim > RECORD_MAX_NDIM) bad("too many dimensions", head.ndim);
  if (head.location_len > MAX_LOCATION) bad("location length", head.location_len);
  size_t dims = size_t{head.ndim} * sizeof(int64_t);
  if (size != sizeof(head) + 2 * dims + head.location_len) bad("length", size);
  Record r;
  r.kind = head.kind;
  r.flags = head.flags;
  r.dtype = head.dtype;
  r.handle.named = head.named != 0;
  r.handle.segment_id = head.segment_id;
  r.handle.secret = head.secret;
  r.handle.size = head.segment_size;
  r.handle.index = head.index;
  r.handle.generation = head.generation;
  r.handle.owner_pid = head.owner_pid;
  r.offset = head.offset;
  r.nbytes = head.nbytes;
  r.storage_offset = head.storage_offset;
  const char* at = data + sizeof(head);
  r.sizes.resize(head.ndim);
  r.strides.resize(head.ndim);
  if (dims > 0) {
    std::memcpy(r.sizes.data(), at, dims);
    std::memcpy(r.strides.data(), at + dims, dims);
  }
  at += 2 * dims;
  r.handle.location.assign(at, head.location_len);
  return r;
}

}  // namespace torch_mp_ext
