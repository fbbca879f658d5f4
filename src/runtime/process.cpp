#include "tdist/common/process.hpp"

#include <atomic>

namespace tdist {
namespace {
std::atomic<int> g_process_rank{-1};
}

int process_rank() { return g_process_rank.load(std::memory_order_relaxed); }
void set_process_rank(int rank) { g_process_rank.store(rank, std::memory_order_relaxed); }

}  // namespace tdist
