// Work items shared by the calling thread and XLA's intra-op pool (as cpu_attention.cc and
// cpu_quant_matmul.cc do): a pool task that starts after the work ran out does nothing; the
// caller waits only for items already claimed, so `fn` may refer to the caller's stack.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

template <typename Fn>
struct SharedItems {
  SharedItems(Fn f, int64_t n) : fn(std::move(f)), items(n) {}
  Fn fn;  // fn(item)
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void drain() {
    int64_t ran = 0;
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      fn(i);
      ++ran;
    }
    if (ran && done.fetch_add(ran) + ran == items) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
};

// Runs fn(0 .. items - 1) on the calling thread and up to `helpers` pool tasks; returns when
// all have run. Waking a pool thread costs microseconds, so callers pass 0 helpers for small
// products. The calling thread is usually one of the pool's own, so it counts as a worker.
template <typename Fn>
void run_items(xla::ffi::ThreadPool& pool, int64_t items, bool split, Fn fn) {
  if (items <= 0) return;
  auto shared = std::make_shared<SharedItems<Fn>>(std::move(fn), items);
  const int64_t helpers = split ? std::min<int64_t>(
      std::max<int64_t>(1, pool.num_threads() - 1), items - 1) : 0;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->drain(); });
  shared->drain();
  // Items a helper claimed finish within microseconds: spin briefly before sleeping.
  for (int spin = 0; spin < 4096 && shared->done.load() != shared->items; ++spin) _mm_pause();
  if (shared->done.load() != shared->items) {
    std::unique_lock<std::mutex> lock(shared->mu);
    shared->cv.wait(lock, [&] { return shared->done.load() == shared->items; });
  }
}

}  // namespace jaxserve
