#pragma once

#include <nccl.h>

namespace tdist::detail {

// Writes into host_out[i] the address, mapped in this process, of LSA member i's copy of offset 0
// of `window`. Synchronous.
void fetch_lsa_bases(ncclWindow_t window, int lsa_size, char** host_out);

}  // namespace tdist::detail
