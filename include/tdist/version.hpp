// tdist's version (one source: the VERSION file at the top of the tree, read by CMake and by the
// Python package's build) and a report of the versions tdist runs with.
#pragma once

#include <string>

namespace tdist {

// "MAJOR.MINOR.PATCH" of the libtdist this process loaded (not of the headers it was compiled with).
const char* version();
int version_major();
int version_minor();
int version_patch();

// Versions of what this process runs with, as "name: value" lines: tdist, NCCL built against and
// loaded, CUDA runtime built against and loaded, CUDA driver, and the GPU `device` when it is >= 0.
// Never throws: a part that cannot be queried (no driver, no GPU) says why.
std::string version_report(int device = -1);

// Logs one INFO line (subsystem INIT) naming the versions above and the GPU; called by World's
// constructor on every rank.
void log_startup(int device);

}  // namespace tdist
