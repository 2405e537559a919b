// Launcher for the CPU kernel harness (test-only): runs a kernel body over a whole
// dispatchThreads grid, as MLX's CustomKernel::eval_gpu dispatches it.
//
// - The grid is (gx, gy, gz) threads; the threadgroup size is min(requested, grid) per dimension;
//   threadgroups at the upper edges may be partial (dispatchThreads: threads outside the grid are
//   not launched). threads_per_threadgroup is the size of the current (possibly partial) group,
//   dispatch_threads_per_threadgroup the requested one.
// - Bodies without threadgroup_barrier run thread by thread.
// - Bodies with threadgroup_barrier run each threadgroup's threads as ucontext fibers: a fiber runs
//   until it reaches a barrier or returns; when every fiber of the group has stopped, all of them
//   must be at a barrier (they are then released together) or all must have returned, otherwise
//   the launch fails ("barrier not reached by every thread"). Between two barriers the threads run
//   one after another in the chosen order (forward or reverse thread index), so a read of data that
//   another thread writes before the same barrier sees it or not depending on the order: run both.
#pragma once

#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace dflash2_harness {

struct ThreadInfo {
  uint dispatch_quadgroups_per_threadgroup;
  uint dispatch_simdgroups_per_threadgroup;
  uint3 dispatch_threads_per_threadgroup;
  uint3 grid_origin;
  uint3 grid_size;
  uint quadgroup_index_in_threadgroup;
  uint quadgroups_per_threadgroup;
  uint simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup;
  uint thread_execution_width;
  uint thread_index_in_quadgroup;
  uint thread_index_in_simdgroup;
  uint thread_index_in_threadgroup;
  uint3 thread_position_in_grid;
  uint3 thread_position_in_threadgroup;
  uint3 threadgroup_position_in_grid;
  uint3 threadgroups_per_grid;
  uint3 threads_per_grid;
  uint threads_per_simdgroup;
  uint3 threads_per_threadgroup;
};

using Body = std::function<void(const ThreadInfo&)>;

enum FiberState { kReady = 0, kAtBarrier = 1, kDone = 2 };

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  ThreadInfo info;
  int state;
};

struct Scheduler {
  ucontext_t main_ctx;
  std::vector<Fiber> fibers;
  const Body* body = nullptr;
  int current = -1;
};

static Scheduler* g_scheduler = nullptr;  // the harness runs one launch at a time per library
static std::string g_error;

inline void fiber_entry() {
  Scheduler* s = g_scheduler;
  Fiber& f = s->fibers[s->current];
  (*s->body)(f.info);
  f.state = kDone;
  // returning resumes uc_link (the scheduler's main context)
}

inline void fail(const std::string& message) {
  if (g_error.empty()) {
    g_error = message;
  }
}

inline uint ceil_div(uint a, uint b) { return (a + b - 1) / b; }

inline int launch(const uint* grid, const uint* group_req, int reverse, bool uses_barrier,
                  const Body& body) {
  g_error.clear();
  const uint gx = grid[0], gy = grid[1], gz = grid[2];
  if (gx == 0 || gy == 0 || gz == 0) {
    fail("grid dimensions must be positive");
    return 1;
  }
  const uint tx = group_req[0] < gx ? group_req[0] : gx;
  const uint ty = group_req[1] < gy ? group_req[1] : gy;
  const uint tz = group_req[2] < gz ? group_req[2] : gz;
  if (tx == 0 || ty == 0 || tz == 0 || tx * ty * tz > 1024) {
    fail("threadgroup size must be positive and at most 1024 threads");
    return 1;
  }
  const uint3 groups = {ceil_div(gx, tx), ceil_div(gy, ty), ceil_div(gz, tz)};
  const size_t n_groups = size_t(groups.x) * groups.y * groups.z;

  Scheduler sched;
  sched.body = &body;
  g_scheduler = &sched;

  for (size_t gi = 0; gi < n_groups && g_error.empty(); ++gi) {
    const size_t g = reverse ? n_groups - 1 - gi : gi;
    const uint3 gpos = {uint(g % groups.x), uint((g / groups.x) % groups.y),
                        uint(g / (size_t(groups.x) * groups.y))};
    // actual size of this (possibly partial) threadgroup
    const uint3 size = {
        (gpos.x + 1) * tx <= gx ? tx : gx - gpos.x * tx,
        (gpos.y + 1) * ty <= gy ? ty : gy - gpos.y * ty,
        (gpos.z + 1) * tz <= gz ? tz : gz - gpos.z * tz,
    };
    const uint n_threads = size.x * size.y * size.z;
    std::vector<ThreadInfo> infos(n_threads);
    for (uint t = 0; t < n_threads; ++t) {
      const uint3 l = {t % size.x, (t / size.x) % size.y, t / (size.x * size.y)};
      ThreadInfo& ti = infos[t];
      ti.dispatch_threads_per_threadgroup = {tx, ty, tz};
      ti.grid_origin = {0, 0, 0};
      ti.grid_size = {gx, gy, gz};
      ti.thread_index_in_threadgroup = t;
      ti.thread_position_in_threadgroup = l;
      ti.threadgroup_position_in_grid = gpos;
      ti.thread_position_in_grid = {gpos.x * tx + l.x, gpos.y * ty + l.y, gpos.z * tz + l.z};
      ti.threadgroups_per_grid = groups;
      ti.threads_per_grid = {gx, gy, gz};
      ti.threads_per_threadgroup = size;
      ti.thread_execution_width = 32;
      ti.threads_per_simdgroup = 32;
      ti.thread_index_in_simdgroup = t % 32;
      ti.simdgroup_index_in_threadgroup = t / 32;
      ti.simdgroups_per_threadgroup = ceil_div(n_threads, 32);
      ti.dispatch_simdgroups_per_threadgroup = ceil_div(tx * ty * tz, 32);
      ti.thread_index_in_quadgroup = t % 4;
      ti.quadgroup_index_in_threadgroup = t / 4;
      ti.quadgroups_per_threadgroup = ceil_div(n_threads, 4);
      ti.dispatch_quadgroups_per_threadgroup = ceil_div(tx * ty * tz, 4);
    }

    if (!uses_barrier) {
      for (uint k = 0; k < n_threads; ++k) {
        body(infos[reverse ? n_threads - 1 - k : k]);
      }
      continue;
    }

    // Cooperative fibers with barriers.
    sched.fibers.resize(n_threads);
    for (uint t = 0; t < n_threads; ++t) {
      Fiber& f = sched.fibers[t];
      f.info = infos[t];
      f.state = kReady;
      f.stack.resize(64 * 1024);
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.data();
      f.ctx.uc_stack.ss_size = f.stack.size();
      f.ctx.uc_link = &sched.main_ctx;
      makecontext(&f.ctx, fiber_entry, 0);
    }
    while (true) {
      for (uint k = 0; k < n_threads; ++k) {
        const uint t = reverse ? n_threads - 1 - k : k;
        if (sched.fibers[t].state != kReady) {
          continue;
        }
        sched.current = int(t);
        swapcontext(&sched.main_ctx, &sched.fibers[t].ctx);
      }
      uint at_barrier = 0, done = 0;
      for (uint t = 0; t < n_threads; ++t) {
        at_barrier += sched.fibers[t].state == kAtBarrier;
        done += sched.fibers[t].state == kDone;
      }
      if (at_barrier == 0) {
        break;  // every thread returned
      }
      if (done > 0) {
        fail("threadgroup_barrier not reached by every thread of a threadgroup (" +
             std::to_string(at_barrier) + " waiting, " + std::to_string(done) + " returned)");
        break;
      }
      for (uint t = 0; t < n_threads; ++t) {
        sched.fibers[t].state = kReady;
      }
    }
  }
  g_scheduler = nullptr;
  return g_error.empty() ? 0 : 1;
}

}  // namespace dflash2_harness

void threadgroup_barrier(mem_flags) {
  dflash2_harness::Scheduler* s = dflash2_harness::g_scheduler;
  if (s == nullptr || s->current < 0 || s->fibers.empty()) {
    // Cannot happen through harness.py (it enables fibers whenever the body names the barrier).
    std::fprintf(stderr, "kernel harness: threadgroup_barrier outside a fiber launch\n");
    std::abort();
  }
  dflash2_harness::Fiber& f = s->fibers[s->current];
  f.state = dflash2_harness::kAtBarrier;
  swapcontext(&f.ctx, &s->main_ctx);
}
