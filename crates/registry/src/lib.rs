//! The tool registry: scans a colon-separated tools path, watches it, and publishes revisioned catalogs.
//!
//! A [`Catalog`] is an immutable snapshot; every effective change (a tool added, removed, or its
//! `.meta` or co-located executable changed) produces a new one with the next revision.

mod definition;
mod scan;
mod watch;

pub use definition::definition;
pub use scan::{
    Catalog, CatalogChanges, Executable, Hashed, Invalid, Open, OpenToAll, ReadError, SETTLE_AGE,
    SHORTAGE_RETRY, Scanner, Tool, hash_file, hash_file_bounded, hex_sha256, is_shortage,
    open_regular, read_meta, split_tools_path, writable_by_anyone,
};
pub use watch::{Numbering, Registry, WatchOptions, log_problems};
