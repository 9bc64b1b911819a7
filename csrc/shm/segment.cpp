#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "common/arith.h"
#include "common/check.h"
#include "platform/compat.h"
#include "platform/process.h"
#include "shm/file_limit.h"
#include "shm/session.h"
#include "shm/sigbus.h"
#include "shm/unmapper.h"

namespace torch_mp_ext {

namespace {

std::atomic<AnonymousBackend> g_backend{AnonymousBackend::Memfd};

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

/// The fix to suggest when this process is out of file descriptors.
std::string no_fd_hint() {
  return detail::str_cat(
      "this process is at its open-file limit (RLIMIT_NOFILE=", fd_limit(),
      "): each shared-memory segment it created for the file_descriptor strategy keeps one "
      "fd. Free tensors it no longer needs (the fds of unused segments are released and this "
      "call retried automatically), raise the limit (ulimit -n, or resource.setrlimit), or "
      "use set_sharing_strategy('file_system')");
}

/// ftruncate + posix_fallocate: pages are reserved now, so a full /dev/shm is an error here
/// instead of a SIGBUS at first touch (Note [Segment layout]).
/// `upto`: bytes from the start to reserve (the rest stays sparse: Note [Ring growth]).
void reserve(int fd, size_t size, size_t upto, const std::string& resource, bool in_dev_shm) {
  if (!file_size_allowed(size)) throw_file_too_big(size, resource);
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

/// Memory mappings of this process (lines of /proc/self/maps) and vm.max_map_count; both 0
/// when unknown. For the ENOMEM message only: it reads /proc.
void map_count(uint64_t* maps, uint64_t* max_maps) {
  *maps = 0;
  *max_maps = 0;
  char buf[8192];
  UniqueFd limit(::open("/proc/sys/vm/max_map_count", O_RDONLY | O_CLOEXEC));
  if (!limit.valid()) return;
  ssize_t n = ::read(limit.get(), buf, 63);
  if (n <= 0) return;
  buf[n] = '\0';
  uint64_t max = std::strtoull(buf, nullptr, 10);
  UniqueFd self(::open("/proc/self/maps", O_RDONLY | O_CLOEXEC));
  if (!self.valid()) return;
  uint64_t lines = 0;
  while ((n = ::read(self.get(), buf, sizeof(buf))) != 0) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return;
    for (ssize_t i = 0; i < n; ++i) lines += buf[i] == '\n';
  }
  *maps = lines;
  *max_maps = max;
}

char* map_fd(int fd, size_t size, const std::string& resource) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    std::string hint;
    uint64_t maps = 0;
    uint64_t max_maps = 0;
    if (err == ENOMEM) map_count(&maps, &max_maps);
    if (err == ENOMEM && max_maps > 0 && maps + 16 >= max_maps) {
      hint = detail::str_cat(
          "this process has ", maps, " memory mappings and the kernel allows ", max_maps,
          " per process (vm.max_map_count): free tensors it no longer needs (unused segments "
          "are released and the call retried), close mappings it does not need, or raise the "
          "limit as root: sysctl -w vm.max_map_count=", 4 * max_maps,
          " (persist it in /etc/sysctl.d/)");
    } else if (err == ENOMEM) {
      struct rlimit as {};
      ::getrlimit(RLIMIT_AS, &as);
      hint = detail::str_cat(
          "this process's address space is exhausted: its limit (RLIMIT_AS, ulimit -v) is ",
          as.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : human_bytes(as.rlim_cur),
          ", and the kernel allows vm.max_map_count mappings per process. Free tensors it "
          "no longer needs (unused segments are released and the call retried), send smaller "
          "ones, or raise the limit");
    }
    throw SyscallError(err, "mmap", resource, hint);
  }
  return static_cast<char*>(p);
}

std::string new_name() {
  char buf[NAME_CAPACITY];
  uint64_t random = random_u64();
  if (uint32_t tag = session_name_tag()) {  // Note [Session names]: the tag, then 32 random bits
    random = (static_cast<uint64_t>(tag) << 32) | (random & 0xffffffffu);
  }
  std::snprintf(buf, sizeof(buf), "/torch_%d_%016" PRIx64, static_cast<int>(self_pid()), random);
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
  if (h->masks_offset != 0) {
    auto* masks = reinterpret_cast<HolderMask*>(base + h->masks_offset);
    for (uint32_t i = 0; i < spec.nblocks; ++i) new (&masks[i]) HolderMask();
  }
  // Free stack in index order: the owner hands out low blocks first.
  for (uint32_t i = spec.nblocks; i-- > 0;) free_push(h, i);
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = SEGMENT_MAGIC;
}

/// a + b and a * b into *out; false on overflow (a forged header must not wrap a check).
bool add_ok(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_add_overflow(a, b, out); }
bool mul_ok(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }
bool round_up_ok(uint64_t value, uint64_t to, uint64_t* out) {
  if (!add_ok(value, to - 1, out)) return false;
  *out = *out / to * to;
  return true;
}

/// Geometry of the segment whose header is at `h`, read once and checked against the mapping
/// (Note [Geometry snapshot]): every field must be exactly what create_segment writes for that
/// kind, block size and block count. Throws CorruptSegmentError naming `resource` and the field.
SegmentGeometry checked_geometry(const volatile SegmentHeader* vh, size_t size,
                                 const std::string& resource) {
  // One read of each field through a volatile view: the compiler may not re-read them later.
  SegmentGeometry g;
  g.id = vh->segment_id;
  uint32_t kind = vh->kind;
  g.block_size = vh->block_size;
  g.data_offset = vh->data_offset;
  g.masks_offset = vh->masks_offset;
  g.nblocks = vh->nblocks;
  uint64_t total = vh->total_size;
  auto corrupt = [&](const char* field, uint64_t value, const std::string& why) {
    return CorruptSegmentError(detail::str_cat("shared memory segment ", resource,
                                               " is corrupt: header field '", field, "' is ",
                                               value, " (", why, ")"));
  };
  if (kind != static_cast<uint32_t>(SegmentKind::Arena) &&
      kind != static_cast<uint32_t>(SegmentKind::Counters)) {
    throw corrupt("kind", kind, "not an arena or counter segment");
  }
  g.kind = static_cast<SegmentKind>(kind);
  if (total != size) {
    throw corrupt("total_size", total, detail::str_cat("the mapping is ", size, " bytes"));
  }
  if (g.nblocks == 0 || g.nblocks >= CORRUPT_BLOCK) {
    throw corrupt("nblocks", g.nblocks, "a segment has 1 to 2^32-3 blocks");
  }
  if (g.block_size % BLOCK_ALIGNMENT != 0) {
    throw corrupt("block_size", g.block_size, "blocks are 64-byte aligned");
  }
  uint64_t tables = slots_offset() + uint64_t{sizeof(BlockSlot)} * g.nblocks;  // < 2^38
  uint64_t want_masks = 0;
  if (g.kind == SegmentKind::Arena) {
    want_masks = (tables + 63) & ~uint64_t{63};
    tables = want_masks + uint64_t{sizeof(HolderMask)} * g.nblocks;
  }
  if (g.masks_offset != want_masks) {
    throw corrupt("masks_offset", g.masks_offset, detail::str_cat("expected ", want_masks));
  }
  uint64_t want_data = 0;
  uint64_t data_bytes = 0;
  uint64_t end = 0;
  uint64_t page = page_size();
  if (!round_up_ok(tables, page, &want_data) || g.data_offset != want_data) {
    throw corrupt("data_offset", g.data_offset, detail::str_cat("expected ", want_data));
  }
  if (!mul_ok(g.block_size, g.nblocks, &data_bytes) || !add_ok(want_data, data_bytes, &end) ||
      end > size) {
    throw corrupt("block_size", g.block_size,
                  detail::str_cat(g.nblocks, " blocks of it do not fit in ", size, " bytes"));
  }
  return g;
}

std::shared_ptr<Mapping> validate(char* base, size_t size, UniqueFd fd, std::string name,
                                  uint64_t expected_id, const std::string& resource) {
  const volatile SegmentHeader* h = reinterpret_cast<SegmentHeader*>(base);
  if (size < slots_offset() || h->magic != SEGMENT_MAGIC) {
    throw CorruptSegmentError("shared memory segment " + resource +
                              " is not a torch_mp_ext segment (bad magic number)");
  }
  uint32_t version = h->layout_version;
  if (version != LAYOUT_VERSION) {
    throw CorruptSegmentError(detail::str_cat(
        "shared memory segment ", resource, " has layout version ", version,
        " but this torch_mp_ext understands version ", LAYOUT_VERSION,
        ": every process must run the same torch_mp_ext release"));
  }
  SegmentGeometry geometry = checked_geometry(h, size, resource);
  if (expected_id != 0 && geometry.id != expected_id) {
    throw CorruptSegmentError(detail::str_cat(
        "shared memory segment ", resource, " has id ", geometry.id, ", expected ",
        expected_id, " (the name was reused after the original segment was freed)"));
  }
  return std::make_shared<Mapping>(base, size, std::move(fd), std::move(name), false, geometry);
}

/// What a received fd or an opened name must be before it is mapped: a regular file (shm or
/// memfd) of this user, of the size the handle announced (when known) and big enough for a
/// header. (A peer of the same user can still truncate a /dev/shm file under our mapping, a
/// SIGBUS at the next access; the memfds we create are sealed against it.)
size_t checked_fd_size(int fd, const std::string& resource, uint64_t expected_size) {
  struct stat st;
  TMX_SYSCHECK(fd_stat(fd, &st), "fstat", resource);
  if (!S_ISREG(st.st_mode)) {
    throw CorruptSegmentError("shared memory segment " + resource +
                              " is not a shared-memory file (not a regular file or memfd)");
  }
  if (st.st_uid != ::geteuid()) {
    throw CorruptSegmentError(detail::str_cat(
        "shared memory segment ", resource, " belongs to uid ", st.st_uid, ", not to this ",
        "process's uid ", ::geteuid(), ": refusing memory another user controls"));
  }
  auto size = static_cast<uint64_t>(st.st_size);
  if (size < slots_offset()) {
    throw CorruptSegmentError(detail::str_cat(
        "shared memory segment ", resource, " is ", size, " bytes: truncated (a header needs ",
        slots_offset(), "; another process shrank the file). The file_descriptor sharing "
        "strategy's segments cannot be truncated"));
  }
  if (expected_size != 0 && size != expected_size) {
    throw CorruptSegmentError(detail::str_cat(
        "shared memory segment ", resource, " is ", size, " bytes but its handle says ",
        expected_size, ": the file was truncated or replaced since the handle was made (another "
        "process changed it). The file_descriptor sharing strategy's segments cannot be "
        "truncated"));
  }
  return static_cast<size_t>(size);
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

Mapping::Mapping(char* base, size_t size, UniqueFd fd, std::string name, bool owned_,
                 const SegmentGeometry& geometry)
    : owned(owned_),
      base_(base),
      size_(size),
      fd_(std::move(fd)),
      name_(std::move(name)),
      geo_(geometry) {}

uint32_t Mapping::pop_free() {
  uint32_t index = free_pop(header(), geo_.nblocks);
  if (index == CORRUPT_BLOCK) {
    throw CorruptSegmentError(detail::str_cat(
        "shared memory segment ", describe(), " is corrupt: its free stack ('free_head' or a "
        "block's 'next') names a block outside its ", geo_.nblocks,
        " blocks; a process wrote garbage into it"));
  }
  return index;
}

std::string Mapping::describe() const {
  if (named()) return "/dev/shm" + name_;
  return detail::str_cat("memfd segment ", geo_.id);
}

Mapping::~Mapping() {
  if (base_ != nullptr) unmap_later(base_, size_);  // Note [Unmapping off the caller's path]
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
      throw SyscallError(err, "shm_open", "/dev/shm" + name,
                         err == EMFILE || err == ENFILE ? no_fd_hint() : "");
    }
    resource = "/dev/shm" + name;
  } else if (g_backend.load() == AnonymousBackend::Memfd) {
    resource = "memfd:tmx_" + std::to_string(self_pid());
    int raw = ::memfd_create(resource.c_str() + 6, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (raw < 0 && (errno == ENOSYS || errno == EPERM)) {
      g_backend.store(AnonymousBackend::ShmUnlinked);  // seccomp or an old kernel
      return create_segment(spec);
    }
    if (raw < 0) {
      int err = errno;
      throw SyscallError(err, "memfd_create", resource,
                         err == EMFILE || err == ENFILE ? no_fd_hint() : "");
    }
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
      throw SyscallError(err, "shm_open", "/dev/shm" + tmp,
                         err == EMFILE || err == ENFILE ? no_fd_hint() : "");
    }
    ::shm_unlink(tmp.c_str());  // anonymous from now on: nothing can leak a name
    resource = "/dev/shm" + tmp + " (unlinked)";
  }
  char* base = nullptr;
  try {
    size_t upto = spec.reserve_bytes == 0 ? size
                                          : std::min(size, data_offset + spec.reserve_bytes);
    reserve(fd.get(), size, upto, resource, in_dev_shm);
    if (!spec.named && g_backend.load() == AnonymousBackend::Memfd && seals_usable()) {
      // Sealed: no process that receives the fd can truncate it under the others' mappings.
      // A kernel without seals (EINVAL) leaves it unsealed (Note [Platform floor]).
      if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        if (errno != EINVAL) throw SyscallError(errno, "fcntl(F_ADD_SEALS)", resource);
        seals_refused();
      }
    }
    base = map_fd(fd.get(), size, resource);
    init_header(base, size, data_offset, spec, name);
  } catch (...) {
    if (base != nullptr) ::munmap(base, size);
    if (spec.named) ::shm_unlink(name.c_str());  // roll back: the name must not outlive us
    throw;
  }
  if (spec.named) {
    fd.reset();  // named segments are reopened by name: no fd to keep
    install_sigbus_handler();  // Note [Truncated under us]
  }
  SegmentGeometry geometry;
  geometry.id = reinterpret_cast<SegmentHeader*>(base)->segment_id;
  geometry.kind = spec.kind;
  geometry.block_size = spec.block_size;
  geometry.data_offset = data_offset;
  geometry.masks_offset = masks_offset_for(spec);
  geometry.nblocks = spec.nblocks;
  auto mapping = std::make_shared<Mapping>(base, size, std::move(fd), name, true, geometry);
  mapping->register_holder();
  return mapping;
}

std::shared_ptr<Mapping> map_segment_fd(UniqueFd& fd, uint64_t expected_id,
                                        uint64_t expected_size) {
  std::string resource = "fd " + std::to_string(fd.get()) + " of segment " +
                         std::to_string(expected_id);
  size_t size = checked_fd_size(fd.get(), resource, expected_size);
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

std::shared_ptr<Mapping> open_named_segment(const std::string& name, uint64_t expected_id,
                                            uint64_t expected_size) {
  std::string resource = "/dev/shm" + name;
  if (name.size() < 2 || name.size() >= NAME_CAPACITY || name[0] != '/' ||
      name.find('/', 1) != std::string::npos || name.find('\0') != std::string::npos) {
    throw std::invalid_argument(detail::str_cat(
        "'", name, "' is not a shared-memory segment name (one '/' then up to ",
        NAME_CAPACITY - 2, " characters, no other '/')"));
  }
  UniqueFd fd(TMX_SYSCHECK(::shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0600),
                           "shm_open", resource));
  install_sigbus_handler();  // Note [Truncated under us]
  size_t size = checked_fd_size(fd.get(), resource, expected_size);
  char* base = map_fd(fd.get(), size, resource);
  fd.reset();
  std::shared_ptr<Mapping> mapping;
  try {
    SigbusGuard guard;  // truncated between fstat and here: an error, not a SIGBUS
    mapping = validate(base, size, UniqueFd(), name, expected_id, resource);
    mapping->register_holder();
    guard.check(("mapped " + resource).c_str());
  } catch (...) {
    if (mapping != nullptr) {
      mapping->deregister_holder();
    } else {
      ::munmap(base, size);
    }
    throw;
  }
  return mapping;
}

bool unlink_name(const std::string& name) {
  if (name.empty()) return false;
  return ::shm_unlink(name.c_str()) == 0;
}

void Mapping::register_holder() {
  // -1 when the table is full: this holder is invisible to reapers and reclaimers (it leaks
  // rather than loses anything).
  if (holder_index < 0) holder_index = holders_of(header()).claim();
}

void Mapping::deregister_holder() {
  if (holder_index >= 0) {
    HolderTable holders = holders_of(header());
    holders[static_cast<size_t>(holder_index)].release(holders.self());
  }
  holder_index = -1;
}

}  // namespace torch_mp_ext

namespace torch_mp_ext {

std::string no_space_message(size_t size, bool in_dev_shm) {
  return no_space_hint(size, in_dev_shm);
}

}  // namespace torch_mp_ext
