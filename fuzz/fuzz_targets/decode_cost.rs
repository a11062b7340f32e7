//! What a received message would take once decoded, counted before decoding
//! (`toolsrv_proto::cost`): for any bytes taken as one of the messages peers send, the count
//! never panics; bytes it calls malformed (other than for a group, which decoding may skip)
//! do not decode; and bytes it lets through decode allocating no more than it counted (and a
//! decoding error), under a counting allocator.
#![no_main]
// A global allocator is an `unsafe` trait; this one only counts and passes each call on.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use libfuzzer_sys::fuzz_target;
use prost::{Message, Name};
use toolsrv_proto::cost::{Why, check_named, decoded_bytes};
use toolsrv_proto::v1;

/// Counts as glibc's malloc spends: rounded up to 16 bytes, with a 16-byte header; a
/// reallocation holds the old block and the new one at once.
struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn charge(size: usize) -> usize {
    size.div_ceil(16) * 16 + 16
}

fn take(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::SeqCst) + bytes;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every call is passed on to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        take(charge(layout.size()));
        // SAFETY: the caller's layout, as given.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CURRENT.fetch_sub(charge(layout.size()), Ordering::SeqCst);
        // SAFETY: the caller's block and layout, as given.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        take(charge(new_size));
        CURRENT.fetch_sub(charge(layout.size()), Ordering::SeqCst);
        // SAFETY: the caller's block, layout and size, as given.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// What a decoding error allocates: prost's error, with the fields it was nested in.
const ERROR_BYTES: usize = 4096;

/// Decodes `bytes` as `M`: whether it decoded, and the most bytes held while it did.
fn decode<M: Message + Default>(bytes: &[u8]) -> (bool, usize) {
    let before = CURRENT.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let decoded = M::decode(bytes);
    let peak = PEAK.load(Ordering::SeqCst) - before;
    (decoded.is_ok(), peak)
}

fn run<M: Message + Name + Default>(bytes: &[u8]) {
    let name = M::full_name();
    let checked = check_named(&name, bytes);
    let (decoded, allocated) = decode::<M>(bytes);
    match checked {
        Ok(()) => {
            let counted = decoded_bytes(&name, bytes).expect("a message let through is counted");
            // Bytes that do not decode allocate what was decoded before the fault, which the
            // count covers, and prost's error (its message and the path of nested fields).
            let error = if decoded { 0 } else { ERROR_BYTES };
            assert!(
                allocated <= counted + error,
                "{name}: {allocated} bytes allocated decoding {} bytes, {counted} counted",
                bytes.len()
            );
        }
        Err(refused) => match refused.why {
            Why::Malformed { what, .. } if !what.starts_with("a group") => {
                assert!(!decoded, "{name}: decoded what the count called malformed: {refused}");
            }
            _ => {}
        },
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    match which % 8 {
        0 => run::<v1::AgentMessage>(bytes),
        1 => run::<v1::CoordinatorMessage>(bytes),
        2 => run::<v1::OpenSessionRequest>(bytes),
        3 => run::<v1::ListToolsResponse>(bytes),
        4 => run::<v1::FindToolsResponse>(bytes),
        5 => run::<v1::ListSessionsResponse>(bytes),
        6 => run::<v1::ListHostsResponse>(bytes),
        _ => run::<v1::CallEvent>(bytes),
    }
});
