#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <new>

#include "common/check.h"
#include "platform/process.h"

namespace torch_mp_ext {

namespace {

std::atomic<AnonymousBackend> g_backend{AnonymousBackend::Memfd};

size_t round_up(size_t value, size_t to) { return (value + to - 1) / to * to; }

/// Where the HolderMask table starts (arena segments only), right after the slots.
size_t masks_offset_for(const SegmentSpec& spec) {
  if (spec.kind != SegmentKind::Arena) return 0;
  return round_up(slots_offset() + sizeof(BlockSlot) * spec.nblocks, 64);
}

std::string human_bytes(uint64_t n) {
  char buf[32];
  if (n >= (1ull << 30)) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", static_cast<double>(n) / (1ull << 30));
  } else if (n >= (1ull << 20)) {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(n) / (1ull << 20));
  } else {
    std::snprintf(buf, sizeof(buf), "%" PRIu64 " bytes", n);
  }
  return buf;
}

/// The fix to suggest when shared memory of `size` bytes could not be allocated.
std::string no_space_hint(size_t size, bool in_dev_shm) {
  std::string hint = "Could not reserve " + std::to_string(size) + " bytes (" +
                     human_bytes(size) + ") of shared memory";
  if (in_dev_shm) {
    struct statvfs st;
    if (::statvfs("/dev/shm", &st) == 0) {
      uint64_t total = static_cast<uint64_t>(st.f_blocks) * st.f_frsize;
      uint64_t avail = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
      hint += " in /dev/shm (" + human_bytes(avail) + " free of " + human_bytes(total) + ")";
    }
    hint +=
        ". /dev/shm is too small: in Docker start the container with a larger --shm-size "
        "(for example --shm-size=8g, or --ipc=host); elsewhere remount it larger "
        "(mount -o remount,size=8G /dev/shm) or free space in it";
  } else {
    hint +=
        ". The memory limit of this process or its cgroup is reached: free memory, raise the "
        "container's memory limit, or send smaller tensors";
  }
  return hint;
}

/// ftruncate + posix_fallocate: pages are reserved now, so a full /dev/shm is an error here
/// instead of a SIGBUS at first touch (Note [Segment layout]).
/// `upto`: bytes from the start to reserve (the rest stays sparse: Note [Ring growth]).
void reserve(int fd, size_t size, size_t upto, const std::string& resource, bool in_dev_shm) {
  TMX_SYSCHECK(::ftruncate(fd, static_cast<off_t>(size)), "ftruncate", resource);
  int rc;
  do {
    rc = ::posix_fallocate(fd, 0, static_cast<off_t>(upto));
  } while (rc == EINTR);
  if (rc == 0 || rc == EINVAL || rc == EOPNOTSUPP) return;  // no fallocate on this fs: as torch
  std::string hint;
  if (rc == ENOSPC || rc == ENOMEM || rc == EFBIG) hint = no_space_hint(upto, in_dev_shm);
  throw SyscallError(rc, "posix_fallocate", resource, hint);
}

char* map_fd(int fd, size_t size, const std::string& resource) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    std::string hint;
    if (err == ENOMEM) hint = "the address space or vm.max_map_count is exhausted";
    throw SyscallError(err, "mmap", resource, hint);
  }
  return static_cast<char*>(p);
}

std::string new_name() {
  char buf[NAME_CAPACITY];
  std::snprintf(buf, sizeof(buf), "/torch_%d_%016" PRIx64, static_cast<int>(self_pid()),
                random_u64());
  return buf;
}

void init_header(char* base, size_t size, size_t data_offset, const SegmentSpec& spec,
                 const std::string& name) {
  // The pages come zero-filled from the kernel: only non-zero fields are written.
  auto* h = new (base) SegmentHeader();
  h->layout_version = LAYOUT_VERSION;
  h->kind = static_cast<uint32_t>(spec.kind);
  h->segment_id = random_u64();
  h->secret = random_u64();
  h->total_size = size;
  h->block_size = spec.block_size;
  h->data_offset = data_offset;
  h->masks_offset = masks_offset_for(spec);
  h->nblocks = spec.nblocks;
  h->owner_pid = self_pid();
  h->owner_key = self_key();
  h->pidns = pid_namespace_id();
  h->flags.store(spec.flags | (spec.named ? FLAG_NAMED : 0u), std::memory_order_relaxed);
  h->live_blocks.store(0, std::memory_order_relaxed);
  h->free_head.store(pack_head(NO_BLOCK, 0), std::memory_order_relaxed);
  std::snprintf(h->name, sizeof(h->name), "%s", name.c_str());
  BlockSlot* slots = slots_of(h);
  for (uint32_t i = 0; i < spec.nblocks; ++i) new (&slots[i]) BlockSlot();
  if (HolderMask* masks = masks_of(h)) {
    for (uint32_t i = 0; i < spec.nblocks; ++i) new (&masks[i]) HolderMask();
  }
  // Free stack in index order: the owner hands out low blocks first.
  for (uint32_t i = spec.nblocks; i-- > 0;) free_push(h, i);
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = SEGMENT_MAGIC;
}

std::shared_ptr<Mapping> validate(char* base, size_t size, UniqueFd fd, std::string name,
                                  uint64_t expected_id, const std::string& resource) {
  auto mapping = std::make_shared<Mapping>(base, size, std::move(fd), std::move(name), false);
  const SegmentHeader* h = mapping->header();
  if (size < sizeof(SegmentHeader) || h->magic != SEGMENT_MAGIC) {
    throw CorruptSegmentError("shared memory segment " + resource +
                              " is not a torch_mp_ext segment (bad magic number)");
  }
  if (h->layout_version != LAYOUT_VERSION) {
    throw CorruptSegmentError(detail::str_cat(
        "shared memory segment ", resource, " has layout version ", h->layout_version,
        " but this torch_mp_ext understands version ", LAYOUT_VERSION,
        ": every process must run the same torch_mp_ext release"));
  }
  if (h->total_size != size || h->data_offset + h->block_size * h->nblocks > size ||
      h->masks_offset + sizeof(HolderMask) * h->nblocks > h->data_offset) {
    throw CorruptSegmentError(detail::str_cat("shared memory segment ", resource, " is ",
                                              size, " bytes but its header says ",
                                              h->total_size));
  }
  if (expected_id != 0 && h->segment_id != expected_id) {
    throw CorruptSegmentError(detail::str_cat(
        "shared memory segment ", resource, " has id ", h->segment_id, ", expected ",
        expected_id, " (the name was reused after the original segment was freed)"));
  }
  return mapping;
}

size_t fd_size(int fd, const std::string& resource) {
  struct stat st;
  TMX_SYSCHECK(::fstat(fd, &st), "fstat", resource);
  return static_cast<size_t>(st.st_size);
}

}  // namespace

void set_anonymous_backend(AnonymousBackend backend) { g_backend.store(backend); }
AnonymousBackend anonymous_backend() { return g_backend.load(); }

size_t segment_size_for(const SegmentSpec& spec, size_t* data_offset) {
  size_t page = page_size();
  size_t tables = slots_offset() + sizeof(BlockSlot) * spec.nblocks;
  if (size_t masks = masks_offset_for(spec)) tables = masks + sizeof(HolderMask) * spec.nblocks;
  size_t offset = round_up(tables, page);
  if (data_offset != nullptr) *data_offset = offset;
  return round_up(offset + spec.block_size * spec.nblocks, page);
}

Mapping::Mapping(char* base, size_t size, UniqueFd fd, std::string name, bool owned_)
    : owned(owned_), base_(base), size_(size), fd_(std::move(fd)), name_(std::move(name)) {}

Mapping::~Mapping() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

std::shared_ptr<Mapping> create_segment(const SegmentSpec& spec) {
  TMX_CHECK_VALUE(spec.nblocks > 0 && spec.nblocks < NO_BLOCK,
                  "a segment needs between 1 and 2^32-2 blocks, got ", spec.nblocks);
  TMX_CHECK_VALUE(spec.block_size % BLOCK_ALIGNMENT == 0,
                  "block size must be a multiple of ", BLOCK_ALIGNMENT, ", got ",
                  spec.block_size);
  size_t data_offset = 0;
  size_t size = segment_size_for(spec, &data_offset);
  UniqueFd fd;
  std::string name;
  std::string resource;
  bool in_dev_shm = true;
  if (spec.named) {
    for (int attempt = 0;; ++attempt) {
      name = new_name();
      int raw = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (raw >= 0) {
        fd.reset(raw);
        break;
      }
      int err = errno;
      if ((err == EEXIST || err == EINTR) && attempt < 16) continue;
      throw SyscallError(err, "shm_open", "/dev/shm" + name);
    }
    resource = "/dev/shm" + name;
  } else if (g_backend.load() == AnonymousBackend::Memfd) {
    resource = "memfd:tmx_" + std::to_string(self_pid());
    int raw = ::memfd_create(resource.c_str() + 6, MFD_CLOEXEC);
    if (raw < 0 && (errno == ENOSYS || errno == EPERM)) {
      g_backend.store(AnonymousBackend::ShmUnlinked);  // seccomp or an old kernel
      return create_segment(spec);
    }
    if (raw < 0) throw SyscallError(errno, "memfd_create", resource);
    fd.reset(raw);
    in_dev_shm = false;
  } else {
    std::string tmp;
    for (int attempt = 0;; ++attempt) {
      tmp = new_name();
      int raw = ::shm_open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (raw >= 0) {
        fd.reset(raw);
        break;
      }
      int err = errno;
      if ((err == EEXIST || err == EINTR) && attempt < 16) continue;
      throw SyscallError(err, "shm_open", "/dev/shm" + tmp);
    }
    ::shm_unlink(tmp.c_str());  // anonymous from now on: nothing can leak a name
    resource = "/dev/shm" + tmp + " (unlinked)";
  }
  char* base = nullptr;
  try {
    size_t upto = spec.reserve_bytes == 0 ? size
                                          : std::min(size, data_offset + spec.reserve_bytes);
    reserve(fd.get(), size, upto, resource, in_dev_shm);
    base = map_fd(fd.get(), size, resource);
    init_header(base, size, data_offset, spec, name);
  } catch (...) {
    if (base != nullptr) ::munmap(base, size);
    if (spec.named) ::shm_unlink(name.c_str());  // roll back: the name must not outlive us
    throw;
  }
  if (spec.named) fd.reset();  // named segments are reopened by name: no fd to keep
  auto mapping = std::make_shared<Mapping>(base, size, std::move(fd), name, true);
  mapping->register_holder();
  return mapping;
}

std::shared_ptr<Mapping> map_segment_fd(UniqueFd fd, uint64_t expected_id) {
  std::string resource = "fd " + std::to_string(fd.get()) + " of segment " +
                         std::to_string(expected_id);
  size_t size = fd_size(fd.get(), resource);
  if (size < sizeof(SegmentHeader)) {
    throw CorruptSegmentError("shared memory segment " + resource + " is truncated");
  }
  char* base = map_fd(fd.get(), size, resource);
  fd.reset();  // a mapping does not need its fd: receivers hold none (Note [fd budget])
  std::shared_ptr<Mapping> mapping;
  try {
    mapping = validate(base, size, UniqueFd(), "", expected_id, resource);
  } catch (...) {
    ::munmap(base, size);
    throw;
  }
  mapping->register_holder();
  return mapping;
}

std::shared_ptr<Mapping> open_named_segment(const std::string& name, uint64_t expected_id) {
  std::string resource = "/dev/shm" + name;
  UniqueFd fd(TMX_SYSCHECK(::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600), "shm_open",
                           resource));
  size_t size = fd_size(fd.get(), resource);
  if (size < sizeof(SegmentHeader)) {
    throw CorruptSegmentError("shared memory segment " + resource + " is truncated");
  }
  char* base = map_fd(fd.get(), size, resource);
  fd.reset();
  std::shared_ptr<Mapping> mapping;
  try {
    mapping = validate(base, size, UniqueFd(), name, expected_id, resource);
  } catch (...) {
    ::munmap(base, size);
    throw;
  }
  mapping->register_holder();
  return mapping;
}

bool unlink_name(const std::string& name) {
  if (name.empty()) return false;
  return ::shm_unlink(name.c_str()) == 0;
}

int holder_register(SegmentHeader* h, uint64_t key) {
  for (size_t i = 0; i < MAX_HOLDERS; ++i) {
    uint64_t expected = 0;
    if (h->holders[i].load(std::memory_order_relaxed) == 0 &&
        h->holders[i].compare_exchange_strong(expected, key, std::memory_order_acq_rel)) {
      return static_cast<int>(i);
    }
  }
  return -1;  // table full: this holder is invisible to reapers and reclaimers (it leaks
              // rather than loses anything)
}

void holder_deregister(SegmentHeader* h, int index, uint64_t key) {
  if (index < 0) return;
  uint64_t expected = key;
  h->holders[index].compare_exchange_strong(expected, 0, std::memory_order_acq_rel);
}

void Mapping::register_holder() {
  if (holder_index < 0) holder_index = holder_register(header(), self_key());
}

void Mapping::deregister_holder() {
  holder_deregister(header(), holder_index, self_key());
  holder_index = -1;
}

bool any_live_holder(SegmentHeader* h, uint64_t except_key) {
  if (h->pidns != pid_namespace_id()) return true;  // cannot judge other namespaces
  for (auto& slot : h->holders) {
    uint64_t key = slot.load(std::memory_order_acquire);
    if (key == 0 || key == except_key || (key & HOLDER_RECLAIMING)) continue;
    auto pid = static_cast<pid_t>(key >> 32);
    if (process_alive(pid, static_cast<uint32_t>(key))) return true;
  }
  return false;
}

}  // namespace torch_mp_ext

namespace torch_mp_ext {

std::string no_space_message(size_t size, bool in_dev_shm) {
  return no_space_hint(size, in_dev_shm);
}

}  // namespace torch_mp_ext
