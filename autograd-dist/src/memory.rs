//! How a training process keeps the memory its tensors free (ALLOC-1).
//!
//! candle gives every result a fresh buffer, and its backward pass three per gradient (the
//! product, zeros to add it to, and their sum). glibc's allocator serves each allocation of
//! 32 MB or more (one 4096 × 4096 `f32` gradient is 64 MB) with a new mapping and unmaps it
//! when it is freed, and the threads of a Tokio runtime allocate from arenas of their own,
//! whose heaps are unmapped when they empty: every training step then faults in hundreds of
//! megabytes of zeroed pages again (1.5 million page faults in 20 steps of `rpc-bench ddp`'s
//! model; a third of a step's time). PyTorch's CPU kernels write into the gradients they
//! keep; ours cannot, so the allocator keeps the pages instead.

/// Keeps the memory freed by tensors in this process for the next allocations instead of
/// handing it back to the kernel (ALLOC-1): with glibc, no allocation gets a mapping of its own
/// (`M_MMAP_MAX` 0), every thread allocates from one arena (`M_ARENA_MAX` 1, so that a
/// buffer freed on one thread serves the next step's allocation on another) and the heap is
/// never trimmed. Returns whether it applied (only with glibc).
///
/// Call it first thing in `main`, before any thread starts (arenas are made with threads).
/// What it costs: the process's memory stays at its peak, and threads that allocate at once
/// share one lock (a step of large tensors allocates rarely). What it gains, measured with
/// `rpc-bench ddp` (the anchors' 25.2 M-parameter MLP, 16 rows): a step of one process from
/// 262 to 146 ms, and two processes with their gradients all-reduced from 372 to 212 ms.
///
/// ```
/// // First in main:
/// let applied = autograd_dist::retain_freed_memory();
/// assert_eq!(applied, cfg!(all(target_os = "linux", target_env = "gnu")));
/// ```
pub fn retain_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes the allocator's tunables; every value is one glibc
        // documents for its parameter.
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0) == 1
                && libc::mallopt(libc::M_ARENA_MAX, 1) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
