//! The file of kept vectors (`toolsrv_find::VectorStore`), which anyone with the owner's rights
//! could have written: any bytes are taken or refused with a reason, without a panic, and the
//! allocation is bounded by the input. Each input is checked twice: as it is, and with the
//! checksum it would need appended (and the fingerprint and length of vector it names taken as
//! the encoder's), so the checks after the checksum are reached too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};
use toolsrv_find::VectorStore;

/// Where the header keeps the length of a vector, and the encoder's fingerprint.
const DIMS_AT: usize = 20;
const FINGERPRINT_AT: usize = 32;

fuzz_target!(|data: &[u8]| {
    let taken = |bytes: &[u8], fingerprint: [u8; 32], dims: usize| {
        match VectorStore::check_file(bytes, fingerprint, dims) {
            Ok(n) => assert!(n * (32 + 4 * dims) <= bytes.len(), "{n} vectors"),
            Err(reason) => assert!(!reason.is_empty()),
        }
    };
    taken(data, [0; 32], 384);
    if data.len() >= FINGERPRINT_AT + 32 {
        let mut dims = [0; 4];
        dims.copy_from_slice(&data[DIMS_AT..DIMS_AT + 4]);
        let dims = u32::from_le_bytes(dims) as usize;
        let mut fingerprint = [0; 32];
        fingerprint.copy_from_slice(&data[FINGERPRINT_AT..FINGERPRINT_AT + 32]);
        let mut file = data.to_vec();
        file.extend_from_slice(&Sha256::digest(data));
        taken(&file, fingerprint, dims);
    }
});
