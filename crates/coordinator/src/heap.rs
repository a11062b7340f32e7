//! Giving the allocator's free memory back to the system after a burst.
//!
//! Building the tool index with an encoder allocates and frees hundreds of MiB on the encoder's
//! threads (activations of every batch of texts). glibc's allocator keeps most of what those
//! threads freed in their arenas, where nothing else in the coordinator reuses it: after the
//! index of 1,000 tools was built for 1,000 hosts, the coordinator stayed at 330 MiB resident,
//! and 214 MiB once that free memory was handed back (BENCHMARKS.md, Fleet, section 9).

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
