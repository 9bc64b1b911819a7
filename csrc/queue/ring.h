// A multi-producer multi-consumer ring of length-prefixed frames in shared memory.
//
// Note [Ring layout]
// The ring lives in one arena block (Note [Block lifetime]); the creator placement-constructs
// the header at the block's first byte (the block may be recycled: every field is written),
// and other processes map the same block through a handle. Nothing in it is a pointer.
//
//   block  ┌──────────────────────────────────────────────────────────────────────────────┐
//          │ RingHeader                                                                   │
//          │   magic version flags capacity maxsize data_offset spin_ns   creator, once  │
//          │   inflight untracked  atomic: holders in pickles / beyond the holder table   │
//          │   recoveries broken   atomic: repairs done / repair found garbage            │
//          │   doorbell            atomic: who owes the SimpleQueue pipe a byte           │
//          │   not_empty not_full all_done    futex conditions (Note [Why not pthread_cond_t])
//          │   mutex               robust, process-shared; guards everything below        │
//          │   state   {head tail count unfinished}    the truth                          │
//          │   journal {head tail count unfinished}    the next truth, valid iff ...      │
//          │   journal_valid       ... this word is 1: the commit point of every operation│
//          │   holders[128]        {process key, queue objects}: who holds the ring       │
//          │ data[max_capacity]: only data[0, state.capacity) is in use (Note [Ring growth])  │
//          │   ... free ... │head▶ [size tag|payload|pad] [size tag|payload|pad] ◀tail│ ... │
//          └──────────────────────────────────────────────────────────────────────────────┘
//
// head and tail are byte counters (position = counter % state.capacity); a frame is
// an 8-byte header {payload size, tag} and the payload padded to 8 bytes, and may wrap around
// the end of the data area. Bytes in [head, tail) are committed frames; only a get may retire
// them (by moving head). Bytes in [tail, head + capacity) are free; only the put that holds the
// mutex writes there, and nobody reads them.
//
// Note [Ring commit]
// Every operation that changes the ring does, holding the mutex: (1) its data work (a put
// copies frames into free space, a get copies frames out), (2) writes the new state into
// `journal`, (3) sets journal_valid = 1: the commit point, one aligned word, (4) copies the
// journal into `state`, (5) clears journal_valid. The steps are separated by compiler fences,
// and the store order is all that matters: a process killed at an instruction boundary has
// executed exactly the stores before it, and the next locker (in another process) only runs
// after the kernel has marked the mutex owner-died, when those stores are all visible.
// What a process killed at any instruction leaves behind:
//   - before (3): `state` is untouched. A put's bytes lie in free space, invisible; a get's
//     frames are still in the ring and go to the next getter. The dead operation never was.
//   - from (3) on: the operation happened. The next locker gets EOWNERDEAD and re-applies the
//     journal (idempotent, so a death during the repair is harmless), then marks the mutex
//     consistent. A dead put's frames are delivered; a dead get's frames were consumed by the
//     process that died with them: lost, never duplicated.
//   - not holding the mutex (waiting in a condition, pickling, unpickling): nothing to repair.
// After a repair the frames from head to tail are walked; if they do not chain exactly to tail
// (only possible if something outside this protocol wrote the memory) the ring is marked
// broken and every later operation raises PeerDiedError rather than deliver a torn item.
//
// Note [Ring growth]
// An unbounded queue (multiprocessing.Queue() with no maxsize) must never block a put for lack
// of room, yet the common case must stay one memcpy into a ring that is already mapped. So a
// growable ring's block is one *sparse* segment: only its first pages (the initial capacity)
// are reserved when it is made; the rest of the address range (max_capacity, 64 GiB by
// default) is mapped in every process that holds the queue but has no pages behind it. The
// data area in use is data[0, state.capacity). A put that finds no room while the item count
// is below maxsize (or maxsize is 0) grows the ring under the mutex:
//   1. reserve the pages of data[capacity, new capacity) with MADV_POPULATE_WRITE: a full
//      /dev/shm (or memory cgroup) is an ENOSPC error here, naming the bytes and the fix
//      (Docker --shm-size), never a SIGBUS later; new capacity = max(2 * capacity, needed);
//   2. relocate: the frames keep their physical place, so head' = head % capacity and
//      tail' = head' + (tail - head); frames that wrapped past the old end (physical
//      [0, tail' - capacity)) are copied to [capacity, tail'), free space in both layouts;
//   3. commit {head', tail', count, unfinished, new capacity} with the put's own frames, as
//      every operation does (Note [Ring commit]).
// A death before the commit leaves the old state, which never looks past the old capacity
// (only reserved pages are left behind, reused by the next growth); after it, the repair
// re-applies the journal. Every process reads capacity from the state under the mutex, so no
// one needs to hear about a growth: the whole range is mapped already, and it is one segment,
// so the file_descriptor strategy, fork, spawn and forkserver need nothing new. The get that
// empties a grown ring commits head = tail = 0 and the initial capacity in the same journal,
// then (still under the mutex, so no growth can race it) returns the grown pages with
// MADV_REMOVE. FIFO order is untouched: growth moves bytes, never reorders frames. A ring made
// with an explicit max_bytes is not sparse and never grows (max_capacity == capacity).
//
// Note [Ring holders]
// Every queue object holding the ring, in any process, is counted in `holders`, by process
// (pid << 32 | start time, so a recycled pid is another process): the creator, every copy a
// pickle became (counted in `inflight` while the pickle travels) and every copy a fork
// inherited. Each such object also holds a BlockRef on the ring's block, but the table counts
// objects, not block references (Note [Ring holders are not block references] in
// bind_queue.cpp). When an object lets go (remove_holder), the processes in the table that are
// dead are reaped (a SIGKILLed or SIGTERMed worker: Pool.terminate(), a DataLoader worker
// killed on timeout) and their count is returned, so that the caller reclaims what they held
// of the block through the segment's holder masks. The caller that finds no live holder left,
// nothing in flight, is the last one: it drains the ring (Note [Queue lifetime] in
// queues/ring_queue.py).
// The table is a holder table (Note [Holder tables]) whose slots carry `refs`; it is only
// changed under the mutex. A slot's refs are written before its key is claimed and zeroed
// before it is released or reaped, so a death mid-update leaves either a free slot or a
// holder that the next reaper judges. Holders in another pid namespace than the ring's
// creator are never judged dead; beyond the table's 128 processes they are only counted
// (`untracked`).
// A holder in flight is never judged either: a pickle may be opened long after its sender
// exited (a queue sent through a queue). So a pickle that is never opened (its receiver was
// killed before unpickling it) keeps the ring until the segment's owner exits.
//
// Note [Doorbell]
// SimpleQueue's wake-up pipe (Note [SimpleQueue internals that the standard library uses] in
// _queue_compat.py) is kept honest by one shared word, `doorbell`: 0, or the key of the one
// process that owes the pipe a byte. The invariant, at every instruction of every process:
//   an item is queued  =>  the pipe holds a byte, or `doorbell` names a process that will
//   write one (or re-check and write one) before its call returns, or `doorbell` is 0 or
//   names a dead process, and the next survivor to touch the queue rings.
// A put commits, then takes the word if it is 0 or names a dead process (CAS) and writes a
// byte. A get claims the word (whatever it held), drains the pipe, and writes a byte if items
// remain; otherwise it clears the word (CAS from its own key) and re-checks the ring like a
// put (sequentially consistent on both sides: a put that saw the getter's key committed
// before the getter's re-check, which then sees its item). SimpleQueue's reader also rings
// like a put whenever `fileno()` is asked for with items queued, which is what
// multiprocessing.connection.wait() does first. So a process SIGKILLed between taking the
// word and writing its byte (or between draining and re-ringing) leaves the word naming a
// dead process, and the next put, get or wait() repairs it: nothing waits for an item that
// is there. Liveness is kill(pid, 0): a zombie counts as alive until its parent reaps it.
// The pipe costs a write, two reads and an exception per item, several times the ring's own
// cost, and only a process that waits on fileno() (ProcessPoolExecutor, connection.wait)
// needs it. So the word starts at DOORBELL_OFF, where puts and gets skip the protocol, and
// fileno() or a waiting poll() arms it (OFF -> 0, once, for every process) and then rings
// like a put if items are queued. A put that saw OFF committed under the mutex before it
// read the word; the armer's CAS precedes its own locked re-check, so either the re-check
// sees that item or the put saw the word armed: no item is left without a byte.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "common/deadline.h"
#include "sync/condition.h"
#include "sync/robust_mutex.h"

namespace torch_mp_ext {

constexpr uint64_t RING_MAGIC = 0x31474e4952584d54ULL;  // "TMXRING1" little-endian
/// 2: holder keys carry the flags of Note [Holder tables]; 3: the doorbell word names its
/// ringer (Note [Doorbell]); 4: the ring grows in place (Note [Ring growth]); 5: the doorbell
/// starts off and is armed by the first watcher (Note [Doorbell]).
constexpr uint32_t RING_VERSION = 5;
/// `doorbell` before anyone watched the pipe: puts and gets skip the protocol (no key is 1).
constexpr uint64_t DOORBELL_OFF = 1;
constexpr uint32_t RING_JOINABLE = 1u << 0;
/// Frame header bytes: uint32 payload size + uint32 tag.
constexpr uint64_t FRAME_HEADER = 8;
/// The largest data area a ring may grow to (Note [Ring growth]); one frame is at most 4 GiB.
constexpr uint64_t MAX_RING_CAPACITY = uint64_t{1} << 46;
/// Default busy-wait before sleeping: about the time a Python producer needs to make its next
/// item, so a 1→1 stream rarely pays for a futex wake-up (measured in benchmarks/bench_queue.py).
constexpr int64_t DEFAULT_SPIN_NS = 50000;
/// Most a waiter spins before it sleeps (a larger spin_ns in a header is corruption).
constexpr int64_t MAX_SPIN_NS = 1000000000;
/// Processes a ring tracks by identity (Note [Ring holders]); more are counted, not judged.
constexpr size_t MAX_RING_HOLDERS = 128;

enum class Status : uint32_t {
  Ok = 0,
  Empty = 1,        ///< get: nothing before the deadline; task_done: nothing unfinished
  Full = 2,         ///< put: no room before the deadline
  Timeout = 3,      ///< join: tasks still unfinished at the deadline
  Closed = 4,       ///< the caller's queue object was closed (a process-local state)
  Interrupted = 5,  ///< a signal or a wait slice ended the wait: run signal handlers, retry
  Busy = 6,         ///< try_only: another process holds the mutex
};

struct RingOptions {
  uint64_t capacity = 0;  ///< bytes of frames the ring holds at first (rounded up to 8)
  /// Bytes it may grow to (Note [Ring growth]); 0: `capacity`, it never grows.
  uint64_t max_capacity = 0;
  bool in_dev_shm = true;  ///< where its pages come from: decides the no-space hint
  uint64_t maxsize = 0;   ///< most frames at once; 0: only bytes limit
  bool joinable = false;  ///< count unfinished tasks (JoinableQueue)
  int64_t spin_ns = DEFAULT_SPIN_NS;
};

struct FrameIn {
  const char* data;
  uint32_t size;
  uint32_t tag;
};

struct FrameOut {
  uint32_t tag;
  uint32_t size;
  size_t offset;  ///< into the FrameBuffer
};

/// A growable byte buffer that does not zero what it grows into.
class FrameBuffer {
 public:
  void clear() { size_ = 0; }
  char* data() const { return buf_.get(); }
  size_t size() const { return size_; }
  /// Appends `n` uninitialised bytes; returns where they start.
  char* append(size_t n);

 private:
  std::unique_ptr<char[]> buf_;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

struct RingState {
  uint64_t head;
  uint64_t tail;
  uint64_t count;
  uint64_t unfinished;
  uint64_t capacity;  ///< bytes of the data area in use now (Note [Ring growth])
};

struct RingHeader;

/// Test hook: a process that sets a crash point SIGKILLs itself when an operation reaches it.
enum class CrashPoint : int {
  None = 0,
  HoldingLock = 1,         ///< right after taking the mutex in put/get
  PutBeforeCommit = 2,     ///< frames copied in, journal written, not committed
  PutAfterCommit = 3,      ///< committed, state not yet updated
  GetBeforeCommit = 4,     ///< frames copied out, not committed
  GetAfterCommit = 5,      ///< committed, state not yet updated
  BellNoByte = 6,          ///< Note [Doorbell]: a put (or repair) took the word, no byte yet
  BellDrained = 7,         ///< Note [Doorbell]: a get claimed the word and drained the pipe
};
void set_crash_point(CrashPoint point);

/// (field, offset, size) of every field of the ring's shared header: for the fuzz tests that
/// write garbage into rings (tests/test_fuzz.py), never used by the core.
std::vector<std::tuple<const char*, size_t, size_t>> ring_layout();

/// A view of a ring in mapped memory; copyable, owns nothing. Every method is thread- and
/// process-safe; blocking methods must be called without the GIL.
class Ring {
 public:
  static size_t header_bytes();
  /// Bytes of memory a ring of `capacity` needs.
  static size_t footprint(uint64_t capacity);
  /// Bytes a frame of `payload` bytes takes in the ring.
  static uint64_t frame_bytes(uint64_t payload) {
    return FRAME_HEADER + ((payload + 7) & ~uint64_t{7});
  }

  /// Constructs a new ring in `memory` (`size` bytes), held once by this process.
  static Ring create(void* memory, size_t size, const RingOptions& options);
  /// Validates and views an existing ring (CorruptSegmentError if it is not one).
  static Ring open(void* memory, size_t size);

  /// Puts `n` frames, all or none, in order. Waits for room until `deadline` unless
  /// `try_only` (then it never waits, not even for the mutex: Busy). Ok, Full, Closed,
  /// Interrupted or Busy. ValueError (std::invalid_argument) if they can never fit.
  Status put(const FrameIn* frames, size_t n, const Deadline& deadline,
             const std::atomic<bool>* closed, bool try_only);
  /// Takes up to `max_frames` frames (at least one) into `bytes` and `frames`. Waits until
  /// `deadline` unless `try_only`. Ok, Empty, Closed, Interrupted or Busy. `closed` may be
  /// null (drain: ignore the caller's closed state).
  Status get(FrameBuffer& bytes, std::vector<FrameOut>& frames, size_t max_frames,
             const Deadline& deadline, const std::atomic<bool>* closed, bool try_only);
  /// Waits until one frame of `payload` bytes would fit (the item count below maxsize, the
  /// bytes within the largest capacity), putting nothing: Ok, Full at the deadline, Closed
  /// or Interrupted. A producer that must not make an item before there is room for it
  /// (Note [Produce into room] in pipeline/links.py) sleeps on `not_full` like a put.
  Status wait_room(size_t payload, const Deadline& deadline, const std::atomic<bool>* closed);
  /// One task done (JoinableQueue): Ok, or Empty when none is unfinished.
  Status task_done();
  /// Waits until no task is unfinished: Ok, Timeout, Closed or Interrupted.
  Status join(const Deadline& deadline, const std::atomic<bool>* closed);
  /// Wakes every waiter of this ring in every process (they re-check their predicates).
  void wake_all();

  struct Counts {
    uint64_t count;
    uint64_t used_bytes;
    uint64_t unfinished;
  };
  /// Read together under the mutex; nullopt if it could not be taken by `deadline` (the
  /// caller retries after running signal handlers: a stopped peer must not freeze it).
  std::optional<Counts> counts(const Deadline& deadline);

  /// Note [Doorbell]: true if the caller must write a byte to the wake-up pipe (the flag was
  /// clear or named a dead process; it names the caller now).
  bool doorbell_should_ring();
  /// A getter about to drain the pipe takes the duty to ring over, whoever had it; false
  /// (and nothing to do) while nobody watches the pipe.
  bool doorbell_claim();
  /// Someone is about to watch the pipe: turns the protocol on for every process (once).
  void doorbell_arm();
  /// The getter found the ring empty after draining: clears the flag if it still names us.
  void doorbell_release();
  /// The pid owing a byte, 0 if none (tests).
  /// This process's spinning on this ring (Note [Adaptive spinning]).
  SpinPolicy::State spin_state() const { return spin_.state(); }
  uint64_t doorbell_owner() const;

  /// Note [Ring holders]: `n` more queue objects of this process hold the ring.
  void add_holders(uint32_t n);
  /// One queue object of this process lets go. Sets `*reaped` to the holders of dead
  /// processes it removed (their block references are the caller's to drop); returns true if
  /// no holder is left anywhere.
  bool remove_holder(uint32_t* reaped);
  /// A pickle of the queue is made / was opened (it carries one holder across).
  void share_holder();
  void adopt_shared_holder();
  /// Holders of every process, dead or alive, plus those in flight.
  std::optional<int64_t> holders(const Deadline& deadline);
  struct HolderInfo {
    int64_t pid;
    uint32_t refs;
    bool alive;
  };
  /// The processes in the holder table (diagnostics and tests).
  std::optional<std::vector<HolderInfo>> holder_table(const Deadline& deadline);

  /// Bytes of the data area in use now (grows and shrinks back: Note [Ring growth]).
  uint64_t capacity() const;
  /// Bytes of frames it may ever hold.
  uint64_t max_capacity() const;
  uint64_t maxsize() const;
  bool joinable() const;
  uint64_t recoveries() const;
  bool broken() const;

 private:
  explicit Ring(RingHeader* header);
  enum class Lock { Ok, Busy, TimedOut };
  /// `untimed`: the caller retries slices of `deadline` until it gets the mutex (a read
  /// that runs signal handlers between slices): judged like an infinite deadline.
  Lock lock(const Deadline& deadline, bool try_only, bool untimed = false);
  /// The mutex is taken: waits in slices, judging its owner (Note [A lock nobody holds]).
  RobustMutex::Acquired lock_slow(const Deadline& deadline, bool untimed);
  enum class Owner { Holder, Garbage, Doubtful };
  /// Who thread `tid`, named by the lock word, is (Note [A lock nobody holds]).
  Owner judge_owner(pid_t tid) const;
  /// The lock word is still `lock_word`, whose owner this thread has waited on for `waited_ns`:
  /// CorruptSegmentError if it is garbage, or doubtful for long enough in an `untimed` wait;
  /// true (give up: time out) if it is doubtful for long enough in a timed one.
  bool owner_hopeless(uint32_t lock_word, int64_t waited_ns, bool untimed);
  void unlock();
  void repair();
  bool chain_ok() const;
  void commit(const RingState& next, CrashPoint after_commit);
  void copy_in(uint64_t cap, uint64_t pos, const void* src, size_t n);
  void copy_out(uint64_t cap, uint64_t pos, void* dst, size_t n) const;
  /// Under the mutex: a state with room for `total` more bytes, its new pages reserved and
  /// the wrapped frames moved (Note [Ring growth]); throws SyscallError(ENOSPC) with the fix.
  RingState grown(uint64_t total);
  /// Under the mutex, after a commit that emptied a grown ring: returns its pages.
  void release_growth(uint64_t from, uint64_t to);
  struct Held;
  /// Releases the mutex and waits on `cond` for one slice at most. Ok: the mutex is held
  /// again, re-check the predicate; otherwise (Interrupted, `on_timeout`) it is not held.
  Status wait_on(Held& held, SharedCondition& cond, const Deadline& deadline,
                 Status on_timeout);

  /// Checks the shared state (head, tail) against capacity_ under the mutex: a peer that
  /// wrote garbage there marks the ring broken instead of steering a copy out of bounds.
  void check_state();

  RingHeader* h_;
  char* data_;
  uint64_t capacity_;  ///< validated copy of h_->capacity (Note [Geometry snapshot])
  uint64_t max_capacity_;  ///< validated copy of h_->max_capacity (Note [Ring growth])
  int64_t spin_ns_;    ///< validated copy of h_->spin_ns
  SpinPolicy spin_;    ///< this process's spinning on this ring (Note [Adaptive spinning])
};

}  // namespace torch_mp_ext
