// A small key-value rendezvous store over TCP, used to bootstrap a job: exchange the NCCL
// unique id, check that every rank agrees on sizes, and meet at barriers.
//
// Rank 0 hosts the server in a background thread and every rank, rank 0 included, is a client.
// Every blocking call ends within the store's timeout: on expiry it throws tdist::TimeoutError
// naming the ranks that did not arrive. A rank whose connection closes without a clean shutdown
// is marked dead, and every later wait on any rank fails at once naming it.
//
// Trust (docs/security.md): the store assumes a trusted network. A process joins only by
// presenting the job's secret (TcpStoreOptions::secret), so another job on the same port, or a
// stray client, reads and writes nothing; the secret is not encrypted on the wire.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tdist {

using Bytes = std::vector<uint8_t>;

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // where rank 0 listens and the others connect
  int port = 29500;
  int rank = 0;
  int world_size = 1;
  // Bound on every wait, the initial connection and the join of all ranks included.
  std::chrono::milliseconds timeout = default_timeout();
  // Shared by all ranks of one job and checked when a process joins (default_secret()). Empty:
  // any process that knows the port and the world size may join.
  std::string secret = default_secret();
  // Rank 0 only: the address its server listens on. Empty: `host`, which must then be an address
  // of this machine. "0.0.0.0" (or "::") listens on every interface.
  std::string bind = default_bind();

  // TDIST_HOST_TIMEOUT_S seconds when set (decimal, 0.001 to 86400), else 300 s.
  static std::chrono::milliseconds default_timeout();
  // TDIST_STORE_SECRET when set (tdistrun exports a random one per job). Else a job identity
  // from the launcher's environment: TORCHELASTIC_RUN_ID (torchrun), SLURM_JOB_ID and
  // SLURM_STEP_ID (srun), OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE (mpirun), so that two jobs on
  // one port never join each other; such an identity is not secret (other local users can read
  // it). Else empty.
  static std::string default_secret();
  // TDIST_STORE_BIND, else empty.
  static std::string default_bind();
};

class TcpStore {
 public:
  // Starts the server on rank 0, connects, and waits until all world_size ranks have joined.
  // Errors: port in use (rank 0), master unreachable, a rank joining with another world size,
  // two processes claiming one rank, ranks missing at the deadline.
  explicit TcpStore(const TcpStoreOptions& options);
  ~TcpStore();  // clean shutdown: this rank is not reported dead
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  int rank() const;
  int world_size() const;

  void set(const std::string& key, const Bytes& value);
  Bytes get(const std::string& key);                   // waits for the key
  void wait(const std::vector<std::string>& keys);     // waits for all keys
  bool check(const std::vector<std::string>& keys);    // true when all exist, never waits
  int64_t add(const std::string& key, int64_t delta);  // atomic; returns the new value

  // Every rank contributes one value under `tag`; returns all, indexed by rank. Each tag may be
  // used once per job, so callers pass a unique tag (a counter suffix).
  std::vector<Bytes> all_gather(const std::string& tag, const Bytes& mine);
  // The same, waiting at most `timeout` instead of the store's (a shorter bound for one call).
  std::vector<Bytes> all_gather(const std::string& tag, const Bytes& mine, std::chrono::milliseconds timeout);
  // All ranks meet; the timeout error lists the ranks that never reached it.
  void barrier(const std::string& tag);
  // (Both timeout errors also say which collective each missing rank last entered, e.g. another
  // barrier, so that ranks at different calls are told apart from ranks that are gone.)

  // Returns at once when no rank has died; throws tdist::Error naming the dead ranks otherwise.
  // For watchdogs that wait on something other than the store (NCCL's initialisation, say).
  void check_alive();

 private:
  void note_position(const std::string& what);  // where this rank waits, for the others' errors
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tdist
