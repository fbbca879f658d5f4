// Facts about this process that layers below the runtime need without depending on it.
#pragma once

namespace tdist {

// This process's rank in its job, for diagnostics (device wait timeouts print it); -1 until a
// tdist::World is created.
int process_rank();
void set_process_rank(int rank);

}  // namespace tdist
