//! Reading a file an operator names (a certificate, a key, a CRL, a policy, a configuration
//! file): at most a bound's worth, so that a path to a device (`/dev/zero`) or a runaway file
//! is an error naming it instead of a process that reads until memory runs out.

use std::io::Read;
use std::path::Path;

/// Most bytes read of a PEM file of certificates or of a key: a system CA bundle is about
/// 200 KiB.
pub const MAX_PEM_BYTES: u64 = 4 << 20;
/// Most bytes read of a CRL file: a large CA's CRL runs to tens of megabytes.
pub const MAX_CRL_BYTES: u64 = 256 << 20;
/// Most bytes read of a configuration, policy or labels file, or a state file of the
/// coordinator's own.
pub const MAX_SETTINGS_BYTES: u64 = 64 << 20;

/// At most `max` bytes of `input`: `None` when it holds more (it is read up to `max + 1`, so an
/// endless input ends there). Every bounded read of a file, a pipe or stdin goes through here,
/// each caller saying in its own words that the input was too large.
pub fn read_up_to(input: impl Read, max: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::new();
    input.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= max).then_some(bytes))
}

/// [`read_up_to`], as UTF-8 text (invalid UTF-8 is an error, as `read_to_string` makes it).
pub fn read_text_up_to(input: impl Read, max: u64) -> std::io::Result<Option<String>> {
    read_up_to(input, max)?
        .map(|bytes| {
            String::from_utf8(bytes).map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "stream did not contain valid UTF-8",
                )
            })
        })
        .transpose()
}

/// The bytes of `path`, or an error when it holds more than `max`.
pub fn read_bounded(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    read_up_to(std::fs::File::open(path)?, max)?.ok_or_else(|| too_large(max))
}

/// [`read_bounded`], as UTF-8 text.
pub fn read_text_bounded(path: &Path, max: u64) -> std::io::Result<String> {
    read_text_up_to(std::fs::File::open(path)?, max)?.ok_or_else(|| too_large(max))
}

fn too_large(max: u64) -> std::io::Error {
    std::io::Error::other(format!(
        "larger than {max} bytes, the most read of such a file"
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_device_or_a_file_past_the_bound_is_an_error_and_one_at_it_is_read() {
        let err = read_bounded(Path::new("/dev/zero"), 1024).unwrap_err();
        assert!(err.to_string().contains("larger than 1024 bytes"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, "x".repeat(1024)).unwrap();
        assert_eq!(read_text_bounded(&path, 1024).unwrap().len(), 1024);
        assert!(read_bounded(&path, 1023).is_err());
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert!(read_text_bounded(&path, 1024).is_err());
        assert!(read_bounded(&dir.path().join("missing"), 1).is_err());
    }
}
