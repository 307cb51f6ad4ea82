// XLA FFI handlers for autoshard.mpi: MPI called directly on XLA's CPU buffers.
//
// Every handler takes an ordering value first and returns one last (a one-byte
// scalar, never read: XLA's token type would make Shardy drop the call's sharding);
// the Python lowering chains these values so that MPI calls run in program order. The
// communicator arrives as an integer id into a table of communicators built by
// register_comm(), indexed by device ordinal (see _comm.py): inside a user's shard_map
// each device has its own communicator; elsewhere every device maps to the same one,
// or, in a jit over several devices, only the first device to reach the call makes it
// and the others skip it and return zeros, which the lowering sums with the caller's
// result (one MPI call per process); when the call fails, they fail with it (see "one call
// per process").
//
// With debug logging on (set_debug, AUTOSHARD_MPI_DEBUG=1) each call prints
// "r{rank} | {op} {bytes} B ..." to stderr on entry and on exit, with its duration.
//
// Buffers of 4 MiB and more are moved onto transparent huge pages (see PreferHugePages):
// XLA's allocator does not ask for them, NumPy's does, and MPI's single-copy transfers of
// large messages are much slower over 4 KiB pages.
//
// Data-movement operations use MPI_BYTE (any dtype works, bfloat16 included);
// reductions use typed MPI datatypes, with user-defined operations for the
// 16-bit floats that MPI has no type for.
//
// Before its MPI call a handler may check that the ranks agree on the call (see "argument
// checks" below and _check.py): over a second communicator per table entry, so that the
// checks' messages never meet the operations' own.
#include <mpi.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------- state

// What a device calls through: the operation's communicator and the one its argument checks
// use (a duplicate). GetComm hands out MPI_COMM_NULL for both to a device that skips a call.
struct CommEntry {
  MPI_Comm comm;
  MPI_Comm check;
};

std::atomic<int64_t> g_inflight{0};
std::atomic<int64_t> g_num_calls{0};
std::atomic<bool> g_debug{false};

int WorldRank() {
  static const int rank = [] {
    int r = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
  }();
  return rank;
}

// Bookkeeping around one MPI call: the in-flight count (awaited at exit), the call count,
// and the debug log.
class Call {
 public:
  Call(const char* op, int64_t bytes, int64_t comm_id, int32_t device)
      : op_(op), bytes_(bytes) {
    ++g_inflight;
    ++g_num_calls;
    if (g_debug.load(std::memory_order_relaxed)) {
      start_ = std::chrono::steady_clock::now();
      std::fprintf(stderr, "r%d | %s %" PRId64 " B (comm %" PRId64 ", device %d) ...\n",
                   WorldRank(), op_, bytes_, comm_id, static_cast<int>(device));
      std::fflush(stderr);
    }
  }
  ~Call() {
    if (g_debug.load(std::memory_order_relaxed)) {
      double us = std::chrono::duration<double, std::micro>(
                      std::chrono::steady_clock::now() - start_).count();
      std::fprintf(stderr, "r%d | %s %" PRId64 " B done in %.1f us\n", WorldRank(), op_,
                   bytes_, us);
      std::fflush(stderr);
    }
    --g_inflight;
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

 private:
  const char* op_;
  int64_t bytes_;
  std::chrono::steady_clock::time_point start_;
};

// ---------------------------------------------------------------- huge pages

// Measured here at 16 MiB: MPI_Bcast and MPI_Sendrecv between two ranks take 1.5-2x as long
// on buffers of 4 KiB pages (XLA's) as on transparent huge pages (NumPy asks for them on
// arrays of 4 MiB and more, so mpi4py gets them), and mpi4py on XLA's memory is as slow as
// we were (likely the shared-memory transport's per-page work). Each large buffer the
// handlers see is therefore advised (MADV_HUGEPAGE, so that pages touched from then on are
// huge), and when the same buffer comes back (a loop's carry, a reused output) its pages
// already touched are collapsed into huge pages (MADV_COLLAPSE, Linux 6.1 and later: a copy
// of the buffer, a few milliseconds at 16 MiB). Collapsing a buffer seen only once would cost
// more than it saves. The collapse also takes the two 2 MiB pages the buffer's ends fall in
// (when the mapping holds them whole: XLA puts buffers side by side): otherwise up to 4 MiB of
// the buffer stays on small pages while a NumPy array, whose mapping the kernel aligns, is
// often huge throughout; measured at 16 MiB, that eighth on small pages made sendrecv 1.1-1.2x
// mpi4py, and mpi4py itself as slow on our buffers. Memory they hold that nothing touched yet
// gets backed too (at most 2 MiB per end).
// Advice only: failures are ignored, and the data is never changed. A buffer freed and another
// allocated at the same address look alike here, so a range seen again is collapsed again
// every 32 sightings (see PreferHugePages).
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kHugeMinBytes = size_t{4} << 20;  // NumPy's threshold for MADV_HUGEPAGE
#if defined(__linux__) && !defined(MADV_COLLAPSE)
#define MADV_COLLAPSE 25
#endif

std::atomic<bool> g_huge_pages{true};
std::atomic<int64_t> g_num_collapsed{0};

struct HugeRange {
  uintptr_t start = 0, end = 0;
  uint32_t sightings = 0;  // after the first
};
constexpr uint32_t kRecollapse = 32;
std::mutex g_huge_mutex;
HugeRange g_huge_ranges[32];  // the large buffers seen last, replaced round robin
size_t g_huge_next = 0;

void PreferHugePages(const void* data, size_t bytes) {
#ifdef __linux__
  if (bytes < kHugeMinBytes || !g_huge_pages.load(std::memory_order_relaxed)) return;
  auto begin = reinterpret_cast<uintptr_t>(data);
  uintptr_t start = (begin + kHugePage - 1) & ~(kHugePage - 1);
  uintptr_t end = (begin + bytes) & ~(kHugePage - 1);
  if (end <= start) return;
  std::lock_guard<std::mutex> lock(g_huge_mutex);
  for (HugeRange& range : g_huge_ranges) {
    if (range.start != start || range.end != end) continue;
    // The second sighting collapses; every kRecollapse-th one again, in case the buffer was
    // freed and another one allocated at the same address (a few microseconds when the
    // range is still huge, a copy when it is a new buffer on small pages).
    if (range.sightings++ % kRecollapse == 0) {
      madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
      if (madvise(reinterpret_cast<void*>(start), end - start, MADV_COLLAPSE) == 0)
        ++g_num_collapsed;
      // The partly covered 2 MiB pages at either end (fails, harmlessly, unless one mapping
      // holds the whole 2 MiB).
      if (begin != start) madvise(reinterpret_cast<void*>(start - kHugePage), kHugePage, MADV_COLLAPSE);
      if ((begin + bytes) != end) madvise(reinterpret_cast<void*>(end), kHugePage, MADV_COLLAPSE);
    }
    return;
  }
  madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
  g_huge_ranges[g_huge_next] = HugeRange{start, end, 0};
  g_huge_next = (g_huge_next + 1) % (sizeof(g_huge_ranges) / sizeof(g_huge_ranges[0]));
#else
  (void)data;
  (void)bytes;
#endif
}

// The buffers an MPI call reads or writes (an input aliased to the output counts once).
void PreferHugePages(std::initializer_list<ffi::AnyBuffer> buffers) {
  const void* previous = nullptr;
  for (const ffi::AnyBuffer& b : buffers) {
    if (b.untyped_data() != previous) PreferHugePages(b.untyped_data(), b.size_bytes());
    previous = b.untyped_data();
  }
}

// A device that does not make the process's call returns zeros (see the header).
ffi::Error Skip() { return ffi::Error::Success(); }
ffi::Error Skip(ffi::Result<ffi::AnyBuffer>& y) {
  std::memset(y->untyped_data(), 0, y->size_bytes());
  return ffi::Error::Success();
}

ffi::Error MpiError(int code, const char* what) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, msg, &len);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("autoshard.mpi: ") + what + " failed: " +
                        std::string(msg, len));
}

#define MPI_CHECK(call, what)                  \
  do {                                         \
    int rc_ = (call);                          \
    if (rc_ != MPI_SUCCESS) return MpiError(rc_, what); \
  } while (0)

// ---------------------------------------------------------------- one call per process

// In a jit over several devices every device of the region runs each call, but only one
// calls MPI (see _lowering._once_per_process): the first device to reach the call in this
// run (XLA's RunId, shared by the devices of one execution). The others (followers) return
// zeros, which a sum over the devices then replaces with the caller's result. A failed call
// must stop every device at that call: a follower that went on to the sum would wait there
// for the failed device until XLA aborts the process. So a follower waits for the caller's
// outcome of the same call (the devices of a region make the same calls, so the n-th call of
// each in a run is the same call) and returns the same error.
struct Region {
  int64_t num_devices = 0;
  std::mutex mutex;
  std::condition_variable finished;
  struct Progress {
    bool started = false;
    int64_t run = 0;
    int64_t calls = 0;  // the region calls this device made in this run
  };
  std::vector<Progress> progress;  // per device ordinal
  struct Outcome {
    bool done = false;
    ffi::Error error;
    int64_t readers_left = 0;  // followers still to read it
  };
  std::map<std::pair<int64_t, int64_t>, Outcome> outcomes;  // (run, call) -> outcome
};

struct CommTable {
  std::vector<CommEntry> entries;  // one per device
  std::unique_ptr<Region> region;  // set for the tables of once-per-process regions
};

std::mutex g_mutex;
std::vector<CommTable> g_comm_tables;  // by id

// The region call this thread is making for its followers (see Handler).
thread_local Region* t_leading = nullptr;
thread_local std::pair<int64_t, int64_t> t_call;

// The first device to reach a region call makes it (Handler publishes its outcome); the
// others wait for that outcome and return its error, or skip the call (*follows).
ffi::Error JoinRegion(Region& region, int64_t device, int64_t run, bool* follows) {
  std::unique_lock<std::mutex> lock(region.mutex);
  Region::Progress& progress = region.progress[device];
  if (!progress.started || progress.run != run) progress = {true, run, 0};
  const std::pair<int64_t, int64_t> call{run, progress.calls++};
  auto [outcome, first] = region.outcomes.try_emplace(call);
  if (first) {
    outcome->second.readers_left = region.num_devices - 1;
    t_leading = &region;
    t_call = call;
    *follows = false;
    return ffi::Error::Success();
  }
  *follows = true;
  region.finished.wait(lock, [&] { return outcome->second.done; });
  ffi::Error error = outcome->second.error;
  if (--outcome->second.readers_left == 0) region.outcomes.erase(outcome);
  return error;
}

// Wraps a handler: publishes the outcome of a region call to the devices that follow it.
template <typename... Args>
auto Handler(ffi::Error (*impl)(Args...)) {
  return [impl](Args... args) -> ffi::Error {
    t_leading = nullptr;
    ffi::Error error = impl(args...);
    if (Region* region = std::exchange(t_leading, nullptr)) {
      std::lock_guard<std::mutex> lock(region->mutex);
      Region::Outcome& outcome = region->outcomes[t_call];
      outcome.done = true;
      outcome.error = error;
      if (outcome.readers_left == 0) region->outcomes.erase(t_call);
      region->finished.notify_all();
    }
    return error;
  };
}

ffi::Error GetComm(int64_t id, int64_t device, ffi::RunId run, MPI_Comm* comm, MPI_Comm* check) {
  Region* region = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (id < 0 || id >= static_cast<int64_t>(g_comm_tables.size()))
      return ffi::Error::InvalidArgument("autoshard.mpi: unknown communicator id");
    const CommTable& table = g_comm_tables[id];
    if (device < 0 || device >= static_cast<int64_t>(table.entries.size()))
      return ffi::Error::InvalidArgument(
          "autoshard.mpi: device ordinal " + std::to_string(device) +
          " has no communicator; the communicator table has " +
          std::to_string(table.entries.size()) + " entries (one per local device)");
    *comm = table.entries[device].comm;
    *check = table.entries[device].check;
    region = table.region.get();
  }
  if (region == nullptr) return ffi::Error::Success();
  bool follows = false;
  if (auto e = JoinRegion(*region, device, run.run_id, &follows); e.failure()) return e;
  if (follows) *comm = *check = MPI_COMM_NULL;  // the handler skips the call
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- argument checks

// MPI leaves a call whose ranks disagree (another operation, root, op, dtype, shape)
// undefined: a truncation error on one rank and a wrong array on another, garbage, or a hang.
// Before its MPI call a handler can compare what the ranks pass (see _check.py for what each
// operation's ranks must agree on), over the entry's check communicator:
// * collectives: a max-allreduce of (hash, -hash) of the call's signature, so every rank
//   learns at once whether all agree; if not, every rank gathers every rank's signature and
//   returns the same error, naming them, without making the call;
// * point-to-point (every-call mode only): the sender sends its signature and its dtype and
//   bytes ahead of the data with the same tag; the receiver takes it (which fixes the source
//   and tag it then receives from) and, on a mismatch, receives the data into a scratch
//   buffer (its sender completes) and returns the error.
// Modes (autoshard_mpi_set_check, from AUTOSHARD_MPI_CHECK): off; first (the default: a
// collective is checked the first time a process makes a call with its signature on a
// communicator; ranks that run the same program reach those first calls together, so the
// check never waits on a rank that skips it); every (each call, point-to-point included).
enum CheckMode : int64_t { kCheckOff = 0, kCheckFirst = 1, kCheckEvery = 2 };
std::atomic<int64_t> g_check_mode{kCheckFirst};
std::atomic<int64_t> g_num_checks{0};
std::mutex g_checked_mutex;
std::set<std::pair<int64_t, int64_t>> g_checked;  // (check communicator, signature hash)
std::atomic<int64_t> g_check_warn_ms{10000};  // see AwaitCheck
constexpr size_t kSignatureBytes = 200;  // a signature's text, as exchanged (truncated)

struct Signature {
  std::string_view text;  // e.g. "allreduce(float32[3], op=SUM)"
  int64_t hash;           // of the text, in [0, 2**62): equal on every rank that agrees
};

// MPI_Comm is a pointer in Open MPI and an int in MPICH.
template <typename Comm>
int64_t CommKey(Comm comm) {
  if constexpr (std::is_pointer_v<Comm>) {
    return static_cast<int64_t>(reinterpret_cast<intptr_t>(comm));
  } else {
    return static_cast<int64_t>(comm);
  }
}

int CommRank(MPI_Comm comm) {
  int rank = -1;
  MPI_Comm_rank(comm, &rank);
  return rank;
}

// Waits for a check's request. A rank that waits long may be waiting for a rank that will not
// come: in first-call mode a rank skips the check of a signature it has checked before, so a
// rank whose arguments changed (a smaller last batch) waits alone. Say so once, on stderr.
ffi::Error AwaitCheck(MPI_Request* request, MPI_Comm check, const Signature& sig) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  bool warned = false;
  for (int64_t polls = 0;; ++polls) {
    int done = 0;
    MPI_CHECK(MPI_Test(request, &done, MPI_STATUS_IGNORE), "MPI_Test (argument check)");
    if (done) return ffi::Error::Success();
    if (polls < 4096) continue;  // the others are usually there within microseconds
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    const auto waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (!warned && waited * 1000 > static_cast<double>(g_check_warn_ms.load())) {
      warned = true;
      std::fprintf(stderr,
                   "autoshard.mpi: rank %d has waited %.1f s for the other ranks to check "
                   "%.*s before making the call. A rank still busy (compiling, computing) "
                   "ends this wait. A rank that already went past this point with other "
                   "arguments does not: AUTOSHARD_MPI_CHECK is 'first' (the default), which "
                   "skips the check of a call a rank has made before with the same "
                   "arguments; run with AUTOSHARD_MPI_CHECK=1 to check every call and get an "
                   "error naming every rank's arguments instead of this deadlock.\n",
                   CommRank(check), waited,
                   static_cast<int>(sig.text.size()), sig.text.data());
      std::fflush(stderr);
    }
  }
}

std::string RankList(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < 8; ++i)
    out += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > 8) out += ", ... (" + std::to_string(ranks.size()) + " ranks)";
  return out;
}

// Every rank learns every rank's signature and returns the same error naming them.
ffi::Error Disagreement(MPI_Comm check, const Signature& sig) {
  int size = 0;
  MPI_Comm_size(check, &size);
  std::vector<char> mine(kSignatureBytes, 0), all(kSignatureBytes * size, 0);
  std::memcpy(mine.data(), sig.text.data(), std::min(sig.text.size(), kSignatureBytes - 1));
  MPI_CHECK(MPI_Allgather(mine.data(), kSignatureBytes, MPI_CHAR, all.data(), kSignatureBytes,
                          MPI_CHAR, check),
            "MPI_Allgather (argument check)");
  std::vector<std::pair<std::string, std::vector<int>>> groups;  // in order of first rank
  for (int r = 0; r < size; ++r) {
    const char* text = all.data() + kSignatureBytes * r;
    std::string signature(text, strnlen(text, kSignatureBytes - 1));
    auto group = groups.begin();
    while (group != groups.end() && group->first != signature) ++group;
    if (group == groups.end()) groups.push_back({signature, {r}});
    else group->second.push_back(r);
  }
  std::string calls;
  for (size_t g = 0; g < groups.size() && g < 8; ++g)
    calls += (g ? "; " : "") + RankList(groups[g].second) + ": " + groups[g].first;
  if (groups.size() > 8) calls += "; ... (" + std::to_string(groups.size()) + " different calls)";
  return ffi::Error(
      ffi::ErrorCode::kFailedPrecondition,
      "autoshard.mpi: the ranks disagree on this MPI call (" + calls + "). MPI leaves such a "
      "call undefined (a truncation error, a wrong result or a hang), so no rank made it. Every "
      "rank must make the same call at this point, with the same dtype and shape (and the same "
      "root, op and counts where the operation takes them). This is rank " +
      std::to_string(CommRank(check)) + ".");
}

// Checks that every rank of `check` makes the call `sig` (collective operations).
ffi::Error CheckCollective(MPI_Comm check, const Signature& sig) {
  const int64_t mode = g_check_mode.load(std::memory_order_relaxed);
  if (mode == kCheckOff) return ffi::Error::Success();
  const std::pair<int64_t, int64_t> key{CommKey(check), sig.hash};
  if (mode == kCheckFirst) {
    std::lock_guard<std::mutex> lock(g_checked_mutex);
    if (g_checked.count(key)) return ffi::Error::Success();
  }
  ++g_num_checks;
  int64_t mine[2] = {sig.hash, -sig.hash}, agreed[2] = {0, 0};
  MPI_Request request;
  MPI_CHECK(MPI_Iallreduce(mine, agreed, 2, MPI_INT64_T, MPI_MAX, check, &request),
            "MPI_Iallreduce (argument check)");
  if (auto e = AwaitCheck(&request, check, sig); e.failure()) return e;
  if (agreed[0] != sig.hash || agreed[1] != -sig.hash) return Disagreement(check, sig);
  if (mode == kCheckFirst) {
    std::lock_guard<std::mutex> lock(g_checked_mutex);
    g_checked.insert(key);
  }
  return ffi::Error::Success();
}

// What a sender tells its receiver ahead of the data (every-call mode).
struct Envelope {
  int64_t dtype;  // ffi::DataType
  int64_t bytes;
  char text[kSignatureBytes];
};

Envelope MakeEnvelope(const ffi::AnyBuffer& data, const Signature& sig) {
  Envelope envelope{static_cast<int64_t>(data.element_type()),
                    static_cast<int64_t>(data.size_bytes()), {}};
  std::memcpy(envelope.text, sig.text.data(), std::min(sig.text.size(), kSignatureBytes - 1));
  return envelope;
}

bool CheckingPointToPoint() { return g_check_mode.load(std::memory_order_relaxed) == kCheckEvery; }

// MPI needs the same type and a message no larger than the receive buffer.
bool Fits(const Envelope& theirs, const ffi::AnyBuffer& buffer) {
  return theirs.dtype == static_cast<int64_t>(buffer.element_type()) &&
         theirs.bytes <= static_cast<int64_t>(buffer.size_bytes());
}

// Receives the data message a mismatched envelope announced, so that its sender completes.
ffi::Error Drain(MPI_Comm comm, int source, int tag) {
  MPI_Status status;
  MPI_CHECK(MPI_Probe(source, tag, comm, &status), "MPI_Probe (argument check)");
  int bytes = 0;
  MPI_Get_count(&status, MPI_BYTE, &bytes);
  std::vector<char> scratch(std::max(bytes, 1));
  MPI_CHECK(MPI_Recv(scratch.data(), bytes, MPI_BYTE, source, tag, comm, MPI_STATUS_IGNORE),
            "MPI_Recv (argument check)");
  return ffi::Error::Success();
}

ffi::Error Misfit(MPI_Comm check, const Envelope& theirs, int source, int tag, const Signature& sig) {
  std::string sent(theirs.text, strnlen(theirs.text, kSignatureBytes - 1));
  return ffi::Error(
      ffi::ErrorCode::kFailedPrecondition,
      "autoshard.mpi: rank " + std::to_string(CommRank(check)) + " cannot receive what rank " +
      std::to_string(source) + " sent with tag " + std::to_string(tag) + ": rank " +
      std::to_string(source) + " made " + sent + " (" + std::to_string(theirs.bytes) +
      " bytes), this rank " + std::string(sig.text) + ". MPI needs the same dtype and a "
      "message no larger than the receive buffer; the message was received and dropped. "
      "Receive into a buffer of the sent dtype and shape.");
}

// ---------------------------------------------------------------- dtypes

// 16-bit floats: conversions for the user-defined reductions.
float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}
float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while ((man & 0x400) == 0) { man <<= 1; --exp; }
      man &= 0x3ff;
      bits = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint16_t FloatToHalf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint32_t sign = (bits >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((bits >> 23) & 0xff) - 127 + 15;
  uint32_t man = bits & 0x7fffff;
  if (((bits >> 23) & 0xff) == 0xff) return sign | 0x7c00 | (man ? 0x200 : 0);
  if (exp >= 0x1f) return sign | 0x7c00;
  if (exp <= 0) {
    if (exp < -10) return sign;
    man |= 0x800000;
    uint32_t shift = 14 - exp;
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return sign | half;
  }
  uint32_t half = sign | (exp << 10) | (man >> 13);
  uint32_t rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return half;
}

// Operation codes shared with Python (_validation.OP_CODES).
enum OpCode : int64_t { kSum = 0, kProd, kMin, kMax, kLand, kLor, kLxor, kBand, kBor, kBxor, kNumOps };

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), int kOp>
void Reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = ToF(a[i]), y = ToF(b[i]), r;
    if (kOp == kSum) r = x + y;
    else if (kOp == kProd) r = x * y;
    else if (kOp == kMin) r = std::fmin(x, y);
    else r = std::fmax(x, y);
    b[i] = FromF(r);
  }
}

MPI_Datatype g_type16 = MPI_DATATYPE_NULL;
MPI_Op g_ops16[2][4];  // [bf16, f16][sum, prod, min, max]
bool g_ops16_ready = false;

void Init16() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_ops16_ready) return;
  MPI_Type_contiguous(2, MPI_BYTE, &g_type16);
  MPI_Type_commit(&g_type16);
  MPI_Op_create(&Reduce16<Bf16ToFloat, FloatToBf16, kSum>, 1, &g_ops16[0][0]);
  MPI_Op_create(&Reduce16<Bf16ToFloat, FloatToBf16, kProd>, 1, &g_ops16[0][1]);
  MPI_Op_create(&Reduce16<Bf16ToFloat, FloatToBf16, kMin>, 1, &g_ops16[0][2]);
  MPI_Op_create(&Reduce16<Bf16ToFloat, FloatToBf16, kMax>, 1, &g_ops16[0][3]);
  MPI_Op_create(&Reduce16<HalfToFloat, FloatToHalf, kSum>, 1, &g_ops16[1][0]);
  MPI_Op_create(&Reduce16<HalfToFloat, FloatToHalf, kProd>, 1, &g_ops16[1][1]);
  MPI_Op_create(&Reduce16<HalfToFloat, FloatToHalf, kMin>, 1, &g_ops16[1][2]);
  MPI_Op_create(&Reduce16<HalfToFloat, FloatToHalf, kMax>, 1, &g_ops16[1][3]);
  g_ops16_ready = true;
}

MPI_Op BuiltinOp(int64_t op) {
  switch (op) {
    case kSum: return MPI_SUM;
    case kProd: return MPI_PROD;
    case kMin: return MPI_MIN;
    case kMax: return MPI_MAX;
    case kLand: return MPI_LAND;
    case kLor: return MPI_LOR;
    case kLxor: return MPI_LXOR;
    case kBand: return MPI_BAND;
    case kBor: return MPI_BOR;
    case kBxor: return MPI_BXOR;
    default: return MPI_OP_NULL;
  }
}

// Resolves the MPI datatype and operation for a reduction over `dtype`.
ffi::Error ReductionTypes(ffi::DataType dtype, int64_t op, MPI_Datatype* type, MPI_Op* mpi_op) {
  if (dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16) {
    if (op > kMax)
      return ffi::Error::InvalidArgument(
          "autoshard.mpi: 16-bit floats support SUM, PROD, MIN and MAX only");
    Init16();
    *type = g_type16;
    *mpi_op = g_ops16[dtype == ffi::DataType::BF16 ? 0 : 1][op];
    return ffi::Error::Success();
  }
  switch (dtype) {
    case ffi::DataType::PRED: *type = MPI_C_BOOL; break;
    case ffi::DataType::S8: *type = MPI_INT8_T; break;
    case ffi::DataType::S16: *type = MPI_INT16_T; break;
    case ffi::DataType::S32: *type = MPI_INT32_T; break;
    case ffi::DataType::S64: *type = MPI_INT64_T; break;
    case ffi::DataType::U8: *type = MPI_UINT8_T; break;
    case ffi::DataType::U16: *type = MPI_UINT16_T; break;
    case ffi::DataType::U32: *type = MPI_UINT32_T; break;
    case ffi::DataType::U64: *type = MPI_UINT64_T; break;
    case ffi::DataType::F32: *type = MPI_FLOAT; break;
    case ffi::DataType::F64: *type = MPI_DOUBLE; break;
    case ffi::DataType::C64: *type = MPI_C_FLOAT_COMPLEX; break;
    case ffi::DataType::C128: *type = MPI_C_DOUBLE_COMPLEX; break;
    default:
      return ffi::Error::InvalidArgument("autoshard.mpi: dtype has no MPI reduction type");
  }
  *mpi_op = BuiltinOp(op);
  if (*mpi_op == MPI_OP_NULL) return ffi::Error::InvalidArgument("autoshard.mpi: unknown op code");
  return ffi::Error::Success();
}

int Count(const ffi::AnyBuffer& b) { return static_cast<int>(b.element_count()); }
int Bytes(const ffi::AnyBuffer& b) { return static_cast<int>(b.size_bytes()); }

// The lowering aliases x to y for the reductions, so XLA hands us one buffer and MPI reduces
// in place (no temporary, no copy); a distinct y (never produced today) still works.
const void* SendBuffer(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  return x.untyped_data() == y.untyped_data() ? MPI_IN_PLACE : x.untyped_data();
}

void FillStatus(int64_t status_addr, const MPI_Status& status) {
  if (status_addr != 0) std::memcpy(reinterpret_cast<void*>(status_addr), &status, sizeof(MPI_Status));
}

// ---------------------------------------------------------------- handlers

ffi::Error AllreduceImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer>,
                         int64_t comm_id, int64_t op,
    std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (auto e = CheckCollective(check, {signature, signature_hash}); e.failure()) return e;
  Call call("allreduce", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({x, *y});
  MPI_Datatype type;
  MPI_Op mpi_op;
  if (auto e = ReductionTypes(x.element_type(), op, &type, &mpi_op); e.failure()) return e;
  MPI_CHECK(MPI_Allreduce(SendBuffer(x, *y), y->untyped_data(), Count(x), type, mpi_op, comm),
            "MPI_Allreduce");
  return ffi::Error::Success();
}

// x is aliased to y: non-root ranks return their input unchanged.
ffi::Error ReduceImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t op, int64_t root,
    std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (auto e = CheckCollective(check, {signature, signature_hash}); e.failure()) return e;
  Call call("reduce", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({*y});
  MPI_Datatype type;
  MPI_Op mpi_op;
  if (auto e = ReductionTypes(x.element_type(), op, &type, &mpi_op); e.failure()) return e;
  int rank;
  MPI_Comm_rank(comm, &rank);
  void* buf = y->untyped_data();
  if (rank == root) {
    MPI_CHECK(MPI_Reduce(MPI_IN_PLACE, buf, Count(x), type, mpi_op, static_cast<int>(root), comm),
              "MPI_Reduce");
  } else {
    MPI_CHECK(MPI_Reduce(buf, nullptr, Count(x), type, mpi_op, static_cast<int>(root), comm),
              "MPI_Reduce");
  }
  return ffi::Error::Success();
}

ffi::Error ScanImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t op,
    std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (auto e = CheckCollective(check, {signature, signature_hash}); e.failure()) return e;
  Call call("scan", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({x, *y});
  MPI_Datatype type;
  MPI_Op mpi_op;
  if (auto e = ReductionTypes(x.element_type(), op, &type, &mpi_op); e.failure()) return e;
  MPI_CHECK(MPI_Scan(SendBuffer(x, *y), y->untyped_data(), Count(x), type, mpi_op, comm),
            "MPI_Scan");
  return ffi::Error::Success();
}

// x is aliased to y: the root's buffer already holds the data.
ffi::Error BcastImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t root,
    std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (auto e = CheckCollective(check, {signature, signature_hash}); e.failure()) return e;
  Call call("bcast", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({*y});
  MPI_CHECK(MPI_Bcast(y->untyped_data(), Bytes(x), MPI_BYTE, static_cast<int>(root), comm),
            "MPI_Bcast");
  return ffi::Error::Success();
}

// Root: y has shape (size, *x.shape). Other ranks: y aliases x (unchanged).
ffi::Error GatherImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t root,
    std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (auto e = CheckCollective(check, {signature, signature_hash}); e.failure()) return e;
  Call call("gather", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({x, *y});
  int rank;
  MPI_Comm_rank(comm, &rank);
  void* recv = rank == root ? y->untyped_data() : nullptr;
  MPI_CHECK(MPI_Gather(x.untyped_data(), Bytes(x), MPI_BYTE, recv, Bytes(x), MPI_BYTE,
                       static_cast<int>(root), comm),
            "MPI_Gather");
  return ffi::Error::Success();
}

// x has shape (size, *y.shape) on the root; other ranks pass y's shape.
ffi::Error ScatterImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t root,
    std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (auto e = CheckCollective(check, {signature, signature_hash}); e.failure()) return e;
  Call call("scatter", static_cast<int64_t>(y->size_bytes()), comm_id, device);
  PreferHugePages({x, *y});
  int rank;
  MPI_Comm_rank(comm, &rank);
  const void* send = rank == root ? x.untyped_data() : nullptr;
  MPI_CHECK(MPI_Scatter(send, Bytes(*y), MPI_BYTE, y->untyped_data(), Bytes(*y), MPI_BYTE,
                        static_cast<int>(root), comm),
            "MPI_Scatter");
  return ffi::Error::Success();
}

ffi::Error AllgatherImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer>, int64_t comm_id,
    std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (auto e = CheckCollective(check, {signature, signature_hash}); e.failure()) return e;
  Call call("allgather", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({x, *y});
  MPI_CHECK(MPI_Allgather(x.untyped_data(), Bytes(x), MPI_BYTE, y->untyped_data(), Bytes(x),
                          MPI_BYTE, comm),
            "MPI_Allgather");
  return ffi::Error::Success();
}

ffi::Error AlltoallImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::AnyBuffer>, int64_t comm_id,
    std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (auto e = CheckCollective(check, {signature, signature_hash}); e.failure()) return e;
  Call call("alltoall", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({x, *y});
  int size;
  MPI_Comm_size(comm, &size);
  int block = Bytes(x) / size;
  MPI_CHECK(MPI_Alltoall(x.untyped_data(), block, MPI_BYTE, y->untyped_data(), block, MPI_BYTE,
                         comm),
            "MPI_Alltoall");
  return ffi::Error::Success();
}

// Variable counts, static: rank i contributes counts[i] rows of row_bytes bytes each; y is
// every rank's rows concatenated in rank order (MPI_Allgatherv).
ffi::Error AllgathervImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer>, int64_t comm_id,
                          ffi::Span<const int64_t> counts, int64_t row_bytes,
    std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (auto e = CheckCollective(check, {signature, signature_hash}); e.failure()) return e;
  Call call("allgatherv", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({x, *y});
  int size;
  MPI_Comm_size(comm, &size);
  if (static_cast<int64_t>(counts.size()) != size)
    return ffi::Error::InvalidArgument("autoshard.mpi: allgatherv needs one count per rank");
  std::vector<int> rcount(size), rdispl(size);
  int64_t offset = 0;
  for (int i = 0; i < size; ++i) {
    rcount[i] = static_cast<int>(counts[i] * row_bytes);
    rdispl[i] = static_cast<int>(offset);
    offset += counts[i] * row_bytes;
  }
  if (offset != static_cast<int64_t>(y->size_bytes()))
    return ffi::Error::InvalidArgument("autoshard.mpi: allgatherv counts do not match the result");
  MPI_CHECK(MPI_Allgatherv(x.untyped_data(), Bytes(x), MPI_BYTE, y->untyped_data(), rcount.data(),
                           rdispl.data(), MPI_BYTE, comm),
            "MPI_Allgatherv");
  return ffi::Error::Success();
}

// Variable counts, dynamic: x is padded to (size, max_rows, *rest) on every rank;
// send_counts[i] rows of x[i] go to rank i, and y[j] receives recv_counts[j] rows
// from rank j (the rest of y is zeros). The counts are runtime values, checked here.
ffi::Error AlltoallvImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::S32> send_counts, ffi::Buffer<ffi::S32> recv_counts,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer>, int64_t comm_id,
                         int64_t row_bytes, int64_t max_rows,
    std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (auto e = CheckCollective(check, {signature, signature_hash}); e.failure()) return e;
  Call call("alltoallv", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({x, *y});
  int size;
  MPI_Comm_size(comm, &size);
  if (static_cast<int64_t>(send_counts.element_count()) != size ||
      static_cast<int64_t>(recv_counts.element_count()) != size)
    return ffi::Error::InvalidArgument("autoshard.mpi: alltoallv needs one count per rank");
  std::vector<int> scount(size), sdispl(size), rcount(size), rdispl(size);
  for (int i = 0; i < size; ++i) {
    int64_t s = send_counts.typed_data()[i], r = recv_counts.typed_data()[i];
    if (s < 0 || s > max_rows || r < 0 || r > max_rows)
      return ffi::Error::InvalidArgument(
          "autoshard.mpi: alltoallv count out of range for peer " + std::to_string(i) +
          ": send " + std::to_string(s) + ", receive " + std::to_string(r) +
          "; counts must lie in [0, " + std::to_string(max_rows) + "] (x.shape[1])");
    scount[i] = static_cast<int>(s * row_bytes);
    rcount[i] = static_cast<int>(r * row_bytes);
    sdispl[i] = rdispl[i] = static_cast<int>(i * max_rows * row_bytes);
  }
  std::memset(y->untyped_data(), 0, y->size_bytes());
  MPI_CHECK(MPI_Alltoallv(x.untyped_data(), scount.data(), sdispl.data(), MPI_BYTE,
                          y->untyped_data(), rcount.data(), rdispl.data(), MPI_BYTE, comm),
            "MPI_Alltoallv");
  return ffi::Error::Success();
}

ffi::Error SendImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer>,
                    int64_t comm_id, int64_t dest, int64_t tag, std::string_view signature,
                    int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip();
  if (CheckingPointToPoint()) {
    ++g_num_checks;
    Envelope mine = MakeEnvelope(x, {signature, signature_hash});
    MPI_CHECK(MPI_Send(&mine, sizeof mine, MPI_BYTE, static_cast<int>(dest), static_cast<int>(tag),
                       check),
              "MPI_Send (argument check)");
  }
  Call call("send", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({x});
  MPI_CHECK(MPI_Send(x.untyped_data(), Bytes(x), MPI_BYTE, static_cast<int>(dest),
                     static_cast<int>(tag), comm),
            "MPI_Send");
  return ffi::Error::Success();
}

// x is a template for the shape of y (not aliased: its contents are never used).
ffi::Error RecvImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t source, int64_t tag,
                    int64_t status_addr, std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (CheckingPointToPoint()) {
    // The envelope fixes the source and tag (MPI.ANY_SOURCE / ANY_TAG): the data follows it.
    ++g_num_checks;
    Envelope theirs;
    MPI_Status status;
    MPI_CHECK(MPI_Recv(&theirs, sizeof theirs, MPI_BYTE, static_cast<int>(source),
                       static_cast<int>(tag), check, &status),
              "MPI_Recv (argument check)");
    source = status.MPI_SOURCE;
    tag = status.MPI_TAG;
    if (!Fits(theirs, *y)) {
      if (auto e = Drain(comm, static_cast<int>(source), static_cast<int>(tag)); e.failure()) return e;
      return Misfit(check, theirs, static_cast<int>(source), static_cast<int>(tag),
                    {signature, signature_hash});
    }
  }
  Call call("recv", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({*y});
  MPI_Status status;
  MPI_CHECK(MPI_Recv(y->untyped_data(), Bytes(x), MPI_BYTE, static_cast<int>(source),
                     static_cast<int>(tag), comm, &status),
            "MPI_Recv");
  FillStatus(status_addr, status);
  return ffi::Error::Success();
}

// recvbuf gives the shape of y and is aliased to it unless it is sendbuf; never read.
ffi::Error SendrecvImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::AnyBuffer sendbuf, ffi::AnyBuffer recvbuf,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer>, int64_t comm_id,
                        int64_t source, int64_t dest, int64_t sendtag, int64_t recvtag,
                        int64_t status_addr, std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  if (CheckingPointToPoint()) {
    ++g_num_checks;
    const Signature sig{signature, signature_hash};
    Envelope mine = MakeEnvelope(sendbuf, sig), theirs;
    MPI_Status status;
    MPI_CHECK(MPI_Sendrecv(&mine, sizeof mine, MPI_BYTE, static_cast<int>(dest),
                           static_cast<int>(sendtag), &theirs, sizeof theirs, MPI_BYTE,
                           static_cast<int>(source), static_cast<int>(recvtag), check, &status),
              "MPI_Sendrecv (argument check)");
    source = status.MPI_SOURCE;
    recvtag = status.MPI_TAG;
    if (!Fits(theirs, *y)) {
      // Send ours all the same (the destination expects it), drop theirs, then fail.
      MPI_Request request;
      MPI_CHECK(MPI_Isend(sendbuf.untyped_data(), Bytes(sendbuf), MPI_BYTE, static_cast<int>(dest),
                          static_cast<int>(sendtag), comm, &request),
                "MPI_Isend");
      if (auto e = Drain(comm, static_cast<int>(source), static_cast<int>(recvtag)); e.failure())
        return e;
      MPI_CHECK(MPI_Wait(&request, MPI_STATUS_IGNORE), "MPI_Wait");
      return Misfit(check, theirs, static_cast<int>(source), static_cast<int>(recvtag), sig);
    }
  }
  Call call("sendrecv", static_cast<int64_t>(sendbuf.size_bytes()), comm_id, device);
  PreferHugePages({sendbuf, *y});
  MPI_Status status;
  MPI_CHECK(MPI_Sendrecv(sendbuf.untyped_data(), Bytes(sendbuf), MPI_BYTE, static_cast<int>(dest),
                         static_cast<int>(sendtag), y->untyped_data(), Bytes(recvbuf), MPI_BYTE,
                         static_cast<int>(source), static_cast<int>(recvtag), comm, &status),
            "MPI_Sendrecv");
  FillStatus(status_addr, status);
  return ffi::Error::Success();
}

ffi::Error BarrierImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>, int64_t comm_id,
    std::string_view signature, int64_t signature_hash) {
  MPI_Comm comm, check;
  if (auto e = GetComm(comm_id, device, run, &comm, &check); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip();
  if (auto e = CheckCollective(check, {signature, signature_hash}); e.failure()) return e;
  Call call("barrier", static_cast<int64_t>(0), comm_id, device);
  MPI_CHECK(MPI_Barrier(comm), "MPI_Barrier");
  return ffi::Error::Success();
}

}  // namespace

// ---------------------------------------------------------------- bindings

#define AUTOSHARD_BIND() \
  ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>().Ctx<ffi::RunId>().Arg<ffi::AnyBuffer>()
// Every handler's last attributes: what the ranks must agree on (see "argument checks").
#define AUTOSHARD_SIGNATURE() Attr<std::string_view>("signature").Attr<int64_t>("signature_hash")

XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_allreduce, Handler(AllreduceImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("op")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_reduce, Handler(ReduceImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("op")
                                  .Attr<int64_t>("root")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_scan, Handler(ScanImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("op")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_bcast, Handler(BcastImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("root")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_gather, Handler(GatherImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("root")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_scatter, Handler(ScatterImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("root")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_allgather, Handler(AllgatherImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_alltoall, Handler(AlltoallImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_allgatherv, Handler(AllgathervImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm")
                                  .Attr<ffi::Span<const int64_t>>("counts")
                                  .Attr<int64_t>("row_bytes")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_alltoallv, Handler(AlltoallvImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm")
                                  .Attr<int64_t>("row_bytes").Attr<int64_t>("max_rows")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_send, Handler(SendImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm").Attr<int64_t>("dest")
                                  .Attr<int64_t>("tag")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_recv, Handler(RecvImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("source")
                                  .Attr<int64_t>("tag").Attr<int64_t>("status")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_sendrecv, Handler(SendrecvImpl),
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("comm")
                                  .Attr<int64_t>("source").Attr<int64_t>("dest")
                                  .Attr<int64_t>("sendtag").Attr<int64_t>("recvtag")
                                  .Attr<int64_t>("status")
                                  .AUTOSHARD_SIGNATURE());
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_barrier, Handler(BarrierImpl),
                              AUTOSHARD_BIND().Ret<ffi::AnyBuffer>().Attr<int64_t>("comm")
                                  .AUTOSHARD_SIGNATURE());

// ---------------------------------------------------------------- C API for ctypes

// MPI_Comm is a pointer in Open MPI and an int in MPICH.
template <typename Comm>
Comm HandleToComm(int64_t handle) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<Comm>(handle);
  } else {
    return static_cast<Comm>(handle);
  }
}

extern "C" {

// Registers one communicator per local device (handles are MPI_Comm values);
// returns the id passed to the handlers as the "comm" attribute.
// `checks` holds the communicators of the argument checks, one per entry. For the table of
// a once-per-process region, `num_devices` is the region's size (else 0; see "one call per
// process").
int64_t autoshard_mpi_register_comm(const int64_t* handles, const int64_t* checks, int64_t n,
                                    int64_t num_devices) {
  CommTable table;
  table.entries.resize(n);
  // A zero handle stands for MPI_COMM_NULL: that device skips its calls.
  auto comm = [](int64_t handle) {
    return handle == 0 ? MPI_COMM_NULL : HandleToComm<MPI_Comm>(handle);
  };
  for (int64_t i = 0; i < n; ++i) table.entries[i] = CommEntry{comm(handles[i]), comm(checks[i])};
  if (num_devices > 1) {
    table.region = std::make_unique<Region>();
    table.region->num_devices = num_devices;
    table.region->progress.resize(n);
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g_comm_tables.push_back(std::move(table));
  return static_cast<int64_t>(g_comm_tables.size()) - 1;
}

// Bumped whenever the Python side needs something new from the extension: an older build
// is reported as stale instead of failing on a missing symbol.
int64_t autoshard_mpi_abi_version() { return 4; }

int64_t autoshard_mpi_inflight() { return g_inflight.load(); }

// MPI calls made by this process so far (skipped devices do not count).
int64_t autoshard_mpi_num_calls() { return g_num_calls.load(); }

void autoshard_mpi_set_debug(int64_t on) { g_debug.store(on != 0); }

// How calls are checked for agreement between ranks: 0 off, 1 first call, 2 every call
// (AUTOSHARD_MPI_CHECK; see "argument checks").
void autoshard_mpi_set_check(int64_t mode) { g_check_mode.store(mode); }

// After how long a rank waiting in a check warns (10 s by default; see AwaitCheck).
void autoshard_mpi_set_check_warn_ms(int64_t ms) { g_check_warn_ms.store(ms); }

// Argument checks this process has exchanged so far.
int64_t autoshard_mpi_num_checks() { return g_num_checks.load(); }

// Whether large buffers are moved onto huge pages (AUTOSHARD_MPI_HUGE_PAGES, on by default).
void autoshard_mpi_set_huge_pages(int64_t on) { g_huge_pages.store(on != 0); }

// Large buffers collapsed into huge pages so far (see PreferHugePages).
int64_t autoshard_mpi_num_collapsed() { return g_num_collapsed.load(); }

int64_t autoshard_mpi_status_size() { return sizeof(MPI_Status); }

}  // extern "C"
