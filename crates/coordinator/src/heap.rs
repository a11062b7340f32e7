//! Giving the allocator's free memory back to the system after a burst.
//!
//! A burst of host views (each decoded, interned, its copies freed) and building the tool index
//! with an encoder (activations of every batch of texts, on the encoder's threads) allocate and
//! free hundreds of MiB. glibc's allocator keeps much of it in the arenas of the threads that
//! freed it, where nothing else in the coordinator reuses it: with 1,000 hosts of 1,000 tools,
//! the coordinator stayed at 140 MiB resident (330 MiB with the encoder), and 111 MiB (232 MiB)
//! once the index build that follows the views handed that memory back (BENCHMARKS.md, Fleet,
//! section 9).

/// Returns the free pages of every allocator arena to the system (`malloc_trim`). Takes a few
/// milliseconds on a heap of some hundreds of MiB; call it after a burst, not on a hot path.
/// A no-op where the allocator is not glibc's.
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let started = std::time::Instant::now();
        // SAFETY: malloc_trim only walks the allocator's own structures, under its own locks; it
        // takes no pointer and may be called from any thread at any time.
        #[allow(unsafe_code)]
        let released = unsafe { libc::malloc_trim(0) };
        tracing::debug!(
            released = released == 1,
            took_ms = started.elapsed().as_secs_f64() * 1e3,
            "free heap memory given back"
        );
    }
}
