// Pins this thread's OpenMP team to cores, one thread per core, as vLLM's CPU worker does
// (VLLM_CPU_OMP_THREADS_BIND): each thread of an omp parallel region calls sched_setaffinity on itself.
//
// Why: a team's threads meet at a barrier after every parallel op, hundreds of times a step. Unpinned, the
// scheduler moves them between cores and, on a busy machine, stacks two on one core while another idles, and
// every barrier then waits for the slowest. Pinned, each stays on its core with its cache. The team belongs to
// the thread that runs the parallel regions, so the engine binds from the thread that steps the model.
// kernels/cpu.py builds this file with the others; engine/threads.py decides the cores.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif
#include <omp.h>

namespace {

// Binds thread i of a team of cpus.size() threads to cpus[i]; returns, per thread, the core it was bound to,
// or -1 where the OS refused (or is not Linux). Sets torch's thread count to the team's size.
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus) {
  const int threads = static_cast<int>(cpus.size());
  TORCH_CHECK(threads >= 1, "kvscope_cpu: bind_threads needs at least one core");
  at::set_num_threads(threads);
  std::vector<int64_t> bound(threads, -1);
#pragma omp parallel num_threads(threads)
  {
    const int index = omp_get_thread_num();
#if defined(__linux__)
    cpu_set_t mask;
    CPU_ZERO(&mask);
    CPU_SET(static_cast<int>(cpus[index]), &mask);
    if (sched_setaffinity(0, sizeof(mask), &mask) == 0) bound[index] = cpus[index];
#endif
  }
  return bound;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope_cpu, m) {
  m.def("bind_threads(int[] cpus) -> int[]", &bind_threads);
}
