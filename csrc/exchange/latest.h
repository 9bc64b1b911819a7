// A versioned latest-value channel in shared memory: one writer, many readers.
//
// Note [Latest-value channel]
// The learner of an RL job publishes a new state_dict after every step; each collector wants
// the newest *complete* one when it starts its next step, never a mix of two. The channel is
// one block of shared memory holding a header and K equal buffers (K >= 2, default 3):
//
//   offset 0        LatestHeader   magic, layout version, K, buffer size, creator's pid
//                                  namespace (home of the holder slots: writer, readers)
//                                  writer   holder key of the process inside a publish (or 0)
//                                  publisher  holder key of the process that publishes (the
//                                           learner; Note [Publisher death])
//                                  latest   newest committed version + 1 (0: none yet)
//                                  changed  futex condition, notified by every commit and by
//                                           close (Note [Why not pthread_cond_t])
//                                  released futex condition, notified by every unpin
//                                           (Note [Borrowed versions])
//                                  stamps[K]     per buffer: 0 empty | version + 1 complete,
//                                                | WRITING while the writer fills it
//                                  published[K]  per buffer: CLOCK_MONOTONIC ns of its commit
//                                  readers[R]    slot: holder key + pinned buffer (index + 1)
//   data_offset     buffer 0 | buffer 1 | ... | buffer K-1   (page aligned, buffer_stride each)
//
//   publish v:  claim the writer word -> pick a back buffer b (never the newest complete
//               one) -> stamp[b] |= WRITING -> no live reader pins b? (else restore, try the
//               next) -> copy -> published[b] = now -> stamp[b] = v + 1 (the flip: one atomic
//               store) -> latest = v + 1 -> notify `changed` -> release the writer word
//   read:       claim a reader slot -> pick the newest complete stamp matching the query
//               (version > newer_than and version % multiple_of == 0; none: wait on `changed`)
//               -> pin b in the slot -> re-check stamp[b] (changed: unpin, pick again) ->
//               copy -> unpin and free the slot
//
// Invariants.
// - The newest complete buffer is never written: whenever any version was committed, a
//   complete one is readable, whatever happened to the writer.
// - A pinned buffer is never written. Pin (reader: store pin, then load stamp) and claim
//   (writer: store WRITING, then load pins) are sequentially consistent, Dekker style: either
//   the writer sees the pin and backs off, or the reader sees WRITING and picks again. So a
//   copy out of a pinned buffer cannot tear; end_read re-checks the stamp all the same.
// - Nothing is a lock. A writer SIGKILLed mid-publish leaves its buffer stamped WRITING and
//   its key in the writer word: readers skip the buffer, and the next writer sees the key's
//   process is dead, takes the word over and reuses the buffer. A reader SIGKILLed mid-read
//   leaves a pin: the writer only looks at pins' liveness when every back buffer is pinned,
//   clears the dead one's slot and goes on. A reader killed while waiting leaves nothing.
// - The writer word and the reader slots are holder-table slots (Note [Holder tables]): keys
//   are (pid << 32 | start time), so a recycled pid is not mistaken for the dead process;
//   holders from another pid namespace than the creator's are never judged dead (they are
//   waited for instead). A dead reader's slot is reaped: its pin cleared, then the slot freed.
// - Versions increase strictly (a commit of a version <= latest is refused), so "newer than v"
//   is a plain comparison, on one host or across hosts, and never needs a clock.
//
// Note [Publisher death]
// A collector loops `while not exchanger.finished: receive()`; "finished" must mean the
// learner closed the channel, never that it died. The learner records itself in the
// `publisher` holder slot (set_publisher, when its exchanger is made and at each publish).
// When that process is found dead (check_publisher: holder_word_dead, so a recycled pid or
// another pid namespace never counts as dead) while the channel is open, the channel is
// closed with CLOSED_PUBLISHER_DIED by one compare-and-swap: every waiter wakes as for
// close(), reads what is there, and then learns the publisher died (PeerDiedError in
// Python), never a normal finish. A new publisher (set_publisher by another process: a
// restarted learner, or a writer taking over from one killed mid-publish) opens the channel
// again; close() is always the normal end. Nothing here waits for the death: a waiting process watches the
// publisher's pidfd (torch_mp_ext/exchange/publisher.py) and calls check_publisher when it
// fires, so a blocked reader costs no CPU and still wakes at once.
//
// Note [Borrowed versions]
// A collector that reads in place (StateDictChannel.borrow_into, ModelExchanger(copy=False))
// keeps its pin for as long as its model's tensors view the buffer: begin_read without the
// copy, end_read when the last view dies (torch_mp_ext/exchange/borrow.py), so a pin lasts a
// whole collector step, not one memcpy. Nothing else changes, and the invariants above are
// what make it safe: a pinned buffer is never written, so a borrowed version never changes
// under its reader and is never torn. The pool is the channel's K buffers, fixed when it is
// made (the memory bound: K state_dicts, whatever the readers do). The writer takes the
// oldest buffer that is neither the newest version nor pinned; pins of one version share one
// buffer, so K >= 2 + (distinct versions pinned) means the writer never waits: K = 3 with
// collectors that all borrow the newest version, K = collectors + 2 for any interleaving.
// When every back buffer is pinned the writer waits (policy: wait, never grow past K) on
// `released`, a condition every unpin notifies, so it costs no CPU; a pin whose holder died
// (SIGKILL) is cleared by the writer itself: before it sleeps, and again at every wake-up,
// it judges the pinning processes (Note [Holder tables]); the Python binding waits in 50 ms
// slices for Ctrl-C, each slice a fresh begin_write, so a dead borrower holds the writer up
// for at most one slice. (Waking on the death itself would need a pidfd per pinning
// process; a slice's wake-up costs a few system calls, only while every buffer is pinned.) A reader that
// waits for a free slot (all LATEST_READER_SLOTS pinned) waits on `released` the same way.
//
// Note [Prefaulted buffers]
// The first touch of a shared page costs each process a page fault (microseconds, and ~25,000
// of them per 100 MB), and each of the K buffers is touched for the first time at a different
// publish. So the channel maps all of its pages when it is made and when a process attaches
// (MADV_POPULATE_WRITE, Linux >= 5.14): publishes and reads then never fault, from the first.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/deadline.h"
#include "sync/condition.h"
#include "sync/holders.h"

namespace torch_mp_ext {

constexpr uint64_t LATEST_MAGIC = 0x3154534554414c54ULL;  // "TLATEST1" little-endian
/// 2: readers and writer are holder-table slots (Note [Holder tables]), home `pidns`.
/// 3: the `released` condition, up to 64 buffers (Note [Borrowed versions]).
constexpr uint32_t LATEST_LAYOUT_VERSION = 3;
/// Buffers per channel: 2 is double buffering; more lets slow readers (and collectors that
/// borrow versions, Note [Borrowed versions]) hold old versions without making the writer wait.
constexpr uint32_t LATEST_MAX_BUFFERS = 64;
/// Reads that can be in progress at once (each holds one slot only while it reads).
constexpr uint32_t LATEST_READER_SLOTS = 128;
constexpr uint64_t STAMP_WRITING = uint64_t{1} << 63;
/// LatestHeader::closed: close() was called (the normal end).
constexpr uint32_t CLOSED_BY_PUBLISHER = 1;
/// LatestHeader::closed: the publisher died without closing (Note [Publisher death]).
constexpr uint32_t CLOSED_PUBLISHER_DIED = 2;
/// Versions are 0 .. LATEST_MAX_VERSION (stamps store version + 1 beside the WRITING bit).
constexpr uint64_t LATEST_MAX_VERSION = (uint64_t{1} << 62) - 1;
/// Largest buffer (2^48 bytes: 256 TiB): keeps every size sum of a channel far from 2^64.
constexpr uint64_t LATEST_MAX_BUFFER_BYTES = uint64_t{1} << 48;

struct alignas(64) LatestBufferState {
  std::atomic<uint64_t> stamp;         ///< 0 | version + 1, possibly | STAMP_WRITING
  std::atomic<uint64_t> published_ns;  ///< CLOCK_MONOTONIC time of the commit
};

struct LatestReaderSlot {
  HolderSlot holder;             ///< the reading process (Note [Holder tables])
  uint64_t reserved2;
  std::atomic<uint32_t> pinned;  ///< index + 1 of the buffer being read; 0: none
  uint32_t reserved0;
  uint64_t reserved1;
};
static_assert(sizeof(LatestReaderSlot) == 32, "LatestReaderSlot is part of the shared layout");

struct LatestHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t nbuffers;
  uint64_t buffer_bytes;
  uint64_t buffer_stride;
  uint64_t data_offset;
  uint64_t total_bytes;
  uint64_t pidns;  ///< the creator's pid namespace: home of the holder tables below
  alignas(64) HolderSlot writer;  ///< a one-slot holder table: the process inside a publish
  HolderSlot publisher;          ///< the process that publishes, 0: none yet (Note [Publisher death])
  std::atomic<uint64_t> latest;  ///< newest committed version + 1; 0: none yet
  SharedCondition changed;       ///< notified by every commit and by close (8 bytes)
  std::atomic<uint32_t> closed;  ///< 0 open, CLOSED_BY_PUBLISHER, CLOSED_PUBLISHER_DIED
  SharedCondition released;      ///< notified by every unpin (Note [Borrowed versions])
  LatestBufferState buffers[LATEST_MAX_BUFFERS];
  LatestReaderSlot readers[LATEST_READER_SLOTS];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared atomics must be lock-free");

enum class LatestStatus : int {
  Ok = 0,
  Timeout = 1,     ///< nothing matching before the deadline (read), or every buffer pinned
  Closed = 2,      ///< closed, and nothing newer will come
  Stale = 3,       ///< begin_write: the version is not above the latest one
  WriterBusy = 4,  ///< begin_write: another live process is publishing
  Interrupted = 5, ///< a signal interrupted the wait: run signal handlers, then retry
};

/// A read in progress: which buffer is pinned, by which slot, holding which version.
struct ReadTicket {
  uint32_t index = 0;
  uint32_t slot = 0;
  uint64_t version = 0;
  uint64_t published_ns = 0;
};

/// One contiguous copy between a buffer and this process's memory.
struct CopySpan {
  uint64_t offset;   ///< inside the buffer
  uintptr_t address; ///< in this process
  uint64_t nbytes;
};

/// A view of a channel laid out in caller-provided shared memory (Note [Latest-value channel]).
/// Process-safe; the object itself holds no state beyond the pointers.
class LatestChannel {
 public:
  /// Bytes a channel of `nbuffers` buffers of `buffer_bytes` needs.
  static uint64_t required_bytes(uint32_t nbuffers, uint64_t buffer_bytes);

  /// `create`: lays the channel out in `base` (no other process may see it yet); otherwise
  /// validates the layout there (CorruptSegmentError when it is not this channel).
  LatestChannel(char* base, uint64_t capacity, uint32_t nbuffers, uint64_t buffer_bytes,
                bool create);

  /// Writer: claims a back buffer for `version` (waiting while every one is pinned).
  /// @note one publish at a time per channel; another process's is WriterBusy.
  LatestStatus begin_write(uint64_t version, const Deadline& deadline, uint32_t* index,
                           uint64_t* busy_key);
  /// Writer: the flip. `index` becomes the newest complete version.
  void commit(uint32_t index, uint64_t version);
  /// Writer: gives the buffer up without publishing (its old contents are lost).
  void abort(uint32_t index);

  /// Reader: pins the newest complete buffer with version > newer_than (-1: any) and
  /// version % multiple_of == 0, waiting until there is one. Always end_read an Ok ticket.
  LatestStatus begin_read(int64_t newer_than, uint64_t multiple_of, const Deadline& deadline,
                          ReadTicket* ticket);
  /// Reader: unpins; false if the buffer changed under the read (Note: cannot happen unless
  /// a writer misjudged this process dead), in which case the caller reads again.
  bool end_read(const ReadTicket& ticket);
  /// Waits, pinning nothing, until a version matching the query is complete.
  LatestStatus wait(int64_t newer_than, uint64_t multiple_of, const Deadline& deadline);
  /// The newest complete version matching the query and its commit time, without waiting.
  bool peek(int64_t newer_than, uint64_t multiple_of, uint64_t* version,
            uint64_t* published_ns) const;

  /// Newest committed version, -1 if none.
  int64_t latest() const;
  /// No version will come any more: wakes every waiter; reads of what is there still work.
  void close();
  /// Closed for any reason (close(), or the publisher died).
  bool closed() const;
  /// Records this process as the channel's publisher (Note [Publisher death]).
  void set_publisher();
  /// The publisher's holder key (Note [Process identity]); 0 when none was recorded.
  uint64_t publisher() const { return header_->publisher.key(); }
  /// If the channel is open and its publisher is known dead, closes it as
  /// CLOSED_PUBLISHER_DIED (waking every waiter). True when the channel is closed so.
  bool check_publisher();
  /// True when the channel was closed because its publisher died.
  bool publisher_died() const;

  void copy_in(uint32_t index, const std::vector<CopySpan>& spans);
  void copy_out(uint32_t index, const std::vector<CopySpan>& spans) const;

  uint64_t buffer_offset(uint32_t index) const;
  uint32_t nbuffers() const { return nbuffers_; }
  uint64_t buffer_bytes() const { return buffer_bytes_; }
  const LatestHeader& header() const { return *header_; }

 private:
  int select(int64_t newer_than, uint64_t multiple_of, uint64_t* stamp) const;
  bool try_claim(uint32_t index, bool judge_pins);
  bool claim_slot(uint32_t* slot);
  void release_slot(uint32_t slot);
  HolderTable readers() const;
  LatestStatus wait_changed(uint32_t seen, const Deadline& deadline);
  LatestStatus wait_on(SharedCondition& cond, uint32_t seen, const Deadline& deadline);

  LatestHeader* header_;
  char* base_;
  // The validated geometry (Note [Geometry snapshot] in shm/segment.h): never re-read.
  uint32_t nbuffers_;
  uint64_t buffer_bytes_;
  uint64_t buffer_stride_;
  uint64_t data_offset_;
};

}  // namespace torch_mp_ext
