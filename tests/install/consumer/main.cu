#include <tdist/device.cuh>
#include <tdist/runtime/symmetric_heap.hpp>

__global__ void touch(tdist::device::SymmetricHeapView heap, tdist::device::u64* flag) {
  tdist::device::signal_op(heap, flag, tdist::device::u64{1}, tdist::device::SignalOp::kAdd, 0);
}

int main(int argc, char**) {
  if (argc > 1) {  // linked, not run: the check is that everything resolves
    tdist::World world;
    tdist::SymmetricHeap heap(world, 1 << 21);
    touch<<<1, 1>>>(heap.view(), heap.allocate_signals64(1));
  }
  return 0;
}
