// XLA FFI handlers for autoshard.mpi: MPI called directly on XLA's CPU buffers.
//
// Every handler takes an ordering value first and returns one last (a one-byte
// scalar, never read: XLA's token type would make Shardy drop the call's sharding);
// the Python lowering chains these values so that MPI calls run in program order. The
// communicator arrives as an integer id into a table of communicators built by
// register_comm(), indexed by device ordinal (see _comm.py): inside a user's shard_map
// each device has its own communicator; elsewhere every device maps to the same one,
// or, in a jit over several devices, only the device that makes the process's call
// does and the others hold MPI_COMM_NULL: they skip the call and return zeros, which
// the lowering sums with the caller's result (one MPI call per process).
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
#include <mpi.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------- state

std::mutex g_mutex;
std::vector<std::vector<MPI_Comm>> g_comm_tables;  // id -> one comm per device
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

ffi::Error GetComm(int64_t id, int64_t device, MPI_Comm* comm) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (id < 0 || id >= static_cast<int64_t>(g_comm_tables.size()))
    return ffi::Error::InvalidArgument("autoshard.mpi: unknown communicator id");
  const auto& table = g_comm_tables[id];
  if (device < 0 || device >= static_cast<int64_t>(table.size()))
    return ffi::Error::InvalidArgument(
        "autoshard.mpi: device ordinal " + std::to_string(device) +
        " has no communicator; the communicator table has " +
        std::to_string(table.size()) + " entries (one per local device)");
  *comm = table[device];
  return ffi::Error::Success();
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

ffi::Error AllreduceImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer>,
                         int64_t comm_id, int64_t op) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
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
ffi::Error ReduceImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t op, int64_t root) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
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

ffi::Error ScanImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t op) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
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
ffi::Error BcastImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t root) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  Call call("bcast", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({*y});
  MPI_CHECK(MPI_Bcast(y->untyped_data(), Bytes(x), MPI_BYTE, static_cast<int>(root), comm),
            "MPI_Bcast");
  return ffi::Error::Success();
}

// Root: y has shape (size, *x.shape). Other ranks: y aliases x (unchanged).
ffi::Error GatherImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t root) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
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
ffi::Error ScatterImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t root) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
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

ffi::Error AllgatherImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer>, int64_t comm_id) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
  Call call("allgather", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({x, *y});
  MPI_CHECK(MPI_Allgather(x.untyped_data(), Bytes(x), MPI_BYTE, y->untyped_data(), Bytes(x),
                          MPI_BYTE, comm),
            "MPI_Allgather");
  return ffi::Error::Success();
}

ffi::Error AlltoallImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::AnyBuffer>, int64_t comm_id) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
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
ffi::Error AllgathervImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer>, int64_t comm_id,
                          ffi::Span<const int64_t> counts, int64_t row_bytes) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
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
ffi::Error AlltoallvImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::S32> send_counts, ffi::Buffer<ffi::S32> recv_counts,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer>, int64_t comm_id,
                         int64_t row_bytes, int64_t max_rows) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
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

ffi::Error SendImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer>,
                    int64_t comm_id, int64_t dest, int64_t tag) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip();
  Call call("send", static_cast<int64_t>(x.size_bytes()), comm_id, device);
  PreferHugePages({x});
  MPI_CHECK(MPI_Send(x.untyped_data(), Bytes(x), MPI_BYTE, static_cast<int>(dest),
                     static_cast<int>(tag), comm),
            "MPI_Send");
  return ffi::Error::Success();
}

// x is a template for the shape of y (not aliased: its contents are never used).
ffi::Error RecvImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                    ffi::Result<ffi::AnyBuffer>, int64_t comm_id, int64_t source, int64_t tag,
                    int64_t status_addr) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
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
ffi::Error SendrecvImpl(int32_t device, ffi::AnyBuffer, ffi::AnyBuffer sendbuf, ffi::AnyBuffer recvbuf,
                        ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer>, int64_t comm_id,
                        int64_t source, int64_t dest, int64_t sendtag, int64_t recvtag,
                        int64_t status_addr) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip(y);
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

ffi::Error BarrierImpl(int32_t device, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>, int64_t comm_id) {
  MPI_Comm comm;
  if (auto e = GetComm(comm_id, device, &comm); e.failure()) return e;
  if (comm == MPI_COMM_NULL) return Skip();
  Call call("barrier", static_cast<int64_t>(0), comm_id, device);
  MPI_CHECK(MPI_Barrier(comm), "MPI_Barrier");
  return ffi::Error::Success();
}

}  // namespace

// ---------------------------------------------------------------- bindings

#define AUTOSHARD_BIND() ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>().Arg<ffi::AnyBuffer>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_allreduce, AllreduceImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("op"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_reduce, ReduceImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("op")
                                  .Attr<int64_t>("root"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_scan, ScanImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("op"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_bcast, BcastImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("root"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_gather, GatherImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("root"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_scatter, ScatterImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("root"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_allgather, AllgatherImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_alltoall, AlltoallImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_allgatherv, AllgathervImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm")
                                  .Attr<ffi::Span<const int64_t>>("counts")
                                  .Attr<int64_t>("row_bytes"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_alltoallv, AlltoallvImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm")
                                  .Attr<int64_t>("row_bytes").Attr<int64_t>("max_rows"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_send, SendImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm").Attr<int64_t>("dest")
                                  .Attr<int64_t>("tag"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_recv, RecvImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("comm").Attr<int64_t>("source")
                                  .Attr<int64_t>("tag").Attr<int64_t>("status"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_sendrecv, SendrecvImpl,
                              AUTOSHARD_BIND().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("comm")
                                  .Attr<int64_t>("source").Attr<int64_t>("dest")
                                  .Attr<int64_t>("sendtag").Attr<int64_t>("recvtag")
                                  .Attr<int64_t>("status"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(autoshard_mpi_barrier, BarrierImpl,
                              AUTOSHARD_BIND().Ret<ffi::AnyBuffer>().Attr<int64_t>("comm"));

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
int64_t autoshard_mpi_register_comm(const int64_t* handles, int64_t n) {
  std::vector<MPI_Comm> table(n);
  // A zero handle stands for MPI_COMM_NULL: that device skips its calls.
  for (int64_t i = 0; i < n; ++i)
    table[i] = handles[i] == 0 ? MPI_COMM_NULL : HandleToComm<MPI_Comm>(handles[i]);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_comm_tables.push_back(std::move(table));
  return static_cast<int64_t>(g_comm_tables.size()) - 1;
}

// Bumped whenever the Python side needs something new from the extension: an older build
// is reported as stale instead of failing on a missing symbol.
int64_t autoshard_mpi_abi_version() { return 3; }

int64_t autoshard_mpi_inflight() { return g_inflight.load(); }

// MPI calls made by this process so far (skipped devices do not count).
int64_t autoshard_mpi_num_calls() { return g_num_calls.load(); }

void autoshard_mpi_set_debug(int64_t on) { g_debug.store(on != 0); }

// Whether large buffers are moved onto huge pages (AUTOSHARD_MPI_HUGE_PAGES, on by default).
void autoshard_mpi_set_huge_pages(int64_t on) { g_huge_pages.store(on != 0); }

// Large buffers collapsed into huge pages so far (see PreferHugePages).
int64_t autoshard_mpi_num_collapsed() { return g_num_collapsed.load(); }

int64_t autoshard_mpi_status_size() { return sizeof(MPI_Status); }

}  // extern "C"
