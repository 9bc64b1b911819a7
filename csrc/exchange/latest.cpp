// The versioned latest-value channel (Note [Latest-value channel] in latest.h).
#include "exchange/latest.h"

#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "common/arith.h"
#include "common/check.h"
#include "common/errors.h"
#include "platform/process.h"

namespace torch_mp_ext {

namespace {

constexpr uint64_t PAGE = 4096;  // buffer alignment: whole pages suit memcpy and huge pages

bool complete(uint64_t stamp) { return stamp != 0 && (stamp & STAMP_WRITING) == 0; }

/// Maps every page of [begin, begin + n) into this process now (Note [Prefaulted buffers]).
void prefault(char* begin, uint64_t n) {
#ifdef MADV_POPULATE_WRITE
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  uintptr_t lo = (reinterpret_cast<uintptr_t>(begin) + page - 1) & ~(page - 1);
  uintptr_t hi = (reinterpret_cast<uintptr_t>(begin) + n) & ~(page - 1);
  if (hi > lo) {
    // Best effort: kernels before 5.14 answer EINVAL, and the pages fault in on first use.
    (void)::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE);
  }
#else
  (void)begin;
  (void)n;
#endif
}

}  // namespace

uint64_t LatestChannel::required_bytes(uint32_t nbuffers, uint64_t buffer_bytes) {
  TMX_CHECK_VALUE(buffer_bytes <= LATEST_MAX_BUFFER_BYTES, "a latest-value channel buffer of ",
                  buffer_bytes, " bytes is larger than the ", LATEST_MAX_BUFFER_BYTES,
                  " bytes supported");
  TMX_CHECK_VALUE(nbuffers <= LATEST_MAX_BUFFERS, "a latest-value channel has at most ",
                  LATEST_MAX_BUFFERS, " buffers, got ", nbuffers);
  // Both bounds keep this sum far below 2^64: no wrap-around.
  return round_up(sizeof(LatestHeader), PAGE) + nbuffers * round_up(buffer_bytes, PAGE);
}

LatestChannel::LatestChannel(char* base, uint64_t capacity, uint32_t nbuffers,
                             uint64_t buffer_bytes, bool create)
    : header_(reinterpret_cast<LatestHeader*>(base)),
      base_(base),
      nbuffers_(nbuffers),
      buffer_bytes_(buffer_bytes),
      buffer_stride_(0),
      data_offset_(round_up(sizeof(LatestHeader), PAGE)) {
  TMX_CHECK_VALUE(nbuffers >= 2 && nbuffers <= LATEST_MAX_BUFFERS,
                  "a latest-value channel needs 2 to ", LATEST_MAX_BUFFERS,
                  " buffers, got ", nbuffers);
  uint64_t need = required_bytes(nbuffers, buffer_bytes);
  buffer_stride_ = round_up(buffer_bytes, PAGE);
  if (create) {
    TMX_CHECK_VALUE(capacity >= need, "a channel of ", nbuffers, " buffers of ", buffer_bytes,
                    " bytes needs ", need, " bytes of shared memory, the block has ", capacity);
    // Pooled blocks come back dirty: every word of the header starts from zero.
    std::memset(static_cast<void*>(base), 0, sizeof(LatestHeader));
    header_->layout_version = LATEST_LAYOUT_VERSION;
    header_->nbuffers = nbuffers;
    header_->buffer_bytes = buffer_bytes;
    header_->buffer_stride = round_up(buffer_bytes, PAGE);
    header_->data_offset = round_up(sizeof(LatestHeader), PAGE);
    header_->total_bytes = need;
    header_->pidns = self_pidns();
    std::atomic_thread_fence(std::memory_order_release);
    header_->magic = LATEST_MAGIC;
    prefault(base + header_->data_offset, need - header_->data_offset);
    return;
  }
  if (capacity < need) {
    throw CorruptSegmentError(detail::str_cat(
        "a latest-value channel of ", nbuffers, " buffers of ", buffer_bytes, " bytes needs ",
        need, " bytes, but the block its handle names has ", capacity));
  }
  if (header_->magic != LATEST_MAGIC) {
    throw CorruptSegmentError("shared memory handed over as a latest-value channel is not one "
                              "(bad magic); was the handle pickled by another program?");
  }
  if (header_->layout_version != LATEST_LAYOUT_VERSION) {
    throw CorruptSegmentError(detail::str_cat(
        "latest-value channel of layout version ", header_->layout_version, ", this build reads ",
        LATEST_LAYOUT_VERSION, ": every process of a job must use one torch_mp_ext build"));
  }
  // Note [Geometry snapshot] (shm/segment.h): the geometry is the handle's, checked once
  // against the header; the members are used from here on, never the shared fields.
  if (header_->nbuffers != nbuffers || header_->buffer_bytes != buffer_bytes) {
    throw CorruptSegmentError(detail::str_cat(
        "latest-value channel holds ", header_->nbuffers, " buffers of ", header_->buffer_bytes,
        " bytes, its handle said ", nbuffers, " of ", buffer_bytes));
  }
  auto corrupt = [](const char* field, uint64_t value, uint64_t expected) {
    return CorruptSegmentError(detail::str_cat(
        "latest-value channel is corrupt: header field '", field, "' is ", value, ", expected ",
        expected, "; a process wrote garbage into its shared memory"));
  };
  if (header_->buffer_stride != buffer_stride_) {
    throw corrupt("buffer_stride", header_->buffer_stride, buffer_stride_);
  }
  if (header_->data_offset != data_offset_) {
    throw corrupt("data_offset", header_->data_offset, data_offset_);
  }
  if (header_->total_bytes != need) throw corrupt("total_bytes", header_->total_bytes, need);
  prefault(base + data_offset_, need - data_offset_);
}

uint64_t LatestChannel::buffer_offset(uint32_t index) const {
  TMX_CHECK_VALUE(index < nbuffers_, "buffer index ", index, " out of range [0, ",
                  nbuffers_, ")");
  return data_offset_ + index * buffer_stride_;
}

int LatestChannel::select(int64_t newer_than, uint64_t multiple_of, uint64_t* stamp) const {
  int best = -1;
  uint64_t best_stamp = 0;
  for (uint32_t i = 0; i < nbuffers_; ++i) {
    uint64_t s = header_->buffers[i].stamp.load(std::memory_order_acquire);
    if (!complete(s)) continue;
    uint64_t version = s - 1;
    if (newer_than >= 0 && version <= static_cast<uint64_t>(newer_than)) continue;
    if (multiple_of > 1 && version % multiple_of != 0) continue;
    if (s > best_stamp) {
      best = static_cast<int>(i);
      best_stamp = s;
    }
  }
  *stamp = best_stamp;
  return best;
}

// ---- writer --------------------------------------------------------------------------------

bool LatestChannel::try_claim(uint32_t index, bool judge_pins) {
  auto& stamp = header_->buffers[index].stamp;
  uint64_t old = stamp.load(std::memory_order_seq_cst);
  stamp.store(old | STAMP_WRITING, std::memory_order_seq_cst);
  for (uint32_t s = 0; s < LATEST_READER_SLOTS; ++s) {
    LatestReaderSlot& slot = header_->readers[s];
    if (slot.pinned.load(std::memory_order_seq_cst) != index + 1) continue;
    if (judge_pins) {
      HolderTable table = readers();
      if (slot.holder.begin_reap(table.home_ns(), table.self())) {
        // A dead reader's slot is ours now (no reader can claim it meanwhile): unpin, free.
        slot.pinned.store(0, std::memory_order_seq_cst);
        slot.holder.end_reap(table.self());
        continue;
      }
    }
    stamp.store(old, std::memory_order_seq_cst);  // a live reader: leave it alone
    return false;
  }
  return true;
}

LatestStatus LatestChannel::begin_write(uint64_t version, const Deadline& deadline,
                                        uint32_t* index, uint64_t* busy_key) {
  TMX_CHECK_VALUE(version <= LATEST_MAX_VERSION, "version ", version, " is above the maximum ",
                  LATEST_MAX_VERSION);
  if (closed()) return LatestStatus::Closed;
  const uint64_t me = holder_word_of_self(header_->pidns);
  for (;;) {  // the writer word: free, or held by a process that died mid-publish
    if (header_->writer.claim(me)) break;
    if (header_->writer.begin_reap(header_->pidns, me)) {
      header_->writer.end_reap(me);  // its buffer stays WRITING: picked first below
      continue;
    }
    uint64_t cur = header_->writer.key();
    if (cur == 0) continue;
    *busy_key = cur;
    return LatestStatus::WriterBusy;
  }
  if (version + 1 <= header_->latest.load()) {
    header_->writer.release(me);
    return LatestStatus::Stale;
  }
  const uint32_t n = nbuffers_;
  for (int attempt = 0;; ++attempt) {
    uint32_t seen = header_->released.snapshot();  // before the pins are looked at
    // Candidates: every buffer but the newest complete one; empty or abandoned ones first,
    // then the oldest versions (the ones readers are least likely to want).
    uint64_t newest_stamp = 0;
    int newest = select(-1, 1, &newest_stamp);
    uint32_t order[LATEST_MAX_BUFFERS];
    uint32_t count = 0;
    for (uint32_t i = 0; i < n; ++i) {
      if (static_cast<int>(i) != newest) order[count++] = i;
    }
    auto rank = [this](uint32_t i) {
      uint64_t s = header_->buffers[i].stamp.load();
      return complete(s) ? s : 0;
    };
    std::sort(order, order + count, [&](uint32_t a, uint32_t b) { return rank(a) < rank(b); });
    for (uint32_t k = 0; k < count; ++k) {
      if (try_claim(order[k], attempt > 0)) {
        *index = order[k];
        return LatestStatus::Ok;
      }
    }
    if (deadline.expired()) {
      header_->writer.release(me);
      return LatestStatus::Timeout;
    }
    if (attempt == 0) continue;  // judge the pinning processes before sleeping
    // Every back buffer is pinned by a live reader: sleep until one unpins (Note [Borrowed
    // versions]). The writer word stays ours meanwhile: a publish in progress.
    LatestStatus st = wait_on(header_->released, seen, deadline);
    if (st == LatestStatus::Interrupted) {
      header_->writer.release(me);
      return st;
    }
  }
}

void LatestChannel::commit(uint32_t index, uint64_t version) {
  TMX_CHECK(index < nbuffers_, "commit of buffer ", index);
  LatestBufferState& b = header_->buffers[index];
  TMX_CHECK(b.stamp.load() & STAMP_WRITING, "commit of buffer ", index, " not claimed");
  b.published_ns.store(static_cast<uint64_t>(monotonic_ns()), std::memory_order_relaxed);
  b.stamp.store(version + 1, std::memory_order_seq_cst);  // the flip
  header_->latest.store(version + 1, std::memory_order_seq_cst);
  header_->writer.release(holder_word_of_self(header_->pidns));
  header_->changed.notify_all();
}

void LatestChannel::abort(uint32_t index) {
  if (index < nbuffers_) header_->buffers[index].stamp.store(0);
  header_->writer.release(holder_word_of_self(header_->pidns));
}

void LatestChannel::copy_in(uint32_t index, const std::vector<CopySpan>& spans) {
  TMX_CHECK_VALUE(index < nbuffers_ &&
                      (header_->buffers[index].stamp.load() & STAMP_WRITING) &&
                      header_->writer.word() == holder_word_of_self(header_->pidns),
                  "copy_in: buffer ", index, " is not claimed by this process (begin_write)");
  char* dst = base_ + buffer_offset(index);
  for (const CopySpan& s : spans) {
    TMX_CHECK_VALUE(s.nbytes <= buffer_bytes_ && s.offset <= buffer_bytes_ - s.nbytes,
                    "copy_in: span [", s.offset, ", +", s.nbytes, ") outside the ",
                    buffer_bytes_, "-byte buffer");
    std::memcpy(dst + s.offset, reinterpret_cast<const void*>(s.address), s.nbytes);
  }
}

// ---- reader --------------------------------------------------------------------------------

HolderTable LatestChannel::readers() const {
  return HolderTable(header_->readers, LATEST_READER_SLOTS, &LatestReaderSlot::holder,
                     header_->pidns);
}

bool LatestChannel::claim_slot(uint32_t* slot) {
  HolderTable table = readers();
  int s = table.claim();
  if (s < 0) {  // every slot taken: free those of dead readers (unpin, then release)
    table.reap([&](size_t i) { header_->readers[i].pinned.store(0, std::memory_order_seq_cst); });
    s = table.claim();
  }
  if (s < 0) return false;
  header_->readers[s].pinned.store(0, std::memory_order_seq_cst);
  *slot = static_cast<uint32_t>(s);
  return true;
}

void LatestChannel::release_slot(uint32_t slot) {
  header_->readers[slot].pinned.store(0, std::memory_order_seq_cst);
  header_->readers[slot].holder.release(readers().self());
  header_->released.notify_all();  // no system call unless a writer or reader sleeps on it
}

LatestStatus LatestChannel::begin_read(int64_t newer_than, uint64_t multiple_of,
                                       const Deadline& deadline, ReadTicket* ticket) {
  uint32_t slot = 0;
  for (;;) {  // more readers than slots: queue up until one unpins (Note [Borrowed versions])
    uint32_t seen = header_->released.snapshot();
    if (claim_slot(&slot)) break;
    if (deadline.expired()) return LatestStatus::Timeout;
    LatestStatus st = wait_on(header_->released, seen, deadline);
    if (st == LatestStatus::Interrupted) return st;
  }
  LatestReaderSlot& r = header_->readers[slot];
  for (;;) {
    uint32_t seen = header_->changed.snapshot();
    uint64_t stamp = 0;
    int b = select(newer_than, multiple_of, &stamp);
    if (b < 0) {
      LatestStatus st = closed() ? LatestStatus::Closed : wait_changed(seen, deadline);
      if (st != LatestStatus::Ok) {
        release_slot(slot);
        return st;
      }
      continue;
    }
    r.pinned.store(static_cast<uint32_t>(b) + 1, std::memory_order_seq_cst);
    if (header_->buffers[b].stamp.load(std::memory_order_seq_cst) != stamp) {
      r.pinned.store(0, std::memory_order_seq_cst);  // the writer got there first: pick again
      continue;
    }
    ticket->index = static_cast<uint32_t>(b);
    ticket->slot = slot;
    ticket->version = stamp - 1;
    ticket->published_ns = header_->buffers[b].published_ns.load(std::memory_order_relaxed);
    return LatestStatus::Ok;
  }
}

bool LatestChannel::end_read(const ReadTicket& t) {
  TMX_CHECK(t.index < nbuffers_ && t.slot < LATEST_READER_SLOTS, "bad read ticket");
  std::atomic_thread_fence(std::memory_order_acquire);
  bool intact =
      header_->buffers[t.index].stamp.load(std::memory_order_relaxed) == t.version + 1;
  release_slot(t.slot);
  return intact;
}

void LatestChannel::copy_out(uint32_t index, const std::vector<CopySpan>& spans) const {
  const char* src = base_ + buffer_offset(index);
  for (const CopySpan& s : spans) {
    TMX_CHECK_VALUE(s.nbytes <= buffer_bytes_ && s.offset <= buffer_bytes_ - s.nbytes,
                    "copy_out: span [", s.offset, ", +", s.nbytes, ") outside the ",
                    buffer_bytes_, "-byte buffer");
    std::memcpy(reinterpret_cast<void*>(s.address), src + s.offset, s.nbytes);
  }
}

LatestStatus LatestChannel::wait(int64_t newer_than, uint64_t multiple_of,
                                 const Deadline& deadline) {
  for (;;) {
    uint32_t seen = header_->changed.snapshot();
    uint64_t stamp = 0;
    if (select(newer_than, multiple_of, &stamp) >= 0) return LatestStatus::Ok;
    if (closed()) return LatestStatus::Closed;
    LatestStatus st = wait_changed(seen, deadline);
    if (st != LatestStatus::Ok) return st;
  }
}

bool LatestChannel::peek(int64_t newer_than, uint64_t multiple_of, uint64_t* version,
                         uint64_t* published_ns) const {
  for (;;) {
    uint64_t stamp = 0;
    int b = select(newer_than, multiple_of, &stamp);
    if (b < 0) return false;
    uint64_t at = header_->buffers[b].published_ns.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (header_->buffers[b].stamp.load(std::memory_order_relaxed) != stamp) continue;
    *version = stamp - 1;
    *published_ns = at;
    return true;
  }
}

int64_t LatestChannel::latest() const {
  return static_cast<int64_t>(header_->latest.load(std::memory_order_acquire)) - 1;
}

void LatestChannel::close() {
  header_->closed.store(CLOSED_BY_PUBLISHER, std::memory_order_seq_cst);
  header_->changed.notify_all();
}

void LatestChannel::set_publisher() {
  const uint64_t me = holder_word_of_self(header_->pidns);
  if (header_->publisher.word() == me) return;
  header_->publisher.set(me);
  uint32_t died = CLOSED_PUBLISHER_DIED;  // a new publisher takes over: open again
  header_->closed.compare_exchange_strong(died, 0, std::memory_order_seq_cst);
}

bool LatestChannel::check_publisher() {
  // Note [Publisher death]
  if (header_->closed.load(std::memory_order_acquire) == 0) {
    const uint64_t word = header_->publisher.word();
    if (word != 0 && holder_word_dead(word, header_->pidns)) {
      uint32_t open = 0;
      if (header_->closed.compare_exchange_strong(open, CLOSED_PUBLISHER_DIED,
                                                  std::memory_order_seq_cst)) {
        header_->changed.notify_all();
      }
    }
  }
  return publisher_died();
}

bool LatestChannel::publisher_died() const {
  return header_->closed.load(std::memory_order_acquire) == CLOSED_PUBLISHER_DIED;
}

bool LatestChannel::closed() const {
  return header_->closed.load(std::memory_order_acquire) != 0;
}

// ---- waiting -------------------------------------------------------------------------------

LatestStatus LatestChannel::wait_changed(uint32_t seen, const Deadline& deadline) {
  // `seen` was read before the predicate (the stamps), and every commit changes a stamp
  // before it notifies: no lost wake-up (Note [Why not pthread_cond_t]). No spin: a reader
  // waits for the learner's next step, milliseconds away.
  return wait_on(header_->changed, seen, deadline);
}

LatestStatus LatestChannel::wait_on(SharedCondition& cond, uint32_t seen,
                                    const Deadline& deadline) {
  switch (cond.wait(seen, deadline, /*spin=*/nullptr)) {
    case SharedCondition::Woke::Event:
      return LatestStatus::Ok;
    case SharedCondition::Woke::TimedOut:
      return LatestStatus::Timeout;
    case SharedCondition::Woke::Interrupted:
      return LatestStatus::Interrupted;
  }
  return LatestStatus::Ok;
}

}  // namespace torch_mp_ext
